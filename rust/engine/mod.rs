//! Engine: the model, its K/V pool and its scheduler, owned by one dedicated thread.
//!
//! Callers talk to the thread through a channel: a request is validated on the caller's side,
//! sent over, and its tokens come back on the request's own stream. Nothing waits on a lock held
//! by the compute loop, and an async caller just awaits its stream.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::bench::{self, BenchReport, BenchSpec};
use crate::cache::disk::BlockLayout;
use crate::cache::ram_gate::RamGate;
use crate::cache::{CacheOptions, ConversationCache, DevicePart};
use crate::device::memory_pool::{MemoryPool, PoolSnapshot};
use crate::device::{self, split, Device};
use crate::error::{Result, StrataError};
use crate::kv::blocks::{BlockPool, KvDtype};
use crate::model::config::ModelConfig;
use crate::model::kernels::cpu::matmul_bf16dot;
use crate::model::kernels::cpu::quant::QuantType;
use crate::model::kernels::cpu::rope::RopeScaling;
use crate::model::tokenizer::Tokenizer;
use crate::model::weights::DType;
use crate::model::{Model, ModelSource};
use core::EngineCore;
#[cfg(feature = "cuda")]
use gpu_sizing::open_gpus;
use ngram::NgramOptions;
use request::{CancelFlag, Event, PromptTokenLogprob, Request, SamplingParams, MAX_LOGPROBS};
use runner::{ModelRunner, Stage};
use scheduler::Scheduler;
use stats::EngineStats;
use structured::Grammars;

pub mod core;
pub mod doorbell;
#[cfg(feature = "cuda")]
mod gpu_sizing;
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
    /// Speculative decoding: "ngram" (drafts by prompt lookup, [`ngram`]); `None`: off.
    pub speculative: Option<String>,
    /// Most drafts a sequence tries per step.
    pub num_speculative_tokens: usize,
    /// Shortest and longest suffix the n-gram lookup matches.
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Draft only as many tokens as the measured step times say pay; false: every draft the
    /// lookup proposes.
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
    /// Bytes of K/V one block holds (all layers).
    pub kv_block_bytes: usize,
    /// Speculative decoding's drafts ("ngram"), if on.
    pub speculative: Option<NgramOptions>,
    /// The devices of `device`, one name each ("cpu", or "cpu:0", "cpu:1", ...), in layer order.
    pub devices: Vec<String>,
    /// Layers each device of `devices` holds.
    pub layer_split: Vec<usize>,
    pub decode_weight_bytes: usize,
}

/// The drafting settings `opts` ask for, checked.
fn speculative_options(opts: &EngineOptions) -> Result<Option<NgramOptions>> {
    match opts.speculative.as_deref() {
        None => return Ok(None),
        Some("ngram") => {}
        Some(other) => {
            return Err(StrataError::invalid(
                "speculative",
                format!("must be \"ngram\" (drafts by prompt lookup), got {other:?}"),
            ))
        }
    }
    let k = opts.num_speculative_tokens;
    if !(1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
        return Err(StrataError::invalid(
            "num_speculative_tokens",
            format!("must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}"),
        ));
    }
    if opts.ngram_min == 0 {
        return Err(StrataError::invalid("ngram_min", "must be at least 1"));
    }
    if opts.ngram_max < opts.ngram_min {
        return Err(StrataError::invalid(
            "ngram_max",
            format!(
                "must be at least ngram_min ({}), got {}",
                opts.ngram_min, opts.ngram_max
            ),
        ));
    }
    Ok(Some(NgramOptions {
        max_drafts: k,
        min_n: opts.ngram_min,
        max_n: opts.ngram_max,
        adaptive: opts.speculative_adaptive,
    }))
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

/// What bounds the K/V pool on devices with a configured capacity.
struct DeviceSizing<'a> {
    devices: &'a [String],
    capacities: &'a [Option<u64>],
    layer_split: &'a [usize],
    /// Bytes of one block's K/V on each device.
    part_bytes: &'a [usize],
    max_batch_tokens: usize,
    max_batch: usize,
    threads: usize,
}

impl DeviceSizing<'_> {
    /// The default K/V pool (`wanted` blocks) cut to what the tightest device holds next to its
    /// weights and workspace: the block table is shared, so every device holds every block's
    /// part for its layers. The workspace is counted as it will be allocated: the RoPE table
    /// and the block-table hint grow with the context, which the pool bounds
    /// (`min(max_context, blocks x BLOCK_SIZE)` positions), and the last device holds the
    /// logits rows. So the reservations made at load fit, with the most blocks that do.
    fn blocks_that_fit(&self, model: &Model, wanted: usize, max_context: usize) -> Result<usize> {
        if self.capacities.iter().all(Option::is_none) {
            return Ok(wanted);
        }
        let c = &model.config;
        let f32s = std::mem::size_of::<f32>() as u64;
        // Made while the model's RoPE table is empty: its block-table hint is the step's rows.
        let base = crate::model::forward::Workspace::new(model, self.max_batch_tokens, self.threads)
            .bytes() as u64;
        let context_bytes = |blocks: usize| -> u64 {
            let positions = max_context.min(blocks.saturating_mul(BLOCK_SIZE)) as u64;
            // cos and sin (head_dim / 2 each per position), and a quarter of the positions in
            // u32s for the block-table hint.
            positions
                .saturating_mul(c.head_dim as u64 * f32s)
                .saturating_add(positions / 4 * f32s)
        };
        let ranges = split::ranges(self.layer_split);
        let last = self.devices.len() - 1;
        let mut blocks = wanted;
        for (d, capacity) in self.capacities.iter().enumerate() {
            let Some(capacity) = *capacity else { continue };
            let weights = model.stage_weight_bytes(ranges[d].clone(), d == 0, d == last) as u64;
            let logits = if d == last {
                (self.max_batch.min(self.max_batch_tokens) * c.vocab_size) as u64 * f32s
            } else {
                0
            };
            let part = self.part_bytes[d] as u64;
            let need = |b: usize| -> u64 {
                weights
                    .saturating_add(base)
                    .saturating_add(logits)
                    .saturating_add(context_bytes(b))
                    .saturating_add((b as u64).saturating_mul(part))
            };
            if need(1) > capacity {
                return Err(StrataError::invalid(
                    "device_memory_mib",
                    format!(
                        "device {} holds {} bytes; its weights and workspace with one K/V block \
                         need {}",
                        self.devices[d],
                        capacity,
                        need(1)
                    ),
                ));
            }
            // need() grows with the blocks: the most that fit, by bisection.
            let (mut lo, mut hi) = (1, blocks);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if need(mid) <= capacity {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            blocks = lo;
        }
        Ok(blocks)
    }
}

impl Engine {
    /// Loads the model folder and starts the engine thread. Blocking: run it off the event loop.
    pub fn load(dir: &Path, opts: EngineOptions) -> Result<Engine> {
        let kv_choice = opts.kv_dtype.as_deref().map(KvDtype::parse).transpose()?;
        let quantize = opts
            .quantize
            .as_deref()
            .map(crate::model::parse_quantize)
            .transpose()?;
        if let (Device::Cuda(_), Some(d @ (KvDtype::Bf16 | KvDtype::Q8_0))) =
            (&opts.device, kv_choice)
        {
            return Err(cuda_kv_refusal(d));
        }
        device::check_available(&opts.device)?;
        let devices = opts.device.members();
        let capacities: Vec<Option<u64>> = match &opts.device_memory_mib {
            Some(spec) => split::parse_device_memory(spec, &devices)?
                .into_iter()
                .map(Some)
                .collect(),
            None => vec![None; devices.len()],
        };
        // GPUs are opened first: their free memory is their pools' capacity (device_memory_mib,
        // when given, caps it), which the default layer split and the K/V sizing read.
        #[cfg(feature = "cuda")]
        let gpus = match &opts.device {
            Device::Cuda(ids) => Some(open_gpus(ids, &capacities, opts.vram_reserve_mib)?),
            _ => None,
        };
        #[cfg(feature = "cuda")]
        let capacities: Vec<Option<u64>> = match &gpus {
            Some(gpus) => gpus.iter().map(|g| g.memory.capacity()).collect(),
            None => capacities,
        };
        let mut cache_opts = opts.cache.clone();
        if cache_opts.faults.is_empty() {
            // Fault injection reaches a server's engine through its environment.
            cache_opts.faults = std::env::var("STRATA_CACHE_FAULTS").unwrap_or_default();
        }
        cache_opts.validate()?;
        if opts.max_batch_tokens == 0 {
            return Err(StrataError::invalid(
                "max_batch_tokens",
                "must be at least 1",
            ));
        }
        if opts.max_batch == 0 {
            return Err(StrataError::invalid("max_batch", "must be at least 1"));
        }
        let ngram = speculative_options(&opts)?;
        let threads = match opts.threads {
            Some(0) => return Err(StrataError::invalid("threads", "must be at least 1")),
            // Each thread gets a workspace: a huge count would abort on allocation, not fail.
            Some(t) if t > MAX_THREADS => {
                return Err(StrataError::invalid(
                    "threads",
                    format!("must be at most {MAX_THREADS}, got {t}"),
                ))
            }
            Some(t) => t,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let source = ModelSource::locate(dir)?;
        // The RoPE table is sized below, once the pool has bounded the context: a context taken
        // from the config (or max_context) can be far larger than memory.
        let mut model = Model::load_source(&source, 0)?;
        if let Some(ty) = quantize {
            if let ModelSource::Gguf(path) = &source {
                return Err(StrataError::invalid(
                    "quantize",
                    format!(
                        "{} is a GGUF file, already in its stored types; quantize applies to \
                         Hugging Face folders",
                        path.display()
                    ),
                ));
            }
            let fell_back = model.quantize(ty)?;
            if fell_back > 0 {
                log::info!(
                    "quantize={}: {fell_back} matrices have rows that are not whole blocks of \
                     it (q8_0 or as stored instead)",
                    ty.lower_name()
                );
            }
        }
        // The CPU's AVX2 and AVX-512 kernels read some quantized types fastest interleaved by
        // groups of 16 rows (the same blocks and bytes, copied out of the map once):
        // `interleave::wanted` says which.
        if !matches!(opts.device, Device::Cuda(_)) {
            let n = model.interleave_for_cpu();
            if n > 0 {
                log::info!("{n} quantized matrices interleaved for the CPU kernels");
            }
        }
        // Only where it changes something (the fingerprint keys the disk cache on it).
        model.bf16_dot = opts.bf16_dot
            && !matches!(opts.device, Device::Cuda(_))
            && matmul_bf16dot::available()
            && model.has_bf16_matrix();
        let config = model.config.clone();
        let layer_split = match &opts.layer_split {
            Some(spec) => split::parse_layer_split(spec, &devices, config.num_layers)?,
            None => split::default_layer_split(&devices, &capacities, config.num_layers)?,
        };
        let tokenizer = Tokenizer::load(source.path())?;
        let max_context = match opts.max_context {
            Some(0) => return Err(StrataError::invalid("max_context", "must be at least 1")),
            Some(n) => n,
            None => config.max_position_embeddings,
        };
        // Unless kv_dtype says otherwise, f32 weights keep exact f32 K/V and f16/bf16 (and
        // quantized) weights get f16 K/V (llama.cpp's default), which halves the bytes attention
        // reads per token.
        let kv_dtype = kv_choice.unwrap_or_else(|| KvDtype::for_weights(model.dtype));
        let block_bytes = BlockPool::block_bytes(
            config.num_layers,
            BLOCK_SIZE,
            config.num_kv_heads,
            config.head_dim,
            kv_dtype,
        );
        let part_bytes: Vec<usize> = layer_split
            .iter()
            .map(|&layers| {
                BlockPool::block_bytes(
                    layers,
                    BLOCK_SIZE,
                    config.num_kv_heads,
                    config.head_dim,
                    kv_dtype,
                )
            })
            .collect();
        let kv_blocks = match opts.kv_memory_mib {
            Some(mib) => {
                mib.checked_mul(1 << 20).ok_or_else(|| {
                    StrataError::invalid("kv_memory_mib", format!("{mib} MiB is too large"))
                })? / block_bytes
            }
            #[cfg(feature = "cuda")]
            None if gpus.is_some() => gpu_sizing::kv_blocks(
                &model,
                gpus.as_deref().unwrap_or_default(),
                &layer_split,
                &part_bytes,
                gpu_sizing::limits(&opts, max_context),
                max_context,
            )?,
            None => {
                let wanted = max_context
                    .div_ceil(BLOCK_SIZE)
                    .min((2048 << 20) / block_bytes)
                    .max(1);
                let sizing = DeviceSizing {
                    devices: &devices,
                    capacities: &capacities,
                    layer_split: &layer_split,
                    part_bytes: &part_bytes,
                    max_batch_tokens: opts.max_batch_tokens.min(max_context),
                    max_batch: opts.max_batch,
                    threads,
                };
                sizing.blocks_that_fit(&model, wanted, max_context)?
            }
        };
        // One sequence must fit in the pool, else no request of max_context could ever run.
        let max_context = max_context.min(kv_blocks.saturating_mul(BLOCK_SIZE));
        model.set_max_positions(max_context)?;
        let max_batch_tokens = opts.max_batch_tokens.min(max_context);
        // Every running sequence's decode row must fit in one step.
        let max_batch = opts.max_batch.min(max_batch_tokens);
        let salt = fingerprint(
            &source,
            &config,
            kv_dtype,
            quantize,
            model.bf16_dot,
            max_context,
        );
        let layout = BlockLayout {
            salt,
            kv_dtype: kv_dtype.code(),
            block_size: BLOCK_SIZE as u32,
            num_layers: config.num_layers as u32,
            kv_heads: config.num_kv_heads as u32,
            head_dim: config.head_dim as u32,
            block_bytes: block_bytes as u64,
        };
        // Without device_memory_mib the CPU's capacity is not configured: the pool accounts, and
        // the OS decides what fits. A GPU's pool is its own (opened above).
        let memory: Vec<MemoryPool> = match () {
            #[cfg(feature = "cuda")]
            () if gpus.is_some() => gpus.iter().flatten().map(|g| g.memory.clone()).collect(),
            () => devices
                .iter()
                .zip(&capacities)
                .map(|(name, &capacity)| MemoryPool::new(name.clone(), capacity))
                .collect(),
        };
        let gate = RamGate::system((cache_opts.host_min_free_mib as u64) << 20);
        // A GPU's tier moves go through a pinned buffer of one block's part, when the RAM gate
        // admits it (else through pageable memory).
        #[cfg(feature = "cuda")]
        let pinned_staging: Vec<bool> = part_bytes
            .iter()
            .map(|&b| gpus.is_some() && gate.admit(b as u64).is_ok())
            .collect();
        let parts = memory
            .iter()
            .zip(&part_bytes)
            .map(|(pool, &bytes)| DevicePart {
                memory: pool.clone(),
                bytes,
            })
            .collect();
        let cache = ConversationCache::new(&cache_opts, layout, gate, parts)?;
        let (dtype, decode_weight_bytes) = (model.dtype.name(), model.decode_weight_bytes);
        let matmul_inputs = match model.dtype {
            DType::Quant(_) => "int8",
            DType::Bf16 if model.bf16_dot => "bf16",
            _ => "f32",
        };
        let stages: Vec<Stage> = memory
            .iter()
            .zip(&layer_split)
            .map(|(pool, &layers)| Stage {
                memory: pool.clone(),
                layers,
            })
            .collect();
        let runner = match () {
            #[cfg(feature = "cuda")]
            () if gpus.is_some() => {
                use crate::device::cuda::runner::{CudaOptions, CudaRunner, StepLimits};
                let gpus = gpus.unwrap_or_default();
                let limits = StepLimits {
                    max_tokens: max_batch_tokens,
                    max_seqs: max_batch,
                    max_context,
                    block_size: BLOCK_SIZE,
                };
                let cuda_opts = CudaOptions {
                    limits,
                    kv_blocks,
                    kv_dtype,
                    pinned_staging,
                    graphs: gpu_sizing::graph_limits(max_batch, gpus.len()),
                };
                let (cuda, kv) = CudaRunner::new(&model, gpus, &layer_split, cuda_opts)?;
                ModelRunner::cuda(model, cuda, kv, threads.min(2))?
            }
            () => ModelRunner::split(
                &stages,
                model,
                kv_blocks,
                BLOCK_SIZE,
                max_batch_tokens,
                threads,
                kv_dtype,
            )?,
        };
        let info = EngineInfo {
            model_dir: source.path().to_path_buf(),
            format: source.format(),
            dtype,
            decode_weight_bytes,
            kv_dtype: kv_dtype.name(),
            quantize: quantize.map(|q| q.lower_name()),
            matmul_inputs,
            config,
            device: opts.device.name(),
            threads,
            max_context,
            max_batch_tokens,
            max_batch,
            max_waiting: opts.max_waiting,
            kv_blocks,
            block_size: BLOCK_SIZE,
            prefix_salt: salt,
            kv_block_bytes: block_bytes,
            speculative: ngram,
            devices: devices.clone(),
            layer_split: layer_split.clone(),
        };
        let tokenizer = Arc::new(tokenizer);
        let queued = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(Mutex::new(EngineStats {
            kv_blocks_total: kv_blocks,
            // What the disk scan found is visible before the first step.
            cache: cache.stats().clone(),
            ..Default::default()
        }));
        // The logits are the last device's output.
        let last_device = memory
            .last()
            .ok_or_else(|| StrataError::Internal("no device".into()))?;
        let mut scheduler = Scheduler::new(max_batch, max_batch_tokens, BLOCK_SIZE, salt);
        scheduler.ngram = ngram;
        let core = EngineCore::new(
            last_device,
            runner,
            scheduler,
            cache,
            tokenizer.clone(),
            max_context,
            max_batch * (1 + ngram.map_or(0, |o| o.max_drafts)),
            queued.clone(),
            stats.clone(),
        )?;
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("strata-engine".into())
            .spawn(move || serve(core, rx))
            .map_err(|e| StrataError::Internal(format!("cannot start the engine thread: {e}")))?;
        let grammars = Grammars::new(tokenizer.clone(), info.config.vocab_size);
        Ok(Engine {
            info,
            tokenizer,
            grammars,
            tx: Some(tx),
            thread: Some(thread),
            next_request_id: AtomicU64::new(0),
            queued,
            stats,
            memory,
        })
    }

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

/// Salt of every prefix hash chain: the model (its config, and each weight file's name, size,
/// header and a sample of its bytes, and the type it was quantized to at load), the K/V format,
/// layout and block size, so that cached K/V never crosses any of them, also on disk across
/// restarts. The sample (64 windows of 4 KiB spread over each file) tells a retrained model from
/// the one it replaced without reading every weight. LongRoPE rotates keys by one factor set or
/// the other as the context served (`max_context`) passes the original one: the set counts too.
fn fingerprint(
    source: &ModelSource,
    config: &ModelConfig,
    kv_dtype: KvDtype,
    quantize: Option<QuantType>,
    bf16_dot: bool,
    max_context: usize,
) -> u64 {
    use xxhash_rust::xxh3::xxh3_64;
    let mut parts: Vec<u64> = vec![
        BLOCK_SIZE as u64,
        u64::from(kv_dtype.code()),
        crate::kv::blocks::KV_LAYOUT_VERSION,
    ];
    if let Some(q) = quantize {
        parts.push(xxh3_64(q.lower_name().as_bytes()));
    }
    // Rounded matmul inputs compute other K/V than f32 inputs from the same weights.
    if bf16_dot {
        parts.push(xxh3_64(b"bf16_dot"));
    }
    parts.push(config.vocab_size as u64);
    if let RopeScaling::LongRope { .. } = config.rope_scaling {
        let set: &[u8] = if config.rope_scaling.uses_long_factors(max_context) {
            b"longrope long"
        } else {
            b"longrope short"
        };
        parts.push(xxh3_64(set));
    }
    if let ModelSource::Folder(dir) = source {
        if let Ok(bytes) = std::fs::read(dir.join("config.json")) {
            parts.push(xxh3_64(&bytes));
        }
    }
    for path in source.weight_files() {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        parts.push(xxh3_64(name.unwrap_or_default().as_bytes()));
        parts.push(sample_file(&path));
    }
    let words: Vec<u32> = parts
        .iter()
        .flat_map(|&p| [p as u32, (p >> 32) as u32])
        .collect();
    crate::kv::prefix::block_hash(0x5712_a7a5, &words)
}

/// A hash of a file's length, its first 64 KiB (a safetensors header) and 64 windows of 4 KiB at
/// evenly spaced offsets. 0 when the file cannot be read (the model load reports that).
fn sample_file(path: &Path) -> u64 {
    use std::io::{Read, Seek, SeekFrom};
    const WINDOW: u64 = 4096;
    const WINDOWS: u64 = 64;
    let Ok(mut f) = std::fs::File::open(path) else {
        return 0;
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let mut sampled = len.to_le_bytes().to_vec();
    let mut buf = vec![0u8; 65536];
    let mut read_at = |f: &mut std::fs::File, at: u64, n: usize, out: &mut Vec<u8>| {
        if f.seek(SeekFrom::Start(at)).is_ok() {
            let n = n.min(buf.len());
            if let Ok(got) = f.read(&mut buf[..n]) {
                out.extend_from_slice(&buf[..got]);
            }
        }
    };
    read_at(&mut f, 0, 65536, &mut sampled);
    for i in 0..WINDOWS {
        let at = len.saturating_sub(WINDOW) * i / (WINDOWS - 1).max(1);
        read_at(&mut f, at, WINDOW as usize, &mut sampled);
    }
    xxhash_rust::xxh3::xxh3_64(&sampled)
}
