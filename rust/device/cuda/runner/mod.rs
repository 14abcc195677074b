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
//!
//! **Files.** This one holds the runner ([`CudaRunner`]: load, the step, what the engine calls);
//! `plan.rs` the step plan ([`HostPlan`]) and its CPU tests; `stage.rs` one device's step
//! buffers and forward ([`CudaStage`]); `capture.rs` the decode graphs ([`DecodeCapture`],
//! [`CapturedStep`]).

mod capture;
mod plan;
mod stage;

use cudarc::driver::DriverError;

use super::device::CudaDevice;
use super::kernels::CudaKernelError;
use super::kv::{CudaKvPart, KvPartShape};
use super::weights::StageWeights;
use crate::device::graphs::{GraphCache, GraphCacheLimits, GraphCacheStats, StepGraph};
use crate::device::memory_pool::{Purpose, Reservation};
use crate::error::{Result, StrataError};
use crate::kv::blocks::{BlockPool, DeviceKv, KvDtype};
use crate::model::config::ModelConfig;
use crate::model::forward::{LogitsWanted, SeqChunk};
use crate::model::kernels::cpu::rope::RopePairing;
use crate::model::weights::DType;
use crate::model::Model;
use plan::HostPlan;
use stage::StepBuffers;

pub use capture::{CapturedStep, DecodeCapture};
pub use stage::{workspace_bytes, CudaStage, StepLimits};

fn kernel(e: CudaKernelError) -> StrataError {
    StrataError::Internal(format!("GPU step: {e}"))
}

fn driver(what: &'static str) -> impl Fn(DriverError) -> StrataError {
    move |e| StrataError::Internal(format!("GPU step: {what}: {e:?}"))
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

/// The tiny Llama config the submodules' CPU tests plan and size for.
#[cfg(test)]
fn tiny_config() -> ModelConfig {
    let text = crate::model::testing::TestModel::tiny("llama")
        .config_json()
        .to_string();
    ModelConfig::parse(std::path::Path::new("config.json"), &text).expect("a config")
}
