//! The forward pass on GPUs: `Model::forward`'s steps, top to bottom, with the CUDA kernels and
//! cuBLAS, one [`CudaStage`] per device of the layer split, and decode steps replayed from
//! captured graphs ([`GraphCache`]) on a single GPU.
//!
//! **A step.** The host builds the step's plan (each row's token, position, K/V slot and
//! attention row, the block tables, the rows that want logits: [`HostPlan`], checked as the CPU
//! pass checks it) and copies it into each device's plan buffers, which were allocated at load.
//! The first device embeds the tokens; each device runs its layers reading and writing its own
//! K/V part ([`CudaKvPart`]); the hidden rows go from one device to the next through host memory;
//! the last device norms the rows that want logits, multiplies them by the head and copies the
//! logits back. Everything of a step is enqueued on each device's compute stream in order, and the
//! step returns once the logits are on the host.
//!
//! **Graphs.** A step of decode rows only (one token per sequence, each wanting its logits) on a
//! single GPU replays the graph of its padded batch size (1, 2, 4, ... `max_batch`): the plan is
//! padded (token 0, slot `SLOT_SKIP` so nothing is written, an attention row with an empty table,
//! whose output is NaN and read by nobody), uploaded, and the graph, which reads only the plan
//! buffers, the weights and the K/V part (fixed addresses), runs the whole forward. Capture is an
//! optimization: the [`GraphCache`] bounds the graphs' count and bytes and falls back to an
//! uncaptured step on any failure. A layer split runs uncaptured (one graph per device would
//! need the host hand-off inside it).

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError};
use half::f16;

use super::blas::{DeviceMatrix, Scratch};
use super::device::CudaDevice;
use super::kernels::{CudaKernelError, KvElem, KvLayout, SLOT_SKIP};
use super::kv::{CudaKvPart, KvPartShape};
use super::weights::StageWeights;
use crate::device::graphs::{
    CaptureError, GraphBackend, GraphCache, GraphCacheLimits, GraphCacheStats, StepGraph,
};
use crate::device::memory_pool::{Purpose, Reservation};
use crate::error::{Result, StrataError};
use crate::kv::blocks::{BlockPool, DeviceKv, KvDtype};
use crate::model::config::ModelConfig;
use crate::model::forward::{LogitsWanted, SeqChunk};
use crate::model::kernels::cpu::rope::RopePairing;
use crate::model::weights::DType;
use crate::model::Model;

fn kernel(e: CudaKernelError) -> StrataError {
    StrataError::Internal(format!("GPU step: {e}"))
}

fn driver(what: &'static str) -> impl Fn(DriverError) -> StrataError {
    move |e| StrataError::Internal(format!("GPU step: {what}: {e:?}"))
}

/// The step plan, built on the host and copied into every device's plan buffers.
#[derive(Default)]
struct HostPlan {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    /// (pos, table_start, table_len) per row: the attention kernel's rows.
    rows: Vec<u32>,
    tables: Vec<u32>,
    /// The rows whose logits the step returns, in batch order.
    picked: Vec<u32>,
}

impl HostPlan {
    /// The plan of `batch`, checked as `Model::plan` checks it: the step fits the workspace, the
    /// RoPE table and the block tables, every token is in the vocabulary, `out` holds the
    /// logits. Returns the row count.
    fn build(
        &mut self,
        batch: &[SeqChunk],
        config: &ModelConfig,
        block_size: usize,
        max_positions: usize,
        max_tokens: usize,
        out_len: usize,
    ) -> Result<usize> {
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if n == 0 || n > max_tokens {
            return Err(StrataError::Internal(format!(
                "a step of {n} tokens (workspace holds 1..={max_tokens})"
            )));
        }
        for v in [
            &mut self.tokens,
            &mut self.positions,
            &mut self.slots,
            &mut self.rows,
            &mut self.tables,
            &mut self.picked,
        ] {
            v.clear();
        }
        let mut row = 0u32;
        for s in batch {
            // Its "last" row would be the previous chunk's.
            if s.tokens.is_empty() && s.logits != LogitsWanted::None {
                return Err(StrataError::Internal(
                    "a chunk with no tokens cannot want logits".into(),
                ));
            }
            let end = s.start_pos + s.tokens.len();
            if end > max_positions || end.div_ceil(block_size) > s.block_table.len() {
                return Err(StrataError::Internal(format!(
                    "positions up to {end} exceed the RoPE table or the block table"
                )));
            }
            if let Some(&tok) = s.tokens.iter().find(|&&t| t as usize >= config.vocab_size) {
                return Err(StrataError::invalid(
                    "token_ids",
                    format!(
                        "token id {tok} is outside the vocabulary (size {})",
                        config.vocab_size
                    ),
                ));
            }
            let table_start = self.tables.len() as u32;
            self.tables.extend_from_slice(s.block_table);
            for (i, pos) in (s.start_pos..end).enumerate() {
                self.tokens.push(s.tokens[i]);
                self.positions.push(pos as u32);
                let block = s.block_table[pos / block_size] as usize;
                self.slots
                    .push((block * block_size + pos % block_size) as u32);
                self.rows
                    .extend_from_slice(&[pos as u32, table_start, s.block_table.len() as u32]);
            }
            let len = s.tokens.len() as u32;
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => self.picked.push(row + len - 1),
                LogitsWanted::All => self.picked.extend(row..row + len),
            }
            row += len;
        }
        if out_len < self.picked.len() * config.vocab_size {
            return Err(StrataError::Internal("logits buffer too small".into()));
        }
        Ok(n)
    }

    /// Pads a decode plan of `n` rows to `padded`: rows that write nothing and whose outputs
    /// nobody reads (module docs).
    fn pad(&mut self, n: usize, padded: usize) {
        for r in n..padded {
            self.tokens.push(0);
            self.positions.push(0);
            self.slots.push(SLOT_SKIP);
            self.rows.extend_from_slice(&[0, 0, 0]);
            self.picked.push(r as u32);
        }
    }

    /// Undoes [`HostPlan::pad`]: the plan of the `n` rows as built.
    fn unpad(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.positions.truncate(n);
        self.slots.truncate(n);
        self.rows.truncate(3 * n);
        self.picked.truncate(n);
    }
}

/// One device's step buffers, allocated at load for `max_tokens` rows.
struct StepBuffers {
    x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    /// The last device's: the normed rows that want logits, and their logits.
    picked: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    scratch: Scratch,
    tokens: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    slots: CudaSlice<u32>,
    rows: CudaSlice<u32>,
    tables: CudaSlice<u32>,
    picked_index: CudaSlice<u32>,
    /// As allocated ([`BufferSizes::bytes`]).
    bytes: usize,
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
    fn new(
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
    weights: StageWeights,
    buffers: StepBuffers,
    first: bool,
    last: bool,
    /// Held for their `Drop`: the device pool's weights and workspace bytes.
    _memory: [Reservation; 2],
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
    fn upload(&mut self, plan: &HostPlan) -> Result<()> {
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
    fn embed(&mut self, c: &ModelConfig, n: usize) -> std::result::Result<(), CudaKernelError> {
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
    fn layers(
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
    fn head_rows(
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

    fn logit_rows(&self) -> usize {
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

/// The engine's GPUs: one stage per device of the split, the graph cache, and the host buffers a
/// step passes through.
pub struct CudaRunner {
    /// First, so that it drops first: the graphs reference the stages' kernels, buffers and
    /// cuBLAS workspace (fields drop in declaration order).
    graphs: GraphCache<CapturedStep>,
    stages: Vec<CudaStage>,
    config: ModelConfig,
    limits: StepLimits,
    max_positions: usize,
    plan: HostPlan,
    /// The hidden rows between two devices of a split.
    hand_off: Vec<f32>,
    /// Held for their `Drop`: each device's K/V bytes.
    _kv: Vec<Reservation>,
}

/// How the engine wants its GPUs.
pub struct CudaOptions {
    pub limits: StepLimits,
    pub kv_blocks: usize,
    pub kv_dtype: KvDtype,
    /// Per device: whether the RAM gate admitted a pinned staging buffer of one block's part.
    pub pinned_staging: Vec<bool>,
    pub graphs: GraphCacheLimits,
}

impl CudaRunner {
    /// Places `model` on `devices` (`layer_counts[d]` consecutive layers on device `d`),
    /// accounting each device's weights, K/V and step buffers in its pool, and returns the
    /// runner with the block pool whose parts live on the devices.
    pub fn new(
        model: &Model,
        devices: Vec<CudaDevice>,
        layer_counts: &[usize],
        opts: CudaOptions,
    ) -> Result<(CudaRunner, BlockPool)> {
        // The kernels read f32 or f16 K/V (kernels.rs); bf16 and q8_0 run on the CPU only.
        if let d @ (KvDtype::Bf16 | KvDtype::Q8_0) = opts.kv_dtype {
            return Err(crate::engine::cuda_kv_refusal(d));
        }
        let c = &model.config;
        let quantized = [&model.embed, &model.lm_head]
            .into_iter()
            .chain(model.layers.iter().flat_map(|l| l.matrices()))
            .any(|t| matches!(t.dtype, DType::Quant(_)));
        if quantized || c.rope_pairing != RopePairing::Half {
            return Err(StrataError::invalid(
                "device",
                "the CUDA backend runs Hugging Face folders (f32, f16, bf16) only; \
                 GGUF and quantized models run on device=\"cpu\"",
            ));
        }
        use crate::model::config::Family;
        if matches!(c.family, Family::Gemma3 | Family::Phi3) || c.moe.is_some() {
            return Err(StrataError::invalid(
                "device",
                format!(
                    "the CUDA backend runs the Llama family only; {} runs on device=\"cpu\"",
                    c.family.name()
                ),
            ));
        }
        let ranges = crate::device::split::ranges(layer_counts);
        let last = devices.len().saturating_sub(1);
        let refused = |field: &str| {
            let field = field.to_string();
            move |r: crate::device::memory_pool::PoolRefusal| {
                StrataError::invalid(&field, r.to_string())
            }
        };
        let mut stages = Vec::with_capacity(devices.len());
        let mut parts: Vec<Box<dyn DeviceKv>> = Vec::with_capacity(devices.len());
        let mut kv_memory = Vec::with_capacity(devices.len());
        for (d, device) in devices.into_iter().enumerate() {
            let range = ranges[d].clone();
            let (first, is_last) = (d == 0, d == last);
            let weights_bytes = model.stage_weight_bytes(range.clone(), first, is_last) as u64;
            let weights_reservation = device
                .memory
                .reserve(Purpose::Weights, weights_bytes)
                .map_err(refused("device"))?;
            let shape = KvPartShape {
                num_blocks: opts.kv_blocks,
                layers: range.len(),
                block_size: opts.limits.block_size,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                kv_dtype: opts.kv_dtype,
            };
            let kv_bytes = (shape.part_bytes() as u64).saturating_mul(opts.kv_blocks as u64);
            kv_memory.push(
                device
                    .memory
                    .reserve(Purpose::Kv, kv_bytes)
                    .map_err(refused("kv_memory_mib"))?,
            );
            let weights =
                StageWeights::upload(&device.stream, model, range.clone(), first, is_last)
                    .map_err(|e| {
                        StrataError::DeviceUnavailable(format!("device {}: {e}", device.name))
                    })?;
            let part = CudaKvPart::new(
                &device.name,
                &device.stream,
                shape,
                opts.pinned_staging.get(d).copied().unwrap_or(false),
            )
            .map_err(|e| StrataError::invalid("kv_memory_mib", e))?;
            parts.push(Box::new(part));
            let buffers = StepBuffers::new(&device.stream, c, opts.limits, is_last, model.dtype)
                .map_err(|e| StrataError::invalid("max_batch_tokens", e.to_string()))?;
            let workspace = device
                .memory
                .reserve(
                    Purpose::Workspace,
                    (buffers.bytes + weights.rope.bytes()) as u64,
                )
                .map_err(refused("max_batch_tokens"))?;
            stages.push(CudaStage {
                device,
                weights,
                buffers,
                first,
                last: is_last,
                _memory: [weights_reservation, workspace],
            });
        }
        let kv = BlockPool::on_devices(
            layer_counts,
            parts,
            opts.kv_blocks,
            opts.limits.block_size,
            c.num_kv_heads,
            c.head_dim,
            opts.kv_dtype,
        )?;
        // A split runs uncaptured (module docs).
        let graphs = if stages.len() == 1 {
            opts.graphs
        } else {
            GraphCacheLimits {
                max_graphs: 0,
                ..opts.graphs
            }
        };
        Ok((
            CudaRunner {
                stages,
                config: c.clone(),
                limits: opts.limits,
                max_positions: model.rope.max_positions(),
                plan: HostPlan::default(),
                hand_off: Vec::new(),
                graphs: GraphCache::new(graphs),
                _kv: kv_memory,
            },
            kv,
        ))
    }

    pub fn max_tokens(&self) -> usize {
        self.limits.max_tokens
    }

    pub fn graph_stats(&self) -> GraphCacheStats {
        self.graphs.stats()
    }

    pub fn devices(&self) -> impl Iterator<Item = &CudaDevice> {
        self.stages.iter().map(|s| &s.device)
    }

    /// One forward step: the logits of the rows that want them, in batch order, into `out`.
    /// Returns the number of logit rows.
    pub fn step(
        &mut self,
        batch: &[SeqChunk],
        kv: &mut BlockPool,
        out: &mut [f32],
    ) -> Result<usize> {
        let c = &self.config;
        let n = self.plan.build(
            batch,
            c,
            self.limits.block_size,
            self.max_positions,
            self.limits.max_tokens,
            out.len(),
        )?;
        let picked = self.plan.picked.len();
        let decode = batch
            .iter()
            .all(|s| s.tokens.len() == 1 && s.logits == LogitsWanted::Last);
        if decode && self.stages.len() == 1 {
            if let Some(rows) = self.replay(n, kv, out)? {
                return Ok(rows);
            }
        }
        self.uncaptured(n, picked, kv, out)?;
        Ok(picked)
    }

    /// A decode step from its graph: `Some(rows)` when one was replayed, `None` when the step
    /// must run uncaptured (the plan is as built, unpadded, then).
    fn replay(&mut self, n: usize, kv: &mut BlockPool, out: &mut [f32]) -> Result<Option<usize>> {
        if self.graphs.limits().max_graphs == 0 {
            return Ok(None);
        }
        let Some(padded) = self.graphs.padded(n) else {
            return Ok(None);
        };
        self.plan.pad(n, padded);
        let stage = &mut self.stages[0];
        stage.upload(&self.plan)?;
        let Some(part) = kv
            .device_part_mut(0)
            .and_then(|p| p.as_any_mut().downcast_mut::<CudaKvPart>())
        else {
            return Err(StrataError::Internal(
                "the K/V pool is not on this GPU".into(),
            ));
        };
        let mut capture = DecodeCapture {
            stage,
            part,
            config: &self.config,
        };
        let graph = match self.graphs.get_or_capture(n, &mut capture) {
            StepGraph::Replay(g) => g,
            StepGraph::Uncaptured(_) => {
                self.plan.unpad(n);
                return Ok(None);
            }
        };
        graph
            .launch()
            .map_err(driver("replaying the decode graph"))?;
        let vocab = self.config.vocab_size;
        let stage = &self.stages[0];
        let s = &stage.device.stream;
        s.memcpy_dtoh(
            &stage.buffers.logits.slice(..n * vocab),
            &mut out[..n * vocab],
        )
        .map_err(driver("copying the logits back"))?;
        s.synchronize().map_err(driver("finishing the step"))?;
        Ok(Some(n))
    }

    fn uncaptured(
        &mut self,
        n: usize,
        picked: usize,
        kv: &mut BlockPool,
        out: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let hidden = c.hidden_size;
        let count = self.stages.len();
        for d in 0..count {
            let stage = &mut self.stages[d];
            stage.upload(&self.plan)?;
            if d == 0 {
                stage.embed(c, n).map_err(kernel)?;
            } else {
                // The previous device's hidden rows, through the host.
                let s = &stage.device.stream;
                s.memcpy_htod(
                    &self.hand_off[..n * hidden],
                    &mut stage.buffers.x.slice_mut(..n * hidden),
                )
                .map_err(driver("handing the hidden rows to the next device"))?;
            }
            let Some(part) = kv
                .device_part_mut(d)
                .and_then(|p| p.as_any_mut().downcast_mut::<CudaKvPart>())
            else {
                return Err(StrataError::Internal(format!(
                    "device {d}'s K/V part is not on a GPU"
                )));
            };
            stage.layers(c, n, part).map_err(kernel)?;
            if d + 1 < count {
                self.hand_off.resize(n * hidden, 0.0);
                let s = &stage.device.stream;
                s.memcpy_dtoh(
                    &stage.buffers.x.slice(..n * hidden),
                    &mut self.hand_off[..n * hidden],
                )
                .map_err(driver("copying the hidden rows out"))?;
                s.synchronize()
                    .map_err(driver("finishing a device's layers"))?;
            }
        }
        let vocab = c.vocab_size;
        let last = &mut self.stages[count - 1];
        let chunk = last.logit_rows().max(1);
        let mut from = 0;
        while from < picked {
            let rows = chunk.min(picked - from);
            last.head_rows(c, n, from, rows).map_err(kernel)?;
            let s = &last.device.stream;
            s.memcpy_dtoh(
                &last.buffers.logits.slice(..rows * vocab),
                &mut out[from * vocab..(from + rows) * vocab],
            )
            .map_err(driver("copying the logits back"))?;
            from += rows;
        }
        for stage in &self.stages {
            stage
                .device
                .stream
                .synchronize()
                .map_err(driver("finishing the step"))?;
        }
        Ok(())
    }
}

/// The decode step of one GPU as a [`GraphBackend`]: captures `embed + layers + head` for a
/// padded batch, reading the plan buffers (already uploaded for this step), the weights and the
/// K/V part.
pub struct DecodeCapture<'a> {
    stage: &'a mut CudaStage,
    part: &'a mut CudaKvPart,
    config: &'a ModelConfig,
}

impl DecodeCapture<'_> {
    /// Everything a decode step of `padded` rows enqueues.
    fn enqueue(&mut self, padded: usize) -> std::result::Result<(), CudaKernelError> {
        let c = self.config;
        self.stage.embed(c, padded)?;
        self.stage.layers(c, padded, self.part)?;
        self.stage.head_rows(c, padded, 0, padded)
    }
}

fn capture_error(e: impl std::fmt::Debug) -> CaptureError {
    let message = format!("{e:?}");
    // The driver's CUDA_ERROR_OUT_OF_MEMORY, or cuBLAS's CUBLAS_STATUS_ALLOC_FAILED from a
    // product inside the capture: both are memory the cache can free by dropping graphs.
    if message.contains("OUT_OF_MEMORY") || message.contains("ALLOC_FAILED") {
        CaptureError::OutOfMemory(message)
    } else {
        CaptureError::Other(message)
    }
}

impl GraphBackend for DecodeCapture<'_> {
    type Graph = CapturedStep;

    fn capture(&mut self, padded: usize) -> std::result::Result<CapturedStep, CaptureError> {
        if padded > self.stage.logit_rows() {
            return Err(CaptureError::Other(format!(
                "{padded} rows exceed the {} rows of the logits buffer",
                self.stage.logit_rows()
            )));
        }
        let stream = self.stage.device.stream.clone();
        // A first run uncaptured: cuBLAS picks and loads its kernels outside the capture (the
        // plan is this step's, so the run writes the K/V the replay writes again).
        self.enqueue(padded).map_err(capture_error)?;
        stream.synchronize().map_err(capture_error)?;
        let (free_before, _) = self
            .stage
            .device
            .memory_info()
            .map_err(CaptureError::Other)?;
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(capture_error)?;
        let enqueued = self.enqueue(padded);
        // The capture ends whatever happened, or the stream stays in capture mode.
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        enqueued.map_err(capture_error)?;
        let graph = ended
            .map_err(capture_error)?
            .ok_or_else(|| CaptureError::Other("the capture was invalidated".into()))?;
        graph.upload().map_err(capture_error)?;
        stream.synchronize().map_err(capture_error)?;
        let (free_after, _) = self
            .stage
            .device
            .memory_info()
            .map_err(CaptureError::Other)?;
        let bytes = free_before.saturating_sub(free_after) as u64;
        // Accounted in the device's pool as `graphs` for as long as the graph lives; a pool
        // without room is out of memory, as the cache understands it (it frees graphs, retries).
        let memory = self
            .stage
            .device
            .memory
            .reserve(Purpose::Graphs, bytes)
            .map_err(|r| CaptureError::OutOfMemory(r.to_string()))?;
        Ok(CapturedStep {
            graph,
            bytes,
            _memory: memory,
        })
    }

    fn bytes(&self, graph: &CapturedStep) -> u64 {
        graph.bytes
    }
}

/// A captured decode step and the device memory it took (free memory before its capture minus
/// after its upload).
pub struct CapturedStep {
    graph: CudaGraph,
    bytes: u64,
    /// The pool's `graphs` bytes, released with the graph.
    _memory: Reservation,
}

// SAFETY: CUDA graph objects are not internally synchronized, but may be used from any thread
// when calls on them are serialized. A CapturedStep is made and replayed by the engine thread
// only (the runner that holds the cache moves to that thread once, before its first step).
unsafe impl Send for CapturedStep {}

impl CapturedStep {
    fn launch(&self) -> std::result::Result<(), DriverError> {
        self.graph.launch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testing::TestModel;

    fn tiny_config() -> ModelConfig {
        let text = TestModel::tiny("llama").config_json().to_string();
        ModelConfig::parse(std::path::Path::new("config.json"), &text).expect("a config")
    }

    /// The plan the GPU kernels read, worked by hand for a mixed step (block size 16): a decode
    /// row, a 3-token prefill that wants every row, and a 2-token chunk that wants none.
    #[test]
    fn a_mixed_step_plans_the_rows_slots_and_picks_the_cpu_uses() {
        let c = tiny_config();
        let (a, b, d) = ([9u32], [1u32, 2, 3], [4u32, 5]);
        let (ta, tb, td) = ([7u32, 2, 11], [4u32], [1u32, 6]);
        let batch = [
            SeqChunk {
                tokens: &a,
                start_pos: 40,
                block_table: &ta,
                logits: LogitsWanted::Last,
            },
            SeqChunk {
                tokens: &b,
                start_pos: 0,
                block_table: &tb,
                logits: LogitsWanted::All,
            },
            SeqChunk {
                tokens: &d,
                start_pos: 14,
                block_table: &td,
                logits: LogitsWanted::None,
            },
        ];
        let mut plan = HostPlan::default();
        assert_eq!(plan.build(&batch, &c, 16, 512, 64, 4 * 256).unwrap(), 6);
        assert_eq!(plan.tokens, [9, 1, 2, 3, 4, 5]);
        assert_eq!(plan.positions, [40, 0, 1, 2, 14, 15]);
        // Block table entry pos / 16, times 16, plus pos % 16.
        assert_eq!(plan.slots, [11 * 16 + 8, 64, 65, 66, 16 + 14, 16 + 15]);
        assert_eq!(
            plan.rows,
            [40, 0, 3, 0, 3, 1, 1, 3, 1, 2, 3, 1, 14, 4, 2, 15, 4, 2]
        );
        assert_eq!(plan.tables, [7, 2, 11, 4, 1, 6]);
        assert_eq!(plan.picked, [0, 1, 2, 3]);
        // A second build starts afresh; padding to a graph's size adds rows that write no K/V.
        let one = [SeqChunk {
            tokens: &a,
            start_pos: 40,
            block_table: &ta,
            logits: LogitsWanted::Last,
        }];
        assert_eq!(plan.build(&one, &c, 16, 512, 64, 256).unwrap(), 1);
        plan.pad(1, 4);
        assert_eq!(plan.tokens, [9, 0, 0, 0]);
        assert_eq!(plan.slots, [184, SLOT_SKIP, SLOT_SKIP, SLOT_SKIP]);
        assert_eq!(plan.rows, [40, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(plan.tables, [7, 2, 11]);
        assert_eq!(plan.picked, [0, 1, 2, 3]);
        // A step that gets no graph runs the plan as built.
        plan.unpad(1);
        assert_eq!(
            (&plan.tokens[..], &plan.positions[..], &plan.slots[..]),
            (&[9][..], &[40][..], &[184][..])
        );
        assert_eq!(
            (&plan.rows[..], &plan.picked[..]),
            (&[40, 0, 3][..], &[0][..])
        );
    }

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

    /// What the plan refuses, as the CPU's `Model::plan` does.
    #[test]
    fn a_plan_refuses_what_the_cpu_refuses() {
        let c = tiny_config();
        let message = |batch: &[SeqChunk], out_len: usize| {
            let err = HostPlan::default()
                .build(batch, &c, 16, 512, 4, out_len)
                .expect_err("refused");
            err.to_string()
        };
        let chunk = |tokens: &'static [u32], start_pos: usize, table: &'static [u32]| SeqChunk {
            tokens,
            start_pos,
            block_table: table,
            logits: LogitsWanted::Last,
        };
        assert!(message(&[chunk(&[256], 0, &[0])], 256)
            .contains("token_ids: token id 256 is outside the vocabulary (size 256)"));
        assert!(message(&[chunk(&[1, 2], 15, &[0])], 256)
            .contains("positions up to 17 exceed the RoPE table or the block table"));
        assert!(message(&[chunk(&[1], 512, &[0; 40])], 256).contains("positions up to 513"));
        assert!(message(&[chunk(&[1; 5], 0, &[0])], 5 * 256)
            .contains("a step of 5 tokens (workspace holds 1..=4)"));
        assert!(message(&[chunk(&[1], 0, &[0])], 255).contains("logits buffer too small"));
        assert!(message(
            &[SeqChunk {
                logits: LogitsWanted::All,
                ..chunk(&[], 0, &[0])
            }],
            256
        )
        .contains("a step of 0 tokens"));
    }

    /// Out of memory from the driver or from cuBLAS inside a capture is memory the graph cache
    /// can free; anything else is a failed capture.
    #[test]
    fn capture_errors_are_classified_by_cause() {
        for oom in [
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
            "Shape(\"cublasGemmEx: CUBLAS_STATUS_ALLOC_FAILED\")",
        ] {
            assert!(
                matches!(capture_error(oom), CaptureError::OutOfMemory(_)),
                "{oom}"
            );
        }
        let other = "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access\")";
        assert!(
            matches!(capture_error(other), CaptureError::Other(_)),
            "{other}"
        );
    }
}
