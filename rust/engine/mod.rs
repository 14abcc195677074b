//! Engine: the model, its K/V pool and its workspace, owned by one dedicated thread.
//!
//! Callers talk to the thread through a channel and get answers on oneshot channels, so nothing
//! waits on a lock held by the compute loop and an async caller just awaits the reply.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use crate::bench::{self, BenchReport, BenchSpec};
use crate::device::{self, Device};
use crate::error::{Result, StrataError};
use crate::kv::blocks::{BlockPool, KvDtype};
use crate::model::config::ModelConfig;
use crate::model::tokenizer::Tokenizer;
use crate::model::Model;
use runner::ModelRunner;

pub mod runner;

/// Tokens in a K/V block.
pub const BLOCK_SIZE: usize = 16;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub device: Device,
    /// Compute threads; `None`: the machine's cores.
    pub threads: Option<usize>,
    /// Tokens per forward step; a longer prompt is prefilled in chunks of this size.
    pub max_batch_tokens: usize,
    /// K/V pool budget; `None`: enough for `max_context` tokens, at most 2 GiB.
    pub kv_memory_mib: Option<usize>,
    /// Longest sequence served; `None`: the model's max_position_embeddings.
    pub max_context: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            device: Device::Cpu,
            threads: None,
            max_batch_tokens: 512,
            kv_memory_mib: None,
            max_context: None,
        }
    }
}

/// What a loaded engine is: shown by `info` and used to validate requests before they queue.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub model_dir: PathBuf,
    pub config: ModelConfig,
    pub dtype: &'static str,
    /// Format of the K/V cache ("f32" or "f16").
    pub kv_dtype: &'static str,
    pub device: String,
    pub threads: usize,
    pub max_context: usize,
    pub max_batch_tokens: usize,
    pub kv_blocks: usize,
    pub block_size: usize,
    pub decode_weight_bytes: usize,
}

enum Command {
    Logits {
        ids: Vec<u32>,
        reply: oneshot::Sender<Result<Vec<f32>>>,
    },
    Bench {
        spec: BenchSpec,
        reply: oneshot::Sender<Result<BenchReport>>,
    },
}

pub struct Engine {
    info: EngineInfo,
    tokenizer: Arc<Tokenizer>,
    /// `None` once closed.
    tx: Option<mpsc::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Loads the model folder and starts the engine thread. Blocking: run it off the event loop.
    pub fn load(dir: &Path, opts: EngineOptions) -> Result<Engine> {
        device::check_available(&opts.device)?;
        if opts.max_batch_tokens == 0 {
            return Err(StrataError::invalid(
                "max_batch_tokens",
                "must be at least 1",
            ));
        }
        let threads = match opts.threads {
            Some(0) => return Err(StrataError::invalid("threads", "must be at least 1")),
            Some(t) => t,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        if !dir.is_dir() {
            return Err(StrataError::model_load(dir, "not a directory"));
        }
        let config = ModelConfig::load(dir)?;
        let tokenizer = Tokenizer::load(dir)?;
        let max_context = match opts.max_context {
            Some(0) => return Err(StrataError::invalid("max_context", "must be at least 1")),
            Some(n) => n,
            None => config.max_position_embeddings,
        };
        // The RoPE table covers the requested context; the pool may clamp it below.
        let model = Model::load(dir, max_context)?;
        // f32 weights keep exact f32 K/V; f16/bf16 weights get f16 K/V (llama.cpp's default),
        // which halves the bytes attention reads per token.
        let kv_dtype = KvDtype::for_weights(model.dtype);
        let block_bytes = BlockPool::block_bytes(
            config.num_layers,
            BLOCK_SIZE,
            config.num_kv_heads,
            config.head_dim,
            kv_dtype,
        );
        let kv_blocks = match opts.kv_memory_mib {
            Some(mib) => (mib << 20) / block_bytes,
            None => max_context
                .div_ceil(BLOCK_SIZE)
                .min((2048 << 20) / block_bytes)
                .max(1),
        };
        // One sequence must fit in the pool, else no request of max_context could ever run.
        let max_context = max_context.min(kv_blocks * BLOCK_SIZE);
        let max_batch_tokens = opts.max_batch_tokens.min(max_context);
        let (dtype, decode_weight_bytes) = (model.dtype.name(), model.decode_weight_bytes);
        let mut runner = ModelRunner::new(
            model,
            kv_blocks,
            BLOCK_SIZE,
            max_batch_tokens,
            threads,
            kv_dtype,
        )?;
        let info = EngineInfo {
            model_dir: dir.to_path_buf(),
            dtype,
            decode_weight_bytes,
            kv_dtype: kv_dtype.name(),
            config,
            device: opts.device.name(),
            threads,
            max_context,
            max_batch_tokens,
            kv_blocks,
            block_size: BLOCK_SIZE,
        };
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("strata-engine".into())
            .spawn(move || serve(&mut runner, rx))
            .map_err(|e| StrataError::Internal(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            info,
            tokenizer: Arc::new(tokenizer),
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Validates `ids` and queues them; the receiver yields `[ids.len(), vocab]` logits.
    pub fn logits(&self, ids: Vec<u32>) -> Result<oneshot::Receiver<Result<Vec<f32>>>> {
        self.check_tokens(&ids)?;
        let (reply, rx) = oneshot::channel();
        self.send(Command::Logits { ids, reply })?;
        Ok(rx)
    }

    /// Times prefill and decode on the engine thread (see `bench`).
    pub fn bench(&self, spec: BenchSpec) -> Result<oneshot::Receiver<Result<BenchReport>>> {
        let needed = spec
            .prefill_lens
            .iter()
            .chain(&spec.decode_contexts)
            .map(|&n| n + spec.decode_steps)
            .max()
            .unwrap_or(0);
        if needed > self.info.max_context {
            return Err(StrataError::ContextOverflow(format!(
                "bench needs {needed} tokens of context but the engine holds {}",
                self.info.max_context
            )));
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Bench { spec, reply })?;
        Ok(rx)
    }

    fn check_tokens(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(StrataError::invalid("token_ids", "must not be empty"));
        }
        let vocab = self.info.config.vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(StrataError::invalid(
                "token_ids",
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        if ids.len() > self.info.max_context {
            return Err(StrataError::ContextOverflow(format!(
                "token_ids: {} tokens exceed the context of {} tokens",
                ids.len(),
                self.info.max_context
            )));
        }
        Ok(())
    }

    fn send(&self, cmd: Command) -> Result<()> {
        let tx = self.tx.as_ref().ok_or_else(stopped)?;
        tx.send(cmd).map_err(|_| stopped())
    }

    /// Stops the engine thread after the command in progress. Idempotent.
    pub fn close(&mut self) {
        self.tx = None; // the thread's recv() fails and it returns
        if let Some(t) = self.thread.take() {
            // A panicked engine thread has nothing left to clean up.
            let _ = t.join();
        }
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_none()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

fn stopped() -> StrataError {
    StrataError::EngineStopped("the engine is closed".into())
}

/// The engine thread: answers commands until every sender is gone.
fn serve(runner: &mut ModelRunner, rx: mpsc::Receiver<Command>) {
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Command::Logits { ids, reply } => {
                // The caller may have gone away; nothing to do then.
                let _ = reply.send(runner.all_logits(&ids));
            }
            Command::Bench { spec, reply } => {
                let _ = reply.send(bench::run(runner, &spec));
            }
        }
    }
}
