//! `Engine::load`: check the options and open the devices, load the model and its tokenizer,
//! size the K/V pool and the context, then build the engine's parts and spawn its thread, in
//! that order (so that of several bad options the same one is reported first, whichever phase
//! grows). Also the disk cache's fingerprint of what was loaded.

use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{mpsc, Arc, Mutex};

use super::core::EngineCore;
#[cfg(feature = "cuda")]
use super::gpu_sizing::{self, open_gpus};
use super::ngram::DraftOptions;
use super::runner::{ModelRunner, Stage};
use super::scheduler::Scheduler;
use super::stats::EngineStats;
use super::structured::Grammars;
use super::{
    cuda_kv_refusal, serve, DraftInfo, Engine, EngineInfo, EngineOptions, BLOCK_SIZE,
    MAX_SPECULATIVE_TOKENS, MAX_THREADS,
};
use crate::cache::disk::BlockLayout;
use crate::cache::ram_gate::RamGate;
use crate::cache::{CacheOptions, ConversationCache, DevicePart};
use crate::device::memory_pool::MemoryPool;
use crate::device::{self, split, Device};
use crate::error::{Result, StrataError};
use crate::kv::blocks::{BlockPool, KvDtype};
use crate::kv::window::WindowLayout;
use crate::model::config::ModelConfig;
use crate::model::kernels::cpu::matmul_bf16dot;
use crate::model::kernels::cpu::quant::QuantType;
use crate::model::kernels::cpu::rope::RopeScaling;
use crate::model::tokenizer::Tokenizer;
use crate::model::weights::DType;
use crate::model::{Model, ModelSource};

impl Engine {
    /// Loads the model folder and starts the engine thread. Blocking: run it off the event loop.
    pub fn load(dir: &Path, opts: EngineOptions) -> Result<Engine> {
        let setup = check_options(&opts)?;
        let mut loaded = load_model(dir, &opts, &setup)?;
        let sizing = size(&opts, &setup, &mut loaded)?;
        build_and_spawn(opts, setup, loaded, sizing)
    }
}

/// The options checked and the devices opened.
struct Setup {
    kv_choice: Option<KvDtype>,
    quantize: Option<QuantType>,
    devices: Vec<String>,
    /// Each device's memory, where configured (a GPU's: what it has free).
    capacities: Vec<Option<u64>>,
    #[cfg(feature = "cuda")]
    gpus: Option<Vec<crate::device::cuda::device::CudaDevice>>,
    cache_opts: CacheOptions,
    speculative: Option<DraftOptions>,
    threads: usize,
}

/// The model, its tokenizer and how its layers are split over the devices.
struct Loaded {
    source: ModelSource,
    model: Model,
    tokenizer: Tokenizer,
    layer_split: Vec<usize>,
    /// Speculative decoding's draft model, when `speculative` names one.
    draft: Option<(ModelSource, Model)>,
}

/// The K/V pool and the limits it sets.
struct Sizing {
    max_context: usize,
    kv_dtype: KvDtype,
    block_bytes: usize,
    /// Bytes of one block's K/V on each device.
    part_bytes: Vec<usize>,
    kv_blocks: usize,
    /// The sliding layers' window slots (CPU pools of windowed models).
    kv_window: Option<WindowLayout>,
    max_batch_tokens: usize,
    max_batch: usize,
    /// Also the prefix hash chains' salt (`layout.salt`).
    layout: BlockLayout,
}

/// Phase 1: every option that can be checked before the model is read, and the GPUs opened
/// (their free memory is their pools' capacity, which the default layer split and the K/V
/// sizing read).
fn check_options(opts: &EngineOptions) -> Result<Setup> {
    let kv_choice = opts.kv_dtype.as_deref().map(KvDtype::parse).transpose()?;
    let quantize = opts
        .quantize
        .as_deref()
        .map(crate::model::parse_quantize)
        .transpose()?;
    if let (Device::Cuda(_), Some(d @ (KvDtype::Bf16 | KvDtype::Q8_0))) = (&opts.device, kv_choice)
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
    let speculative = speculative_options(opts)?;
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
    Ok(Setup {
        kv_choice,
        quantize,
        devices,
        capacities,
        #[cfg(feature = "cuda")]
        gpus,
        cache_opts,
        speculative,
        threads,
    })
}

/// Phase 2: the model (quantized at load, interleaved for the CPU's kernels), the layer split
/// its layer count allows, and the tokenizer.
fn load_model(dir: &Path, opts: &EngineOptions, setup: &Setup) -> Result<Loaded> {
    let source = ModelSource::locate(dir)?;
    // The RoPE table is sized in `size`, once the pool has bounded the context: a context taken
    // from the config (or max_context) can be far larger than memory.
    let mut model = Model::load_source(&source, 0)?;
    if let Some(ty) = setup.quantize {
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
    let config = &model.config;
    let layer_split = match &opts.layer_split {
        Some(spec) => split::parse_layer_split(spec, &setup.devices, config.num_layers)?,
        None => split::default_layer_split(&setup.devices, &setup.capacities, config.num_layers)?,
    };
    let tokenizer = Tokenizer::load(source.path())?;
    let draft = match (&setup.speculative, opts.speculative.as_deref()) {
        (Some(o), Some(path)) if o.model => {
            if layer_split.len() > 1 || matches!(opts.device, Device::Cuda(_)) {
                return Err(StrataError::invalid(
                    "speculative",
                    "a draft model runs on one CPU device (no CUDA, no layer_split)",
                ));
            }
            Some(load_draft(Path::new(path), &tokenizer, opts, setup)?)
        }
        _ => None,
    };
    Ok(Loaded {
        source,
        model,
        tokenizer,
        layer_split,
        draft,
    })
}

/// A draft model for speculative decoding, from any source the target could load, with the
/// target's weight options (a Hugging Face folder quantized as `quantize` says, bf16 dot
/// products as `bf16_dot` says) and interleaved for the CPU's kernels; its vocabulary must be
/// the target's token for token, since its drafts are the target's token ids.
fn load_draft(
    path: &Path,
    target: &Tokenizer,
    opts: &EngineOptions,
    setup: &Setup,
) -> Result<(ModelSource, Model)> {
    let source = ModelSource::locate(path)?;
    let mut model = Model::load_source(&source, 0)?;
    if let (Some(ty), ModelSource::Folder(_)) = (setup.quantize, &source) {
        model.quantize(ty)?;
    }
    model.interleave_for_cpu();
    model.bf16_dot = opts.bf16_dot && matmul_bf16dot::available() && model.has_bf16_matrix();
    let tokenizer = Tokenizer::load(source.path())?;
    let differs = |why: String| {
        StrataError::invalid(
            "speculative",
            format!(
                "the draft model {} does not share the target's tokenizer: {why}",
                path.display()
            ),
        )
    };
    if tokenizer.vocab_size() != target.vocab_size() {
        return Err(differs(format!(
            "{} tokens, the target has {}",
            tokenizer.vocab_size(),
            target.vocab_size()
        )));
    }
    for id in 0..target.vocab_size() as u32 {
        let (a, b) = (tokenizer.id_to_token(id), target.id_to_token(id));
        if a != b {
            let (a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
            return Err(differs(format!("token {id} is {a:?}, the target's {b:?}")));
        }
    }
    Ok((source, model))
}

/// Phase 3: the K/V pool (kv_memory_mib, or what the devices hold next to the weights), the
/// context it bounds (the RoPE table is sized to it now), the step's limits and the cache's
/// fingerprint.
fn size(opts: &EngineOptions, setup: &Setup, loaded: &mut Loaded) -> Result<Sizing> {
    let max_context = match opts.max_context {
        Some(0) => return Err(StrataError::invalid("max_context", "must be at least 1")),
        Some(n) => n,
        None => loaded.model.config.max_position_embeddings,
    };
    // Unless kv_dtype says otherwise, f32 weights keep exact f32 K/V and f16/bf16 (and
    // quantized) weights get f16 K/V (llama.cpp's default), which halves the bytes attention
    // reads per token.
    let kv_dtype = setup
        .kv_choice
        .unwrap_or_else(|| KvDtype::for_weights(loaded.model.dtype));
    let config = &loaded.model.config;
    // A draft model's K/V shares the blocks (one device: `load_model` checked).
    let draft_bytes = loaded.draft.as_ref().map_or(0, |(_, d)| {
        let c = &d.config;
        BlockPool::block_bytes(
            c.num_layers,
            BLOCK_SIZE,
            c.num_kv_heads,
            c.head_dim,
            kv_dtype,
        )
    });
    let block_bytes = BlockPool::block_bytes(
        config.num_layers,
        BLOCK_SIZE,
        config.num_kv_heads,
        config.head_dim,
        kv_dtype,
    ) + draft_bytes;
    let part_bytes: Vec<usize> = loaded
        .layer_split
        .iter()
        .map(|&layers| {
            BlockPool::block_bytes(
                layers,
                BLOCK_SIZE,
                config.num_kv_heads,
                config.head_dim,
                kv_dtype,
            ) + draft_bytes
        })
        .collect();
    let kv_blocks = match opts.kv_memory_mib {
        Some(mib) => {
            mib.checked_mul(1 << 20).ok_or_else(|| {
                StrataError::invalid("kv_memory_mib", format!("{mib} MiB is too large"))
            })? / block_bytes
        }
        #[cfg(feature = "cuda")]
        None if setup.gpus.is_some() => gpu_sizing::kv_blocks(
            &loaded.model,
            setup.gpus.as_deref().unwrap_or_default(),
            &loaded.layer_split,
            &part_bytes,
            gpu_sizing::limits(opts, max_context),
            max_context,
        )?,
        None => {
            let wanted = max_context
                .div_ceil(BLOCK_SIZE)
                .min(DEFAULT_KV_BYTES / block_bytes)
                .max(1);
            let sizing = DeviceSizing {
                devices: &setup.devices,
                capacities: &setup.capacities,
                layer_split: &loaded.layer_split,
                part_bytes: &part_bytes,
                max_batch_tokens: opts.max_batch_tokens.min(max_context),
                max_batch: opts.max_batch,
                threads: setup.threads,
            };
            sizing.blocks_that_fit(&loaded.model, wanted, max_context)?
        }
    };
    #[cfg(feature = "cuda")]
    let on_gpus = setup.gpus.is_some();
    #[cfg(not(feature = "cuda"))]
    let on_gpus = false;
    let (kv_blocks, kv_window) = match on_gpus {
        // The CUDA runner's tables address every layer by block: its pool keeps every position.
        true => {
            if loaded.model.config.sliding_window.is_some() {
                log::info!(
                    "sliding-window layers keep every position's K/V on CUDA (window slots are \
                     CPU-only for now)"
                );
            }
            (kv_blocks, None)
        }
        false => window_slots(
            opts,
            &loaded.model.config,
            kv_blocks,
            (block_bytes, draft_bytes),
            max_context,
        ),
    };
    // One sequence must fit in the pool, else no request of max_context could ever run.
    let max_context = max_context.min(kv_blocks.saturating_mul(BLOCK_SIZE));
    loaded.model.set_max_positions(max_context)?;
    if let Some((_, draft)) = loaded.draft.as_mut() {
        draft.set_max_positions(max_context)?;
    }
    let config = &loaded.model.config;
    let max_batch_tokens = opts.max_batch_tokens.min(max_context);
    // Every running sequence's decode row must fit in one step.
    let max_batch = opts.max_batch.min(max_batch_tokens);
    let salt = fingerprint(
        &loaded.source,
        config,
        kv_dtype,
        setup.quantize,
        loaded.model.bf16_dot,
        max_context,
        kv_window.is_some(),
    );
    // The draft model's K/V is part of every block: another draft, another format.
    let salt = match &loaded.draft {
        Some((source, draft)) => {
            let quantize = setup
                .quantize
                .filter(|_| matches!(source, ModelSource::Folder(_)));
            let f = fingerprint(
                source,
                &draft.config,
                kv_dtype,
                quantize,
                draft.bf16_dot,
                max_context,
                false,
            );
            crate::kv::prefix::block_hash(salt, &[f as u32, (f >> 32) as u32])
        }
        None => salt,
    };
    let layout = BlockLayout {
        salt,
        kv_dtype: kv_dtype.code(),
        block_size: BLOCK_SIZE as u32,
        num_layers: config.num_layers as u32,
        kv_heads: config.num_kv_heads as u32,
        head_dim: config.head_dim as u32,
        // A draft model's part is followed by whether the block holds it, and with window
        // slots a block's bytes end in whether its sliding layers' part is there
        // (`BlockPool::read_block`).
        block_bytes: block_bytes as u64
            + u64::from(loaded.draft.is_some())
            + u64::from(kv_window.is_some()),
    };
    Ok(Sizing {
        max_context,
        kv_dtype,
        block_bytes,
        part_bytes,
        kv_blocks,
        kv_window,
        max_batch_tokens,
        max_batch,
        layout,
    })
}

/// The most K/V the default sizing (no kv_memory_mib) takes for max_context.
const DEFAULT_KV_BYTES: usize = 2048 << 20;

/// The window slots of a model with sliding-window layers, and the pool's blocks with them.
/// The slots hold the running sequences' windows and as many cached tails
/// ([`WindowLayout::slots_for`]); the bytes the sliding layers no longer hold become blocks of
/// the others, up to kv_memory_mib, or without it up to max_context's blocks within the default
/// cap (at most as many blocks as one layer alone would get, for a model whose every layer
/// slides). Blocks that device_memory_mib fitted beside the weights stay as they are. No
/// slots when they would be as many as the blocks (a budget too small for windows to pay).
///
/// `bytes`: a block's bytes, and of them the draft model's part (which keeps every block).
fn window_slots(
    opts: &EngineOptions,
    config: &ModelConfig,
    kv_blocks: usize,
    bytes: (usize, usize),
    max_context: usize,
) -> (usize, Option<WindowLayout>) {
    let (block_bytes, draft_bytes) = bytes;
    let Some(window) = config.sliding_window else {
        return (kv_blocks, None);
    };
    let layers: Vec<bool> = (0..config.num_layers)
        .map(|l| config.window(l).is_some())
        .collect();
    let windowed = layers.iter().filter(|&&w| w).count();
    if windowed == 0 {
        return (kv_blocks, None);
    }
    let slots = |blocks| {
        WindowLayout::slots_for(
            window,
            BLOCK_SIZE,
            opts.max_batch,
            opts.max_batch_tokens,
            blocks,
        )
    };
    let per_layer = (block_bytes - draft_bytes) / config.num_layers.max(1);
    let (budget, wanted) = match (opts.kv_memory_mib, opts.device_memory_mib.is_some()) {
        (Some(_), _) => (kv_blocks.saturating_mul(block_bytes), usize::MAX),
        (None, true) => (kv_blocks.saturating_mul(block_bytes), kv_blocks),
        (None, false) => (DEFAULT_KV_BYTES, max_context.div_ceil(BLOCK_SIZE)),
    };
    let (full, sliding) = (config.num_layers - windowed, windowed);
    let held = slots(usize::MAX).saturating_mul(sliding * per_layer);
    let blocks = match budget.checked_sub(held) {
        Some(rest) if rest > 0 => (rest / (full * per_layer + draft_bytes).max(1))
            .min(wanted)
            .clamp(kv_blocks, kv_blocks.saturating_mul(config.num_layers)),
        _ => kv_blocks,
    };
    let num_slots = slots(blocks);
    if num_slots >= blocks {
        // A slot for every block: the windows would save nothing, so the pool keeps every
        // block of every layer (and reports no window slots).
        return (blocks, None);
    }
    let layout = WindowLayout {
        window,
        layers,
        num_slots,
    };
    (blocks, Some(layout))
}

/// Phase 4: the memory pools, the conversation cache, the model runner and the engine core,
/// and the engine thread that serves them.
fn build_and_spawn(
    opts: EngineOptions,
    setup: Setup,
    loaded: Loaded,
    sizing: Sizing,
) -> Result<Engine> {
    // Without device_memory_mib the CPU's capacity is not configured: the pool accounts, and
    // the OS decides what fits. A GPU's pool is its own (opened above).
    let memory: Vec<MemoryPool> = match () {
        #[cfg(feature = "cuda")]
        () if setup.gpus.is_some() => setup
            .gpus
            .iter()
            .flatten()
            .map(|g| g.memory.clone())
            .collect(),
        () => setup
            .devices
            .iter()
            .zip(&setup.capacities)
            .map(|(name, &capacity)| MemoryPool::new(name.clone(), capacity))
            .collect(),
    };
    let gate = RamGate::system((setup.cache_opts.host_min_free_mib as u64) << 20);
    // A GPU's tier moves go through a pinned buffer of one block's part, when the RAM gate
    // admits it (else through pageable memory).
    #[cfg(feature = "cuda")]
    let pinned_staging: Vec<bool> = sizing
        .part_bytes
        .iter()
        .map(|&b| setup.gpus.is_some() && gate.admit(b as u64).is_ok())
        .collect();
    let parts = memory
        .iter()
        .zip(&sizing.part_bytes)
        .map(|(pool, &bytes)| DevicePart {
            memory: pool.clone(),
            bytes,
        })
        .collect();
    let cache = ConversationCache::new(&setup.cache_opts, sizing.layout, gate, parts)?;
    let Loaded {
        source,
        model,
        tokenizer,
        layer_split,
        draft,
    } = loaded;
    let Sizing {
        max_context,
        kv_dtype,
        block_bytes,
        kv_blocks,
        kv_window,
        max_batch_tokens,
        max_batch,
        ..
    } = sizing;
    let salt = sizing.layout.salt;
    let block_layout_bytes = sizing.layout.block_bytes;
    let kv_window_slots = kv_window.as_ref().map_or(0, |w| w.num_slots);
    let (threads, speculative, devices) = (setup.threads, setup.speculative, setup.devices);
    let config = model.config.clone();
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
    let mut runner = match () {
        #[cfg(feature = "cuda")]
        () if setup.gpus.is_some() => {
            use crate::device::cuda::runner::{CudaOptions, CudaRunner, StepLimits};
            let gpus = setup.gpus.unwrap_or_default();
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
            kv_window,
            BLOCK_SIZE,
            max_batch_tokens,
            threads,
            kv_dtype,
        )?,
    };
    let draft_model = draft.as_ref().map(|(s, d)| DraftInfo {
        path: s.path().to_path_buf(),
        dtype: d.dtype.name(),
        num_layers: d.config.num_layers,
    });
    if let (Some((_, d)), Some(memory)) = (draft, memory.first()) {
        // A draft forward feeds the step's tokens and, per sequence, what it has not fed since
        // its last full block: fewer than a block plus the pending token
        // (`EngineCore::catch_up_draft`, `EngineCore::propose`).
        let rows = max_batch_tokens + max_batch * (BLOCK_SIZE + 1);
        runner.attach_draft(memory, d, rows, threads)?;
    }
    // The tiers copy blocks through buffers of the layout's size.
    if runner.kv.is_host() && runner.kv.bytes_per_block() as u64 != block_layout_bytes {
        return Err(StrataError::Internal(format!(
            "a block's bytes: the pool has {}, the tiers' layout {block_layout_bytes}",
            runner.kv.bytes_per_block()
        )));
    }
    let info = EngineInfo {
        model_dir: source.path().to_path_buf(),
        format: source.format(),
        dtype,
        decode_weight_bytes,
        kv_dtype: kv_dtype.name(),
        quantize: setup.quantize.map(|q| q.lower_name()),
        matmul_inputs,
        cpu_levels: crate::model::kernels::cpu::isa::cpu().names(),
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
        speculative,
        draft_model,
        devices,
        layer_split,
    };
    let tokenizer = Arc::new(tokenizer);
    let queued = Arc::new(AtomicUsize::new(0));
    let stats = Arc::new(Mutex::new(EngineStats {
        kv_blocks_total: kv_blocks,
        kv_window_slots_total: kv_window_slots,
        // What the disk scan found is visible before the first step.
        cache: cache.stats().clone(),
        ..Default::default()
    }));
    // The logits are the last device's output.
    let last_device = memory
        .last()
        .ok_or_else(|| StrataError::Internal("no device".into()))?;
    let mut scheduler = Scheduler::new(max_batch, max_batch_tokens, BLOCK_SIZE, salt);
    scheduler.speculative = speculative;
    let core = EngineCore::new(
        last_device,
        runner,
        scheduler,
        cache,
        tokenizer.clone(),
        max_context,
        max_batch * (1 + speculative.map_or(0, |o| o.max_drafts)),
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

/// The drafting settings `opts` ask for, checked.
fn speculative_options(opts: &EngineOptions) -> Result<Option<DraftOptions>> {
    let model = match opts.speculative.as_deref() {
        None => return Ok(None),
        Some("ngram") => false,
        Some("") => {
            return Err(StrataError::invalid(
                "speculative",
                "must be \"ngram\" (drafts by prompt lookup) or a draft model's path, got \"\"",
            ))
        }
        Some(_) => true,
    };
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
    Ok(Some(DraftOptions {
        model,
        max_drafts: k,
        min_n: opts.ngram_min,
        max_n: opts.ngram_max,
        adaptive: opts.speculative_adaptive,
    }))
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
    window_slots: bool,
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
    // A block's bytes say whether its sliding layers' part is there (`BlockPool::read_block`).
    if window_slots {
        parts.push(xxh3_64(b"window slots"));
    }
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
