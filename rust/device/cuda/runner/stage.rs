//! One device of the layer split ([`CudaStage`]) and its forward: the step buffers it allocates
//! at load ([`StepBuffers`], sized by [`StepLimits`]; [`workspace_bytes`] is the same formula
//! for the engine's sizing), the plan upload, the embedding, its layers (`CudaStage::layers`,
//! the CPU's `Model::run_layers` line for line) and the head. The runner (`runner/mod.rs`)
//! chains the stages into a step; the decode graphs (`capture.rs`) capture the same calls.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use half::f16;

use super::driver;
use super::plan::HostPlan;
use crate::device::cuda::blas::{DeviceMatrix, Scratch};
use crate::device::cuda::device::CudaDevice;
use crate::device::cuda::kernels::{CudaKernelError, KvElem, KvLayout};
use crate::device::cuda::kv::CudaKvPart;
use crate::device::cuda::weights::StageWeights;
use crate::device::memory_pool::Reservation;
use crate::error::{Result, StrataError};
use crate::kv::blocks::KvDtype;
use crate::model::config::ModelConfig;
use crate::model::weights::DType;

/// One device's step buffers, allocated at load for `max_tokens` rows.
pub(super) struct StepBuffers {
    pub(super) x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    /// The last device's: the normed rows that want logits, and their logits.
    picked: CudaSlice<f32>,
    pub(super) logits: CudaSlice<f32>,
    scratch: Scratch,
    tokens: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    slots: CudaSlice<u32>,
    rows: CudaSlice<u32>,
    tables: CudaSlice<u32>,
    picked_index: CudaSlice<u32>,
    /// As allocated ([`BufferSizes::bytes`]).
    pub(super) bytes: usize,
}

/// Sizes of the step buffers.
#[derive(Clone, Copy, Debug)]
pub struct StepLimits {
    /// Rows of a step (`max_batch_tokens`).
    pub max_tokens: usize,
    /// Sequences in a step (`max_batch`).
    pub max_seqs: usize,
    /// The longest sequence (`max_context`): with `max_seqs`, what the block tables hold.
    pub max_context: usize,
    pub block_size: usize,
}

impl StepLimits {
    /// Rows of logits computed at once: a decode step's (`max_seqs`), at least 64, at most a
    /// step's rows. More rows (every position of a prefill chunk) are taken in chunks.
    fn logit_rows(&self) -> usize {
        self.max_seqs.max(64).min(self.max_tokens)
    }

    fn table_capacity(&self) -> usize {
        self.max_seqs
            .saturating_mul(self.max_context.div_ceil(self.block_size))
            .max(1)
    }
}

/// The element counts of a device's step buffers: one formula for what is allocated and for
/// what the engine's sizing counts before anything is allocated.
struct BufferSizes {
    /// x, xn, q, k, v, attn, gate, up, picked, logits (f32).
    floats: [usize; 10],
    /// tokens, positions, slots, rows, tables, picked index (u32).
    ids: [usize; 6],
    /// The half-precision matmul input (u16): none for f32 weights, whose products read the
    /// f32 rows.
    halves: usize,
}

impl BufferSizes {
    fn new(c: &ModelConfig, limits: StepLimits, last: bool, weights: DType) -> BufferSizes {
        let t = limits.max_tokens;
        let logit_rows = if last { limits.logit_rows() } else { 0 };
        let widest = c.hidden_size.max(c.q_dim()).max(c.intermediate_size);
        BufferSizes {
            floats: [
                t * c.hidden_size,
                t * c.hidden_size.max(c.q_dim()),
                t * c.q_dim(),
                t * c.kv_dim(),
                t * c.kv_dim(),
                t * c.q_dim(),
                t * c.intermediate_size,
                t * c.intermediate_size,
                logit_rows * c.hidden_size,
                logit_rows * c.vocab_size,
            ],
            ids: [t, t, t, 3 * t, limits.table_capacity(), t],
            halves: if weights == DType::F32 { 0 } else { t * widest },
        }
    }

    /// Bytes as allocated (an empty buffer is allocated as one element).
    fn bytes(&self) -> usize {
        let elems = |v: &[usize]| v.iter().map(|&n| n.max(1)).sum::<usize>();
        (elems(&self.floats) + elems(&self.ids)) * 4 + self.halves.max(1) * 2
    }
}

/// Bytes of the step buffers (and the RoPE table for `max_positions`) a device of the split
/// allocates: what the engine's sizing leaves room for before it sizes the K/V pool.
pub fn workspace_bytes(
    c: &ModelConfig,
    limits: StepLimits,
    last: bool,
    weights: DType,
    max_positions: usize,
) -> usize {
    BufferSizes::new(c, limits, last, weights).bytes() + max_positions * c.head_dim * 4
}

impl StepBuffers {
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        c: &ModelConfig,
        limits: StepLimits,
        last: bool,
        weights: DType,
    ) -> std::result::Result<StepBuffers, CudaKernelError> {
        let sizes = BufferSizes::new(c, limits, last, weights);
        let floats = |i: usize| {
            let n = sizes.floats[i];
            stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(|source| CudaKernelError::Driver {
                    what: format!("allocating {n} floats of step buffers"),
                    source,
                })
        };
        let ids = |i: usize| {
            let n = sizes.ids[i];
            stream
                .alloc_zeros::<u32>(n.max(1))
                .map_err(|source| CudaKernelError::Driver {
                    what: format!("allocating {n} ids of the step plan"),
                    source,
                })
        };
        Ok(StepBuffers {
            x: floats(0)?,
            xn: floats(1)?,
            q: floats(2)?,
            k: floats(3)?,
            v: floats(4)?,
            attn: floats(5)?,
            gate: floats(6)?,
            up: floats(7)?,
            picked: floats(8)?,
            logits: floats(9)?,
            scratch: Scratch::new(stream, sizes.halves)?,
            tokens: ids(0)?,
            positions: ids(1)?,
            slots: ids(2)?,
            rows: ids(3)?,
            tables: ids(4)?,
            picked_index: ids(5)?,
            bytes: sizes.bytes(),
        })
    }
}

/// A product of a group: its weights, optional bias and output.
type BiasedProduct<'a, 'y> = (
    &'a DeviceMatrix,
    Option<&'a CudaSlice<f32>>,
    &'a mut CudaViewMut<'y, f32>,
);

/// One device of the split: what it holds of the model and its step buffers.
pub struct CudaStage {
    pub device: CudaDevice,
    pub(super) weights: StageWeights,
    pub(super) buffers: StepBuffers,
    pub(super) first: bool,
    pub(super) last: bool,
    /// Held for their `Drop`: the device pool's weights and workspace bytes.
    pub(super) _memory: [Reservation; 2],
}

/// `x.slice(..n)` as a view.
fn head(x: &CudaSlice<f32>, n: usize) -> CudaView<'_, f32> {
    x.slice(..n)
}

fn head_mut(x: &mut CudaSlice<f32>, n: usize) -> CudaViewMut<'_, f32> {
    x.slice_mut(..n)
}

impl CudaStage {
    /// Copies the plan into this device's plan buffers (what this device's kernels read).
    pub(super) fn upload(&mut self, plan: &HostPlan) -> Result<()> {
        let s = &self.device.stream;
        let b = &mut self.buffers;
        if plan.tables.len() > b.tables.len() {
            return Err(StrataError::Internal(format!(
                "a step's block tables ({} entries) exceed the buffer of {}",
                plan.tables.len(),
                b.tables.len()
            )));
        }
        let copy = driver("uploading the step plan");
        s.memcpy_htod(
            &plan.positions,
            &mut b.positions.slice_mut(..plan.positions.len()),
        )
        .map_err(&copy)?;
        s.memcpy_htod(&plan.slots, &mut b.slots.slice_mut(..plan.slots.len()))
            .map_err(&copy)?;
        s.memcpy_htod(&plan.rows, &mut b.rows.slice_mut(..plan.rows.len()))
            .map_err(&copy)?;
        s.memcpy_htod(&plan.tables, &mut b.tables.slice_mut(..plan.tables.len()))
            .map_err(&copy)?;
        if self.first {
            s.memcpy_htod(&plan.tokens, &mut b.tokens.slice_mut(..plan.tokens.len()))
                .map_err(&copy)?;
        }
        if self.last && !plan.picked.is_empty() {
            s.memcpy_htod(
                &plan.picked,
                &mut b.picked_index.slice_mut(..plan.picked.len()),
            )
            .map_err(&copy)?;
        }
        Ok(())
    }

    /// The first device's input: each row's embedding.
    pub(super) fn embed(
        &mut self,
        c: &ModelConfig,
        n: usize,
    ) -> std::result::Result<(), CudaKernelError> {
        let Some(table) = self.weights.embed.as_ref() else {
            return Err(CudaKernelError::Shape(
                "embed on a device without the embedding".into(),
            ));
        };
        let s = &self.device.stream;
        let k = &self.device.kernels;
        let tokens = self.buffers.tokens.slice(..n);
        let mut x = head_mut(&mut self.buffers.x, n * c.hidden_size);
        let vocab = c.vocab_size;
        // The table's bytes as the dtype it was stored in.
        let len = table.rows * table.cols;
        // SAFETY (each arm): the buffer holds `len` elements of that dtype, as uploaded.
        match table.dtype {
            DType::F32 => {
                let t = unsafe { table.data.transmute::<f32>(len) }.ok_or_else(view_error)?;
                k.embedding(s, &t, vocab, &tokens, &mut x)
            }
            DType::F16 => {
                let t = unsafe { table.data.transmute::<f16>(len) }.ok_or_else(view_error)?;
                k.embedding(s, &t, vocab, &tokens, &mut x)
            }
            DType::Bf16 => {
                let t =
                    unsafe { table.data.transmute::<half::bf16>(len) }.ok_or_else(view_error)?;
                k.embedding(s, &t, vocab, &tokens, &mut x)
            }
            DType::Quant(q) => Err(CudaKernelError::Shape(format!(
                "embedding: a {} table reached the CUDA backend (it refuses quantized models)",
                q.name()
            ))),
        }
    }

    /// `y = x · wᵀ (+ bias)` for `n` rows.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        device: &CudaDevice,
        scratch: &mut Scratch,
        x: &CudaView<f32>,
        n: usize,
        w: &DeviceMatrix,
        bias: Option<&CudaSlice<f32>>,
        y: &mut CudaViewMut<f32>,
    ) -> std::result::Result<(), CudaKernelError> {
        Self::linear_group(device, scratch, x, n, &mut [(w, bias, y)])
    }

    /// The products of one input, each with its optional bias (q/k/v, gate/up): the input is
    /// rounded for half weights once (`Blas::linear_group`).
    fn linear_group(
        device: &CudaDevice,
        scratch: &mut Scratch,
        x: &CudaView<f32>,
        n: usize,
        products: &mut [BiasedProduct<'_, '_>],
    ) -> std::result::Result<(), CudaKernelError> {
        let mut gemms: Vec<(&DeviceMatrix, &mut CudaViewMut<f32>)> = products
            .iter_mut()
            .map(|(w, _, y)| (*w, &mut **y))
            .collect();
        device
            .blas
            .linear_group(&device.kernels, x, n, &mut gemms, scratch)?;
        for (_, bias, y) in products.iter_mut() {
            if let Some(b) = bias {
                device.kernels.add_bias(&device.stream, y, &b.as_view())?;
            }
        }
        Ok(())
    }

    /// This device's layers over `n` rows, reading and writing `kv`.
    pub(super) fn layers(
        &mut self,
        c: &ModelConfig,
        n: usize,
        kv: &mut CudaKvPart,
    ) -> std::result::Result<(), CudaKernelError> {
        let (hidden, q_dim, kv_dim, inter) =
            (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let dev = &self.device;
        let (s, k) = (&dev.stream, &dev.kernels);
        let b = &mut self.buffers;
        let eps = c.rms_norm_eps;
        for (j, l) in self.weights.layers.iter().enumerate() {
            let li = self.weights.first_layer + j;
            // Attention block.
            k.rmsnorm(
                s,
                &head(&b.x, n * hidden),
                &l.attn_norm.as_view(),
                eps,
                &mut head_mut(&mut b.xn, n * hidden),
            )?;
            Self::linear_group(
                dev,
                &mut b.scratch,
                &head(&b.xn, n * hidden),
                n,
                &mut [
                    (
                        &l.q_proj,
                        l.q_bias.as_ref(),
                        &mut head_mut(&mut b.q, n * q_dim),
                    ),
                    (
                        &l.k_proj,
                        l.k_bias.as_ref(),
                        &mut head_mut(&mut b.k, n * kv_dim),
                    ),
                    (
                        &l.v_proj,
                        l.v_bias.as_ref(),
                        &mut head_mut(&mut b.v, n * kv_dim),
                    ),
                ],
            )?;
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                k.rmsnorm_inplace(s, &mut head_mut(&mut b.q, n * q_dim), &qn.as_view(), eps)?;
                k.rmsnorm_inplace(s, &mut head_mut(&mut b.k, n * kv_dim), &kn.as_view(), eps)?;
            }
            let positions = b.positions.slice(..n);
            let rope = &self.weights.rope;
            k.rope(
                s,
                &mut head_mut(&mut b.q, n * q_dim),
                c.num_heads,
                &positions,
                rope,
            )?;
            k.rope(
                s,
                &mut head_mut(&mut b.k, n * kv_dim),
                c.num_kv_heads,
                &positions,
                rope,
            )?;
            let layout = kv.layout(j);
            let attend = Attend {
                q: head(&b.q, n * q_dim),
                k: head(&b.k, n * kv_dim),
                v: head(&b.v, n * kv_dim),
                slots: b.slots.slice(..n),
                rows: b.rows.slice(..3 * n),
                tables: b.tables.as_view(),
                layout,
                n_heads: c.num_heads,
                scale,
                window: c.window(li),
            };
            let mut out = head_mut(&mut b.attn, n * q_dim);
            match kv.kv_dtype() {
                KvDtype::F32 => attend.run::<f32>(dev, kv.data_mut(), &mut out)?,
                KvDtype::F16 => attend.run::<f16>(dev, kv.data_mut(), &mut out)?,
                // Refused at load (CudaRunner::new).
                d @ (KvDtype::Bf16 | KvDtype::Q8_0) => {
                    return Err(CudaKernelError::Shape(
                        crate::engine::cuda_kv_refusal(d).to_string(),
                    ))
                }
            }
            Self::linear(
                dev,
                &mut b.scratch,
                &head(&b.attn, n * q_dim),
                n,
                &l.o_proj,
                l.o_bias.as_ref(),
                &mut head_mut(&mut b.xn, n * hidden),
            )?;
            k.add_inplace(
                s,
                &mut head_mut(&mut b.x, n * hidden),
                &head(&b.xn, n * hidden),
            )?;

            // MLP block.
            k.rmsnorm(
                s,
                &head(&b.x, n * hidden),
                &l.mlp_norm.as_view(),
                eps,
                &mut head_mut(&mut b.xn, n * hidden),
            )?;
            Self::linear_group(
                dev,
                &mut b.scratch,
                &head(&b.xn, n * hidden),
                n,
                &mut [
                    (&l.gate_proj, None, &mut head_mut(&mut b.gate, n * inter)),
                    (&l.up_proj, None, &mut head_mut(&mut b.up, n * inter)),
                ],
            )?;
            k.silu_mul(
                s,
                &mut head_mut(&mut b.gate, n * inter),
                &head(&b.up, n * inter),
            )?;
            Self::linear(
                dev,
                &mut b.scratch,
                &head(&b.gate, n * inter),
                n,
                &l.down_proj,
                None,
                &mut head_mut(&mut b.xn, n * hidden),
            )?;
            k.add_inplace(
                s,
                &mut head_mut(&mut b.x, n * hidden),
                &head(&b.xn, n * hidden),
            )?;
        }
        Ok(())
    }

    /// The last device's output for picked rows `from..from + rows` (at most `logit_rows`):
    /// the final norm of those rows of `x` (`n` rows), then the head, into `logits`.
    pub(super) fn head_rows(
        &mut self,
        c: &ModelConfig,
        n: usize,
        from: usize,
        rows: usize,
    ) -> std::result::Result<(), CudaKernelError> {
        let (Some(norm), Some(lm_head)) = (self.weights.norm.as_ref(), self.weights.head()) else {
            return Err(CudaKernelError::Shape(
                "logits on a device without the head".into(),
            ));
        };
        let hidden = c.hidden_size;
        let dev = &self.device;
        let b = &mut self.buffers;
        dev.kernels.rmsnorm_rows(
            &dev.stream,
            &head(&b.x, n * hidden),
            &norm.as_view(),
            &b.picked_index.slice(from..from + rows),
            c.rms_norm_eps,
            &mut head_mut(&mut b.picked, rows * hidden),
        )?;
        dev.blas.linear(
            &dev.kernels,
            &head(&b.picked, rows * hidden),
            rows,
            lm_head,
            &mut b.scratch,
            &mut head_mut(&mut b.logits, rows * c.vocab_size),
        )
    }

    pub(super) fn logit_rows(&self) -> usize {
        self.buffers.logits.len() / self.weights.head().map_or(1, |h| h.rows.max(1))
    }
}

fn view_error() -> CudaKernelError {
    CudaKernelError::Shape("a typed view of a device buffer".into())
}

/// One layer's K/V write and attention, over the device part `cache` of any K/V dtype.
struct Attend<'a> {
    q: CudaView<'a, f32>,
    k: CudaView<'a, f32>,
    v: CudaView<'a, f32>,
    slots: CudaView<'a, u32>,
    rows: CudaView<'a, u32>,
    tables: CudaView<'a, u32>,
    layout: KvLayout,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
}

impl Attend<'_> {
    fn run<T: KvElem>(
        &self,
        dev: &CudaDevice,
        cache: &mut CudaSlice<u8>,
        out: &mut CudaViewMut<f32>,
    ) -> std::result::Result<(), CudaKernelError> {
        let len = cache.len() / std::mem::size_of::<T>();
        let (s, k) = (&dev.stream, &dev.kernels);
        {
            // SAFETY: the part holds `len` elements of its K/V dtype (zeroed at load).
            let mut typed = unsafe { cache.transmute_mut::<T>(len) }.ok_or_else(view_error)?;
            k.kv_write(s, &self.k, &self.v, &self.slots, self.layout, &mut typed)?;
        }
        // SAFETY: as above.
        let typed = unsafe { cache.transmute::<T>(len) }.ok_or_else(view_error)?;
        k.paged_attention(
            s,
            &self.q,
            &self.rows,
            &self.tables,
            &typed,
            self.layout,
            self.n_heads,
            self.scale,
            self.window,
            out,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::tiny_config;
    use super::*;

    /// Step buffers hold the half-precision copy of a product's input only for half weights,
    /// and the engine's sizing counts what is allocated.
    #[test]
    fn only_half_weights_get_a_half_precision_scratch() {
        let c = tiny_config();
        let limits = StepLimits {
            max_tokens: 32,
            max_seqs: 4,
            max_context: 256,
            block_size: 16,
        };
        let f32_sizes = BufferSizes::new(&c, limits, true, DType::F32);
        let bf16_sizes = BufferSizes::new(&c, limits, true, DType::Bf16);
        assert_eq!(f32_sizes.halves, 0);
        // The widest input: 32 rows of the intermediate size (128).
        assert_eq!(bf16_sizes.halves, 32 * 128);
        assert_eq!(bf16_sizes.bytes() - f32_sizes.bytes(), (32 * 128 - 1) * 2);
        assert_eq!(
            workspace_bytes(&c, limits, true, DType::F32, 512),
            f32_sizes.bytes() + 512 * 16 * 4
        );
    }
}
