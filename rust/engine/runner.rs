//! ModelRunner: a model with its K/V pool, workspace and compute threads; runs forward steps.

use crate::device::memory_pool::{MemoryPool, PoolRefusal, Purpose, Reservation};
use crate::error::{Result, StrataError};
use crate::kv::blocks::{BlockPool, KvDtype};
use crate::model::forward::{LogitsWanted, SeqChunk, Workspace};
use crate::model::Model;

pub struct ModelRunner {
    pub model: Model,
    pub kv: BlockPool,
    pub ws: Workspace,
    pool: rayon::ThreadPool,
    /// The device memory the fields above hold, released when the runner is dropped.
    _memory: RunnerMemory,
}

/// A runner's reservations in its device's [`MemoryPool`], one per thing it owns; never read,
/// held for their `Drop`.
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
    /// Builds the K/V pool and the workspace for `model`, accounting them and the model's
    /// weights in `memory` (the device's pool): a refusal fails the load before the K/V pool is
    /// allocated; the workspace, whose size its allocations decide, is accounted right after.
    pub fn new(
        memory: &MemoryPool,
        model: Model,
        kv_blocks: usize,
        block_size: usize,
        max_batch_tokens: usize,
        threads: usize,
        kv_dtype: KvDtype,
    ) -> Result<ModelRunner> {
        let c = &model.config;
        let weights = memory
            .reserve(Purpose::Weights, model.weight_bytes() as u64)
            .map_err(|r| refused("device", r))?;
        let kv_bytes = BlockPool::block_bytes(
            c.num_layers,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            kv_dtype,
        )
        .checked_mul(kv_blocks)
        .ok_or_else(|| StrataError::invalid("kv_memory_mib", "too large"))?;
        let kv_reserved = memory
            .reserve(Purpose::Kv, kv_bytes as u64)
            .map_err(|r| refused("kv_memory_mib", r))?;
        let kv = BlockPool::new(
            c.num_layers,
            kv_blocks,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            kv_dtype,
        )?;
        let ws = Workspace::new(&model, max_batch_tokens, threads);
        let workspace = memory
            .reserve(Purpose::Workspace, (ws.bytes() + model.rope.bytes()) as u64)
            .map_err(|r| refused("max_batch_tokens", r))?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("strata-compute-{i}"))
            .build()
            .map_err(|e| StrataError::Internal(format!("cannot start compute threads: {e}")))?;
        Ok(ModelRunner {
            model,
            kv,
            ws,
            pool,
            _memory: RunnerMemory {
                _weights: weights,
                _kv: kv_reserved,
                _workspace: workspace,
            },
        })
    }

    /// Runs `f` on the runner's compute threads.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Runs `f` on one of the compute threads, without waiting for it.
    pub fn spawn(&self, f: impl FnOnce() + Send + 'static) {
        self.pool.spawn(f)
    }

    /// One forward step on the runner's compute threads.
    pub fn step(&mut self, batch: &[SeqChunk], out: &mut [f32]) -> Result<usize> {
        let ModelRunner {
            model,
            kv,
            ws,
            pool,
            ..
        } = self;
        pool.install(|| model.forward(batch, kv, ws, out))
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
        let step = self.ws.max_tokens();
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

    /// Blocks for a sequence of `len` tokens, or ContextOverflow when the pool cannot hold it.
    /// For the diagnostic commands (logits, bench): cached blocks it evicts are not kept below.
    pub fn allocate(&mut self, len: usize) -> Result<Vec<u32>> {
        self.kv
            .allocate(len.div_ceil(self.kv.block_size()))
            .map(|a| a.blocks)
            .ok_or_else(|| {
                StrataError::ContextOverflow(format!(
                    "token_ids: no room in the K/V pool for {len} tokens"
                ))
            })
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
