//! BlockPool: the device's K/V memory, cut into fixed-size blocks of `block_size` tokens.
//!
//! Layout per layer: K is `[num_blocks, kv_heads, head_dim, block_size]` (each block's keys
//! transposed, which the attention kernel scores 16 at a time) and V `[num_blocks, block_size,
//! kv_heads, head_dim]`, stored as f32, f16, bf16 or q8_0 ([`KvDtype`]; rows are written as f32
//! and rounded to nearest, or quantized: q8_0's groups of 32 int8 with an f16 scale keep the
//! same order, see [`crate::model::kernels::cpu::kv_q8`]). Either way a block is one contiguous
//! range of bytes of each array, which the tiers below copy as they are. A
//! sequence owns a block table; its token at position p lives in block `table[p / block_size]`,
//! row `p % block_size`. Blocks are reference-counted so that sequences can share a prefix, and
//! full blocks can be indexed by their prefix hash ([`PrefixIndex`]) so that a block nobody holds
//! keeps its K/V until the space is needed. Sliding-window layers may keep theirs in fewer
//! slots ([`crate::kv::window`]): a block has one only while a window still reaches it. A
//! speculative draft model keeps its own layers' K/V of the same blocks ([`BlockPool::attach_draft`]):
//! one table, one prefix index, and the tiers move both models' parts of a block together. A
//! sequence that stops drafting stops computing the draft's K/V, so each block says whether it
//! holds the draft's part ([`BlockPool::set_draft_kv`]), and so does its copy in the tiers.

use crate::error::{Result, StrataError};
use crate::kv::prefix::{Evicted, PrefixIndex};
use crate::kv::window::{WindowLayout, WindowSlots};
use crate::model::kernels::cpu::attention::{k_index, KvData, KvLayer};
use crate::model::kernels::cpu::kv_q8;
use crate::model::weights::DType;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// The version of the block layout above, part of every prefix hash's salt: blocks kept on disk
/// in an older layout are another format's, never read as this one. 2: K transposed per block.
/// 3: a draft model's part is followed by a byte saying whether the block holds it.
pub const KV_LAYOUT_VERSION: u64 = 3;

/// The format of the K/V cache.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
    /// 8-bit: groups of 32 int8 with one f16 scale each (ggml's q8_0, 34 bytes per 32 values).
    Q8_0,
}

impl KvDtype {
    /// Every format, in the order errors list them.
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Q8_0];

    /// The cache format for a model's weights: f32 models keep exact f32 K/V; f16 and bf16
    /// models get f16 (llama.cpp's default), which halves the K/V read per decoded token.
    pub fn for_weights(d: DType) -> KvDtype {
        match d {
            DType::F32 => KvDtype::F32,
            DType::F16 | DType::Bf16 | DType::Quant(_) => KvDtype::F16,
        }
    }

    /// The format named `name` ("f32", "f16", "bf16", "q8_0"); an error naming the `kv_dtype`
    /// option and the allowed names otherwise.
    pub fn parse(name: &str) -> Result<KvDtype> {
        KvDtype::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                StrataError::invalid(
                    "kv_dtype",
                    format!("{name:?}: must be f32, f16, bf16 or q8_0"),
                )
            })
    }

    /// Bytes of one head's vector of `head_dim` values (one token's K, or V, of one K/V head).
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * head_dim,
            KvDtype::F16 | KvDtype::Bf16 => 2 * head_dim,
            KvDtype::Q8_0 => kv_q8::row_bytes(head_dim),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Q8_0 => "q8_0",
        }
    }

    /// The format's number in the disk tier's block header and in the engine's fingerprint:
    /// distinct for every format, so that blocks of one are never read as another's. f32 and
    /// f16 keep the numbers they had (their element sizes), so existing disk caches stay valid.
    pub fn code(self) -> u8 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
            KvDtype::Bf16 => 3,
            KvDtype::Q8_0 => 8,
        }
    }
}

enum LayerStore {
    F32 {
        k: Vec<f32>,
        v: Vec<f32>,
    },
    F16 {
        k: Vec<f16>,
        v: Vec<f16>,
    },
    Bf16 {
        k: Vec<bf16>,
        v: Vec<bf16>,
    },
    /// q8_0 bytes in [`kv_q8`]'s K and V layouts.
    Q8_0 {
        k: Vec<u8>,
        v: Vec<u8>,
    },
}

impl LayerStore {
    /// A layer of `bytes` bytes of K and as many of V, all zero (the value 0 in every format).
    fn zeroed(kv_dtype: KvDtype, bytes: usize) -> std::result::Result<LayerStore, ()> {
        Ok(match kv_dtype {
            KvDtype::F32 => LayerStore::F32 {
                k: zeroed(bytes / 4)?,
                v: zeroed(bytes / 4)?,
            },
            KvDtype::F16 => LayerStore::F16 {
                k: zeroed(bytes / 2)?,
                v: zeroed(bytes / 2)?,
            },
            KvDtype::Bf16 => LayerStore::Bf16 {
                k: zeroed(bytes / 2)?,
                v: zeroed(bytes / 2)?,
            },
            KvDtype::Q8_0 => LayerStore::Q8_0 {
                k: zeroed(bytes)?,
                v: zeroed(bytes)?,
            },
        })
    }

    /// The K and V arrays as bytes.
    fn bytes(&self) -> (&[u8], &[u8]) {
        match self {
            LayerStore::F32 { k, v } => (as_bytes(k), as_bytes(v)),
            LayerStore::F16 { k, v } => (as_bytes(k), as_bytes(v)),
            LayerStore::Bf16 { k, v } => (as_bytes(k), as_bytes(v)),
            LayerStore::Q8_0 { k, v } => (k, v),
        }
    }

    fn bytes_mut(&mut self) -> (&mut [u8], &mut [u8]) {
        match self {
            LayerStore::F32 { k, v } => (as_bytes_mut(k), as_bytes_mut(v)),
            LayerStore::F16 { k, v } => (as_bytes_mut(k), as_bytes_mut(v)),
            LayerStore::Bf16 { k, v } => (as_bytes_mut(k), as_bytes_mut(v)),
            LayerStore::Q8_0 { k, v } => (k, v),
        }
    }
}

/// One device's part of every block, in memory the pool cannot address itself (a GPU's): the
/// backend that owns it copies a block's part out and in, laid out as
/// [`BlockPool::read_block_part`] lays it (for each of the device's layers, K then V), and may
/// fail (a driver error): the caller skips that move. `as_any` lets the backend's forward pass
/// reach its own type.
pub trait DeviceKv: Send {
    /// Copies block `block`'s part out into `out` (`part_bytes` long).
    fn read_part(&self, block: u32, out: &mut [u8]) -> std::result::Result<(), String>;
    /// Copies block `block`'s part in from `data` (`part_bytes` long).
    fn write_part(&mut self, block: u32, data: &[u8]) -> std::result::Result<(), String>;
    /// Bytes this part holds (every block's), as allocated.
    fn bytes(&self) -> usize;
    /// Copy streams the part's moves have made (a GPU makes one on its first move).
    fn copy_streams(&self) -> usize {
        0
    }
    fn as_any(&self) -> &dyn std::any::Any;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// Where the blocks' K and V live.
enum KvStore {
    /// Host memory the CPU forward pass reads: one K and one V array per layer.
    Host(Vec<LayerStore>),
    /// One part per device of the split, owned by the device's backend (a GPU's memory).
    Device(Vec<Box<dyn DeviceKv>>),
}

/// Element types whose all-zero bit pattern is the value 0 (for u8: a q8_0 zero, q 0 scale 0).
trait ZeroBits: Copy {}
impl ZeroBits for f32 {}
impl ZeroBits for f16 {}
impl ZeroBits for bf16 {}
impl ZeroBits for u8 {}

/// A vector of `n` zeros, or an error when the memory is not there. Allocated zeroed (calloc):
/// the OS backs the pages lazily, so untouched blocks cost no RAM.
fn zeroed<T: ZeroBits>(n: usize) -> std::result::Result<Vec<T>, ()> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| ())?;
    // SAFETY: `layout` has a non-zero size; a null return is handled.
    let p = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if p.is_null() {
        return Err(());
    }
    // SAFETY: `p` was allocated by the global allocator with the layout of `n` `T`s, and all
    // `n` are initialised: zero bits are a valid `T` (ZeroBits).
    Ok(unsafe { Vec::from_raw_parts(p, n, n) })
}

/// Blocks taken by `allocate`, and the cached blocks it evicted to find them. The evicted blocks'
/// K/V is still intact: whoever wants to keep it must copy it out before anything writes them.
#[must_use]
pub struct Allocation {
    pub blocks: Vec<u32>,
    pub evicted: Vec<Evicted>,
}

/// Views K/V elements as bytes (this code runs on little-endian machines only: x86-64, aarch64).
fn as_bytes<T: ZeroBits>(s: &[T]) -> &[u8] {
    // SAFETY: f32, f16, bf16 and u8 have no padding; any initialized value is valid bytes.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

fn as_bytes_mut<T: ZeroBits>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and every bit pattern is a valid f32, f16, bf16 or u8.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

/// Bytes below which a copy is not worth streaming.
#[cfg(target_arch = "x86_64")]
const STREAM_MIN: usize = 1024;

/// `dst.copy_from_slice(src)` with non-temporal stores on x86-64: a restore writes blocks the
/// CPU has not read lately, and ordinary stores would first read every destination line
/// (read-for-ownership), a third memory transfer beside the read and the write. Callers end a
/// run of copies with [`store_fence`].
fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAM_MIN {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // Plain copy up to the first 16-byte aligned destination byte.
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let body = (dst.len() - head) / 16 * 16;
        // SAFETY: SSE2 is part of x86-64; the 16-byte chunks lie inside both slices, the
        // destination ones aligned (after `head`); `src` may be unaligned (loadu).
        unsafe {
            let (d, s) = (dst.as_mut_ptr().add(head), src.as_ptr().add(head));
            let mut i = 0;
            while i < body {
                let x = _mm_loadu_si128(s.add(i) as *const __m128i);
                _mm_stream_si128(d.add(i) as *mut __m128i, x);
                i += 16;
            }
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
        return;
    }
    dst.copy_from_slice(src);
}

/// The byte range of `block` within `layer`'s K (or V) array, whose blocks are `n` bytes: a
/// sliding layer's holds the block's window slot, `None` when it has none.
fn block_range(
    window: &Option<WindowSlots>,
    n: usize,
    layer: usize,
    block: u32,
) -> Option<std::ops::Range<usize>> {
    let row = match window {
        Some(w) if w.is_windowed(layer) => w.slot(block)?,
        _ => block,
    } as usize;
    Some(row * n..(row + 1) * n)
}

/// Orders the non-temporal stores of [`copy_streaming`] before any later store.
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// The K/V blocks of one model: one block table for every layer, the K/V arrays per layer.
///
/// With a layer split, each device keeps the arrays of its own layers (`stages[d]` is device
/// `d`'s layer range) and a block id means the same token rows on every device, so the
/// bookkeeping below (refcounts, free list, prefix index) is shared, as the block manager of
/// vLLM's pipeline stages is: the number of blocks is what the tightest device can hold.
pub struct BlockPool {
    block_size: usize,
    num_blocks: usize,
    kv_heads: usize,
    head_dim: usize,
    kv_dtype: KvDtype,
    store: KvStore,
    /// Each device's layers, consecutive, in order; one range without a split.
    stages: Vec<std::ops::Range<usize>>,
    refcount: Vec<u32>,
    /// Blocks that hold nothing worth keeping; popped from the end.
    free: Vec<u32>,
    /// Indexed full blocks; those nobody holds are evictable, least recently used first.
    prefix: PrefixIndex,
    /// The sliding-window layers' slots, when they have fewer rows than the pool has blocks.
    window: Option<WindowSlots>,
    /// A draft model's K/V of the same blocks (its own layers and shape), addressed by this
    /// pool's block ids; only its arrays are used, the bookkeeping is this pool's.
    draft: Option<Box<BlockPool>>,
    /// Per block, with a draft model: whether the block holds the draft's K/V (set when it is
    /// indexed or restored; only indexed blocks are ever looked up or moved to the tiers).
    draft_kv: Vec<bool>,
}

impl BlockPool {
    /// Bytes of K/V one block holds across all layers.
    pub fn block_bytes(
        num_layers: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        kv_dtype: KvDtype,
    ) -> usize {
        num_layers * 2 * block_size * kv_heads * kv_dtype.row_bytes(head_dim)
    }

    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        kv_dtype: KvDtype,
    ) -> Result<BlockPool> {
        Self::split(
            &[num_layers],
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            kv_dtype,
        )
    }

    /// A pool whose layers are split across devices, `layer_counts[d]` consecutive layers on
    /// device `d`.
    pub fn split(
        layer_counts: &[usize],
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        kv_dtype: KvDtype,
    ) -> Result<BlockPool> {
        Self::windowed(
            layer_counts,
            num_blocks,
            None,
            block_size,
            kv_heads,
            head_dim,
            kv_dtype,
        )
    }

    /// As [`BlockPool::split`], the layers `window` names keeping their K/V in its slots.
    pub fn windowed(
        layer_counts: &[usize],
        num_blocks: usize,
        window: Option<WindowLayout>,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        kv_dtype: KvDtype,
    ) -> Result<BlockPool> {
        let stages = crate::device::split::ranges(layer_counts);
        let num_layers = layer_counts.iter().sum();
        if num_blocks == 0 || block_size == 0 {
            return Err(StrataError::invalid(
                "kv_memory_mib",
                "the K/V budget holds no block; raise it",
            ));
        }
        if let Some(w) = &window {
            if w.window == 0 || w.num_slots == 0 || w.layers.len() != num_layers {
                return Err(StrataError::Internal(format!(
                    "window slots: window {}, {} slots, {} layers of {num_layers}",
                    w.window,
                    w.num_slots,
                    w.layers.len()
                )));
            }
        }
        let rows = |layer: usize| match &window {
            Some(w) if w.layers[layer] => w.num_slots,
            _ => num_blocks,
        };
        // Bytes of K (and of V) per block of a layer.
        let per_block = block_size * kv_heads * kv_dtype.row_bytes(head_dim);
        let total: usize = (0..num_layers)
            .map(|l| rows(l).saturating_mul(per_block).saturating_mul(2))
            .fold(0, usize::saturating_add);
        // The budget is the caller's (kv_memory_mib, or the default derived from max_context).
        let oom = |_| {
            StrataError::invalid(
                "kv_memory_mib",
                format!("cannot allocate the K/V pool ({} MiB)", total >> 20),
            )
        };
        let mut layers = Vec::with_capacity(num_layers);
        for l in 0..num_layers {
            let bytes = rows(l)
                .checked_mul(per_block)
                .ok_or_else(|| StrataError::invalid("kv_memory_mib", "too large"))?;
            layers.push(LayerStore::zeroed(kv_dtype, bytes).map_err(oom)?);
        }
        let mut pool = Self::with_store(
            KvStore::Host(layers),
            stages,
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            kv_dtype,
        );
        pool.window = window.map(|w| WindowSlots::new(&w, block_size, num_blocks));
        Ok(pool)
    }

    /// A pool whose blocks live in device memory: `parts[d]` is device `d`'s, holding
    /// `layer_counts[d]` consecutive layers of every block. The bookkeeping is the same as for
    /// host blocks; the CPU forward pass cannot run on it.
    pub fn on_devices(
        layer_counts: &[usize],
        parts: Vec<Box<dyn DeviceKv>>,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        kv_dtype: KvDtype,
    ) -> Result<BlockPool> {
        if num_blocks == 0 || block_size == 0 {
            return Err(StrataError::invalid(
                "kv_memory_mib",
                "the K/V budget holds no block; raise it",
            ));
        }
        if parts.len() != layer_counts.len() {
            return Err(StrataError::Internal(format!(
                "{} device parts for a split of {} devices",
                parts.len(),
                layer_counts.len()
            )));
        }
        let stages = crate::device::split::ranges(layer_counts);
        Ok(Self::with_store(
            KvStore::Device(parts),
            stages,
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            kv_dtype,
        ))
    }

    fn with_store(
        store: KvStore,
        stages: Vec<std::ops::Range<usize>>,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        kv_dtype: KvDtype,
    ) -> BlockPool {
        BlockPool {
            block_size,
            num_blocks,
            kv_heads,
            head_dim,
            kv_dtype,
            store,
            stages,
            refcount: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            prefix: PrefixIndex::new(num_blocks),
            window: None,
            draft: None,
            draft_kv: Vec::new(),
        }
    }

    /// Gives a host pool the K/V arrays of a draft model (`layers` layers of `kv_heads` x
    /// `head_dim`, in this pool's dtype) for every block; a block's bytes then carry both
    /// models' parts ([`BlockPool::read_block`]).
    pub fn attach_draft(&mut self, layers: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
        if !self.is_host() {
            return Err(StrataError::invalid(
                "speculative",
                "a draft model runs on the CPU backend only",
            ));
        }
        let pool = BlockPool::new(
            layers,
            self.num_blocks,
            self.block_size,
            kv_heads,
            head_dim,
            self.kv_dtype,
        )?;
        self.draft = Some(Box::new(pool));
        self.draft_kv = vec![false; self.num_blocks];
        Ok(())
    }

    /// Records whether `block` holds the draft model's K/V (a no-op without a draft model).
    pub fn set_draft_kv(&mut self, block: u32, present: bool) {
        if let Some(p) = self.draft_kv.get_mut(block as usize) {
            *p = present;
        }
    }

    /// How many leading blocks of `table` hold the draft model's K/V (all of them without a
    /// draft model).
    pub fn draft_kv_prefix(&self, table: &[u32]) -> usize {
        if self.draft.is_none() {
            return table.len();
        }
        table
            .iter()
            .take_while(|&&b| self.draft_kv[b as usize])
            .count()
    }

    /// The draft model's K/V, when a draft model is attached: the pool its forward pass writes
    /// and reads, with this pool's block tables.
    pub fn draft_mut(&mut self) -> Option<&mut BlockPool> {
        self.draft.as_deref_mut()
    }

    /// Bytes of one block of the draft model's K/V (0 without one).
    fn draft_block_bytes(&self) -> usize {
        self.draft.as_ref().map_or(0, |d| d.bytes_per_block())
    }

    /// Whether the blocks live in host memory (the CPU forward pass's pool).
    pub fn is_host(&self) -> bool {
        matches!(self.store, KvStore::Host(_))
    }

    /// Device `stage`'s part of a device-held pool; `None` for a host pool.
    pub fn device_part(&self, stage: usize) -> Option<&dyn DeviceKv> {
        match &self.store {
            KvStore::Host(_) => None,
            KvStore::Device(parts) => parts.get(stage).map(|p| p.as_ref()),
        }
    }

    /// As [`BlockPool::device_part`], to write through (the backend's forward pass).
    pub fn device_part_mut(&mut self, stage: usize) -> Option<&mut dyn DeviceKv> {
        match &mut self.store {
            KvStore::Host(_) => None,
            KvStore::Device(parts) => parts
                .get_mut(stage)
                .map(|p| p.as_mut() as &mut dyn DeviceKv),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks an allocation can take: free ones plus cached ones nobody holds, and as many
    /// window slots (free ones plus those of cached blocks nobody holds).
    pub fn num_free(&self) -> usize {
        let blocks = self.free.len() + self.prefix.evictable();
        match &self.window {
            Some(w) => blocks.min(w.num_free() + w.parked),
            None => blocks,
        }
    }

    /// Free blocks that hold no cached prefix (with free window slots): an allocation of up to
    /// this many evicts nothing.
    pub fn num_empty(&self) -> usize {
        match &self.window {
            Some(w) => self.free.len().min(w.num_free()),
            None => self.free.len(),
        }
    }

    /// Blocks some sequence holds.
    pub fn num_used(&self) -> usize {
        self.num_blocks - self.free.len() - self.prefix.evictable()
    }

    /// Blocks indexed in the prefix cache, held or not.
    pub fn num_cached(&self) -> usize {
        self.prefix.len()
    }

    /// Takes `n` blocks, or none at all when fewer than `n` can be had. Free blocks go first;
    /// then the least recently used cached blocks are evicted (returned in `evicted`). With
    /// window slots, each block comes with one.
    pub fn allocate(&mut self, n: usize) -> Option<Allocation> {
        if n > self.num_free() {
            return None;
        }
        let a = self.take_blocks(n)?;
        self.give_slots(&a.blocks).then_some(a)
    }

    /// As [`BlockPool::allocate`], without window slots: for blocks a restore writes (each takes
    /// one only if its data has the sliding layers' part, [`BlockPool::write_block`]) and for
    /// tables the caller gives slots to as it computes them ([`BlockPool::give_slots`],
    /// [`BlockPool::slots_from`]).
    pub fn allocate_unslotted(&mut self, n: usize) -> Option<Allocation> {
        if n > self.free.len() + self.prefix.evictable() {
            return None;
        }
        self.take_blocks(n)
    }

    /// `n` blocks, held once; the caller checked that they are there.
    fn take_blocks(&mut self, n: usize) -> Option<Allocation> {
        let from_free = n.min(self.free.len());
        let mut blocks = self.free.split_off(self.free.len() - from_free);
        let mut evicted = Vec::new();
        while blocks.len() < n {
            // The caller counted the evictable blocks, so this cannot run dry.
            let e = self.prefix.evict()?;
            // It keeps its slot: what the slot holds is still its K/V until the caller has
            // copied it out.
            if let Some(w) = self.window.as_mut().filter(|w| w.has_slot(e.block)) {
                w.parked -= 1;
            }
            blocks.push(e.block);
            evicted.push(e);
        }
        for &b in &blocks {
            self.refcount[b as usize] = 1;
        }
        Some(Allocation { blocks, evicted })
    }

    /// For a table no scheduler keeps window references for (the diagnostic commands): its
    /// blocks before `from` give their window slots back, those from it on get one. False when
    /// the slots run out.
    pub fn slots_from(&mut self, table: &[u32], from: usize) -> bool {
        if let Some(w) = self.window.as_mut() {
            for &b in &table[..from.min(table.len())] {
                if w.refs(b) == 0 {
                    w.give_back(b);
                }
            }
        }
        self.give_slots(table.get(from..).unwrap_or_default())
    }

    /// Gives each of `blocks` (held) a window slot if it has none: free ones first, then those
    /// of the least recently used cached blocks nobody holds (their full layers stay cached).
    /// False, and nothing more taken, when the slots run out first.
    pub fn give_slots(&mut self, blocks: &[u32]) -> bool {
        let Some(w) = self.window.as_mut() else {
            return true;
        };
        let lacking = blocks.iter().filter(|&&b| !w.has_slot(b)).count();
        if lacking > w.num_free() + w.parked {
            return false;
        }
        for &b in blocks {
            if w.has_slot(b) {
                continue;
            }
            if w.num_free() == 0 {
                let Some(oldest) = self.prefix.parked_oldest_first().find(|&p| w.has_slot(p))
                else {
                    return false;
                };
                w.parked -= 1;
                w.give_back(oldest);
            }
            w.take(b);
        }
        true
    }

    /// Every block in the prefix index, held or not: (block, hash, tokens).
    pub fn cached_blocks(&self) -> impl Iterator<Item = (u32, u64, &[u32])> {
        self.prefix.iter()
    }

    /// The devices the layers are split across (1 without a split).
    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// The layers device `stage` holds.
    pub fn stage_layers(&self, stage: usize) -> std::ops::Range<usize> {
        self.stages[stage].clone()
    }

    /// Bytes the K and V arrays hold as allocated: `num_blocks() * bytes_per_block()`.
    pub fn storage_bytes(&self) -> usize {
        (0..self.stages.len())
            .map(|s| self.stage_storage_bytes(s))
            .sum()
    }

    /// Bytes the draft model's K and V arrays hold (0 without one).
    pub fn draft_storage_bytes(&self) -> usize {
        self.draft.as_ref().map_or(0, |d| d.storage_bytes())
    }

    /// Bytes device `stage`'s K and V arrays hold: `num_blocks() * part_bytes(stage)`.
    pub fn stage_storage_bytes(&self, stage: usize) -> usize {
        match &self.store {
            KvStore::Host(layers) => layers[self.stages[stage].clone()]
                .iter()
                .map(|l| {
                    let (k, v) = l.bytes();
                    k.len() + v.len()
                })
                .sum(),
            KvStore::Device(parts) => parts[stage].bytes(),
        }
    }

    fn num_layers(&self) -> usize {
        self.stages.last().map_or(0, |r| r.end)
    }

    /// Bytes of one block's K/V across all layers, as `read_block` lays them out (a draft
    /// model's part after them and a byte saying whether it is there; with window slots, one
    /// more: whether the sliding layers' part is there).
    pub fn bytes_per_block(&self) -> usize {
        Self::block_bytes(
            self.num_layers(),
            self.block_size,
            self.kv_heads,
            self.head_dim,
            self.kv_dtype,
        ) + self.draft_block_bytes()
            + usize::from(self.draft.is_some())
            + usize::from(self.window.is_some())
    }

    /// Bytes of one block's K/V on device `stage` (its layers only).
    pub fn part_bytes(&self, stage: usize) -> usize {
        Self::block_bytes(
            self.stages[stage].len(),
            self.block_size,
            self.kv_heads,
            self.head_dim,
            self.kv_dtype,
        )
    }

    /// Where device `stage`'s part starts in a block as `read_block` lays it out.
    pub fn part_offset(&self, stage: usize) -> usize {
        (0..stage).map(|s| self.part_bytes(s)).sum()
    }

    /// Bytes of one block of one layer's K (or V) array.
    fn layer_block_bytes(&self) -> usize {
        self.block_size * self.kv_heads * self.kv_dtype.row_bytes(self.head_dim)
    }

    /// Copies one block's K/V out: for each layer, its K rows then its V rows, in the pool's
    /// dtype. `out` is `bytes_per_block()` long. The parts of the devices follow each other in
    /// layer order, so the layout is the same whatever the split; a draft model's part follows,
    /// then a byte that says whether the block holds it (1: it does). With window slots, a
    /// block without one has zeros for the sliding layers, and the last byte says which (1:
    /// there). Host blocks always copy; a device's copy can fail (the caller skips that move).
    pub fn read_block(&self, block: u32, out: &mut [u8]) -> std::result::Result<(), String> {
        let mut at = 0;
        for stage in 0..self.stages.len() {
            let n = self.part_bytes(stage);
            self.read_block_part(stage, block, &mut out[at..at + n])?;
            at += n;
        }
        if let Some(d) = &self.draft {
            let n = d.bytes_per_block();
            d.read_block(block, &mut out[at..at + n])?;
            at += n;
            out[at] = u8::from(self.draft_kv[block as usize]);
            at += 1;
        }
        if let Some(w) = &self.window {
            out[at] = u8::from(w.has_slot(block));
        }
        Ok(())
    }

    /// Copies device `stage`'s part of one block out (`part_bytes(stage)` long): for each of its
    /// layers, the K rows then the V rows.
    pub fn read_block_part(
        &self,
        stage: usize,
        block: u32,
        out: &mut [u8],
    ) -> std::result::Result<(), String> {
        let layers = match &self.store {
            KvStore::Host(layers) => layers,
            KvStore::Device(parts) => return parts[stage].read_part(block, out),
        };
        let n = self.layer_block_bytes();
        let mut at = 0;
        for li in self.stages[stage].clone() {
            let Some(r) = block_range(&self.window, n, li, block) else {
                out[at..at + 2 * n].fill(0);
                at += 2 * n;
                continue;
            };
            let (k, v) = layers[li].bytes();
            for part in [&k[r.clone()], &v[r.clone()]] {
                out[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
        }
        Ok(())
    }

    /// Copies one block's K/V in, laid out as `read_block` writes it. A block whose sliding
    /// layers' part is not in `data` gives its window slot back.
    pub fn write_block(&mut self, block: u32, data: &[u8]) -> std::result::Result<(), String> {
        if self.window.is_some() {
            // A part that finds no slot is dropped: the block then counts as without it.
            if data.last() != Some(&1) || !self.give_slots(&[block]) {
                if let Some(w) = self.window.as_mut() {
                    w.give_back(block);
                }
            }
        }
        let mut at = 0;
        for stage in 0..self.stages.len() {
            let n = self.part_bytes(stage);
            self.write_block_part(stage, block, &data[at..at + n])?;
            at += n;
        }
        if let Some(d) = self.draft.as_mut() {
            let n = d.bytes_per_block();
            d.write_block(block, &data[at..at + n])?;
            self.draft_kv[block as usize] = data[at + n] == 1;
        }
        Ok(())
    }

    /// Copies device `stage`'s part of one block in, laid out as `read_block_part` writes it.
    pub fn write_block_part(
        &mut self,
        stage: usize,
        block: u32,
        data: &[u8],
    ) -> std::result::Result<(), String> {
        let n = self.layer_block_bytes();
        let range = self.stages[stage].clone();
        let window = &self.window;
        let layers = match &mut self.store {
            KvStore::Host(layers) => layers,
            KvStore::Device(parts) => return parts[stage].write_part(block, data),
        };
        let mut at = 0;
        for li in range {
            let Some(r) = block_range(window, n, li, block) else {
                at += 2 * n;
                continue;
            };
            let (k, v) = layers[li].bytes_mut();
            for part in [&mut k[r.clone()], &mut v[r.clone()]] {
                let n = part.len();
                copy_streaming(part, &data[at..at + n]);
                at += n;
            }
        }
        store_fence();
        Ok(())
    }

    /// Adds a reference to a block: a shared prefix, or a cache hit on a block nobody held.
    pub fn retain(&mut self, block: u32) {
        let rc = &mut self.refcount[block as usize];
        if *rc == 0 {
            self.prefix.unpark(block);
            if let Some(w) = self.window.as_mut().filter(|w| w.has_slot(block)) {
                w.parked -= 1;
            }
        }
        *rc += 1;
    }

    /// Drops one reference to each block of a block table. A block nobody holds any more stays
    /// cached when it is indexed, else it is free. The table is released from its end, so that a
    /// sequence's last blocks are evicted before the prefix they extend. No window reference is
    /// dropped ([`BlockPool::release_table`] drops a sequence's).
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let rc = &mut self.refcount[b as usize];
            debug_assert!(*rc > 0, "block {b} released more often than taken");
            *rc = rc.saturating_sub(1);
            let rc = *rc;
            if rc == 0 {
                if self.prefix.is_indexed(b) {
                    self.prefix.park(b);
                } else {
                    self.free.push(b);
                }
            }
            let Some(w) = self.window.as_mut() else {
                continue;
            };
            if w.refs(b) == 0 && w.has_slot(b) {
                // A cached block nobody holds keeps its slot while it can (the tail of a
                // conversation that may come back); any other block no window reaches gives
                // it back.
                if rc == 0 && self.prefix.is_indexed(b) {
                    w.parked += 1;
                } else {
                    w.give_back(b);
                }
            }
        }
    }

    /// Releases a sequence's block table whose blocks from `windowed_from` on hold its window
    /// references ([`BlockPool::enter_windows`]), dropping those.
    pub fn release_table(&mut self, table: &[u32], windowed_from: usize) {
        if let Some(w) = self.window.as_mut() {
            for &b in table.iter().skip(windowed_from) {
                w.drop_ref(b);
            }
        }
        self.release(table);
    }

    /// The positions a sliding layer reads, when the pool keeps window slots.
    pub fn window(&self) -> Option<usize> {
        self.window.as_ref().map(|w| w.window())
    }

    /// The first block of its table a sequence with `computed` positions still reads in its
    /// sliding layers (0 without window slots: every block is read).
    pub fn first_read(&self, computed: usize) -> usize {
        self.window.as_ref().map_or(0, |w| w.first_read(computed))
    }

    /// The first block of its table a sequence with `computed` positions keeps window slots
    /// for ([`WindowSlots::first_kept`]; 0 without window slots).
    pub fn first_kept(&self, computed: usize) -> usize {
        self.window.as_ref().map_or(0, |w| w.first_kept(computed))
    }

    /// A sequence's table starts to hold window references from block `from` on: each of those
    /// blocks gets one, and the blocks before it that no window reaches give their slots back.
    /// Those from `from` on must have their slots (new blocks, or a usable prefix hit).
    pub fn enter_windows(&mut self, table: &[u32], from: usize) {
        let Some(w) = self.window.as_mut() else {
            return;
        };
        let from = from.min(table.len());
        for &b in &table[from..] {
            w.add_ref(b);
        }
        for &b in &table[..from] {
            if w.refs(b) == 0 {
                w.give_back(b);
            }
        }
    }

    /// A sequence's window has passed `blocks` (which it holds): each drops its window
    /// reference, and one that no window reaches any more gives its slot back.
    pub fn pass_window(&mut self, blocks: &[u32]) {
        let Some(w) = self.window.as_mut() else {
            return;
        };
        for &b in blocks {
            if w.drop_ref(b) == 0 && w.has_slot(b) {
                w.give_back(b);
                w.passed += 1;
            }
        }
    }

    /// Panics unless the window slots' bookkeeping agrees with itself and with the blocks'
    /// (the tests call it after every step): each slot is held by one block at most, the held
    /// and the free ones add up, the count of cached unheld blocks with a slot is right, and
    /// window references sit only on held blocks with a slot.
    #[cfg(test)]
    pub fn check_window_slots(&self) {
        let Some(w) = &self.window else {
            return;
        };
        let mut owner = vec![None; w.num_slots()];
        for b in 0..w.num_blocks() as u32 {
            if let Some(s) = w.slot(b) {
                assert_eq!(owner[s as usize], None, "slot {s} held twice");
                owner[s as usize] = Some(b);
            }
            if w.refs(b) > 0 {
                assert!(
                    self.refcount[b as usize] > 0,
                    "block {b}: unheld in a window"
                );
                assert!(w.has_slot(b), "block {b}: in a window without a slot");
            }
        }
        let held = owner.iter().filter(|o| o.is_some()).count();
        assert_eq!(held + w.num_free(), w.num_slots(), "slots lost");
        let parked = self
            .prefix
            .parked_oldest_first()
            .filter(|&b| w.has_slot(b))
            .count();
        assert_eq!(parked, w.parked, "cached unheld blocks with a slot");
        for &b in &self.free {
            assert!(!w.has_slot(b), "free block {b} has a slot");
        }
    }

    /// The window slots: (slots, those held by a block, slots given back as windows passed
    /// their blocks); `None` without them.
    pub fn window_slots(&self) -> Option<(usize, usize, u64)> {
        let w = self.window.as_ref()?;
        Some((w.num_slots(), w.num_slots() - w.num_free(), w.passed))
    }

    /// Whether `layer` keeps its K/V in window slots (the forward pass then addresses it
    /// through [`BlockPool::window_table`] and [`BlockPool::window_row`]).
    pub fn is_windowed(&self, layer: usize) -> bool {
        self.window.as_ref().is_some_and(|w| w.is_windowed(layer))
    }

    /// `table` translated to window slots, appended to `out` (blocks without one read as slot
    /// 0; see [`WindowSlots::translate`]).
    pub fn window_table(&self, table: &[u32], out: &mut Vec<u32>) {
        if let Some(w) = &self.window {
            w.translate(table, out);
        }
    }

    /// The window-slot row for position `pos` of a sequence with block table `table`, `None`
    /// when its block has no slot.
    pub fn window_row(&self, table: &[u32], pos: usize) -> Option<usize> {
        let w = self.window.as_ref()?;
        let s = w.slot(table[pos / self.block_size])?;
        Some(s as usize * self.block_size + pos % self.block_size)
    }

    /// Whether every block of `table` has its window slot (true without window slots).
    pub fn has_window_slots(&self, table: &[u32]) -> bool {
        self.window
            .as_ref()
            .is_none_or(|w| table.iter().all(|&b| w.has_slot(b)))
    }

    /// Indexes a full, computed block under its prefix hash; false when that prefix is already
    /// cached in another block (this one then stays private and is freed as usual).
    pub fn register(&mut self, block: u32, hash: u64, tokens: &[u32]) -> bool {
        debug_assert!(self.refcount[block as usize] > 0, "register a held block");
        self.prefix.insert(block, hash, tokens)
    }

    /// The cached blocks holding the longest prefix of `hashes` (hashes of consecutive full
    /// blocks of `tokens`). With window slots a sequence can continue only from
    /// [`BlockPool::usable_prefix`] of them. The caller retains what it uses.
    pub fn lookup(&self, hashes: &[u64], tokens: &[u32]) -> Vec<u32> {
        let bs = self.block_size;
        hashes
            .iter()
            .enumerate()
            .map_while(|(i, &h)| self.prefix.get(h, &tokens[i * bs..(i + 1) * bs]))
            .collect()
    }

    /// The longest prefix of the blocks `table` a sequence can continue from: all of it without
    /// window slots, else up to where the next token's window has its slots.
    pub fn usable_prefix(&self, table: &[u32]) -> usize {
        self.window
            .as_ref()
            .map_or(table.len(), |w| w.usable_prefix(table))
    }

    /// Index of the K/V row for position `pos` of a sequence with block table `table`.
    pub fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// The host arrays of a host pool. Only the CPU forward pass and its tests write and read
    /// them, and the forward pass refuses a device-held pool first (`Model::forward`), so a
    /// device-held pool here is a bug.
    fn host_layers(&self) -> &[LayerStore] {
        match &self.store {
            KvStore::Host(layers) => layers,
            KvStore::Device(_) => panic!("the CPU forward pass was given a device-held K/V pool"),
        }
    }

    /// Writes one token's K and V (`kv_heads * head_dim` each) into `slot` of `layer`; an f16 or
    /// bf16 cache rounds them to nearest, a q8_0 cache quantizes each head's groups of 32 (round
    /// to nearest, scale amax / 127). K goes to its transposed place in the block. Host pools
    /// only.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let (bs, kvh, hd) = (self.block_size, self.kv_heads, self.head_dim);
        let d = kvh * hd;
        let r = slot * d..(slot + 1) * d;
        // Element e = g * hd + i of the row lands at k_index(slot, g, i) = k0 + e * bs.
        let k0 = k_index(slot, 0, 0, bs, kvh, hd);
        let KvStore::Host(layers) = &mut self.store else {
            panic!("the CPU forward pass was given a device-held K/V pool");
        };
        match &mut layers[layer] {
            LayerStore::F32 { k: sk, v: sv } => {
                for (e, &x) in k[..d].iter().enumerate() {
                    sk[k0 + e * bs] = x;
                }
                sv[r].copy_from_slice(v);
            }
            LayerStore::F16 { k: sk, v: sv } => {
                for (e, &x) in k[..d].iter().enumerate() {
                    sk[k0 + e * bs] = f16::from_f32(x);
                }
                sv[r].convert_from_f32_slice(v);
            }
            LayerStore::Bf16 { k: sk, v: sv } => {
                for (e, &x) in k[..d].iter().enumerate() {
                    sk[k0 + e * bs] = bf16::from_f32(x);
                }
                sv[r].convert_from_f32_slice(v);
            }
            LayerStore::Q8_0 { k: sk, v: sv } => {
                kv_q8::write_k(sk, slot, &k[..d], bs, kvh, hd);
                kv_q8::write_v(sv, slot, &v[..d], kvh, hd);
            }
        }
    }

    /// One layer's K and V arrays. Host pools only.
    pub fn layer(&self, layer: usize) -> KvLayer<'_> {
        let (k, v) = match &self.host_layers()[layer] {
            LayerStore::F32 { k, v } => (KvData::F32(k), KvData::F32(v)),
            LayerStore::F16 { k, v } => (KvData::F16(k), KvData::F16(v)),
            LayerStore::Bf16 { k, v } => (KvData::Bf16(k), KvData::Bf16(v)),
            LayerStore::Q8_0 { k, v } => (KvData::Q8_0(k), KvData::Q8_0(v)),
        };
        KvLayer {
            k,
            v,
            block_size: self.block_size,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_and_share() {
        let mut pool = BlockPool::new(2, 4, 16, 2, 8, KvDtype::F32).unwrap();
        let a = pool.allocate(3).unwrap().blocks;
        assert_eq!(pool.num_free(), 1);
        assert!(pool.allocate(2).is_none(), "all-or-nothing");
        assert_eq!(pool.num_free(), 1);
        pool.retain(a[0]);
        pool.release(&a);
        assert_eq!(pool.num_free(), 3, "the shared block stays taken");
        pool.release(&a[..1]);
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn cached_blocks_survive_release_and_are_evicted_last() {
        let mut pool = BlockPool::new(1, 4, 2, 1, 2, KvDtype::F32).unwrap();
        let toks = [1u32, 2, 3, 4];
        let hashes = [11u64, 12];
        let a = pool.allocate(3).unwrap().blocks;
        assert!(pool.register(a[0], hashes[0], &toks[0..2]));
        assert!(pool.register(a[1], hashes[1], &toks[2..4]));
        assert_eq!(pool.lookup(&hashes, &toks), vec![a[0], a[1]]);
        assert_eq!(
            pool.lookup(&hashes, &[1, 2, 3, 5]),
            vec![a[0]],
            "tokens are checked"
        );
        pool.release(&a);
        assert_eq!(
            (pool.num_free(), pool.num_used(), pool.num_cached()),
            (4, 0, 2)
        );
        // A hit takes the cached blocks back.
        let hit = pool.lookup(&hashes, &toks);
        hit.iter().for_each(|&b| pool.retain(b));
        assert_eq!((pool.num_free(), pool.num_used()), (2, 2));
        pool.release(&hit);
        // Free blocks go first, then the leaf (released first, so older), then its parent.
        let b = pool.allocate(2).unwrap();
        assert!(b.evicted.is_empty(), "free blocks first");
        let b = b.blocks;
        assert!(!b.contains(&a[0]) && !b.contains(&a[1]));
        let leaf = pool.allocate(1).unwrap();
        assert_eq!(leaf.blocks, vec![a[1]]);
        assert_eq!(
            leaf.evicted,
            vec![Evicted {
                block: a[1],
                hash: hashes[1],
                tokens: toks[2..4].into()
            }],
            "an eviction says what the block held"
        );
        assert_eq!(pool.lookup(&hashes, &toks), vec![a[0]]);
        assert_eq!(pool.allocate(1).unwrap().blocks, vec![a[0]]);
        assert!(pool.lookup(&hashes, &toks).is_empty());
        assert!(pool.allocate(1).is_none());
    }

    /// What a pool of `dtype` gives back for `x` written in a group whose largest magnitude is
    /// `amax`: exact for these small values (halves, below 256) in f32, f16 and bf16; q8_0
    /// within half its step.
    fn close(dtype: KvDtype, got: f32, x: f32, amax: f32) -> bool {
        match dtype {
            KvDtype::Q8_0 => (got - x).abs() <= amax / 254.0 * (1.0 + 2f32.powi(-10)),
            _ => got == x,
        }
    }

    #[test]
    fn read_block_and_write_block_round_trip_every_layer() {
        for dtype in KvDtype::ALL {
            let mut pool = BlockPool::new(2, 3, 2, 1, 2, dtype).unwrap();
            let n = pool.bytes_per_block();
            assert_eq!(n, 2 * 2 * 2 * dtype.row_bytes(2));
            // Block 1, both rows, both layers, distinct values.
            for layer in 0..2 {
                for row in 0..2 {
                    let x = (layer * 10 + row) as f32;
                    pool.write(layer, 2 + row, &[x, x + 0.5], &[-x, -x - 0.5]);
                }
            }
            let mut bytes = vec![0u8; n];
            pool.read_block(1, &mut bytes).expect("a host read");
            pool.write_block(2, &bytes).expect("a host write");
            for layer in 0..2 {
                let l = pool.layer(layer);
                // Block 2 (slots 4, 5) holds what block 1 (slots 2, 3) held.
                for (slot, d) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    assert_eq!(l.k_at(4 + slot, 0, d), l.k_at(2 + slot, 0, d));
                    assert_eq!(l.v_at(4 + slot, 0, d), l.v_at(2 + slot, 0, d));
                }
                let x = (layer * 10 + 1) as f32;
                assert!(close(dtype, l.k_at(5, 0, 0), x, x + 0.5), "{dtype:?}");
                assert!(
                    close(dtype, l.v_at(5, 0, 1), -x - 0.5, x + 0.5),
                    "{dtype:?}"
                );
            }
            let mut again = vec![0u8; n];
            pool.read_block(2, &mut again).expect("a host read");
            assert_eq!(bytes, again);
        }
    }

    #[test]
    fn a_draft_models_part_follows_the_targets_in_a_blocks_bytes() {
        // Target: 1 layer of 1 head x 2; draft: 2 layers of 2 heads x 4; blocks of 2 rows.
        let mut pool = BlockPool::new(1, 3, 2, 1, 2, KvDtype::F32).unwrap();
        let target = pool.bytes_per_block();
        pool.attach_draft(2, 2, 4).unwrap();
        let draft = BlockPool::block_bytes(2, 2, 2, 4, KvDtype::F32);
        // The draft's part, then whether the block holds it.
        assert_eq!(pool.bytes_per_block(), target + draft + 1);
        assert_eq!(pool.draft_storage_bytes(), 3 * draft);
        pool.write(0, 2, &[1.0, 2.0], &[3.0, 4.0]);
        let row: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let d = pool.draft_mut().unwrap();
        d.write(1, 3, &row, &row);
        pool.set_draft_kv(1, true);
        let mut bytes = vec![0u8; target + draft + 1];
        pool.read_block(1, &mut bytes).unwrap();
        assert_eq!(bytes[target + draft], 1);
        assert_eq!(pool.draft_kv_prefix(&[2, 1]), 0);
        pool.write_block(2, &bytes).unwrap();
        assert_eq!(
            pool.draft_kv_prefix(&[2, 1, 0]),
            2,
            "the flag came with the bytes"
        );
        // Block 2 (slots 4, 5) holds what block 1 (slots 2, 3) held, in both models.
        assert_eq!(pool.layer(0).k_at(4, 0, 1), 2.0);
        assert_eq!(pool.layer(0).v_at(4, 0, 0), 3.0);
        let d = pool.draft_mut().unwrap().layer(1);
        assert_eq!((d.k_at(5, 1, 3), d.v_at(5, 1, 2)), (7.0, 6.0));
        assert_eq!(d.k_at(4, 1, 3), 0.0);
        // A block indexed without the draft's K/V says so in its bytes, and its copy too.
        pool.set_draft_kv(1, false);
        pool.read_block(1, &mut bytes).unwrap();
        assert_eq!(bytes[target + draft], 0);
        pool.write_block(2, &bytes).unwrap();
        assert_eq!(pool.draft_kv_prefix(&[2]), 0);
    }

    /// Layer 0 slides (window 8, blocks of 4: a token reads at most 3 blocks) in 4 slots; layer
    /// 1 keeps all 8 blocks.
    fn windowed_pool() -> BlockPool {
        let window = WindowLayout {
            window: 8,
            layers: vec![true, false],
            num_slots: 4,
        };
        BlockPool::windowed(&[2], 8, Some(window), 4, 1, 2, KvDtype::F32).unwrap()
    }

    /// Writes position `pos` of `table` in both layers: K `[pos, layer]`, V `[-pos, layer]`.
    fn write_position(pool: &mut BlockPool, table: &[u32], pos: usize) {
        let x = pos as f32;
        let row = pool.window_row(table, pos).expect("a slot");
        pool.write(0, row, &[x, 0.0], &[-x, 0.0]);
        let row = pool.slot(table, pos);
        pool.write(1, row, &[x, 1.0], &[-x, 1.0]);
    }

    #[test]
    fn window_slots_follow_the_windows_and_the_cache() {
        let mut pool = windowed_pool();
        assert_eq!(pool.window(), Some(8));
        assert_eq!(pool.bytes_per_block(), 2 * 2 * 4 * 2 * 4 + 1);
        // Layer 0 holds 4 slots, layer 1 8 blocks.
        assert_eq!(pool.storage_bytes(), (4 + 8) * 2 * 4 * 2 * 4);
        let t = pool.allocate(3).unwrap().blocks;
        pool.enter_windows(&t, 0);
        assert_eq!(pool.window_slots(), Some((4, 3, 0)));
        for pos in 0..12 {
            write_position(&mut pool, &t, pos);
        }
        let tokens: Vec<u32> = (0..12).collect();
        let mut hashes = Vec::new();
        crate::kv::prefix::extend_hashes(1, &tokens, 4, &mut hashes);
        for b in 0..3 {
            assert!(pool.register(t[b], hashes[b], &tokens[b * 4..b * 4 + 4]));
        }
        let n = pool.bytes_per_block();
        let mut first = vec![0u8; n];
        pool.read_block(t[0], &mut first).unwrap();
        assert_eq!(first[n - 1], 1, "block 0 has its sliding part");
        // At 12 computed positions the next token reads 5..=12: block 0 is passed.
        assert_eq!(pool.first_read(12), 1);
        pool.pass_window(&t[..1]);
        assert_eq!(pool.window_slots(), Some((4, 2, 1)));
        let mut passed = vec![0u8; n];
        pool.read_block(t[0], &mut passed).unwrap();
        assert_eq!(passed[n - 1], 0, "block 0 lost its sliding part");
        let layer = 2 * 4 * 2 * 4;
        assert!(
            passed[..layer].iter().all(|&b| b == 0),
            "zeros in its place"
        );
        assert_eq!(
            passed[layer..n - 1],
            first[layer..n - 1],
            "the full layer stays"
        );
        // Its conversation ends: the blocks its window reached keep their slots, cached.
        pool.release_table(&t, 1);
        assert_eq!(pool.num_used(), 0);
        assert_eq!(pool.window_slots(), Some((4, 2, 1)));
        assert_eq!(pool.lookup(&hashes, &tokens), t);
        assert_eq!(pool.usable_prefix(&t), 3, "continuing reads blocks 1 and 2");
        // 5 blocks free, 3 cached; 2 slots free, 2 held by cached blocks.
        assert_eq!((pool.num_free(), pool.num_empty()), (4, 2));
        // An allocation of 3 takes free blocks and a cached block's slot: the least recently
        // used, block 2 (a table is released from its end).
        let u = pool.allocate(3).unwrap();
        assert!(u.evicted.is_empty());
        pool.enter_windows(&u.blocks, 0);
        assert_eq!(pool.window_slots(), Some((4, 4, 1)));
        assert_eq!(pool.num_free(), 1, "block 1's slot is the last to be had");
        assert_eq!(pool.usable_prefix(&t), 0, "block 2's window lacks slots");
        assert_eq!(pool.usable_prefix(&t[..1]), 0);
        // A block restored without its sliding part gives its slot back; one with it needs one.
        pool.write_block(u.blocks[2], &passed).unwrap();
        assert_eq!(pool.window_slots(), Some((4, 3, 1)));
        pool.write_block(u.blocks[1], &first).unwrap();
        let mut again = vec![0u8; n];
        pool.read_block(u.blocks[1], &mut again).unwrap();
        assert_eq!(again, first);
        // Block 2 takes the free slot back for its part.
        pool.write_block(u.blocks[2], &first).unwrap();
        assert_eq!(pool.window_slots(), Some((4, 4, 1)));
        pool.read_block(u.blocks[2], &mut again).unwrap();
        assert_eq!(again, first);
        // With every slot held (the cached block 1's was the last to be had), a part is dropped.
        pool.write_block(u.blocks[2], &passed).unwrap();
        let v = pool.allocate(2).unwrap().blocks;
        assert_eq!(pool.window_slots(), Some((4, 4, 1)));
        assert_eq!(pool.num_free(), 0);
        pool.write_block(u.blocks[2], &first).unwrap();
        pool.read_block(u.blocks[2], &mut again).unwrap();
        assert_eq!(again, passed);
        pool.release_table(&u.blocks, 0);
        pool.release(&v);
        assert_eq!(
            pool.window_slots(),
            Some((4, 0, 1)),
            "unindexed blocks give theirs back"
        );
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn a_split_pool_keeps_each_devices_layers_and_the_same_block_layout() {
        for dtype in KvDtype::ALL {
            let mut whole = BlockPool::new(3, 3, 2, 1, 2, dtype).unwrap();
            let mut split = BlockPool::split(&[2, 1], 3, 2, 1, 2, dtype).unwrap();
            assert_eq!((split.num_stages(), whole.num_stages()), (2, 1));
            assert_eq!((split.stage_layers(0), split.stage_layers(1)), (0..2, 2..3));
            let layer = 2 * 2 * dtype.row_bytes(2);
            assert_eq!(
                (split.part_bytes(0), split.part_bytes(1)),
                (2 * layer, layer)
            );
            assert_eq!((split.part_offset(0), split.part_offset(1)), (0, 2 * layer));
            assert_eq!(split.bytes_per_block(), whole.bytes_per_block());
            assert_eq!(split.stage_storage_bytes(0), 3 * 2 * layer);
            assert_eq!(split.stage_storage_bytes(1), 3 * layer);
            assert_eq!(split.storage_bytes(), whole.storage_bytes());
            for layer in 0..3 {
                for slot in 0..6 {
                    let x = (layer * 10 + slot) as f32;
                    whole.write(layer, slot, &[x, x + 0.5], &[-x, -x - 0.5]);
                    split.write(layer, slot, &[x, x + 0.5], &[-x, -x - 0.5]);
                }
            }
            let n = whole.bytes_per_block();
            let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
            whole.read_block(1, &mut a).expect("a host read");
            split.read_block(1, &mut b).expect("a host read");
            assert_eq!(a, b, "the same bytes whatever the split");
            // Each device's part is its slice of the block, and writes back into its layers only.
            let mut part = vec![0u8; split.part_bytes(1)];
            split.read_block_part(1, 1, &mut part).expect("a host read");
            assert_eq!(part, a[split.part_offset(1)..]);
            split.write_block_part(1, 2, &part).expect("a host write");
            let l = split.layer(2);
            assert!(
                close(dtype, l.k_at(4, 0, 0), 22.0, 22.5),
                "{dtype:?}: block 1 row 0 of layer 2"
            );
            let l = split.layer(0);
            assert!(
                close(dtype, l.k_at(4, 0, 0), 4.0, 4.5),
                "{dtype:?}: layer 0 untouched"
            );
            split.write_block(0, &a).expect("a host write");
            let mut c = vec![0u8; n];
            split.read_block(0, &mut c).expect("a host read");
            assert_eq!(c, a);
        }
    }

    #[test]
    fn streaming_copy_copies_every_byte_at_any_alignment() {
        let src: Vec<u8> = (0..9000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 15, 1023, 1024, 1025, 4096 + 7, 8000] {
            for (so, doff) in [(0, 0), (1, 0), (0, 3), (5, 9), (16, 15)] {
                let mut dst = vec![0u8; len + doff + 16];
                copy_streaming(&mut dst[doff..doff + len], &src[so..so + len]);
                store_fence();
                assert_eq!(
                    &dst[doff..doff + len],
                    &src[so..so + len],
                    "len {len} at {so}/{doff}"
                );
                assert!(dst[..doff]
                    .iter()
                    .chain(&dst[doff + len..])
                    .all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn slots_follow_the_block_table() {
        let mut pool = BlockPool::new(1, 4, 4, 1, 2, KvDtype::F32).unwrap();
        let table = [3u32, 1];
        assert_eq!(pool.slot(&table, 0), 12);
        assert_eq!(pool.slot(&table, 5), 5);
        pool.write(0, pool.slot(&table, 5), &[1.0, 2.0], &[3.0, 4.0]);
        let l = pool.layer(0);
        let got: Vec<f32> = (0..2).map(|d| l.k.get(l.k_index(5, 0, d))).collect();
        assert_eq!(got, [1.0, 2.0]);
        // Transposed within the block: element d of slot 5 (block 1, row 1) at 4 * (2 + d) + 1.
        assert_eq!((l.k_index(5, 0, 0), l.k_index(5, 0, 1)), (9, 13));
        let got: Vec<f32> = (10..12).map(|i| l.v.get(i)).collect();
        assert_eq!(got, [3.0, 4.0]);
    }

    #[test]
    fn f16_pool_rounds_to_nearest() {
        let mut pool = BlockPool::new(2, 2, 4, 1, 2, KvDtype::F16).unwrap();
        assert_eq!(pool.kv_dtype(), KvDtype::F16);
        let x = 1.0 + 1.0 / 3.0;
        pool.write(1, 6, &[x, -70000.0], &[1e-9, 0.1]);
        let l = pool.layer(1);
        assert!(matches!(l.k, KvData::F16(_)));
        let (k0, k1) = (l.k_index(6, 0, 0), l.k_index(6, 0, 1));
        assert_eq!(l.k.get(k0), f16::from_f32(x).to_f32());
        assert!((l.k.get(k0) - x).abs() <= x * 2f32.powi(-11));
        assert_eq!(l.k.get(k1), f32::NEG_INFINITY, "beyond f16's range");
        assert_eq!(l.v.get(12), f16::from_f32(1e-9).to_f32());
        assert_eq!(l.v.get(13), f16::from_f32(0.1).to_f32());
        // Layer 0 untouched.
        assert_eq!(pool.layer(0).k.get(k0), 0.0);
    }

    #[test]
    fn bf16_pool_rounds_to_nearest() {
        let mut pool = BlockPool::new(1, 2, 4, 1, 2, KvDtype::Bf16).unwrap();
        let x = 1.0 + 1.0 / 3.0;
        pool.write(0, 5, &[x, 1e30], &[-x, 1e-30]);
        let l = pool.layer(0);
        assert!(matches!(l.k, KvData::Bf16(_)));
        assert_eq!(l.k_at(5, 0, 0), bf16::from_f32(x).to_f32());
        assert!((l.k_at(5, 0, 0) - x).abs() <= x * 2f32.powi(-8));
        assert_eq!(
            l.k_at(5, 0, 1),
            bf16::from_f32(1e30).to_f32(),
            "f32's range"
        );
        assert_eq!(l.v_at(5, 0, 0), bf16::from_f32(-x).to_f32());
        assert_eq!(l.v_at(5, 0, 1), bf16::from_f32(1e-30).to_f32());
    }

    /// A q8_0 pool quantizes each head's vector in groups of 32: every value within amax/254 of
    /// its group (times 1 + 2^-10, the scale's rounding to f16), other rows, heads and layers
    /// untouched; block copies move the bytes as they are.
    #[test]
    fn q8_0_pool_quantizes_each_group_and_copies_blocks_as_bytes() {
        let (layers, blocks, bs, kvh, hd) = (2, 3, 16, 2, 40);
        let mut pool = BlockPool::new(layers, blocks, bs, kvh, hd, KvDtype::Q8_0).unwrap();
        // 2 heads of 40: a group of 32 and one of 8 each, 40 + 2 * 2 bytes a head.
        assert_eq!(pool.bytes_per_block(), layers * 2 * bs * kvh * 44);
        assert_eq!(pool.storage_bytes(), blocks * pool.bytes_per_block());
        let row = |slot: usize, scale: f32| -> Vec<f32> {
            (0..kvh * hd)
                .map(|e| ((e * 37 + slot * 11) % 101) as f32 / 50.0 - 1.0)
                .map(|x| x * scale)
                .collect()
        };
        for slot in 16..32 {
            pool.write(1, slot, &row(slot, 3.0), &row(slot + 1, 0.01));
        }
        let l = pool.layer(1);
        for slot in 16..32 {
            for (x, is_k) in [(row(slot, 3.0), true), (row(slot + 1, 0.01), false)] {
                for g in 0..kvh {
                    for (j, group) in x[g * hd..(g + 1) * hd].chunks(32).enumerate() {
                        let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
                        for (i, &want) in group.iter().enumerate() {
                            let d = j * 32 + i;
                            let got = if is_k {
                                l.k_at(slot, g, d)
                            } else {
                                l.v_at(slot, g, d)
                            };
                            assert!(
                                close(KvDtype::Q8_0, got, want, amax),
                                "slot {slot} head {g} element {d}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
        let zeros = |l: &KvLayer, slot: usize| {
            (0..kvh)
                .all(|g| (0..hd).all(|d| l.k_at(slot, g, d) == 0.0 && l.v_at(slot, g, d) == 0.0))
        };
        assert!(
            zeros(&l, 15) && zeros(&l, 32),
            "neighbouring blocks untouched"
        );
        assert!(zeros(&pool.layer(0), 20), "layer 0 untouched");
        let mut bytes = vec![0u8; pool.bytes_per_block()];
        pool.read_block(1, &mut bytes).expect("a host read");
        pool.write_block(2, &bytes).expect("a host write");
        let l = pool.layer(1);
        for r in 0..bs {
            for g in 0..kvh {
                for d in 0..hd {
                    assert_eq!(l.k_at(32 + r, g, d), l.k_at(16 + r, g, d));
                    assert_eq!(l.v_at(32 + r, g, d), l.v_at(16 + r, g, d));
                }
            }
        }
    }

    #[test]
    fn dtype_for_weights_names_and_sizes() {
        assert_eq!(KvDtype::for_weights(DType::F32), KvDtype::F32);
        assert_eq!(KvDtype::for_weights(DType::F16), KvDtype::F16);
        assert_eq!(KvDtype::for_weights(DType::Bf16), KvDtype::F16);
        for d in KvDtype::ALL {
            assert_eq!(KvDtype::parse(d.name()).unwrap(), d);
        }
        let codes: std::collections::HashSet<u8> = KvDtype::ALL.map(|d| d.code()).into();
        assert_eq!(codes.len(), 4, "every format its own disk code");
        assert_eq!(
            (KvDtype::F32.code(), KvDtype::F16.code()),
            (4, 2),
            "as before"
        );
        assert_eq!(
            KvDtype::parse("int8").unwrap_err().to_string(),
            "kv_dtype: \"int8\": must be f32, f16, bf16 or q8_0"
        );
        assert_eq!(KvDtype::F16.row_bytes(64), 128);
        assert_eq!(KvDtype::Bf16.row_bytes(64), 128);
        assert_eq!(KvDtype::Q8_0.row_bytes(64), 68, "ggml's 34 bytes per 32");
        assert_eq!(
            BlockPool::block_bytes(30, 16, 3, 64, KvDtype::F32),
            2 * BlockPool::block_bytes(30, 16, 3, 64, KvDtype::F16)
        );
        assert_eq!(
            BlockPool::block_bytes(30, 16, 3, 64, KvDtype::Q8_0) * 64,
            BlockPool::block_bytes(30, 16, 3, 64, KvDtype::F16) * 34
        );
    }
}
