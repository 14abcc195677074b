//! ModelRunner: a model with its K/V pool, workspace and compute threads; runs forward steps, on
//! the CPU (`Model::forward` over host workspaces) or on GPUs (`CudaRunner`, feature "cuda").

use super::request::PromptTokenLogprob;
use super::sampler::{prompt_token_logprob, LogprobScratch};
use crate::device::memory_pool::{MemoryPool, PoolRefusal, Purpose, Reservation};
use crate::error::{Result, StrataError};
use crate::kv::blocks::{BlockPool, KvDtype};
use crate::kv::window::WindowLayout;
use crate::model::forward::{LogitsWanted, SeqChunk, Workspace};
use crate::model::Model;

pub struct ModelRunner {
    pub model: Model,
    pub kv: BlockPool,
    backend: Backend,
    /// The CPU's compute threads; with a GPU backend they run the step's delivery jobs only.
    pool: rayon::ThreadPool,
    /// The device memory the CPU backend holds, per device, released when the runner is dropped
    /// (a GPU backend holds its own).
    _memory: Vec<RunnerMemory>,
    /// Speculative decoding's draft model, when the engine has one.
    draft: Option<DraftModel>,
}

/// The smaller model that proposes drafts for the target to verify: its own weights and
/// workspace, its K/V in the target's pool ([`BlockPool::attach_draft`]), so that the block
/// tables, the prefix index and the tiers serve both models at once.
struct DraftModel {
    model: Model,
    ws: Vec<Workspace>,
    _memory: RunnerMemory,
}

/// Where the forward pass runs.
enum Backend {
    /// One workspace per device of the layer split, in layer order.
    Cpu(Vec<Workspace>),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::device::cuda::runner::CudaRunner>),
}

/// One device of a layer split: its memory pool and how many consecutive layers it holds.
#[derive(Clone, Debug)]
pub struct Stage {
    pub memory: MemoryPool,
    pub layers: usize,
}

/// A runner's reservations in one device's [`MemoryPool`], one per thing it owns there; never
/// read, held for their `Drop`.
struct RunnerMemory {
    _weights: Reservation,
    _kv: Reservation,
    /// The workspace's buffers and the model's RoPE table (both sized at load, by
    /// `max_batch_tokens` and the context).
    _workspace: Reservation,
}

/// A load the device cannot hold, as an error naming the option that sizes what was refused.
fn refused(field: &str, refusal: PoolRefusal) -> StrataError {
    StrataError::invalid(field, refusal.to_string())
}

impl ModelRunner {
    /// Builds the K/V pool and the workspace for `model` on one device, accounting them and the
    /// model's weights in `memory` (the device's pool): a refusal fails the load before the K/V
    /// pool is allocated; the workspace, whose size its allocations decide, is accounted right
    /// after.
    pub fn new(
        memory: &MemoryPool,
        model: Model,
        kv_blocks: usize,
        block_size: usize,
        max_batch_tokens: usize,
        threads: usize,
        kv_dtype: KvDtype,
    ) -> Result<ModelRunner> {
        let stage = Stage {
            memory: memory.clone(),
            layers: model.config.num_layers,
        };
        Self::split(
            &[stage],
            model,
            kv_blocks,
            None,
            block_size,
            max_batch_tokens,
            threads,
            kv_dtype,
        )
    }

    /// As [`ModelRunner::new`], with the layers split across `stages` (consecutive ranges, in
    /// order): each device accounts its own layers' weights (the embedding on the first, the
    /// final norm and head on the last), the K/V of its layers for every block, and a workspace
    /// of its own with the RoPE table. `kv_window`: the sliding layers' window slots, if they
    /// keep fewer blocks than the pool.
    #[allow(clippy::too_many_arguments)]
    pub fn split(
        stages: &[Stage],
        model: Model,
        kv_blocks: usize,
        kv_window: Option<WindowLayout>,
        block_size: usize,
        max_batch_tokens: usize,
        threads: usize,
        kv_dtype: KvDtype,
    ) -> Result<ModelRunner> {
        let c = &model.config;
        let counts: Vec<usize> = stages.iter().map(|s| s.layers).collect();
        if stages.is_empty() || counts.iter().sum::<usize>() != c.num_layers {
            return Err(StrataError::Internal(format!(
                "a split of {counts:?} layers for a model of {}",
                c.num_layers
            )));
        }
        let ranges = crate::device::split::ranges(&counts);
        let last = stages.len() - 1;
        let mut weights = Vec::with_capacity(stages.len());
        let mut kv_reserved = Vec::with_capacity(stages.len());
        for (d, stage) in stages.iter().enumerate() {
            let bytes = model.stage_weight_bytes(ranges[d].clone(), d == 0, d == last);
            weights.push(
                stage
                    .memory
                    .reserve(Purpose::Weights, bytes as u64)
                    .map_err(|r| refused("device", r))?,
            );
        }
        // The arrays are allocated zeroed, which touches no page: reserving their bytes after
        // is still before any is used.
        let kv = BlockPool::windowed(
            &counts,
            kv_blocks,
            kv_window,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            kv_dtype,
        )?;
        for (d, stage) in stages.iter().enumerate() {
            kv_reserved.push(
                stage
                    .memory
                    .reserve(Purpose::Kv, kv.stage_storage_bytes(d) as u64)
                    .map_err(|r| refused("kv_memory_mib", r))?,
            );
        }
        let mut ws = Vec::with_capacity(stages.len());
        let mut memory = Vec::with_capacity(stages.len());
        for ((stage, weights), kv) in stages.iter().zip(weights).zip(kv_reserved) {
            let w = Workspace::new(&model, max_batch_tokens, threads);
            let workspace = stage
                .memory
                .reserve(Purpose::Workspace, (w.bytes() + model.rope_bytes()) as u64)
                .map_err(|r| refused("max_batch_tokens", r))?;
            ws.push(w);
            memory.push(RunnerMemory {
                _weights: weights,
                _kv: kv,
                _workspace: workspace,
            });
        }
        let pool = compute_threads(threads)?;
        Ok(ModelRunner {
            model,
            kv,
            backend: Backend::Cpu(ws),
            pool,
            _memory: memory,
            draft: None,
        })
    }

    /// A runner on GPUs: `cuda` holds the model's tensors and step buffers, `kv` the block pool
    /// whose parts live on those devices (both from `CudaRunner::new`). `threads` CPU threads run
    /// what stays on the host (sending a step's deltas).
    #[cfg(feature = "cuda")]
    pub fn cuda(
        model: Model,
        cuda: crate::device::cuda::runner::CudaRunner,
        kv: BlockPool,
        threads: usize,
    ) -> Result<ModelRunner> {
        Ok(ModelRunner {
            model,
            kv,
            backend: Backend::Cuda(Box::new(cuda)),
            pool: compute_threads(threads)?,
            _memory: Vec::new(),
            draft: None,
        })
    }

    /// Adds a draft model (same vocabulary, and a CPU runner of one device: both checked by the
    /// caller, `load::load_model`): its K/V for every block of the pool, a workspace of
    /// `max_tokens` rows, and its weights, all accounted in `memory` (the device's pool).
    pub fn attach_draft(
        &mut self,
        memory: &MemoryPool,
        model: Model,
        max_tokens: usize,
        threads: usize,
    ) -> Result<()> {
        if !matches!(&self.backend, Backend::Cpu(ws) if ws.len() == 1) {
            return Err(StrataError::Internal(
                "a draft model for a runner that is not one CPU device".into(),
            ));
        }
        let c = &model.config;
        let layers = c.num_layers;
        let weights = memory
            .reserve(
                Purpose::Weights,
                model.stage_weight_bytes(0..layers, true, true) as u64,
            )
            .map_err(|r| refused("speculative", r))?;
        self.kv.attach_draft(layers, c.num_kv_heads, c.head_dim)?;
        let kv = memory
            .reserve(Purpose::Kv, self.kv.draft_storage_bytes() as u64)
            .map_err(|r| refused("kv_memory_mib", r))?;
        let ws = Workspace::new(&model, max_tokens, threads);
        let workspace = memory
            .reserve(Purpose::Workspace, (ws.bytes() + model.rope_bytes()) as u64)
            .map_err(|r| refused("max_batch_tokens", r))?;
        self.draft = Some(DraftModel {
            model,
            ws: vec![ws],
            _memory: RunnerMemory {
                _weights: weights,
                _kv: kv,
                _workspace: workspace,
            },
        });
        Ok(())
    }

    /// The draft model's vocabulary size (its logits' row length), when there is one.
    pub fn draft_vocab(&self) -> Option<usize> {
        self.draft.as_ref().map(|d| d.model.config.vocab_size)
    }

    /// One forward step of the draft model over its K/V, on the compute threads.
    pub fn draft_step(&mut self, batch: &[SeqChunk], out: &mut [f32]) -> Result<usize> {
        let ModelRunner {
            kv, pool, draft, ..
        } = self;
        let (Some(draft), Some(kv)) = (draft.as_mut(), kv.draft_mut()) else {
            return Err(StrataError::Internal(
                "a draft step without a draft model".into(),
            ));
        };
        pool.install(|| draft.model.forward(batch, kv, &mut draft.ws, out))
    }

    /// The CPU backend's workspaces, one per device of the split (none on GPUs).
    pub fn workspaces(&self) -> &[Workspace] {
        match &self.backend {
            Backend::Cpu(ws) => ws,
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => &[],
        }
    }

    /// The GPU backend, when the runner has one.
    #[cfg(feature = "cuda")]
    pub fn cuda_runner(&self) -> Option<&crate::device::cuda::runner::CudaRunner> {
        match &self.backend {
            Backend::Cpu(_) => None,
            Backend::Cuda(c) => Some(c),
        }
    }

    /// The captured decode graphs' counters (the CPU captures none).
    pub fn graph_stats(&self) -> crate::device::graphs::GraphCacheStats {
        match &self.backend {
            Backend::Cpu(_) => Default::default(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.graph_stats(),
        }
    }

    /// Copy streams made for tier moves (GPUs make one each on their first move).
    pub fn copy_streams(&self) -> usize {
        (0..self.kv.num_stages())
            .filter_map(|d| self.kv.device_part(d))
            .map(|p| p.copy_streams())
            .sum()
    }

    /// Rows of one step: the workspace's size.
    pub fn max_tokens(&self) -> usize {
        match &self.backend {
            Backend::Cpu(ws) => ws.first().map_or(1, Workspace::max_tokens),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.max_tokens(),
        }
    }

    /// Runs `f` on the runner's compute threads.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Runs `f` on one of the compute threads, without waiting for it.
    pub fn spawn(&self, f: impl FnOnce() + Send + 'static) {
        self.pool.spawn(f)
    }

    /// One forward step: on the runner's compute threads, or on its GPUs.
    pub fn step(&mut self, batch: &[SeqChunk], out: &mut [f32]) -> Result<usize> {
        let ModelRunner {
            model,
            kv,
            backend,
            pool,
            ..
        } = self;
        match backend {
            Backend::Cpu(ws) => pool.install(|| model.forward(batch, kv, ws, out)),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.step(batch, kv, out),
        }
    }

    /// Fills positions `start..start + ids.len()` of the sequence with block table `table`, in
    /// chunks of the step size; `out` gets the logits of every position (`want = All`), of the
    /// last one (`Last`) or none.
    pub fn prefill(
        &mut self,
        ids: &[u32],
        start: usize,
        table: &[u32],
        want: LogitsWanted,
        out: &mut [f32],
    ) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        let step = self.max_tokens();
        let chunks = ids.len().div_ceil(step);
        for (i, chunk) in ids.chunks(step).enumerate() {
            let pos = start + i * step;
            let (logits, dst) = match want {
                LogitsWanted::All => (
                    LogitsWanted::All,
                    &mut out[i * step * vocab..(i * step + chunk.len()) * vocab],
                ),
                LogitsWanted::Last if i + 1 == chunks => (LogitsWanted::Last, &mut out[..vocab]),
                _ => (LogitsWanted::None, &mut out[..0]),
            };
            self.window_slots(table, pos, pos + chunk.len())?;
            let batch = [SeqChunk {
                tokens: chunk,
                start_pos: pos,
                block_table: table,
                logits,
            }];
            self.step(&batch, dst)?;
        }
        Ok(())
    }

    /// Window slots for a diagnostic step that writes positions `start..end` of `table` (from
    /// [`ModelRunner::allocate`]): the blocks its window reads and writes get theirs, those
    /// before give theirs back. A no-op without window slots.
    pub fn window_slots(&mut self, table: &[u32], start: usize, end: usize) -> Result<()> {
        let to = end.div_ceil(self.kv.block_size()).min(table.len());
        if self.kv.slots_from(&table[..to], self.kv.first_read(start)) {
            return Ok(());
        }
        Err(StrataError::ContextOverflow(format!(
            "token_ids: no room in the K/V pool's window slots for positions {start}..{end}"
        )))
    }

    /// Blocks for a sequence of `len` tokens, or ContextOverflow when the pool cannot hold it.
    /// For the diagnostic commands (logits, bench): cached blocks it evicts are not kept below.
    /// Their window slots come with each step ([`ModelRunner::window_slots`]).
    pub fn allocate(&mut self, len: usize) -> Result<Vec<u32>> {
        self.kv
            .allocate_unslotted(len.div_ceil(self.kv.block_size()))
            .map(|a| a.blocks)
            .ok_or_else(|| {
                StrataError::ContextOverflow(format!(
                    "token_ids: no room in the K/V pool for {len} tokens"
                ))
            })
    }

    /// Each token's entry after the first (`prompt_token_logprob`: its logprob under the
    /// positions before it, its rank, the `top` most likely tokens there), from a cold K/V state.
    /// The logits are made one prefill chunk at a time and reduced at once, so a long prompt
    /// never holds `[len, vocab]` of them.
    pub fn prompt_logprobs(&mut self, ids: &[u32], top: usize) -> Result<Vec<PromptTokenLogprob>> {
        let table = self.allocate(ids.len())?;
        let result = self.prompt_logprobs_in(ids, top, &table);
        self.kv.release(&table);
        result
    }

    fn prompt_logprobs_in(
        &mut self,
        ids: &[u32],
        top: usize,
        table: &[u32],
    ) -> Result<Vec<PromptTokenLogprob>> {
        let vocab = self.model.config.vocab_size;
        let step = self.max_tokens();
        let mut logits = vec![0.0f32; step.min(ids.len()) * vocab];
        let mut scratch = LogprobScratch::default();
        let mut out = Vec::with_capacity(ids.len().saturating_sub(1));
        for (i, chunk) in ids.chunks(step).enumerate() {
            let start = i * step;
            self.window_slots(table, start, start + chunk.len())?;
            let batch = [SeqChunk {
                tokens: chunk,
                start_pos: start,
                block_table: table,
                logits: LogitsWanted::All,
            }];
            let rows = &mut logits[..chunk.len() * vocab];
            self.step(&batch, rows)?;
            for (r, row) in rows.chunks_mut(vocab).enumerate() {
                if let Some(&next) = ids.get(start + r + 1) {
                    out.push(prompt_token_logprob(row, next, top, &mut scratch));
                }
            }
        }
        Ok(out)
    }

    /// Logits of every position of `ids` (`[ids.len(), vocab]`), from a cold K/V state.
    pub fn all_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let table = self.allocate(ids.len())?;
        let mut out = vec![0.0f32; ids.len() * self.model.config.vocab_size];
        let result = self.prefill(ids, 0, &table, LogitsWanted::All, &mut out);
        self.kv.release(&table);
        result.map(|_| out)
    }
}

fn compute_threads(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("strata-compute-{i}"))
        .build()
        .map_err(|e| StrataError::Internal(format!("cannot start compute threads: {e}")))
}
