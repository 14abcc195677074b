//! Engine: the model, its K/V pool and its scheduler, owned by one dedicated thread.
//!
//! Callers talk to the thread through a channel: a request is validated on the caller's side,
//! sent over, and its tokens come back on the request's own stream. Nothing waits on a lock held
//! by the compute loop, and an async caller just awaits its stream.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::bench::{self, BenchReport, BenchSpec};
use crate::cache::CacheOptions;
use crate::device::memory_pool::{MemoryPool, PoolSnapshot};
use crate::device::Device;
use crate::error::{Result, StrataError};
use crate::kv::blocks::KvDtype;
use crate::model::config::ModelConfig;
use crate::model::tokenizer::Tokenizer;
use core::EngineCore;
use ngram::DraftOptions;
use request::{CancelFlag, Event, PromptTokenLogprob, Request, SamplingParams, MAX_LOGPROBS};
use stats::EngineStats;
use structured::Grammars;

pub mod core;
pub mod doorbell;
#[cfg(feature = "cuda")]
mod gpu_sizing;
mod load;
pub mod ngram;
pub mod request;
pub mod runner;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod stats;
pub mod stop;
pub mod structured;

/// Tokens in a K/V block.
pub const BLOCK_SIZE: usize = 16;
/// Most compute threads an engine may be asked for.
pub const MAX_THREADS: usize = 1024;
/// Most drafts per step (`num_speculative_tokens`).
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub device: Device,
    /// Compute threads; `None`: the machine's cores.
    pub threads: Option<usize>,
    /// Tokens per forward step; a longer prompt is prefilled in chunks of this size.
    pub max_batch_tokens: usize,
    /// Sequences running at once (rows of a decode step).
    pub max_batch: usize,
    /// Requests that may wait for admission; past it, `submit` refuses with EngineBusy.
    pub max_waiting: usize,
    /// K/V pool budget; `None`: enough for `max_context` tokens, at most 2 GiB.
    pub kv_memory_mib: Option<usize>,
    /// Format of the K/V cache ("f32", "f16", "bf16", "q8_0": [`KvDtype::parse`]); `None`: from
    /// the weights ([`KvDtype::for_weights`]).
    pub kv_dtype: Option<String>,
    /// Quantize a Hugging Face folder's weight matrices at load ("q8_0", "q4_k", "q6_k":
    /// [`Model::quantize`]); `None`: as stored.
    pub quantize: Option<String>,
    /// bf16 weight matrices take the CPU's bf16 dot products (AVX512_BF16), their input rows
    /// rounded to bf16 (llama.cpp's arithmetic on bf16 weights): about twice the prefill
    /// speed, at the rounding's error (2^-9 per product). Off: f32 inputs. Ignored where the
    /// CPU lacks the instructions and on a GPU; `info["matmul_inputs"]` says what runs.
    pub bf16_dot: bool,
    /// Longest sequence served; `None`: the model's max_position_embeddings.
    pub max_context: Option<usize>,
    /// Speculative decoding: "ngram" (drafts by prompt lookup, [`ngram`]) or the path of a
    /// draft model with the target's tokenizer (any format the engine loads; its drafts are its
    /// greedy picks); `None`: off.
    pub speculative: Option<String>,
    /// Most drafts a sequence tries per step.
    pub num_speculative_tokens: usize,
    /// Shortest and longest suffix the n-gram lookup matches.
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Draft only as many tokens as the measured step times say pay; false: every draft the
    /// lookup proposes (a draft model: `num_speculative_tokens` each step).
    pub speculative_adaptive: bool,
    /// The conversation cache below the device.
    pub cache: CacheOptions,
    /// Each device's capacity in MiB ("300,120"), one per device of `device`, in its order;
    /// `None`: not configured (the CPU's pools account and never refuse).
    pub device_memory_mib: Option<String>,
    /// Layers per device of `device` ("20,10"); `None`: in proportion to each device's free
    /// memory, evenly when it is not known.
    pub layer_split: Option<String>,
    /// GPU memory left free on each device after load (MiB), beside what the pool accounts: the
    /// driver's own allocations (graphs, streams), fragmentation, other processes' growth.
    pub vram_reserve_mib: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            device: Device::Cpu,
            threads: None,
            max_batch_tokens: 512,
            max_batch: 8,
            max_waiting: 256,
            kv_memory_mib: None,
            kv_dtype: None,
            quantize: None,
            bf16_dot: false,
            max_context: None,
            speculative: None,
            num_speculative_tokens: 4,
            ngram_min: 2,
            ngram_max: 4,
            speculative_adaptive: true,
            cache: CacheOptions::default(),
            device_memory_mib: None,
            layer_split: None,
            vram_reserve_mib: 1024,
        }
    }
}

/// What a draft model is (`EngineInfo::draft_model`).
#[derive(Clone, Debug)]
pub struct DraftInfo {
    /// Its file or folder.
    pub path: std::path::PathBuf,
    /// Its weights' type as they run (after `quantize`).
    pub dtype: &'static str,
    pub num_layers: usize,
}

/// What a loaded engine is: shown by `info` and used to validate requests before they queue.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    /// The model folder, or the (first) GGUF file.
    pub model_dir: PathBuf,
    /// "hf" or "gguf".
    pub format: &'static str,
    pub config: ModelConfig,
    pub dtype: &'static str,
    /// Format of the K/V cache ("f32", "f16", "bf16" or "q8_0").
    pub kv_dtype: &'static str,
    /// The type the weights were quantized to at load (`quantize`), if they were.
    pub quantize: Option<&'static str>,
    /// What the matmuls of the model's dtype (the one holding the most bytes) round their input
    /// rows to: "f32" (not rounded), "bf16" (bf16 weights with `bf16_dot` on a CPU with bf16
    /// dot products) or "int8" (quantized weights).
    pub matmul_inputs: &'static str,
    /// The instruction-set levels the CPU kernels dispatch to on this machine
    /// ([`crate::model::kernels::cpu::isa::CpuLevels::names`]).
    pub cpu_levels: Vec<&'static str>,
    pub device: String,
    pub threads: usize,
    pub max_context: usize,
    pub max_batch_tokens: usize,
    pub max_batch: usize,
    pub max_waiting: usize,
    pub kv_blocks: usize,
    pub block_size: usize,
    /// The start of every prefix hash chain (`kv::prefix::extend_hashes`): the model and the
    /// K/V format's fingerprint.
    pub prefix_salt: u64,
    /// Bytes of K/V one block holds (all layers; a draft model's too).
    pub kv_block_bytes: usize,
    /// Speculative decoding's drafts (by lookup or by a draft model), if on.
    pub speculative: Option<DraftOptions>,
    /// The draft model, when one proposes.
    pub draft_model: Option<DraftInfo>,
    /// The devices of `device`, one name each ("cpu", or "cpu:0", "cpu:1", ...), in layer order.
    pub devices: Vec<String>,
    /// Layers each device of `devices` holds.
    pub layer_split: Vec<usize>,
    pub decode_weight_bytes: usize,
}

enum Command {
    Submit(Box<Request>),
    /// Makes the next step panic, as a bug would: tests the fault path end to end.
    InjectFault,
    Logits {
        ids: Vec<u32>,
        reply: oneshot::Sender<Result<Vec<f32>>>,
    },
    PromptLogprobs {
        ids: Vec<u32>,
        top: usize,
        reply: oneshot::Sender<Result<Vec<PromptTokenLogprob>>>,
    },
    Bench {
        spec: BenchSpec,
        reply: oneshot::Sender<Result<BenchReport>>,
    },
    CachedBlockHashes {
        reply: oneshot::Sender<Vec<u64>>,
    },
}

pub struct Engine {
    info: EngineInfo,
    tokenizer: Arc<Tokenizer>,
    /// Compiles requests' `structured_outputs` (built on first use).
    grammars: Grammars,
    /// `None` once closed.
    tx: Option<mpsc::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
    next_request_id: AtomicU64,
    /// Requests submitted and not yet admitted (the engine thread counts them down).
    queued: Arc<AtomicUsize>,
    stats: Arc<Mutex<EngineStats>>,
    /// Each device's memory accounting, shared with what the engine thread owns.
    memory: Vec<MemoryPool>,
}

/// A submitted request: its stream of events and the switch that cancels it.
pub struct Submission {
    pub id: u64,
    pub events: tmpsc::UnboundedReceiver<Event>,
    pub cancel: CancelFlag,
}

impl Engine {
    /// Validates a request and queues it. Its deltas arrive on `events`; the last one carries
    /// the usage. Refuses with EngineBusy when `max_waiting` requests are already waiting.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Submission> {
        self.check_tokens(&prompt, "prompt")?;
        params.validate(self.info.config.vocab_size)?;
        let constraint = match &params.structured_outputs {
            Some(s) => Some(self.grammars.compile(s)?),
            None => None,
        };
        let ctx = self.info.max_context;
        if prompt.len() >= ctx {
            return Err(StrataError::ContextOverflow(format!(
                "prompt: {} tokens leave no room to generate in the context of {ctx} tokens",
                prompt.len()
            )));
        }
        if let Some(m) = params.max_tokens {
            if prompt.len() + m > ctx {
                return Err(StrataError::ContextOverflow(format!(
                    "max_tokens: {} prompt tokens + {m} exceed the context of {ctx} tokens",
                    prompt.len()
                )));
            }
        }
        let tx = self.live_sender()?;
        let max_waiting = self.info.max_waiting;
        if self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < max_waiting).then_some(q + 1)
            })
            .is_err()
        {
            self.lock_stats().refused += 1;
            return Err(StrataError::EngineBusy(format!(
                "{max_waiting} requests are already waiting (max_waiting); retry later"
            )));
        }
        let (events_tx, events) = tmpsc::unbounded_channel();
        let cancel = CancelFlag::default();
        let id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let req = Request {
            id,
            prompt,
            params,
            constraint,
            events: events_tx,
            cancel: cancel.clone(),
        };
        if tx.send(Command::Submit(Box::new(req))).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(self.stopped_error());
        }
        Ok(Submission { id, events, cancel })
    }

    /// Makes the engine thread's next step panic, exactly as a bug would: every stream ends with
    /// the error, `stats().stopped` says why, and later calls get EngineStopped. For tests of
    /// what callers (the server's /health) do when the engine dies.
    pub fn inject_fault(&self) -> Result<()> {
        self.send(Command::InjectFault)
    }

    /// A snapshot of the engine's counters, as of its last step.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.lock_stats().clone();
        // Queued requests still in the channel are waiting too.
        s.waiting = s.waiting.max(self.queued.load(Ordering::Acquire));
        s
    }

    /// The memory accounting of each device the engine uses, read now (not as of the last step).
    pub fn memory(&self) -> Vec<PoolSnapshot> {
        self.memory.iter().map(MemoryPool::snapshot).collect()
    }

    fn lock_stats(&self) -> std::sync::MutexGuard<'_, EngineStats> {
        crate::sync::lock(&self.stats)
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The prefix hashes of the blocks this engine holds itself, on the device and in the host
    /// tier (not the disk tier: other processes may share its folder), as of the next step.
    /// What a router needs to send a conversation where its history is.
    pub fn cached_block_hashes(&self) -> Result<oneshot::Receiver<Vec<u64>>> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::CachedBlockHashes { reply })?;
        Ok(rx)
    }

    /// Validates `ids` and queues them; the receiver yields `[ids.len(), vocab]` logits.
    pub fn logits(&self, ids: Vec<u32>) -> Result<oneshot::Receiver<Result<Vec<f32>>>> {
        self.check_tokens(&ids, "token_ids")?;
        let (reply, rx) = oneshot::channel();
        self.send(Command::Logits { ids, reply })?;
        Ok(rx)
    }

    /// Validates `ids` and `top` and queues them; the receiver yields each token's entry after
    /// the first, with its rank (`ModelRunner::prompt_logprobs`).
    pub fn prompt_logprobs(
        &self,
        ids: Vec<u32>,
        top: usize,
    ) -> Result<oneshot::Receiver<Result<Vec<PromptTokenLogprob>>>> {
        self.check_tokens(&ids, "token_ids")?;
        if top > MAX_LOGPROBS {
            return Err(StrataError::invalid(
                "top_logprobs",
                format!("must be at most {MAX_LOGPROBS}, got {top}"),
            ));
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::PromptLogprobs { ids, top, reply })?;
        Ok(rx)
    }

    /// Times prefill and decode on the engine thread (see `bench`).
    pub fn bench(&self, spec: BenchSpec) -> Result<oneshot::Receiver<Result<BenchReport>>> {
        // A prefill holds its prompt; a decode context, its steps too.
        let needed = spec
            .prefill_lens
            .iter()
            .copied()
            .chain(spec.decode_contexts.iter().map(|&n| n + spec.decode_steps))
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

    fn check_tokens(&self, ids: &[u32], field: &str) -> Result<()> {
        if ids.is_empty() {
            return Err(StrataError::invalid(field, "must not be empty"));
        }
        let vocab = self.info.config.vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(StrataError::invalid(
                field,
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        if ids.len() > self.info.max_context {
            return Err(StrataError::ContextOverflow(format!(
                "{field}: {} tokens exceed the context of {} tokens",
                ids.len(),
                self.info.max_context
            )));
        }
        Ok(())
    }

    fn send(&self, cmd: Command) -> Result<()> {
        self.live_sender()?
            .send(cmd)
            .map_err(|_| self.stopped_error())
    }

    /// The channel to the engine thread, unless the engine is closed or its loop has stopped
    /// (the thread publishes why before it tells any stream, so no request slips in between).
    fn live_sender(&self) -> Result<&mpsc::Sender<Command>> {
        let stopped = self.lock_stats().stopped.is_some();
        match (&self.tx, stopped) {
            (Some(tx), false) => Ok(tx),
            _ => Err(self.stopped_error()),
        }
    }

    fn stopped_error(&self) -> StrataError {
        let why = self.lock_stats().stopped.clone();
        match why {
            Some(why) if self.tx.is_some() => {
                StrataError::EngineStopped(format!("the engine stopped: {why}"))
            }
            _ => stopped(),
        }
    }

    /// Stops the engine thread after the step in progress; every open stream ends with
    /// EngineStopped. Idempotent.
    pub fn close(&mut self) {
        if let Some(t) = self.begin_close() {
            // A panicked engine thread has nothing left to clean up.
            let _ = t.join();
        }
    }

    /// Stops taking requests and tells the thread to stop; the caller joins the returned thread
    /// (so that it need not hold a lock on the engine while the last step finishes).
    pub fn begin_close(&mut self) -> Option<JoinHandle<()>> {
        self.tx = None; // the thread's recv() fails and it returns
        self.thread.take()
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

/// The engine thread: takes commands and runs steps until the engine is closed or faults.
fn serve(mut core: EngineCore, rx: mpsc::Receiver<Command>) {
    let closed = || StrataError::EngineStopped("the engine was closed".into());
    loop {
        // Block while there is nothing to run; otherwise take what arrived and step.
        if core.is_idle() && !core.inject_fault {
            core.persist_if_idle_writes();
            match rx.recv() {
                Ok(cmd) => handle(&mut core, cmd),
                Err(_) => {
                    core.persist_cache();
                    core.set_stopped(closed().to_string());
                    return;
                }
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => handle(&mut core, cmd),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    // Stopped is published before the streams hear of it.
                    core.set_stopped(closed().to_string());
                    core.fail_all(closed);
                    core.persist_cache();
                    return;
                }
            }
        }
        // A fault inside a step (a bug, or the OS failing us) stops the engine: every stream
        // ends with the error and later calls get EngineStopped, rather than a loop that looks
        // alive but serves nothing.
        let fault = match catch_unwind(AssertUnwindSafe(|| core.step())) {
            Ok(Ok(true)) => continue,
            Ok(Ok(false)) => {
                // Work is queued but nothing could be scheduled (it should not happen: a lone
                // sequence always fits). Wait for a command rather than spin.
                match rx.recv_timeout(std::time::Duration::from_millis(1)) {
                    Ok(cmd) => handle(&mut core, cmd),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        core.set_stopped(closed().to_string());
                        core.fail_all(closed);
                        core.persist_cache();
                        return;
                    }
                }
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(panic) => panic_message(panic.as_ref()),
        };
        let msg = format!("engine fault: {fault}");
        core.set_stopped(msg.clone());
        core.fail_all(|| StrataError::Internal(msg.clone()));
        return;
    }
}

fn handle(core: &mut EngineCore, cmd: Command) {
    match cmd {
        Command::Submit(req) => {
            core.count_prompt(req.prompt.len());
            core.add_request(*req);
        }
        Command::InjectFault => core.inject_fault = true,
        Command::Logits { ids, reply } => {
            // The caller may have gone away; nothing to do then.
            let _ = reply.send(core.runner.all_logits(&ids));
        }
        Command::PromptLogprobs { ids, top, reply } => {
            let _ = reply.send(core.runner.prompt_logprobs(&ids, top));
        }
        Command::Bench { spec, reply } => {
            let _ = reply.send(bench::run(&mut core.runner, &spec));
        }
        Command::CachedBlockHashes { reply } => {
            let _ = reply.send(core.cached_block_hashes());
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".into()
    }
}

/// The refusal of a K/V format the CUDA backend has no kernels for (it reads f32 and f16 K/V).
pub fn cuda_kv_refusal(d: KvDtype) -> StrataError {
    StrataError::invalid(
        "kv_dtype",
        format!(
            "{:?} K/V runs on the CPU only; the CUDA backend reads f32 or f16 K/V",
            d.name()
        ),
    )
}
