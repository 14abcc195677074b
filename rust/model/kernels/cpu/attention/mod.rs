//! Grouped-query attention for one batch of query rows over a paged K/V cache.
//!
//! **Layout** (per layer, [`KvLayer`]): K is `[num_blocks, kv_heads, head_dim, block_size]`, each
//! block's keys transposed, so that element `d` of consecutive keys is contiguous; V is
//! `[num_blocks, block_size, kv_heads, head_dim]`. Elements are f32, f16 or bf16, or 8-bit
//! q8_0 groups with f16 scales in the same order ([`KvData`]; the q8_0 layout is in
//! [`super::kv_q8`]); all arithmetic is f32.
//!
//! **Tiles.** Keys are taken 16 at a time (a tile, aligned to a multiple of 16 by absolute
//! position). A tile's K and V are widened to f32 once and then serve every query head of the
//! K/V head in up to [`ROW_BLOCK`] consecutive rows of one sequence (a prefill chunk), so a
//! returning conversation's new rows read and convert their long history once per block of rows
//! instead of once per row. A tile's 16 scores come out of lane-wise FMAs over the transposed K
//! (no horizontal sums): four chains over the head's elements, added, times the scale. Every
//! stored format widens to f32 exactly (f16 and bf16 are subsets of f32; a q8_0 value is an int8
//! times an f16 scale, 19 significant bits), so the format changes the values a tile holds,
//! never the arithmetic on them: q8_0 K/V gives the bits its dequantized f32 copy gives. On
//! AVX-512 a block of rows computes the tile for 16 (row, query head) lanes at a time with the
//! lanes in the vector lanes ([`lanes_step_avx512`]), so the online softmax is vertical too;
//! each lane's arithmetic is the row-by-row path's, operation for operation.
//!
//! **Batch invariance.** A row's visible keys are cut into fixed segments by absolute key
//! position (`SEGMENT` keys, aligned to multiples of `SEGMENT`), each segment's softmax state is
//! computed from scratch over its tiles, and the states are merged in key order. That arithmetic
//! depends only on the row (its position, window, queries and cache), never on which rows share
//! its tiles, the thread count or the instruction set (FMA rounds once everywhere, and no step
//! reassociates): decode batches with few (row, K/V head) tasks run the segments in parallel
//! (split-K, as in flash-decoding) so that every thread has work; bigger batches run one task per
//! (block of rows, K/V head) that walks its segments in order. All give the same bits.

#[cfg(target_arch = "x86_64")]
mod row_avx2;
#[cfg(target_arch = "x86_64")]
mod row_avx512;
#[cfg(target_arch = "x86_64")]
mod tile_at;

use super::kv_q8;
use super::swiglu::fast_exp;
use half::{bf16, f16};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Largest supported head dimension (stack buffers are sized for it).
pub const MAX_HEAD_DIM: usize = 256;
/// Largest supported query heads per K/V head.
pub const MAX_GROUP: usize = 16;
/// Keys per tile: one 16-lane vector of scores.
const LANES: usize = 16;
/// Keys per segment (a multiple of LANES): segment `j` is keys `j*SEGMENT..(j+1)*SEGMENT`,
/// intersected with a row's visible keys.
const SEGMENT: usize = 128;
/// Most rows of one sequence that share each tile (fewer when their accumulators would not fit
/// [`BLOCK_ACC_FLOATS`]).
const ROW_BLOCK: usize = 16;
/// Floats of per-row segment accumulators a row-block task keeps on its stack (32 KiB).
const BLOCK_ACC_FLOATS: usize = 8192;
/// Most query lanes ((row, query head) pairs) of a row block: their queries are held transposed
/// on the task's stack, `LANES` lanes per vector (48 KiB at the largest head dimension).
const LANE_BLOCK: usize = 48;
/// Output floats of one register pass over V (4 AVX-512 vectors per query head).
const V_CHUNK: usize = 64;
/// Segments run as parallel tasks (split-K) while there are fewer than this many (row, K/V
/// head) tasks per thread.
const TASKS_PER_THREAD: usize = 4;
/// Floats of split-K partial states in [`AttnScratch`] (4 MiB): with smollm's 3 heads of 64
/// per K/V head, 5300 segments, e.g. 2 rows of 3 K/V heads at 110k keys. Bigger plans run
/// one task per (row, K/V head): the same bits, less parallel.
const PARTS_FLOATS: usize = 1 << 20;
/// How many tiles ahead a row read in place prefetches (into L2: into L1 the prefetches
/// stalled on the core's miss buffers and gained nothing; docs/benchmarks.md).
#[cfg(target_arch = "x86_64")]
const PREFETCH_TILES: usize = 2;

/// One layer's K or V storage (layouts in the module docs).
#[derive(Clone, Copy, Debug)]
pub enum KvData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    /// q8_0 groups ([`super::kv_q8`]): K and V in their own byte layouts.
    Q8_0(&'a [u8]),
}

impl KvData<'_> {
    /// Bytes the storage holds.
    pub fn bytes(&self) -> usize {
        match self {
            KvData::F32(x) => std::mem::size_of_val(*x),
            KvData::F16(x) => std::mem::size_of_val(*x),
            KvData::Bf16(x) => std::mem::size_of_val(*x),
            KvData::Q8_0(x) => x.len(),
        }
    }

    /// Bytes of one head's vector of `head_dim` values.
    pub fn row_bytes(&self, head_dim: usize) -> usize {
        match self {
            KvData::F32(_) => 4 * head_dim,
            KvData::F16(_) | KvData::Bf16(_) => 2 * head_dim,
            KvData::Q8_0(_) => kv_q8::row_bytes(head_dim),
        }
    }

    /// Element `i` as f32 (the element formats; a q8_0 value needs the layout:
    /// [`KvLayer::k_at`], [`KvLayer::v_at`]).
    pub fn get(&self, i: usize) -> f32 {
        match self {
            KvData::F32(x) => x[i],
            KvData::F16(x) => x[i].to_f32(),
            KvData::Bf16(x) => x[i].to_f32(),
            KvData::Q8_0(_) => panic!("KvData::get on q8_0 K/V: use KvLayer::k_at or v_at"),
        }
    }
}

/// The K/V cache of one layer: `k` is `[num_blocks, kv_heads, head_dim, block_size]`, `v`
/// `[num_blocks, block_size, kv_heads, head_dim]`.
pub struct KvLayer<'a> {
    pub k: KvData<'a>,
    pub v: KvData<'a>,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayer<'_> {
    /// Index in `k` of element `d` of K/V head `g` at cache row `slot` (`block * block_size +
    /// row`).
    pub fn k_index(&self, slot: usize, g: usize, d: usize) -> usize {
        k_index(slot, g, d, self.block_size, self.kv_heads, self.head_dim)
    }

    /// Index in `v` of element `d` of K/V head `g` at cache row `slot`.
    pub fn v_index(&self, slot: usize, g: usize, d: usize) -> usize {
        (slot * self.kv_heads + g) * self.head_dim + d
    }

    /// Element `d` of the key of K/V head `g` at cache row `slot`, as f32 (what the kernel
    /// widens it to: exact for every format).
    pub fn k_at(&self, slot: usize, g: usize, d: usize) -> f32 {
        let (bs, kvh, hd) = (self.block_size, self.kv_heads, self.head_dim);
        match self.k {
            KvData::Q8_0(k) => kv_q8::k_get(k, slot, g, d, bs, kvh, hd),
            k => k.get(self.k_index(slot, g, d)),
        }
    }

    /// Element `d` of the value of K/V head `g` at cache row `slot`, as f32.
    pub fn v_at(&self, slot: usize, g: usize, d: usize) -> f32 {
        match self.v {
            KvData::Q8_0(v) => kv_q8::v_get(v, slot, g, d, self.kv_heads, self.head_dim),
            v => v.get(self.v_index(slot, g, d)),
        }
    }
}

/// Index in K of element `d` of K/V head `g` at cache row `slot` (the block's keys transposed).
pub fn k_index(slot: usize, g: usize, d: usize, bs: usize, kvh: usize, hd: usize) -> usize {
    let (block, r) = (slot / bs, slot % bs);
    ((block * kvh + g) * hd + d) * bs + r
}

/// One query row of the batch: its absolute position and where its sequence's block table sits
/// in `tables`.
#[derive(Clone, Copy, Debug)]
pub struct AttnRow {
    pub pos: u32,
    pub table_start: u32,
    pub table_len: u32,
}

/// One split-K segment: keys `lo..=hi` of row `t`, K/V head `g`.
#[derive(Clone, Copy, Debug, Default)]
struct Segment {
    t: u32,
    g: u32,
    lo: u32,
    hi: u32,
}

/// A segment's softmax state per query head of the group: the running max of the scores and
/// the sum of `exp(score - max)` (the accumulators live beside it).
#[derive(Clone, Copy)]
struct State {
    mx: [f32; MAX_GROUP],
    sum: [f32; MAX_GROUP],
}

impl State {
    const EMPTY: State = State {
        mx: [f32::NEG_INFINITY; MAX_GROUP],
        sum: [0.0; MAX_GROUP],
    };
}

/// Preallocated scratch: the split-K segment list and each segment's partial softmax state,
/// and the row blocks of the unsplit path.
pub struct AttnScratch {
    threads: usize,
    max_rows: usize,
    segments: Vec<Segment>,
    /// `[group * hd acc | group max | group sum]` per segment.
    parts: Vec<f32>,
    /// Row blocks `(first row, rows)` of the unsplit path.
    blocks: Vec<(u32, u32)>,
}

impl AttnScratch {
    /// Scratch for batches of up to `max_rows` query rows of a model with `n_heads` query heads of
    /// `head_dim`, run on `threads` threads (the count split-K plans for; results do not depend
    /// on it).
    pub fn new(max_rows: usize, n_heads: usize, head_dim: usize, threads: usize) -> AttnScratch {
        let threads = threads.max(1);
        // At least one segment per task that split-K can plan for.
        let floats = PARTS_FLOATS.max(TASKS_PER_THREAD * threads * n_heads * (head_dim + 2));
        AttnScratch {
            threads,
            max_rows,
            // A part holds at least head_dim + 2 floats.
            segments: Vec::with_capacity(floats / (head_dim + 2).max(1)),
            parts: vec![0.0; floats],
            blocks: Vec::with_capacity(max_rows),
        }
    }

    /// Bytes the scratch buffers hold (for the device's memory accounting).
    pub fn bytes(&self) -> usize {
        use std::mem::size_of;
        self.segments.capacity() * size_of::<Segment>()
            + self.parts.capacity() * size_of::<f32>()
            + self.blocks.capacity() * size_of::<(u32, u32)>()
    }
}

/// How to run the segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// Split-K when the batch has few tasks, else one task per (block of rows, K/V head).
    Auto,
    /// Never split-K (the tests' baseline).
    #[cfg_attr(not(test), allow(dead_code))]
    Never,
}

/// The instruction set the kernel is compiled for (it changes speed, not results).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Plain,
}

fn detect_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let cpu = super::isa::cpu();
        if cpu.avx512 {
            return Isa::Avx512;
        }
        if cpu.avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Plain
}

/// `out[t]` = softmax over visible `j` of `(q[t,h]·k[j,g]) * scale`, applied to `v[j,g]`, with
/// `g = h / (n_heads / kv_heads)`. Visible: `j <= pos`, and `pos - j < window` when a sliding
/// window is given. `q`, `out` are `[rows.len(), n_heads * head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    rows: &[AttnRow],
    tables: &[u32],
    kv: &KvLayer,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    paged_attention_with(
        q,
        rows,
        tables,
        kv,
        n_heads,
        scale,
        window,
        out,
        scratch,
        detect_isa(),
        Split::Auto,
    );
}

#[allow(clippy::too_many_arguments)]
fn paged_attention_with(
    q: &[f32],
    rows: &[AttnRow],
    tables: &[u32],
    kv: &KvLayer,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    isa: Isa,
    split: Split,
) {
    let (hd, kvh, bs) = (kv.head_dim, kv.kv_heads, kv.block_size);
    assert!(
        kvh > 0 && bs > 0 && hd > 0,
        "attention: empty cache geometry"
    );
    assert!(
        n_heads.is_multiple_of(kvh),
        "attention: n_heads not a multiple of kv_heads"
    );
    let group = n_heads / kvh;
    assert!(
        hd <= MAX_HEAD_DIM,
        "attention: head_dim {hd} > {MAX_HEAD_DIM}"
    );
    assert!(group <= MAX_GROUP, "attention: group {group} > {MAX_GROUP}");
    assert_eq!(q.len(), rows.len() * n_heads * hd, "attention: q shape");
    assert_eq!(out.len(), q.len(), "attention: out shape");
    assert_eq!(kv.k.bytes(), kv.v.bytes(), "attention: k and v differ");
    let block_bytes = bs * kvh * kv.k.row_bytes(hd);
    assert_eq!(kv.k.bytes() % block_bytes, 0, "attention: cache shape");
    let num_blocks = kv.k.bytes() / block_bytes;
    if let Some(w) = window {
        assert!(w > 0, "attention: window must be positive");
    }
    for r in rows {
        let (s, l) = (r.table_start as usize, r.table_len as usize);
        assert!(s + l <= tables.len(), "attention: block table out of range");
        assert!(
            (r.pos as usize) / bs < l,
            "attention: position beyond block table"
        );
        // Every block a row can read lies inside the cache: the kernel indexes it unchecked.
        assert!(
            tables[s..s + l].iter().all(|&b| (b as usize) < num_blocks),
            "attention: block id beyond the cache"
        );
    }
    macro_rules! go {
        ($kv:expr) => {{
            let c = Ctx {
                q,
                rows,
                tables,
                kv: $kv,
                bs,
                kvh,
                hd,
                n_heads,
                group,
                scale,
                window,
            };
            run(&c, out, scratch, isa, split)
        }};
    }
    match (kv.k, kv.v) {
        (KvData::F32(k), KvData::F32(v)) => go!(Elems { k, v }),
        (KvData::F16(k), KvData::F16(v)) => go!(Elems { k, v }),
        (KvData::Bf16(k), KvData::Bf16(v)) => go!(Elems { k, v }),
        (KvData::Q8_0(k), KvData::Q8_0(v)) => go!(Q8 { k, v }),
        _ => panic!("attention: k and v differ in dtype"),
    }
}

/// One call's validated arguments, with K/V read through `S`.
struct Ctx<'a, S> {
    q: &'a [f32],
    rows: &'a [AttnRow],
    tables: &'a [u32],
    kv: S,
    bs: usize,
    kvh: usize,
    hd: usize,
    n_heads: usize,
    group: usize,
    scale: f32,
    window: Option<usize>,
}

impl<S> Ctx<'_, S> {
    /// The block table of row `t`.
    fn table(&self, t: usize) -> &[u32] {
        let r = self.rows[t];
        &self.tables[r.table_start as usize..(r.table_start + r.table_len) as usize]
    }

    /// The query heads of K/V head `g` in row `t`.
    fn q_group(&self, t: usize, g: usize) -> &[f32] {
        let gh = self.group * self.hd;
        &self.q[t * self.n_heads * self.hd + g * gh..][..gh]
    }

    /// Rows of one sequence at consecutive positions, as many as may share a tile.
    fn row_block_limit(&self) -> usize {
        (BLOCK_ACC_FLOATS / (self.group * self.hd))
            .min(LANE_BLOCK / self.group)
            .clamp(1, ROW_BLOCK)
    }
}

/// The visible keys `lo..=pos` of a row.
fn visible(r: &AttnRow, window: Option<usize>) -> (usize, usize) {
    let pos = r.pos as usize;
    (window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos)
}

/// Segment `j` of a row whose visible keys are `lo..=hi`.
fn segment(lo: usize, hi: usize, j: usize) -> (usize, usize) {
    (lo.max(j * SEGMENT), hi.min((j + 1) * SEGMENT - 1))
}

/// The segment indices `j` of a row whose visible keys are `lo..=hi`.
fn segment_range(lo: usize, hi: usize) -> std::ops::RangeInclusive<usize> {
    lo / SEGMENT..=hi / SEGMENT
}

/// The output rows of the unsplit path, written by tasks that each own distinct
/// (row, K/V head) slices.
#[derive(Clone, Copy)]
struct OutRows(*mut f32);
// SAFETY: tasks write disjoint slices (see `run`); the pointer outlives the parallel loop.
unsafe impl Send for OutRows {}
unsafe impl Sync for OutRows {}

fn run<S: KvSource>(
    c: &Ctx<S>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    isa: Isa,
    split: Split,
) {
    let (hd, group) = (c.hd, c.group);
    if split == Split::Auto && plan_segments(c, scratch) {
        let slot = group * (hd + 2);
        let AttnScratch {
            segments, parts, ..
        } = scratch;
        let n = segments.len();
        parts[..n * slot]
            .par_chunks_mut(slot)
            .zip(segments.par_iter())
            .for_each(|(p, s)| {
                let (acc, st) = p.split_at_mut(group * hd);
                let state = dispatch(isa, c, Task::Segment { seg: *s, acc });
                st[..group].copy_from_slice(&state.mx[..group]);
                st[group..].copy_from_slice(&state.sum[..group]);
            });
        // Segments of one (row, head) are consecutive, in key order.
        let mut i = 0;
        while i < n {
            let s0 = segments[i];
            let mut e = i + 1;
            while e < n && segments[e].t == s0.t && segments[e].g == s0.g {
                e += 1;
            }
            let o =
                &mut out[(s0.t as usize * c.n_heads + s0.g as usize * group) * hd..][..group * hd];
            let part = |p: &[f32]| {
                let mut st = State::EMPTY;
                st.mx[..group].copy_from_slice(&p[group * hd..group * hd + group]);
                st.sum[..group].copy_from_slice(&p[group * hd + group..slot]);
                st
            };
            let first = &parts[i * slot..(i + 1) * slot];
            o.copy_from_slice(&first[..group * hd]);
            let mut state = part(first);
            for p in parts[(i + 1) * slot..e * slot].chunks_exact(slot) {
                combine(o, &mut state, &p[..group * hd], &part(p), group, hd);
            }
            finish(o, &state, group, hd);
            i = e;
        }
        return;
    }
    // One task per (block of consecutive rows of a sequence, K/V head).
    plan_row_blocks(c, &mut scratch.blocks);
    let ptr = OutRows(out.as_mut_ptr());
    let tasks = scratch.blocks.len() * c.kvh;
    (0..tasks).into_par_iter().for_each(|i| {
        let (first, n) = scratch.blocks[i / c.kvh];
        let g = i % c.kvh;
        let task = Task::Rows {
            first: first as usize,
            n: n as usize,
            g,
            out: ptr,
        };
        dispatch(isa, c, task);
    });
}

/// Cuts the batch into blocks of rows that may share tiles: consecutive batch rows of one
/// sequence (same block table) at consecutive positions, at most `row_block_limit` each.
fn plan_row_blocks<S>(c: &Ctx<S>, blocks: &mut Vec<(u32, u32)>) {
    blocks.clear();
    let limit = c.row_block_limit();
    for (t, r) in c.rows.iter().enumerate() {
        if let Some((first, n)) = blocks.last_mut() {
            let p = c.rows[*first as usize + *n as usize - 1];
            let follows =
                p.table_start == r.table_start && p.table_len == r.table_len && p.pos + 1 == r.pos;
            if follows && (*n as usize) < limit {
                *n += 1;
                continue;
            }
        }
        blocks.push((t as u32, 1));
    }
}

/// Fills `scratch.segments` with the split-K plan: every row's segments, per K/V head, in key
/// order. False when split-K does not pay (enough tasks already, or no row with two segments)
/// or does not fit the scratch.
fn plan_segments<S>(c: &Ctx<S>, scratch: &mut AttnScratch) -> bool {
    let tasks = c.rows.len() * c.kvh;
    if tasks == 0 || tasks >= TASKS_PER_THREAD * scratch.threads || c.rows.len() > scratch.max_rows
    {
        return false;
    }
    let total: usize = c
        .rows
        .iter()
        .map(|r| {
            let (lo, hi) = visible(r, c.window);
            segment_range(lo, hi).count() * c.kvh
        })
        .sum();
    let slot = c.group * (c.hd + 2);
    if total == tasks || total * slot > scratch.parts.len() || total > scratch.segments.capacity() {
        return false;
    }
    scratch.segments.clear();
    for (t, r) in c.rows.iter().enumerate() {
        let (lo, hi) = visible(r, c.window);
        for g in 0..c.kvh {
            for j in segment_range(lo, hi) {
                let (a, b) = segment(lo, hi, j);
                scratch.segments.push(Segment {
                    t: t as u32,
                    g: g as u32,
                    lo: a as u32,
                    hi: b as u32,
                });
            }
        }
    }
    true
}

/// Merges the next segment (accumulators `acc_b`, state `b`) into the running ones (`acc`,
/// `state`) of one (row, K/V head): both rescaled to the larger max. Plain element-wise
/// arithmetic, the same wherever it runs.
fn combine(acc: &mut [f32], state: &mut State, acc_b: &[f32], b: &State, group: usize, hd: usize) {
    for h in 0..group {
        let m = state.mx[h].max(b.mx[h]);
        let ca = fast_exp(state.mx[h] - m);
        let cb = fast_exp(b.mx[h] - m);
        state.mx[h] = m;
        state.sum[h] = state.sum[h] * ca + b.sum[h] * cb;
        for (x, &y) in acc[h * hd..(h + 1) * hd]
            .iter_mut()
            .zip(&acc_b[h * hd..(h + 1) * hd])
        {
            *x = *x * ca + y * cb;
        }
    }
}

/// Normalises accumulated rows by their sums.
fn finish(acc: &mut [f32], state: &State, group: usize, hd: usize) {
    for h in 0..group {
        // The last key is always visible, so sum >= 1.
        let inv = 1.0 / state.sum[h];
        for x in acc[h * hd..(h + 1) * hd].iter_mut() {
            *x *= inv;
        }
    }
}

/// A K/V element format, widened to f32 exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ElemKind {
    F32,
    F16,
    Bf16,
}

/// A K/V element type.
trait KvElem: Copy + Send + Sync {
    const KIND: ElemKind;
    fn to_f32(self) -> f32;
}
impl KvElem for f32 {
    const KIND: ElemKind = ElemKind::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}
impl KvElem for f16 {
    const KIND: ElemKind = ElemKind::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}
impl KvElem for bf16 {
    const KIND: ElemKind = ElemKind::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Reads the f16 at `src` (any alignment) as f32.
#[inline(always)]
unsafe fn f16_at(src: *const u8) -> f32 {
    f16::from_bits(u16::from_le_bytes([*src, *src.add(1)])).to_f32()
}

/// Widening of stored K/V to f32, per ISA (exact, so every ISA gets the same values: an int8
/// times an f16 scale is exact in f32 too).
trait Widen {
    /// `dst[i] = src[i]` as f32 for `i < n`.
    ///
    /// # Safety
    /// The CPU supports the implementation's ISA; `src` and `dst` hold `n` elements.
    unsafe fn widen<E: KvElem>(src: *const E, dst: *mut f32, n: usize);

    /// `dst[i] = q[i] * scales[i]` for `i < n` (q8_0 keys: each key its own scale).
    ///
    /// # Safety
    /// As [`Widen::widen`]; `q`, `scales` and `dst` hold `n` elements.
    #[inline(always)]
    unsafe fn widen_q8(q: *const i8, scales: *const f32, dst: *mut f32, n: usize) {
        for i in 0..n {
            *dst.add(i) = *q.add(i) as f32 * *scales.add(i);
        }
    }

    /// `dst[i] = q[i] * scale` for `i < n` (a q8_0 group of a value row).
    ///
    /// # Safety
    /// As [`Widen::widen`]; `q` and `dst` hold `n` elements.
    #[inline(always)]
    unsafe fn widen_q8_group(q: *const i8, scale: f32, dst: *mut f32, n: usize) {
        for i in 0..n {
            *dst.add(i) = *q.add(i) as f32 * scale;
        }
    }

    /// `dst[i]` = the f16 at bytes `2i..2i + 2` of `src` (any alignment) as f32, `i < n`: the
    /// scales of q8_0 keys.
    ///
    /// # Safety
    /// As [`Widen::widen`]; `src` holds `2n` bytes, `dst` `n` floats.
    #[inline(always)]
    unsafe fn widen_f16_bytes(src: *const u8, dst: *mut f32, n: usize) {
        for i in 0..n {
            *dst.add(i) = f16_at(src.add(2 * i));
        }
    }

    /// Query lanes ((row, head) pairs) per vector when row blocks take the lanes path
    /// ([`lanes_step_avx512`] with 16, [`lanes_step_avx2`] with 8: the same bits as
    /// [`tile_step`], faster); 0: row by row.
    const QUERY_LANES: usize = 0;
}

struct Plain;
impl Widen for Plain {
    #[inline(always)]
    unsafe fn widen<E: KvElem>(src: *const E, dst: *mut f32, n: usize) {
        for i in 0..n {
            *dst.add(i) = (*src.add(i)).to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Widen for Avx2 {
    const QUERY_LANES: usize = 8;

    #[inline(always)]
    unsafe fn widen<E: KvElem>(src: *const E, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        if E::KIND == ElemKind::F32 {
            std::ptr::copy_nonoverlapping(src as *const f32, dst, n);
            return;
        }
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(src.add(i) as *const __m128i);
            let x = if E::KIND == ElemKind::F16 {
                _mm256_cvtph_ps(h)
            } else {
                // bf16: the upper half of an f32.
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            };
            _mm256_storeu_ps(dst.add(i), x);
            i += 8;
        }
        for j in i..n {
            *dst.add(j) = (*src.add(j)).to_f32();
        }
    }

    #[inline(always)]
    unsafe fn widen_q8(q: *const i8, scales: *const f32, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                q.add(i) as *const __m128i
            )));
            _mm256_storeu_ps(dst.add(i), _mm256_mul_ps(x, _mm256_loadu_ps(scales.add(i))));
            i += 8;
        }
        for j in i..n {
            *dst.add(j) = *q.add(j) as f32 * *scales.add(j);
        }
    }

    #[inline(always)]
    unsafe fn widen_q8_group(q: *const i8, scale: f32, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let s = _mm256_set1_ps(scale);
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                q.add(i) as *const __m128i
            )));
            _mm256_storeu_ps(dst.add(i), _mm256_mul_ps(x, s));
            i += 8;
        }
        for j in i..n {
            *dst.add(j) = *q.add(j) as f32 * scale;
        }
    }

    #[inline(always)]
    unsafe fn widen_f16_bytes(src: *const u8, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
            _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
        for j in i..n {
            *dst.add(j) = f16_at(src.add(2 * j));
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Widen for Avx512 {
    const QUERY_LANES: usize = 16;

    #[inline(always)]
    unsafe fn widen<E: KvElem>(src: *const E, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        if E::KIND == ElemKind::F32 {
            std::ptr::copy_nonoverlapping(src as *const f32, dst, n);
            return;
        }
        let mut i = 0;
        while i < n {
            let m = mask16(n - i);
            let h = _mm256_maskz_loadu_epi16(m, src.add(i) as *const i16);
            let x = if E::KIND == ElemKind::F16 {
                _mm512_cvtph_ps(h)
            } else {
                // bf16: the upper half of an f32.
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            };
            _mm512_mask_storeu_ps(dst.add(i), m, x);
            i += 16;
        }
    }

    #[inline(always)]
    unsafe fn widen_q8(q: *const i8, scales: *const f32, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i < n {
            let m = mask16(n - i);
            let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q.add(i))));
            let s = _mm512_maskz_loadu_ps(m, scales.add(i));
            _mm512_mask_storeu_ps(dst.add(i), m, _mm512_mul_ps(x, s));
            i += 16;
        }
    }

    #[inline(always)]
    unsafe fn widen_q8_group(q: *const i8, scale: f32, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let s = _mm512_set1_ps(scale);
        let mut i = 0;
        while i < n {
            let m = mask16(n - i);
            let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q.add(i))));
            _mm512_mask_storeu_ps(dst.add(i), m, _mm512_mul_ps(x, s));
            i += 16;
        }
    }

    #[inline(always)]
    unsafe fn widen_f16_bytes(src: *const u8, dst: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i < n {
            let m = mask16(n - i);
            let h = _mm256_maskz_loadu_epi16(m, src.add(2 * i) as *const i16);
            _mm512_mask_storeu_ps(dst.add(i), m, _mm512_cvtph_ps(h));
            i += 16;
        }
    }
}

/// The mask of the first `min(left, 16)` lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn mask16(left: usize) -> u16 {
    if left >= 16 {
        0xffff
    } else {
        ((1u32 << left) - 1) as u16
    }
}

/// A cache's geometry: tokens per block, K/V heads, head dimension.
#[derive(Clone, Copy)]
struct Geom {
    bs: usize,
    kvh: usize,
    hd: usize,
}

/// A layer's K/V as the kernel reads it: tiles of keys and rows of values widened to f32 (in
/// the same values whatever the ISA `W`).
trait KvSource: Copy + Send + Sync {
    /// How [`row_avx512`] and [`row_avx2`] read a tile in place.
    #[cfg(target_arch = "x86_64")]
    type Tile: row_avx512::TileRead + row_avx2::TileRead;

    /// Where keys `r0..r0 + LANES` of block `block` (`bs % LANES == 0`), K/V head `g`, and their
    /// value rows lie, for a row read in place.
    ///
    /// # Safety
    /// The block lies in the cache.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_at(&self, geo: Geom, block: usize, r0: usize, g: usize) -> Self::Tile;

    /// Keys `r0..r0 + LANES` of block `block` (`bs % LANES == 0`), K/V head `g`, into `kt`
    /// transposed: `kt[d * LANES + lane]`.
    ///
    /// # Safety
    /// W's ISA is supported; the block lies in the cache; `kt` holds `hd * LANES` floats.
    unsafe fn k_tile<W: Widen>(&self, geo: Geom, block: usize, r0: usize, g: usize, kt: *mut f32);

    /// Element `d` of the key of K/V head `g` at cache row `slot`.
    ///
    /// # Safety
    /// The row lies in the cache.
    unsafe fn k_elem(&self, geo: Geom, slot: usize, g: usize, d: usize) -> f32;

    /// The value of K/V head `g` at cache row `slot` into `dst` (`hd` floats).
    ///
    /// # Safety
    /// As [`KvSource::k_tile`]; `dst` holds `hd` floats.
    unsafe fn v_row<W: Widen>(&self, geo: Geom, slot: usize, g: usize, dst: *mut f32);
}

/// K/V of one element type (f32, f16, bf16).
#[derive(Clone, Copy)]
struct Elems<'a, E> {
    k: &'a [E],
    v: &'a [E],
}

impl<E: KvElem> KvSource for Elems<'_, E> {
    #[cfg(target_arch = "x86_64")]
    type Tile = tile_at::TileAt<E>;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile_at(&self, geo: Geom, block: usize, r0: usize, g: usize) -> Self::Tile {
        let Geom { bs, kvh, hd } = geo;
        let slot = block * bs + r0;
        tile_at::TileAt {
            k: self.k.as_ptr().add(k_index(slot, g, 0, bs, kvh, hd)),
            k_stride: bs,
            v: self.v.as_ptr().add((slot * kvh + g) * hd),
            v_stride: kvh * hd,
        }
    }

    #[inline(always)]
    unsafe fn k_tile<W: Widen>(&self, geo: Geom, block: usize, r0: usize, g: usize, kt: *mut f32) {
        let Geom { bs, kvh, hd } = geo;
        let (k, slot) = (self.k.as_ptr(), block * bs + r0);
        if bs == LANES {
            // The tile is one block: its K for head g is `[hd][LANES]`, contiguous.
            W::widen(k.add(k_index(slot, g, 0, bs, kvh, hd)), kt, hd * LANES);
        } else {
            // Element d of the tile's 16 keys is contiguous.
            for d in 0..hd {
                W::widen(
                    k.add(k_index(slot, g, d, bs, kvh, hd)),
                    kt.add(d * LANES),
                    LANES,
                );
            }
        }
    }

    #[inline(always)]
    unsafe fn k_elem(&self, geo: Geom, slot: usize, g: usize, d: usize) -> f32 {
        let Geom { bs, kvh, hd } = geo;
        (*self.k.as_ptr().add(k_index(slot, g, d, bs, kvh, hd))).to_f32()
    }

    #[inline(always)]
    unsafe fn v_row<W: Widen>(&self, geo: Geom, slot: usize, g: usize, dst: *mut f32) {
        let Geom { kvh, hd, .. } = geo;
        W::widen(self.v.as_ptr().add((slot * kvh + g) * hd), dst, hd);
    }
}

/// q8_0 K/V ([`kv_q8`]'s layouts).
#[derive(Clone, Copy)]
struct Q8<'a> {
    k: &'a [u8],
    v: &'a [u8],
}

impl KvSource for Q8<'_> {
    #[cfg(target_arch = "x86_64")]
    type Tile = tile_at::Q8TileAt;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile_at(&self, geo: Geom, block: usize, r0: usize, g: usize) -> Self::Tile {
        let Geom { bs, kvh, hd } = geo;
        // The (block, head) chunk: q `[hd][bs]`, then scales `[groups][bs]`.
        let chunk = self.k.as_ptr().add(kv_q8::k_chunk(block, g, bs, kvh, hd));
        tile_at::Q8TileAt {
            k_q: chunk.add(r0).cast(),
            k_stride: bs,
            k_scales: chunk.add(hd * bs + 2 * r0),
            scale_stride: 2 * bs,
            v: self
                .v
                .as_ptr()
                .add(kv_q8::v_row_at(block * bs + r0, g, kvh, hd)),
            v_stride: kvh * kv_q8::row_bytes(hd),
        }
    }

    #[inline(always)]
    unsafe fn k_tile<W: Widen>(&self, geo: Geom, block: usize, r0: usize, g: usize, kt: *mut f32) {
        let Geom { bs, kvh, hd } = geo;
        // The (block, head) chunk: q `[hd][bs]`, then scales `[groups][bs]`.
        let chunk = self.k.as_ptr().add(kv_q8::k_chunk(block, g, bs, kvh, hd));
        let mut scales = [0f32; LANES];
        for j in 0..kv_q8::groups(hd) {
            let at = chunk.add(hd * bs + 2 * (j * bs + r0));
            W::widen_f16_bytes(at, scales.as_mut_ptr(), LANES);
            for d in j * kv_q8::QK..((j + 1) * kv_q8::QK).min(hd) {
                let q = chunk.add(d * bs + r0) as *const i8;
                W::widen_q8(q, scales.as_ptr(), kt.add(d * LANES), LANES);
            }
        }
    }

    #[inline(always)]
    unsafe fn k_elem(&self, geo: Geom, slot: usize, g: usize, d: usize) -> f32 {
        kv_q8::k_get(self.k, slot, g, d, geo.bs, geo.kvh, geo.hd)
    }

    #[inline(always)]
    unsafe fn v_row<W: Widen>(&self, geo: Geom, slot: usize, g: usize, dst: *mut f32) {
        let Geom { kvh, hd, .. } = geo;
        // ggml's blocks: [scale f16][32 x i8] per group.
        let row = self.v.as_ptr().add(kv_q8::v_row_at(slot, g, kvh, hd));
        for j in 0..kv_q8::groups(hd) {
            let at = row.add(j * (kv_q8::QK + 2));
            let n = kv_q8::QK.min(hd - j * kv_q8::QK);
            W::widen_q8_group(
                at.add(2) as *const i8,
                f16_at(at),
                dst.add(j * kv_q8::QK),
                n,
            );
        }
    }
}

/// One unit of parallel work.
enum Task<'a> {
    /// Rows `first..first + n` (consecutive positions of one sequence) over all their keys, K/V
    /// head `g`: normalised outputs written to their slices of `out`.
    Rows {
        first: usize,
        n: usize,
        g: usize,
        out: OutRows,
    },
    /// One split-K segment: unnormalised accumulators into `acc`, the state returned.
    Segment { seg: Segment, acc: &'a mut [f32] },
}

/// Runs `task` compiled for `isa`.
fn dispatch<S: KvSource>(isa: Isa, c: &Ctx<S>, task: Task) -> State {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: detect_isa checked the features (tests only pass ISAs they detected).
        Isa::Avx512 => unsafe { task_avx512(c, task) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { task_avx2(c, task) },
        Isa::Plain => run_task::<Plain, S>(c, task),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn task_avx512<S: KvSource>(c: &Ctx<S>, task: Task) -> State {
    run_task::<Avx512, S>(c, task)
}
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2<S: KvSource>(c: &Ctx<S>, task: Task) -> State {
    run_task::<Avx2, S>(c, task)
}

/// A tile's K (transposed: `kt[d * LANES + lane]`) and V (`vt[lane * hd + d]`) in f32.
struct TileBuf {
    kt: [MaybeUninit<f32>; MAX_HEAD_DIM * LANES],
    vt: [MaybeUninit<f32>; LANES * MAX_HEAD_DIM],
}

#[inline(always)]
fn run_task<W: Widen, S: KvSource>(c: &Ctx<S>, task: Task) -> State {
    let mut tile = TileBuf {
        kt: [MaybeUninit::uninit(); MAX_HEAD_DIM * LANES],
        vt: [MaybeUninit::uninit(); LANES * MAX_HEAD_DIM],
    };
    let gh = c.group * c.hd;
    match task {
        Task::Segment { seg, acc } => {
            let mut st = [State::EMPTY];
            acc[..gh].fill(0.0);
            let (t, lo, hi) = (seg.t as usize, seg.lo as usize, seg.hi as usize);
            segment_pass::<W, S>(
                c,
                t,
                &[(lo, hi)],
                seg.g as usize,
                (lo, hi),
                &mut [&mut acc[..gh]],
                &mut st,
                &mut tile,
                None,
            );
            st[0]
        }
        Task::Rows { first, n, g, out } => {
            rows_task::<W, S>(c, first, n, g, out, &mut tile);
            State::EMPTY
        }
    }
}

/// Rows `first..first + n` of one sequence over all their visible keys, K/V head `g`: each
/// row's segments in key order, the first accumulated in place in `out`, the later ones on the
/// stack and merged in, then normalised.
#[inline(always)]
fn rows_task<W: Widen, S: KvSource>(
    c: &Ctx<S>,
    first: usize,
    n: usize,
    g: usize,
    out: OutRows,
    tile: &mut TileBuf,
) {
    let (hd, group) = (c.hd, c.group);
    let gh = group * hd;
    debug_assert!((1..=ROW_BLOCK).contains(&n) && n * gh <= BLOCK_ACC_FLOATS);
    // SAFETY: this task is the only one writing rows `first..first + n` at K/V head `g` (the
    // row blocks partition the rows; each (block, g) is one task), and those slices lie in `out`
    // (`q` has the same shape, checked on entry).
    let mut outs: [&mut [f32]; ROW_BLOCK] = std::array::from_fn(|_| Default::default());
    for (i, o) in outs.iter_mut().take(n).enumerate() {
        let at = ((first + i) * c.n_heads + g * group) * hd;
        *o = unsafe { std::slice::from_raw_parts_mut(out.0.add(at), gh) };
    }
    let mut seg_buf = [MaybeUninit::<f32>::uninit(); BLOCK_ACC_FLOATS];
    // SAFETY: n * gh <= BLOCK_ACC_FLOATS (row_block_limit); written (zeroed) before any read.
    let seg_all = unsafe {
        let p = seg_buf.as_mut_ptr().cast::<f32>();
        std::ptr::write_bytes(p, 0, n * gh);
        std::slice::from_raw_parts_mut(p, n * gh)
    };
    // Two or more rows on the lanes path: their queries transposed, lane = i * group + h, QL =
    // W::QUERY_LANES lanes per vector (`qt[(v * hd + d) * QL + lane % QL]`, v = lane / QL),
    // unused lanes zero.
    let mut qt_buf = [MaybeUninit::<f32>::uninit(); LANE_BLOCK * MAX_HEAD_DIM];
    let ql = W::QUERY_LANES;
    let qt = (ql > 0 && n >= 2).then(|| {
        let lanes = n * group;
        let vectors = lanes.div_ceil(ql);
        debug_assert!(lanes <= LANE_BLOCK && LANE_BLOCK.is_multiple_of(ql));
        // SAFETY: vectors * hd * ql <= LANE_BLOCK * MAX_HEAD_DIM (row_block_limit keeps
        // n * group <= LANE_BLOCK, a multiple of ql, so whole vectors fit too); every float is
        // written here before it is read.
        let qt = unsafe {
            let p = qt_buf.as_mut_ptr().cast::<f32>();
            std::ptr::write_bytes(p, 0, vectors * hd * ql);
            std::slice::from_raw_parts_mut(p, vectors * hd * ql)
        };
        for lane in 0..lanes {
            let (i, h) = (lane / group, lane % group);
            let q = &c.q_group(first + i, g)[h * hd..(h + 1) * hd];
            let (v, l) = (lane / ql, lane % ql);
            for (d, &x) in q.iter().enumerate() {
                qt[(v * hd + d) * ql + l] = x;
            }
        }
        &*qt
    });
    let mut spans = [(0usize, 0usize); ROW_BLOCK];
    for (i, s) in spans.iter_mut().take(n).enumerate() {
        *s = visible(&c.rows[first + i], c.window);
    }
    let ulo = spans[..n].iter().map(|s| s.0).min().unwrap_or(0);
    let uhi = spans[..n].iter().map(|s| s.1).max().unwrap_or(0);
    let mut running = [State::EMPTY; ROW_BLOCK];
    let mut started = [false; ROW_BLOCK];
    for j in segment_range(ulo, uhi) {
        let seg_span = segment(ulo, uhi, j);
        // Each row's part of segment j: empty (lo > hi) where the row does not reach it.
        let mut parts = [(1usize, 0usize); ROW_BLOCK];
        for (p, s) in parts.iter_mut().zip(&spans).take(n) {
            *p = segment(s.0, s.1, j);
        }
        let mut states = [State::EMPTY; ROW_BLOCK];
        {
            // Rows not yet started accumulate in place; the others into their stack slot.
            let mut accs: [&mut [f32]; ROW_BLOCK] = std::array::from_fn(|_| Default::default());
            for (i, (a, (o, s))) in accs
                .iter_mut()
                .zip(outs.iter_mut().zip(seg_all.chunks_exact_mut(gh)))
                .take(n)
                .enumerate()
            {
                if parts[i].0 > parts[i].1 {
                    continue;
                }
                *a = if started[i] { s } else { &mut **o };
                a.fill(0.0);
            }
            segment_pass::<W, S>(
                c,
                first,
                &parts[..n],
                g,
                seg_span,
                &mut accs[..n],
                &mut states[..n],
                tile,
                qt,
            );
        }
        for i in 0..n {
            if parts[i].0 > parts[i].1 {
                continue;
            }
            if started[i] {
                let s = &seg_all[i * gh..(i + 1) * gh];
                combine(outs[i], &mut running[i], s, &states[i], group, hd);
            } else {
                running[i] = states[i];
                started[i] = true;
            }
        }
    }
    for i in 0..n {
        finish(outs[i], &running[i], group, hd);
    }
}

/// The keys `span` (inside one segment) for the rows `first + i` whose parts `parts[i]` of it
/// are not empty, K/V head `g`: tile by tile, each tile widened once for all of them, each row's
/// softmax state (`states[i]`, accumulators `accs[i]`) updated over its own keys. With `qt`
/// (the rows' queries transposed, see `rows_task`) a tile is computed for 16 query lanes at a
/// time by [`lanes_step_avx512`], else row by row by [`tile_step`]: the same arithmetic per row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn segment_pass<W: Widen, S: KvSource>(
    c: &Ctx<S>,
    first: usize,
    parts: &[(usize, usize)],
    g: usize,
    span: (usize, usize),
    accs: &mut [&mut [f32]],
    states: &mut [State],
    tile: &mut TileBuf,
    qt: Option<&[f32]>,
) {
    let (hd, group, bs, kvh) = (c.hd, c.group, c.bs, c.kvh);
    // One row (two or more take the lanes path with `qt`) reads its tiles in place where the
    // ISA has a kernel for it and the tiles lie in single blocks.
    #[cfg(target_arch = "x86_64")]
    if W::QUERY_LANES > 0 && qt.is_none() && bs.is_multiple_of(LANES) {
        let avx512 = W::QUERY_LANES == LANES;
        if avx512 || hd.is_multiple_of(8) {
            debug_assert_eq!(parts.len(), 1);
            if parts[0].0 <= parts[0].1 {
                let (acc, st) = (&mut *accs[0], &mut states[0]);
                // SAFETY: W = Avx512 (16 query lanes) or Avx2 (8), so the CPU has the
                // features (detect_isa), and the AVX2 kernel's hd is a multiple of 8; the
                // part's keys are at most the row's position, so their blocks are in its table
                // and in the cache (checked on entry); accs[0] holds the group's accumulators.
                unsafe {
                    if avx512 {
                        row_in_place_avx512(c, first, parts[0], g, acc, st)
                    } else {
                        row_in_place_avx2(c, first, parts[0], g, acc, st)
                    }
                };
            }
            return;
        }
    }
    let table = c.table(first);
    let geo = Geom { bs, kvh, hd };
    let kt = tile.kt.as_mut_ptr().cast::<f32>();
    let vt = tile.vt.as_mut_ptr().cast::<f32>();
    let mut t0 = span.0 / LANES * LANES;
    while t0 <= span.1 {
        // The tile's keys that some row needs.
        let mut need = (usize::MAX, 0usize);
        for &(a, b) in parts {
            let (a, b) = (a.max(t0), b.min(t0 + LANES - 1));
            if a <= b {
                need = (need.0.min(a), need.1.max(b));
            }
        }
        if need.0 > need.1 {
            t0 += LANES;
            continue;
        }
        // SAFETY (all reads below): every key in `need` is at most some row's position, so its
        // block is in the row's table, and every table entry is below the cache's block count
        // (checked on entry); d < hd, lanes < LANES fit the buffers (hd <= MAX_HEAD_DIM).
        unsafe {
            if bs % LANES == 0 {
                // The whole tile lies in one block.
                c.kv.k_tile::<W>(geo, table[t0 / bs] as usize, t0 % bs, g, kt);
            } else {
                for lane in 0..LANES {
                    let key = t0 + lane;
                    if key < need.0 || key > need.1 {
                        for d in 0..hd {
                            *kt.add(d * LANES + lane) = 0.0;
                        }
                        continue;
                    }
                    let slot = table[key / bs] as usize * bs + key % bs;
                    for d in 0..hd {
                        *kt.add(d * LANES + lane) = c.kv.k_elem(geo, slot, g, d);
                    }
                }
            }
            for key in need.0..=need.1 {
                let slot = table[key / bs] as usize * bs + key % bs;
                c.kv.v_row::<W>(geo, slot, g, vt.add((key - t0) * hd));
            }
        }
        // SAFETY: the lanes of every row's part were written above (rows' parts lie in `need`).
        let (kts, vts) = unsafe {
            (
                std::slice::from_raw_parts(kt, hd * LANES),
                std::slice::from_raw_parts(vt, LANES * hd),
            )
        };
        #[cfg(target_arch = "x86_64")]
        if let Some(qt) = qt {
            // SAFETY: qt is only built where W::QUERY_LANES > 0: W = Avx512 (16 lanes, the CPU
            // has AVX-512F) or Avx2 (8 lanes, AVX2 and FMA), with hd * QUERY_LANES floats per
            // vector of the rows' heads (rows_task); the tile is widened above; accs[i] holds
            // group * hd floats for every row whose part is not empty.
            unsafe {
                if W::QUERY_LANES == 16 {
                    lanes_step_avx512(qt, parts, t0, group, hd, kts, vts, c.scale, accs, states)
                } else {
                    lanes_step_avx2(qt, parts, t0, group, hd, kts, vts, c.scale, accs, states)
                }
            };
            t0 += LANES;
            continue;
        }
        for (i, &(a, b)) in parts.iter().enumerate() {
            let (a, b) = (a.max(t0), b.min(t0 + LANES - 1));
            if a > b {
                continue;
            }
            let lanes = (a - t0, b - t0);
            let q = c.q_group(first + i, g);
            let (acc, st) = (&mut *accs[i], &mut states[i]);
            // Heads in fixed-size chunks so that their accumulators stay in registers.
            let mut h = 0;
            while h < group {
                h += match group - h {
                    1 => tile_step::<1>(q, h, hd, kts, vts, lanes, c.scale, acc, st),
                    2 => tile_step::<2>(q, h, hd, kts, vts, lanes, c.scale, acc, st),
                    3 => tile_step::<3>(q, h, hd, kts, vts, lanes, c.scale, acc, st),
                    _ => tile_step::<4>(q, h, hd, kts, vts, lanes, c.scale, acc, st),
                };
            }
        }
        t0 += LANES;
    }
}

/// A kernel that computes one tile for one row read in place: [`row_avx512`] or [`row_avx2`].
#[cfg(target_arch = "x86_64")]
trait InPlace {
    /// [`row_avx512::tile_step_in_place`]'s contract, for this kernel's ISA.
    #[allow(clippy::too_many_arguments)]
    unsafe fn step<T: row_avx512::TileRead + row_avx2::TileRead, const N: usize>(
        q: &[f32],
        h0: usize,
        hd: usize,
        at: T,
        lanes: (usize, usize),
        scale: f32,
        acc: &mut [f32],
        st: &mut State,
    ) -> usize;
}

#[cfg(target_arch = "x86_64")]
struct InPlaceAvx512;
#[cfg(target_arch = "x86_64")]
impl InPlace for InPlaceAvx512 {
    #[inline(always)]
    unsafe fn step<T: row_avx512::TileRead + row_avx2::TileRead, const N: usize>(
        q: &[f32],
        h0: usize,
        hd: usize,
        at: T,
        lanes: (usize, usize),
        scale: f32,
        acc: &mut [f32],
        st: &mut State,
    ) -> usize {
        row_avx512::tile_step_in_place::<T, N>(q, h0, hd, at, lanes, scale, acc, st)
    }
}

#[cfg(target_arch = "x86_64")]
struct InPlaceAvx2;
#[cfg(target_arch = "x86_64")]
impl InPlace for InPlaceAvx2 {
    #[inline(always)]
    unsafe fn step<T: row_avx512::TileRead + row_avx2::TileRead, const N: usize>(
        q: &[f32],
        h0: usize,
        hd: usize,
        at: T,
        lanes: (usize, usize),
        scale: f32,
        acc: &mut [f32],
        st: &mut State,
    ) -> usize {
        row_avx2::tile_step_in_place::<T, N>(q, h0, hd, at, lanes, scale, acc, st)
    }
}

/// [`row_in_place`] on AVX-512.
///
/// # Safety
/// As [`row_in_place`]; AVX-512F/BW/VL, F16C and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn row_in_place_avx512<S: KvSource>(
    c: &Ctx<S>,
    t: usize,
    part: (usize, usize),
    g: usize,
    acc: &mut [f32],
    st: &mut State,
) {
    row_in_place::<S, InPlaceAvx512>(c, t, part, g, acc, st)
}

/// [`row_in_place`] on AVX2.
///
/// # Safety
/// As [`row_in_place`]; AVX2, F16C and FMA; `hd` is a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_in_place_avx2<S: KvSource>(
    c: &Ctx<S>,
    t: usize,
    part: (usize, usize),
    g: usize,
    acc: &mut [f32],
    st: &mut State,
) {
    row_in_place::<S, InPlaceAvx2>(c, t, part, g, acc, st)
}

/// Keys `part` (inside one segment) of row `t`, K/V head `g`, tile by tile, read in place by
/// `P`'s kernel: what [`segment_pass`] computes for one row from widened tiles, to the bit.
/// The tile [`PREFETCH_TILES`] ahead (up to the row's last key, into its next segment) is
/// prefetched into L2.
///
/// # Safety
/// `bs % LANES == 0`; the part's keys are visible to the row; `acc` holds `group * hd` floats;
/// inlined into a function with `P`'s features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_in_place<S: KvSource, P: InPlace>(
    c: &Ctx<S>,
    t: usize,
    part: (usize, usize),
    g: usize,
    acc: &mut [f32],
    st: &mut State,
) {
    use tile_at::TileLocation;
    let (hd, group, bs, kvh) = (c.hd, c.group, c.bs, c.kvh);
    let geo = Geom { bs, kvh, hd };
    let table = c.table(t);
    let q = c.q_group(t, g);
    let (lo, hi) = part;
    let last = visible(&c.rows[t], c.window).1;
    let mut t0 = lo / LANES * LANES;
    while t0 <= hi {
        let ahead = t0 + PREFETCH_TILES * LANES;
        if ahead <= last {
            c.kv.tile_at(geo, table[ahead / bs] as usize, ahead % bs, g)
                .prefetch(hd);
        }
        let tile = c.kv.tile_at(geo, table[t0 / bs] as usize, t0 % bs, g);
        let lanes = (lo.max(t0) - t0, hi.min(t0 + LANES - 1) - t0);
        let mut h = 0;
        while h < group {
            h += match group - h {
                1 => P::step::<S::Tile, 1>(q, h, hd, tile, lanes, c.scale, acc, st),
                2 => P::step::<S::Tile, 2>(q, h, hd, tile, lanes, c.scale, acc, st),
                3 => P::step::<S::Tile, 3>(q, h, hd, tile, lanes, c.scale, acc, st),
                _ => P::step::<S::Tile, 4>(q, h, hd, tile, lanes, c.scale, acc, st),
            };
        }
        t0 += LANES;
    }
}

/// One tile for query heads `h0..h0 + N` of one row (`q` holds the row's group of heads):
/// scores of the lanes `lanes.0..=lanes.1`, the online-softmax update of `st`, and `acc +=
/// p · V` over those lanes in key order. Returns N.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
fn tile_step<const N: usize>(
    q: &[f32],
    h0: usize,
    hd: usize,
    kt: &[f32],
    vt: &[f32],
    lanes: (usize, usize),
    scale: f32,
    acc: &mut [f32],
    st: &mut State,
) -> usize {
    let q = &q[h0 * hd..(h0 + N) * hd];
    let acc = &mut acc[h0 * hd..(h0 + N) * hd];
    let kt = &kt[..hd * LANES];
    let vt = &vt[..LANES * hd];
    let (a, b) = lanes;
    let mut valid = [false; LANES];
    for (l, x) in valid.iter_mut().enumerate() {
        *x = l >= a && l <= b;
    }
    // Scores: lane-wise FMA chains over the head's elements, element d into chain d % 4.
    let mut c = [[[0f32; LANES]; 4]; N];
    let body = hd - hd % 4;
    let (qp, kp) = (q.as_ptr(), kt.as_ptr());
    let mut d = 0;
    while d < body {
        for j in 0..4 {
            // SAFETY: d + j < hd, so q[h * hd + d + j] (h < N) and kt[(d + j) * LANES + l]
            // (l < LANES) are inside the slices sized above.
            let k: &[f32; LANES] = unsafe { &*(kp.add((d + j) * LANES) as *const [f32; LANES]) };
            for h in 0..N {
                let x = unsafe { *qp.add(h * hd + d + j) };
                for l in 0..LANES {
                    c[h][j][l] = x.mul_add(k[l], c[h][j][l]);
                }
            }
        }
        d += 4;
    }
    for d in body..hd {
        let k = &kt[d * LANES..(d + 1) * LANES];
        for h in 0..N {
            let x = q[h * hd + d];
            for l in 0..LANES {
                c[h][d % 4][l] = x.mul_add(k[l], c[h][d % 4][l]);
            }
        }
    }
    let mut p = [[0f32; LANES]; N];
    for h in 0..N {
        let mut s = [0f32; LANES];
        for l in 0..LANES {
            let x = ((c[h][0][l] + c[h][1][l]) + (c[h][2][l] + c[h][3][l])) * scale;
            s[l] = if valid[l] { x } else { f32::NEG_INFINITY };
        }
        let tile_max = tree16(s, |x, y| if y > x { y } else { x });
        let (mx, sum) = (&mut st.mx[h0 + h], &mut st.sum[h0 + h]);
        let corr = raise_max(mx, tile_max);
        let new_max = *mx;
        // Exponentials of every lane (a plain loop vectorises), then the invisible ones zeroed.
        for x in s.iter_mut() {
            *x = fast_exp(*x - new_max);
        }
        for l in 0..LANES {
            p[h][l] = if valid[l] { s[l] } else { 0.0 };
        }
        *sum = *sum * corr + tree16(p[h], |x, y| x + y);
        if corr != 1.0 {
            for x in acc[h * hd..(h + 1) * hd].iter_mut() {
                *x *= corr;
            }
        }
    }
    // acc += p · V, in key order, V_CHUNK outputs per head at a time held in registers.
    let mut d0 = 0;
    while d0 < hd {
        let w = V_CHUNK.min(hd - d0);
        if w == V_CHUNK {
            let mut r = [[0f32; V_CHUNK]; N];
            for h in 0..N {
                r[h].copy_from_slice(&acc[h * hd + d0..h * hd + d0 + V_CHUNK]);
            }
            for l in a..=b {
                // SAFETY: l < LANES and d0 + V_CHUNK <= hd: inside `vt`.
                let row: &[f32; V_CHUNK] =
                    unsafe { &*(vt.as_ptr().add(l * hd + d0) as *const [f32; V_CHUNK]) };
                for h in 0..N {
                    let ph = p[h][l];
                    for x in 0..V_CHUNK {
                        r[h][x] = ph.mul_add(row[x], r[h][x]);
                    }
                }
            }
            for h in 0..N {
                acc[h * hd + d0..h * hd + d0 + V_CHUNK].copy_from_slice(&r[h]);
            }
        } else {
            for l in a..=b {
                let row = &vt[l * hd + d0..l * hd + d0 + w];
                for h in 0..N {
                    let ph = p[h][l];
                    for (x, &y) in acc[h * hd + d0..h * hd + d0 + w].iter_mut().zip(row) {
                        *x = ph.mul_add(y, *x);
                    }
                }
            }
        }
        d0 += w;
    }
    N
}

/// The online softmax's step to a tile's scores: `mx` becomes the larger of itself and
/// `tile_max`, and the factor that rescales the sum and accumulators so far is returned. First
/// tile: nothing accumulated yet, so 0 (avoids exp(-inf - -inf)); an unchanged max rescales by
/// fast_exp(0) = 1 exactly, so that exp is skipped.
#[inline(always)]
fn raise_max(mx: &mut f32, tile_max: f32) -> f32 {
    let new_max = mx.max(tile_max);
    let corr = if *mx == f32::NEG_INFINITY {
        0.0
    } else if *mx == new_max {
        1.0
    } else {
        fast_exp(*mx - new_max)
    };
    *mx = new_max;
    corr
}

/// The scalar side of one vector of query lanes in a key tile, shared by the lanes paths
/// ([`lanes_step_avx512`], [`lanes_step_avx2`]; `QL` lanes a vector): each lane's (row, head),
/// the keys of the tile it sees, its running max and sum before the tile, and afterwards its new
/// state and the runs of lanes that see the same keys.
#[cfg(target_arch = "x86_64")]
struct LaneTile<const QL: usize> {
    count: usize,
    /// Each lane's (row, head), counted up from the first: no division per lane.
    rh: [(usize, usize); QL],
    /// Each lane's visible keys in this tile, `ka..=kb` (none: ka > kb).
    ka: [i32; QL],
    kb: [i32; QL],
    mx: [f32; QL],
    sum: [f32; QL],
}

#[cfg(target_arch = "x86_64")]
impl<const QL: usize> LaneTile<QL> {
    /// Lanes `base..base + count` of `parts.len() * group`, in the tile of keys from `t0`.
    #[inline(always)]
    fn new(
        parts: &[(usize, usize)],
        t0: usize,
        group: usize,
        base: usize,
        count: usize,
        states: &[State],
    ) -> Self {
        let mut lt = LaneTile {
            count,
            rh: [(0, 0); QL],
            ka: [LANES as i32; QL],
            kb: [0; QL],
            mx: [f32::NEG_INFINITY; QL],
            sum: [0.0; QL],
        };
        let (mut i, mut h) = (base / group, base % group);
        for l in 0..count {
            lt.rh[l] = (i, h);
            let (a, b) = (parts[i].0.max(t0), parts[i].1.min(t0 + LANES - 1));
            if a <= b {
                (lt.ka[l], lt.kb[l]) = ((a - t0) as i32, (b - t0) as i32);
            }
            lt.mx[l] = states[i].mx[h];
            lt.sum[l] = states[i].sum[h];
            h += 1;
            if h == group {
                (i, h) = (i + 1, 0);
            }
        }
        lt
    }

    #[inline(always)]
    fn sees_keys(&self, l: usize) -> bool {
        self.ka[l] <= self.kb[l]
    }

    /// Stores each lane's new max and sum (lanes with no key in the tile are left as they are)
    /// and returns where each such lane's accumulator starts (null for the others).
    #[inline(always)]
    fn store_states(
        &self,
        new_max: &[f32; QL],
        new_sum: &[f32; QL],
        accs: &mut [&mut [f32]],
        states: &mut [State],
        hd: usize,
    ) -> [*mut f32; QL] {
        let mut acc_at = [std::ptr::null_mut::<f32>(); QL];
        for l in (0..self.count).filter(|&l| self.sees_keys(l)) {
            let (i, h) = self.rh[l];
            states[i].mx[h] = new_max[l];
            states[i].sum[h] = new_sum[l];
            acc_at[l] = accs[i][h * hd..(h + 1) * hd].as_mut_ptr();
        }
        acc_at
    }

    /// The runs `l..e` of at most `max_run` consecutive lanes that see the same keys, in lane
    /// order (lanes that see none are skipped). An iterator, not a callback: a closure would not
    /// inherit its caller's target features, and the intrinsics in it would become calls.
    #[inline(always)]
    fn same_key_runs(&self, max_run: usize) -> SameKeyRuns<'_, QL> {
        SameKeyRuns {
            tile: self,
            max_run,
            l: 0,
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct SameKeyRuns<'a, const QL: usize> {
    tile: &'a LaneTile<QL>,
    max_run: usize,
    l: usize,
}

#[cfg(target_arch = "x86_64")]
impl<const QL: usize> Iterator for SameKeyRuns<'_, QL> {
    type Item = (usize, usize);

    #[inline(always)]
    fn next(&mut self) -> Option<(usize, usize)> {
        let t = self.tile;
        while self.l < t.count && !t.sees_keys(self.l) {
            self.l += 1;
        }
        let l = self.l;
        if l >= t.count {
            return None;
        }
        let mut e = l + 1;
        while e < t.count && e - l < self.max_run && t.ka[e] == t.ka[l] && t.kb[e] == t.kb[l] {
            e += 1;
        }
        self.l = e;
        Some((l, e))
    }
}

/// One tile for every query lane of a row block (`qt`, transposed queries; lane = i * group +
/// h for row `first + i`, head `h`), 16 lanes at a time, with the lanes in the vector lanes:
/// the scores of one key for 16 queries are one vector, so the softmax needs no horizontal
/// reductions. Every lane's arithmetic is [`tile_step`]'s for its row and head, operation for
/// operation (the same FMA chains over the head's elements, the same [`tree16`] order over the
/// keys, the same rescale and `p · V` in key order; `fast_exp_avx512` is `fast_exp`), so a
/// row's bits do not depend on the path (`attention_rows_are_batch_invariant` compares it with
/// the portable build). Written with intrinsics: the compiler vectorised the plain version of
/// this loop nest across the head's elements, with gathers.
///
/// # Safety
/// The CPU supports AVX-512F; `qt` holds `hd * LANES` floats per 16 lanes of
/// `parts.len() * group`, `kt` and `vt` a widened tile (`hd * LANES` floats each), `accs[i]`
/// `group * hd` floats for every row whose part meets the tile.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn lanes_step_avx512(
    qt: &[f32],
    parts: &[(usize, usize)],
    t0: usize,
    group: usize,
    hd: usize,
    kt: &[f32],
    vt: &[f32],
    scale: f32,
    accs: &mut [&mut [f32]],
    states: &mut [State],
) {
    use super::swiglu::fast_exp_avx512;
    use std::arch::x86_64::*;
    let lanes = parts.len() * group;
    let kt = &kt[..hd * LANES];
    let kp = kt.as_ptr();
    for v in 0..lanes.div_ceil(LANES) {
        let base = v * LANES;
        let count = (lanes - base).min(LANES);
        let q = qt[v * hd * LANES..(v + 1) * hd * LANES].as_ptr();
        let lt = LaneTile::<LANES>::new(parts, t0, group, base, count, states);
        let (ka, kb) = (&lt.ka, &lt.kb);
        let (kav, kbv) = (
            _mm512_loadu_si512(ka.as_ptr().cast()),
            _mm512_loadu_si512(kb.as_ptr().cast()),
        );
        let mut valid = [0 as __mmask16; LANES];
        for (k, m) in valid.iter_mut().enumerate() {
            let kv = _mm512_set1_epi32(k as i32);
            *m = _mm512_cmple_epi32_mask(kav, kv) & _mm512_cmple_epi32_mask(kv, kbv);
        }
        // Scores: chain j holds elements d = j, j + 4, ... of the head, in order; then
        // ((c0 + c1) + (c2 + c3)) * scale.
        let zero = _mm512_setzero_ps();
        let mut chains = [[zero; LANES]; 4];
        for (j, chain) in chains.iter_mut().enumerate() {
            let mut acc = [zero; LANES];
            let mut d = j;
            while d < hd {
                let qv = _mm512_loadu_ps(q.add(d * LANES));
                for k in 0..LANES {
                    let kd = _mm512_set1_ps(*kp.add(d * LANES + k));
                    acc[k] = _mm512_fmadd_ps(qv, kd, acc[k]);
                }
                d += 4;
            }
            *chain = acc;
        }
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut sc = [zero; LANES];
        for k in 0..LANES {
            let x = _mm512_mul_ps(
                _mm512_add_ps(
                    _mm512_add_ps(chains[0][k], chains[1][k]),
                    _mm512_add_ps(chains[2][k], chains[3][k]),
                ),
                _mm512_set1_ps(scale),
            );
            sc[k] = _mm512_mask_blend_ps(valid[k], neg_inf, x);
        }
        // tree16's max: op(x, y) = if y > x { y } else { x }, which is max_ps(y, x).
        let mut t = sc;
        let mut n = LANES / 2;
        while n > 0 {
            for k in 0..n {
                t[k] = _mm512_max_ps(t[k + n], t[k]);
            }
            n /= 2;
        }
        let mxv = _mm512_loadu_ps(lt.mx.as_ptr());
        // mx.max(tile_max): neither is NaN.
        let new_max = _mm512_max_ps(t[0], mxv);
        let e = fast_exp_avx512(_mm512_sub_ps(mxv, new_max));
        let one = _mm512_set1_ps(1.0);
        let corr = _mm512_mask_blend_ps(_mm512_cmpeq_ps_mask(mxv, new_max), e, one);
        let corr = _mm512_mask_blend_ps(_mm512_cmpeq_ps_mask(mxv, neg_inf), corr, zero);
        let mut p = [[0f32; LANES]; LANES];
        let mut pv = [zero; LANES];
        for k in 0..LANES {
            let e = fast_exp_avx512(_mm512_sub_ps(sc[k], new_max));
            pv[k] = _mm512_maskz_mov_ps(valid[k], e);
            _mm512_storeu_ps(p[k].as_mut_ptr(), pv[k]);
        }
        let mut n = LANES / 2;
        while n > 0 {
            for k in 0..n {
                pv[k] = _mm512_add_ps(pv[k], pv[k + n]);
            }
            n /= 2;
        }
        let new_sum = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(lt.sum.as_ptr()), corr), pv[0]);
        let (mut nm, mut ns, mut cr) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
        _mm512_storeu_ps(nm.as_mut_ptr(), new_max);
        _mm512_storeu_ps(ns.as_mut_ptr(), new_sum);
        _mm512_storeu_ps(cr.as_mut_ptr(), corr);
        // The rescale of the accumulators by `cr` is done as `pv_lanes_avx512` loads them.
        let acc_at = lt.store_states(&nm, &ns, accs, states, hd);
        // acc += p · V over each lane's keys in order: up to 4 lanes with the same keys at once.
        for (l, e) in lt.same_key_runs(4) {
            let keys = (ka[l] as usize, kb[l] as usize);
            let (at, cr) = (&acc_at[l..e], &cr[l..e]);
            match e - l {
                1 => pv_lanes_avx512::<1>(at, cr, &p, l, keys, vt, hd),
                2 => pv_lanes_avx512::<2>(at, cr, &p, l, keys, vt, hd),
                3 => pv_lanes_avx512::<3>(at, cr, &p, l, keys, vt, hd),
                _ => pv_lanes_avx512::<4>(at, cr, &p, l, keys, vt, hd),
            }
        }
    }
}

/// `acc = acc * corr` where `corr != 1`, then `acc += p · V`, for N consecutive lanes from
/// `lane` that see the same keys `keys`, in key order, V_CHUNK outputs per lane at a time in
/// registers ([`tile_step`]'s rescale and loop, with N lanes for its N heads).
///
/// # Safety
/// AVX-512F; `acc[n]` points at `hd` floats that no other pointer of `acc` overlaps.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pv_lanes_avx512<const N: usize>(
    acc: &[*mut f32],
    corr: &[f32],
    p: &[[f32; LANES]; LANES],
    lane: usize,
    keys: (usize, usize),
    vt: &[f32],
    hd: usize,
) {
    use std::arch::x86_64::*;
    let (a, b) = keys;
    let vt = &vt[..LANES * hd];
    let mut d0 = 0;
    while d0 < hd {
        let w = V_CHUNK.min(hd - d0);
        if w == V_CHUNK {
            let mut r = [[_mm512_setzero_ps(); 4]; N];
            for n in 0..N {
                for x in 0..4 {
                    r[n][x] = _mm512_loadu_ps(acc[n].add(d0 + 16 * x));
                    if corr[n] != 1.0 {
                        r[n][x] = _mm512_mul_ps(r[n][x], _mm512_set1_ps(corr[n]));
                    }
                }
            }
            for k in a..=b {
                let row = vt.as_ptr().add(k * hd + d0);
                let vr = [0, 1, 2, 3].map(|x| _mm512_loadu_ps(row.add(16 * x)));
                for n in 0..N {
                    let pn = _mm512_set1_ps(p[k][lane + n]);
                    for x in 0..4 {
                        r[n][x] = _mm512_fmadd_ps(pn, vr[x], r[n][x]);
                    }
                }
            }
            for n in 0..N {
                for x in 0..4 {
                    _mm512_storeu_ps(acc[n].add(d0 + 16 * x), r[n][x]);
                }
            }
        } else {
            for n in 0..N {
                if corr[n] != 1.0 {
                    for x in 0..w {
                        *acc[n].add(d0 + x) *= corr[n];
                    }
                }
            }
            for k in a..=b {
                let row = &vt[k * hd + d0..k * hd + d0 + w];
                for n in 0..N {
                    let pn = p[k][lane + n];
                    for (x, &y) in row.iter().enumerate() {
                        let o = acc[n].add(d0 + x);
                        *o = pn.mul_add(y, *o);
                    }
                }
            }
        }
        d0 += w;
    }
}

/// [`lanes_step_avx512`] on AVX2: 8 query lanes per vector, keys scored in two halves of 8 so
/// that the accumulators fit the 16 registers. Every lane's arithmetic is [`tile_step`]'s,
/// operation for operation, as in the AVX-512 version (`fast_exp_avx2` is `fast_exp`), so a row's
/// bits do not depend on the path (`attention_rows_are_batch_invariant` checks it against the
/// portable build).
///
/// # Safety
/// The CPU supports AVX2 and FMA; `qt` holds `hd * 8` floats per 8 lanes of
/// `parts.len() * group`, `kt` and `vt` a widened tile (`hd * LANES` floats each), `accs[i]`
/// `group * hd` floats for every row whose part meets the tile.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn lanes_step_avx2(
    qt: &[f32],
    parts: &[(usize, usize)],
    t0: usize,
    group: usize,
    hd: usize,
    kt: &[f32],
    vt: &[f32],
    scale: f32,
    accs: &mut [&mut [f32]],
    states: &mut [State],
) {
    use super::swiglu::fast_exp_avx2;
    use std::arch::x86_64::*;
    const QL: usize = 8;
    let lanes = parts.len() * group;
    let kt = &kt[..hd * LANES];
    let kp = kt.as_ptr();
    for v in 0..lanes.div_ceil(QL) {
        let base = v * QL;
        let count = (lanes - base).min(QL);
        let q = qt[v * hd * QL..(v + 1) * hd * QL].as_ptr();
        let lt = LaneTile::<QL>::new(parts, t0, group, base, count, states);
        let (ka, kb) = (&lt.ka, &lt.kb);
        let (kav, kbv) = (
            _mm256_loadu_si256(ka.as_ptr().cast()),
            _mm256_loadu_si256(kb.as_ptr().cast()),
        );
        // Key k is visible to a lane where ka <= k <= kb: all ones there, zero elsewhere.
        let ones = _mm256_set1_epi32(-1);
        let mut valid = [_mm256_setzero_ps(); LANES];
        for (k, m) in valid.iter_mut().enumerate() {
            let kv = _mm256_set1_epi32(k as i32);
            let outside = _mm256_or_si256(_mm256_cmpgt_epi32(kav, kv), _mm256_cmpgt_epi32(kv, kbv));
            *m = _mm256_castsi256_ps(_mm256_xor_si256(outside, ones));
        }
        // Scores: chain j holds elements d = j, j + 4, ... of the head, in order; then
        // ((c0 + c1) + (c2 + c3)) * scale. Keys in two halves of 8 (each key's chain is the
        // same sequence of FMAs either way).
        let zero = _mm256_setzero_ps();
        let mut chains = [[zero; LANES]; 4];
        for (j, chain) in chains.iter_mut().enumerate() {
            for half in 0..2 {
                let mut acc = [zero; 8];
                let mut d = j;
                while d < hd {
                    let qv = _mm256_loadu_ps(q.add(d * QL));
                    for k in 0..8 {
                        let kd = _mm256_set1_ps(*kp.add(d * LANES + half * 8 + k));
                        acc[k] = _mm256_fmadd_ps(qv, kd, acc[k]);
                    }
                    d += 4;
                }
                chain[half * 8..half * 8 + 8].copy_from_slice(&acc);
            }
        }
        let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut sc = [zero; LANES];
        for k in 0..LANES {
            let x = _mm256_mul_ps(
                _mm256_add_ps(
                    _mm256_add_ps(chains[0][k], chains[1][k]),
                    _mm256_add_ps(chains[2][k], chains[3][k]),
                ),
                _mm256_set1_ps(scale),
            );
            sc[k] = _mm256_blendv_ps(neg_inf, x, valid[k]);
        }
        // tree16's max: op(x, y) = if y > x { y } else { x }, which is max_ps(y, x).
        let mut t = sc;
        let mut n = LANES / 2;
        while n > 0 {
            for k in 0..n {
                t[k] = _mm256_max_ps(t[k + n], t[k]);
            }
            n /= 2;
        }
        let mxv = _mm256_loadu_ps(lt.mx.as_ptr());
        let new_max = _mm256_max_ps(t[0], mxv);
        let e = fast_exp_avx2(_mm256_sub_ps(mxv, new_max));
        let one = _mm256_set1_ps(1.0);
        let corr = _mm256_blendv_ps(e, one, _mm256_cmp_ps::<_CMP_EQ_OQ>(mxv, new_max));
        let corr = _mm256_blendv_ps(corr, zero, _mm256_cmp_ps::<_CMP_EQ_OQ>(mxv, neg_inf));
        let mut p = [[0f32; QL]; LANES];
        let mut pv = [zero; LANES];
        for k in 0..LANES {
            let e = fast_exp_avx2(_mm256_sub_ps(sc[k], new_max));
            pv[k] = _mm256_and_ps(valid[k], e);
            _mm256_storeu_ps(p[k].as_mut_ptr(), pv[k]);
        }
        let mut n = LANES / 2;
        while n > 0 {
            for k in 0..n {
                pv[k] = _mm256_add_ps(pv[k], pv[k + n]);
            }
            n /= 2;
        }
        let new_sum = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(lt.sum.as_ptr()), corr), pv[0]);
        let (mut nm, mut ns, mut cr) = ([0f32; QL], [0f32; QL], [0f32; QL]);
        _mm256_storeu_ps(nm.as_mut_ptr(), new_max);
        _mm256_storeu_ps(ns.as_mut_ptr(), new_sum);
        _mm256_storeu_ps(cr.as_mut_ptr(), corr);
        let acc_at = lt.store_states(&nm, &ns, accs, states, hd);
        // acc += p · V over each lane's keys in order: up to 3 lanes with the same keys at once.
        for (l, e) in lt.same_key_runs(3) {
            let keys = (ka[l] as usize, kb[l] as usize);
            let (at, cr) = (&acc_at[l..e], &cr[l..e]);
            match e - l {
                1 => pv_lanes_avx2::<1>(at, cr, &p, l, keys, vt, hd),
                2 => pv_lanes_avx2::<2>(at, cr, &p, l, keys, vt, hd),
                _ => pv_lanes_avx2::<3>(at, cr, &p, l, keys, vt, hd),
            }
        }
    }
}

/// [`pv_lanes_avx512`] on AVX2: 32 outputs per lane at a time (4 registers each, so 3 lanes'
/// accumulators, a V row's vector and the weight fit the 16 registers).
///
/// # Safety
/// AVX2 and FMA; `acc[n]` points at `hd` floats that no other pointer of `acc` overlaps.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pv_lanes_avx2<const N: usize>(
    acc: &[*mut f32],
    corr: &[f32],
    p: &[[f32; 8]; LANES],
    lane: usize,
    keys: (usize, usize),
    vt: &[f32],
    hd: usize,
) {
    use std::arch::x86_64::*;
    const CHUNK: usize = 32;
    let (a, b) = keys;
    let vt = &vt[..LANES * hd];
    let mut d0 = 0;
    while d0 < hd {
        let w = CHUNK.min(hd - d0);
        if w == CHUNK {
            let mut r = [[_mm256_setzero_ps(); 4]; N];
            for n in 0..N {
                for x in 0..4 {
                    r[n][x] = _mm256_loadu_ps(acc[n].add(d0 + 8 * x));
                    if corr[n] != 1.0 {
                        r[n][x] = _mm256_mul_ps(r[n][x], _mm256_set1_ps(corr[n]));
                    }
                }
            }
            for k in a..=b {
                let row = vt.as_ptr().add(k * hd + d0);
                for x in 0..4 {
                    let vr = _mm256_loadu_ps(row.add(8 * x));
                    for n in 0..N {
                        let pn = _mm256_set1_ps(p[k][lane + n]);
                        r[n][x] = _mm256_fmadd_ps(pn, vr, r[n][x]);
                    }
                }
            }
            for n in 0..N {
                for x in 0..4 {
                    _mm256_storeu_ps(acc[n].add(d0 + 8 * x), r[n][x]);
                }
            }
        } else {
            for n in 0..N {
                if corr[n] != 1.0 {
                    for x in 0..w {
                        *acc[n].add(d0 + x) *= corr[n];
                    }
                }
            }
            for k in a..=b {
                let row = &vt[k * hd + d0..k * hd + d0 + w];
                for n in 0..N {
                    let pn = p[k][lane + n];
                    for (x, &y) in row.iter().enumerate() {
                        let o = acc[n].add(d0 + x);
                        *o = pn.mul_add(y, *o);
                    }
                }
            }
        }
        d0 += w;
    }
}

/// Reduces 16 lanes pairwise (lane l with l + 8, then + 4, + 2, + 1): a fixed order that
/// vectorises.
#[inline(always)]
fn tree16(mut x: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut n = LANES / 2;
    while n > 0 {
        for l in 0..n {
            x[l] = op(x[l], x[l + n]);
        }
        n /= 2;
    }
    x[0]
}

/// Naive reference: dense scores and softmax in f64 (on the stored values, widened exactly).
#[allow(clippy::too_many_arguments)]
pub fn reference(
    q: &[f32],
    rows: &[AttnRow],
    tables: &[u32],
    kv: &KvLayer,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    let (hd, kvh, bs) = (kv.head_dim, kv.kv_heads, kv.block_size);
    let group = n_heads / kvh;
    for (t, r) in rows.iter().enumerate() {
        let pos = r.pos as usize;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..n_heads {
            let g = h / group;
            let qh = &q[(t * n_heads + h) * hd..][..hd];
            let slot = |j: usize| tables[r.table_start as usize + j / bs] as usize * bs + j % bs;
            let scores: Vec<f64> = (lo..=pos)
                .map(|j| {
                    qh.iter()
                        .enumerate()
                        .map(|(d, &a)| a as f64 * kv.k_at(slot(j), g, d) as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let mut acc = 0.0;
                for (idx, j) in (lo..=pos).enumerate() {
                    acc += e[idx] * kv.v_at(slot(j), g, d) as f64;
                }
                out[(t * n_heads + h) * hd + d] = (acc / z) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::kernels::cpu::test_rng::{thread_pools, Rng};

    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Dt {
        F32,
        F16,
        Bf16,
        Q8_0,
    }

    const DTS: [Dt; 4] = [Dt::F32, Dt::F16, Dt::Bf16, Dt::Q8_0];

    /// The timing module's K/V in every format.
    pub(super) fn stored(k: Vec<f32>, v: Vec<f32>, bs: usize, kvh: usize, hd: usize) -> Stored {
        Stored::new(k, v, bs, kvh, hd)
    }

    /// K/V in every format, from the same f32 values in the f32 layouts.
    pub(super) struct Stored {
        k: Vec<f32>,
        v: Vec<f32>,
        k16: Vec<f16>,
        v16: Vec<f16>,
        kb: Vec<bf16>,
        vb: Vec<bf16>,
        kq: Vec<u8>,
        vq: Vec<u8>,
        bs: usize,
        kvh: usize,
        hd: usize,
    }

    impl Stored {
        fn new(k: Vec<f32>, v: Vec<f32>, bs: usize, kvh: usize, hd: usize) -> Stored {
            let (kq, vq) = quantized(&k, &v, bs, kvh, hd);
            Stored {
                k16: k.iter().map(|&x| f16::from_f32(x)).collect(),
                v16: v.iter().map(|&x| f16::from_f32(x)).collect(),
                kb: k.iter().map(|&x| bf16::from_f32(x)).collect(),
                vb: v.iter().map(|&x| bf16::from_f32(x)).collect(),
                k,
                v,
                kq,
                vq,
                bs,
                kvh,
                hd,
            }
        }

        /// Format `i` of [`DTS`] (f32, f16, bf16, q8_0).
        pub(super) fn layer_of(&self, i: usize) -> KvLayer<'_> {
            self.layer(DTS[i])
        }

        fn layer(&self, dt: Dt) -> KvLayer<'_> {
            let (k, v) = match dt {
                Dt::F32 => (KvData::F32(&self.k), KvData::F32(&self.v)),
                Dt::F16 => (KvData::F16(&self.k16), KvData::F16(&self.v16)),
                Dt::Bf16 => (KvData::Bf16(&self.kb), KvData::Bf16(&self.vb)),
                Dt::Q8_0 => (KvData::Q8_0(&self.kq), KvData::Q8_0(&self.vq)),
            };
            KvLayer {
                k,
                v,
                block_size: self.bs,
                kv_heads: self.kvh,
                head_dim: self.hd,
            }
        }
    }

    /// f32 K/V (the f32 layouts) quantized to q8_0 row by row, as the pool writes them.
    fn quantized(k: &[f32], v: &[f32], bs: usize, kvh: usize, hd: usize) -> (Vec<u8>, Vec<u8>) {
        let slots = k.len() / (kvh * hd);
        let f = KvLayer {
            k: KvData::F32(k),
            v: KvData::F32(v),
            block_size: bs,
            kv_heads: kvh,
            head_dim: hd,
        };
        let bytes = slots * kvh * kv_q8::row_bytes(hd);
        let (mut kq, mut vq) = (vec![0u8; bytes], vec![0u8; bytes]);
        for slot in 0..slots {
            let kr: Vec<f32> = (0..kvh * hd)
                .map(|e| f.k_at(slot, e / hd, e % hd))
                .collect();
            let vr: Vec<f32> = (0..kvh * hd)
                .map(|e| f.v_at(slot, e / hd, e % hd))
                .collect();
            kv_q8::write_k(&mut kq, slot, &kr, bs, kvh, hd);
            kv_q8::write_v(&mut vq, slot, &vr, kvh, hd);
        }
        (kq, vq)
    }

    /// The values a cache holds, as f32 K/V in the f32 layouts.
    fn dequantized(kv: &KvLayer) -> (Vec<f32>, Vec<f32>) {
        let (bs, kvh, hd) = (kv.block_size, kv.kv_heads, kv.head_dim);
        let slots = kv.k.bytes() / kv.k.row_bytes(hd) / kvh;
        let mut k = vec![0f32; slots * kvh * hd];
        let mut v = k.clone();
        for slot in 0..slots {
            for g in 0..kvh {
                for d in 0..hd {
                    k[k_index(slot, g, d, bs, kvh, hd)] = kv.k_at(slot, g, d);
                    v[kv.v_index(slot, g, d)] = kv.v_at(slot, g, d);
                }
            }
        }
        (k, v)
    }

    /// Every ISA this CPU can run.
    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Plain];
        #[cfg(target_arch = "x86_64")]
        {
            if super::super::isa::cpu().avx2 {
                v.push(Isa::Avx2);
            }
            if detect_isa() == Isa::Avx512 {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    /// Builds a cache with `seq_lens.len()` sequences on shuffled blocks, queries the given
    /// (sequence, position) rows, and compares with the f64 reference on the stored (rounded or
    /// quantized) values: every ISA, split-K planned for 1, 2 and 8 threads and never split.
    /// Returns how many of the runs used split-K.
    #[allow(clippy::too_many_arguments)]
    fn run_dt(
        dt: Dt,
        n_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        bs: usize,
        seq_lens: &[usize],
        queries: &[(usize, usize)],
        window: Option<usize>,
        seed: u64,
    ) -> usize {
        let mut rng = Rng(seed);
        let blocks_per: Vec<usize> = seq_lens.iter().map(|l| l.div_ceil(bs)).collect();
        // A few unused blocks.
        let num_blocks: usize = blocks_per.iter().sum::<usize>() + 3;
        // Shuffled physical block ids, so tables are non-contiguous.
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            let j = (rng.next_u() % (i as u64 + 1)) as usize;
            ids.swap(i, j);
        }
        let mut tables = Vec::new();
        let mut starts = Vec::new();
        for &b in &blocks_per {
            starts.push(tables.len());
            let st = tables.len();
            tables.extend_from_slice(&ids[st..st + b]);
        }
        let n = num_blocks * bs * kv_heads * head_dim;
        let k: Vec<f32> = (0..n).map(|_| rng.next() * 2.0).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.next()).collect();
        let stored = Stored::new(k, v, bs, kv_heads, head_dim);
        let kv = stored.layer(dt);
        let rows: Vec<AttnRow> = queries
            .iter()
            .map(|&(sq, pos)| AttnRow {
                pos: pos as u32,
                table_start: starts[sq] as u32,
                table_len: blocks_per[sq] as u32,
            })
            .collect();
        let q: Vec<f32> = (0..rows.len() * n_heads * head_dim)
            .map(|_| rng.next() * 2.0)
            .collect();
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut want = vec![0.0; q.len()];
        reference(&q, &rows, &tables, &kv, n_heads, scale, window, &mut want);

        let mut got = vec![f32::NAN; q.len()];
        let mut scratch = AttnScratch::new(rows.len(), n_heads, head_dim, 2);
        paged_attention(
            &q,
            &rows,
            &tables,
            &kv,
            n_heads,
            scale,
            window,
            &mut got,
            &mut scratch,
        );
        let check = |got: &[f32], what: &str| {
            for i in 0..q.len() {
                // Outputs are convex combinations of values in [-1, 1]: absolute tolerance.
                assert!(
                    (got[i] - want[i]).abs() <= 2e-5,
                    "{what} i={i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
        };
        check(&got, "dispatched");

        let mut splits = 0;
        for isa in isas() {
            let mut unsplit = vec![f32::NAN; q.len()];
            paged_attention_with(
                &q,
                &rows,
                &tables,
                &kv,
                n_heads,
                scale,
                window,
                &mut unsplit,
                &mut scratch,
                isa,
                Split::Never,
            );
            check(&unsplit, &format!("{isa:?} unsplit"));
            for threads in [1, 2, 8] {
                let mut scratch = AttnScratch::new(rows.len(), n_heads, head_dim, threads);
                let mut split = vec![f32::NAN; q.len()];
                paged_attention_with(
                    &q,
                    &rows,
                    &tables,
                    &kv,
                    n_heads,
                    scale,
                    window,
                    &mut split,
                    &mut scratch,
                    isa,
                    Split::Auto,
                );
                let planned = {
                    let c = Ctx {
                        q: &q,
                        rows: &rows,
                        tables: &tables,
                        kv: Elems::<f32> { k: &[], v: &[] },
                        bs,
                        kvh: kv_heads,
                        hd: head_dim,
                        n_heads,
                        group: n_heads / kv_heads,
                        scale,
                        window,
                    };
                    plan_segments(&c, &mut scratch)
                };
                splits += planned as usize;
                check(&split, &format!("{isa:?} split-K for {threads} threads"));
                // Split and unsplit agree to the bit.
                for i in 0..q.len() {
                    assert_eq!(
                        split[i].to_bits(),
                        unsplit[i].to_bits(),
                        "{isa:?} {threads} threads: split {} vs unsplit {} at {i}",
                        split[i],
                        unsplit[i]
                    );
                }
            }
        }
        splits
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        n_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        bs: usize,
        seq_lens: &[usize],
        queries: &[(usize, usize)],
        window: Option<usize>,
        seed: u64,
    ) {
        for dt in DTS {
            run_dt(
                dt, n_heads, kv_heads, head_dim, bs, seq_lens, queries, window, seed,
            );
        }
    }

    #[test]
    fn gqa_block16_several_sequences() {
        run(
            6,
            2,
            32,
            16,
            &[100, 37, 1],
            &[(0, 99), (1, 36), (2, 0), (0, 50), (1, 16)],
            None,
            1,
        );
    }

    #[test]
    fn gqa_block4_odd_positions() {
        run(
            6,
            2,
            32,
            4,
            &[70, 9],
            &[(0, 69), (1, 8), (0, 3), (1, 4)],
            None,
            2,
        );
    }

    #[test]
    fn mha_and_odd_head_dim() {
        run(
            4,
            4,
            32,
            16,
            &[45, 80],
            &[(0, 44), (1, 79), (1, 31)],
            None,
            3,
        );
        run(3, 1, 67, 4, &[33], &[(0, 32), (0, 0)], None, 4);
        run(2, 1, 40, 16, &[60], &[(0, 59)], None, 9);
    }

    #[test]
    fn sliding_window() {
        run(
            6,
            2,
            32,
            16,
            &[120, 40],
            &[(0, 119), (1, 39), (0, 10), (0, 64)],
            Some(33),
            5,
        );
        run(4, 4, 16, 4, &[50], &[(0, 49), (0, 5)], Some(1), 6);
        run(6, 3, 32, 4, &[50], &[(0, 49), (0, 47)], Some(48), 7);
    }

    #[test]
    fn long_context_many_tiles() {
        // Many tiles with a rising running max exercise the rescaling.
        run(2, 1, 8, 4, &[200], &[(0, 199)], None, 8);
    }

    #[test]
    fn split_k_long_contexts() {
        for dt in DTS {
            // Decode-shaped GQA (smollm: 9 heads on 3 K/V heads, head_dim 64), 3000 keys.
            let n = run_dt(dt, 9, 3, 64, 16, &[3000], &[(0, 2999)], None, 11);
            assert!(n > 0, "split-K never planned");
            // Two decode rows of different lengths, block size 4.
            let n = run_dt(
                dt,
                6,
                2,
                32,
                4,
                &[3000, 700],
                &[(0, 2999), (1, 699)],
                None,
                12,
            );
            assert!(n > 0);
            // Sliding window with split-K: 1000 of 3000 keys visible.
            let n = run_dt(dt, 9, 3, 64, 16, &[3000], &[(0, 2999)], Some(1000), 13);
            assert!(n > 0);
            // MHA, odd head_dim.
            let n = run_dt(dt, 4, 4, 40, 16, &[1500], &[(0, 1499)], None, 14);
            assert!(n > 0);
        }
    }

    /// Attention over q8_0 K/V gives the bits of attention over its dequantized f32 copy (the
    /// widening is exact), on every ISA, split-K or not, for block sizes on each tile path (16,
    /// 32: a tile inside a block; 4: key by key), head dims with a short last group (16, 40),
    /// and a window; and its error against f32 K/V is what 8 bits allow.
    #[test]
    fn q8_0_attention_is_the_attention_of_its_dequantized_values() {
        // (n_heads, kv_heads, head_dim, block_size, sequence lengths, window)
        type Case = (usize, usize, usize, usize, &'static [usize], Option<usize>);
        let cases: [Case; 5] = [
            (9, 3, 64, 16, &[3000, 37], None),
            (6, 2, 40, 4, &[300, 70], Some(50)),
            (4, 2, 16, 32, &[700], None),
            (8, 1, 128, 16, &[129, 1], None),
            (2, 2, 67, 16, &[200], Some(17)),
        ];
        for (seed, (n_heads, kvh, hd, bs, seq_lens, window)) in cases.into_iter().enumerate() {
            let mut rng = Rng(90 + seed as u64);
            let num_blocks: usize = seq_lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 1;
            let mut tables: Vec<u32> = (0..num_blocks as u32).collect();
            for i in (1..tables.len()).rev() {
                let j = (rng.next_u() % (i as u64 + 1)) as usize;
                tables.swap(i, j);
            }
            let n = num_blocks * bs * kvh * hd;
            let k: Vec<f32> = (0..n).map(|_| rng.next() * 3.0).collect();
            let v: Vec<f32> = (0..n).map(|_| rng.next()).collect();
            let stored = Stored::new(k, v, bs, kvh, hd);
            let q8 = stored.layer(Dt::Q8_0);
            let (dk, dv) = dequantized(&q8);
            let deq = KvLayer {
                k: KvData::F32(&dk),
                v: KvData::F32(&dv),
                ..stored.layer(Dt::F32)
            };
            // Every position of each sequence's last tiles, and a few early ones.
            let mut rows = Vec::new();
            let mut start = 0;
            for &len in seq_lens {
                let table_len = len.div_ceil(bs) as u32;
                for pos in (0..len).rev().take(20).chain([0, len / 3]) {
                    rows.push(AttnRow {
                        pos: pos as u32,
                        table_start: start,
                        table_len,
                    });
                }
                start += table_len;
            }
            let q: Vec<f32> = (0..rows.len() * n_heads * hd)
                .map(|_| rng.next() * 2.0)
                .collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let attend = |kv: &KvLayer, isa: Isa, split: Split, threads: usize| {
                let mut out = vec![f32::NAN; q.len()];
                let mut scratch = AttnScratch::new(rows.len(), n_heads, hd, threads);
                paged_attention_with(
                    &q,
                    &rows,
                    &tables,
                    kv,
                    n_heads,
                    scale,
                    window,
                    &mut out,
                    &mut scratch,
                    isa,
                    split,
                );
                out
            };
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let want = bits(&attend(&deq, Isa::Plain, Split::Never, 1));
            for isa in isas() {
                for (split, threads) in [(Split::Never, 2), (Split::Auto, 8)] {
                    let what = format!("case {seed}, {isa:?}, {split:?}");
                    assert_eq!(bits(&attend(&q8, isa, split, threads)), want, "{what}");
                    assert_eq!(bits(&attend(&deq, isa, split, threads)), want, "{what}");
                }
            }
            // Against f32 K/V: outputs are convex combinations of V in [-1, 1], each off by
            // at most amax/254 <= 1/254 in V, plus what the rounded keys move the weights.
            let exact = attend(&stored.layer(Dt::F32), Isa::Plain, Split::Never, 1);
            let got = attend(&q8, Isa::Plain, Split::Never, 1);
            let worst = exact
                .iter()
                .zip(&got)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst < 0.03, "case {seed}: q8_0 off by {worst}");
        }
    }

    #[test]
    fn split_k_plans_cover_the_keys() {
        let rows = [
            AttnRow {
                pos: 2999,
                table_start: 0,
                table_len: 188,
            },
            AttnRow {
                pos: 99,
                table_start: 0,
                table_len: 188,
            },
        ];
        let c = Ctx {
            q: &[],
            rows: &rows,
            tables: &[],
            kv: Elems::<f32> { k: &[], v: &[] },
            bs: 16,
            kvh: 3,
            hd: 64,
            n_heads: 9,
            group: 3,
            scale: 1.0,
            window: None,
        };
        let mut scratch = AttnScratch::new(4, 9, 64, 2);
        assert!(plan_segments(&c, &mut scratch));
        // 6 tasks for 2 threads: the long row in its fixed segments of 128 keys (the last one
        // partial); the short one whole.
        let mut long: Vec<(u32, u32)> = (0..23).map(|j| (128 * j, 128 * j + 127)).collect();
        long.push((2944, 2999));
        for g in 0..3u32 {
            let segs: Vec<_> = scratch
                .segments
                .iter()
                .filter(|s| s.t == 0 && s.g == g)
                .map(|s| (s.lo, s.hi))
                .collect();
            assert_eq!(segs, long);
            let short: Vec<_> = scratch
                .segments
                .iter()
                .filter(|s| s.t == 1 && s.g == g)
                .map(|s| (s.lo, s.hi))
                .collect();
            assert_eq!(short, vec![(0, 99)]);
        }
        // A sliding window cuts the first segment, not the grid.
        let c = Ctx {
            window: Some(1000),
            ..c
        };
        assert!(plan_segments(&c, &mut scratch));
        let segs: Vec<_> = scratch
            .segments
            .iter()
            .filter(|s| s.t == 0 && s.g == 0)
            .map(|s| (s.lo, s.hi))
            .collect();
        assert_eq!(segs[..2], [(2000, 2047), (2048, 2175)]);
        assert_eq!(segs.last(), Some(&(2944, 2999)));
        // Enough tasks already: no split.
        let mut scratch = AttnScratch::new(4, 9, 64, 1);
        assert!(!plan_segments(&c, &mut scratch));
    }

    /// A row's output is bitwise the same alone and in batches of 1 to 40 rows (decode rows of
    /// other sequences and runs of consecutive prefill rows, short and long, which share tiles
    /// in row blocks), whichever way the segments run (split-K planned for 1, 2 or 8 threads, or
    /// never) and on 1 to 3 threads, and on every ISA the same as in the portable build: long
    /// (3000-key) and short target rows, with and without a sliding window, K/V in every
    /// format (f32, f16, bf16, q8_0).
    #[test]
    fn attention_rows_are_batch_invariant() {
        // Other rows to mix in: decode rows of every sequence, then a prefill run of sequence 1.
        let mut others: Vec<(usize, usize)> = vec![(0, 2500), (1, 699), (2, 299), (3, 44)];
        others.extend((600..640).map(|p| (1, p)));
        // (1, 640): a position at a tile's first key, so that in the last tile it sees one key
        // (a lanes path's edge).
        let targets = [(0usize, 2999usize), (2, 130), (3, 40), (1, 640)];
        batch_invariance(&[3000, 700, 300, 45], &targets, &others, &DTS, Some(1000));
    }

    /// The same at long context: a decode row at 16,400 keys (129 segments of split-K), with
    /// rows of a short sequence and a prefill run beside it, in the K/V formats long contexts
    /// use (f16, q8_0), without a window (the segments are the same code at any length).
    #[test]
    fn attention_rows_are_batch_invariant_at_16k() {
        let mut others: Vec<(usize, usize)> = vec![(0, 2000), (1, 699)];
        others.extend((600..620).map(|p| (1, p)));
        batch_invariance(
            &[16_400, 700],
            &[(0, 16_399)],
            &others,
            &[Dt::F16, Dt::Q8_0],
            None,
        );
    }

    /// A row read in place (decode, split-K segments) gives the portable build's bits for every
    /// group size the kernels unroll (1 to 4 heads, and 5 = 4 + 1), head dimensions that are
    /// and are not a multiple of 8 (the AVX2 kernel's condition), blocks of 16 and 32 keys, with
    /// and without split-K, in every K/V format.
    #[test]
    fn in_place_rows_equal_the_portable_build() {
        let mut rng = Rng(77);
        for (group, hd, bs) in [
            (1, 64, 16),
            (2, 128, 32),
            (4, 64, 16),
            (5, 40, 16),
            (5, 72, 32),
        ] {
            let (kvh, len) = (2usize, 700usize);
            let n_heads = group * kvh;
            let blocks = len.div_ceil(bs);
            // The blocks in reverse: the table is not the identity.
            let tables: Vec<u32> = (0..blocks as u32).rev().collect();
            let n = blocks * bs * kvh * hd;
            let k: Vec<f32> = (0..n).map(|_| rng.next() * 2.0).collect();
            let v: Vec<f32> = (0..n).map(|_| rng.next()).collect();
            let stored = Stored::new(k, v, bs, kvh, hd);
            let q: Vec<f32> = (0..n_heads * hd).map(|_| rng.next() * 2.0).collect();
            // A position inside a tile, so the last tile has invisible lanes.
            let rows = [AttnRow {
                pos: (len - 6) as u32,
                table_start: 0,
                table_len: blocks as u32,
            }];
            let scale = 1.0 / (hd as f32).sqrt();
            for dt in DTS {
                let kv = stored.layer(dt);
                let run = |isa: Isa, split: Split| {
                    let mut out = vec![f32::NAN; q.len()];
                    let mut scratch = AttnScratch::new(1, n_heads, hd, 2);
                    paged_attention_with(
                        &q,
                        &rows,
                        &tables,
                        &kv,
                        n_heads,
                        scale,
                        None,
                        &mut out,
                        &mut scratch,
                        isa,
                        split,
                    );
                    out
                };
                let portable = run(Isa::Plain, Split::Never);
                for isa in isas() {
                    for split in [Split::Never, Split::Auto] {
                        let got = run(isa, split);
                        for (i, (a, b)) in portable.iter().zip(&got).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{isa:?} {split:?} {dt:?} group {group} hd {hd} bs {bs} at {i}: \
                                 {b} vs the portable {a}"
                            );
                        }
                    }
                }
            }
        }
    }

    fn batch_invariance(
        seq_lens: &[usize],
        targets: &[(usize, usize)],
        others: &[(usize, usize)],
        dts: &[Dt],
        window: Option<usize>,
    ) {
        let (n_heads, kvh, hd, bs) = (9usize, 3usize, 64usize, 16usize);
        let mut rng = Rng(31);
        let blocks_per: Vec<usize> = seq_lens.iter().map(|l| l.div_ceil(bs)).collect();
        let num_blocks: usize = blocks_per.iter().sum();
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            let j = (rng.next_u() % (i as u64 + 1)) as usize;
            ids.swap(i, j);
        }
        let mut starts = Vec::new();
        let mut st = 0;
        for &b in &blocks_per {
            starts.push(st);
            st += b;
        }
        let len = num_blocks * bs * kvh * hd;
        let k: Vec<f32> = (0..len).map(|_| rng.next() * 2.0).collect();
        let v: Vec<f32> = (0..len).map(|_| rng.next()).collect();
        let stored = Stored::new(k, v, bs, kvh, hd);
        let row = |sq: usize, pos: usize| AttnRow {
            pos: pos as u32,
            table_start: starts[sq] as u32,
            table_len: blocks_per[sq] as u32,
        };
        // Queries are drawn per (sequence, position): a row brings the same q into any batch.
        let qrow = |sq: usize, pos: usize| -> Vec<f32> {
            let mut r = Rng(1000 * sq as u64 + pos as u64 + 1);
            (0..n_heads * hd).map(|_| r.next() * 2.0).collect()
        };
        let pools = thread_pools(&[1, 2, 3]);
        let scale = 1.0 / (hd as f32).sqrt();
        for &dt in dts {
            let kv = stored.layer(dt);
            // bf16 widens as f16 does (one more exact conversion): no window, to save time.
            let windows = match (dt, window) {
                (Dt::Bf16, _) | (_, None) => vec![None],
                (_, Some(w)) => vec![None, Some(w)],
            };
            for window in windows {
                for isa in isas() {
                    for &target in targets {
                        let tq = qrow(target.0, target.1);
                        let solo = |isa: Isa, split: Split| {
                            let mut out = vec![f32::NAN; tq.len()];
                            paged_attention_with(
                                &tq,
                                &[row(target.0, target.1)],
                                &ids,
                                &kv,
                                n_heads,
                                scale,
                                window,
                                &mut out,
                                &mut AttnScratch::new(1, n_heads, hd, 2),
                                isa,
                                split,
                            );
                            out
                        };
                        let alone = solo(isa, Split::Auto);
                        // The instruction set changes speed, not bits: the portable build
                        // gives the same row.
                        let portable = solo(Isa::Plain, Split::Never);
                        assert!(
                            portable
                                .iter()
                                .zip(&alone)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa:?} {dt:?} K/V, window {window:?}: row {target:?} differs from \
                             the portable build"
                        );
                        // The target at a varying place among size - 1 others.
                        let mut batches: Vec<(Vec<(usize, usize)>, usize)> = Vec::new();
                        for (bi, &size) in [1usize, 2, 3, 5, 8, 13, 24, 40].iter().enumerate() {
                            let at = (bi * 7) % size;
                            let mut batch: Vec<(usize, usize)> = others
                                .iter()
                                .cycle()
                                .skip(bi)
                                .take(size - 1)
                                .copied()
                                .collect();
                            batch.insert(at, target);
                            batches.push((batch, at));
                        }
                        // In a run of consecutive rows of its own sequence (a prefill chunk),
                        // sharing every tile with its neighbours in a row block, at each place.
                        let (sq, pos) = target;
                        for before in [1usize, 3, 7, 8, 12] {
                            let first = pos.saturating_sub(before);
                            let last = (pos + 5).min(seq_lens[sq] - 1);
                            batches.push(((first..=last).map(|p| (sq, p)).collect(), pos - first));
                        }
                        for (batch, at) in batches {
                            let size = batch.len();
                            let rows: Vec<AttnRow> =
                                batch.iter().map(|&(sq, p)| row(sq, p)).collect();
                            let q: Vec<f32> =
                                batch.iter().flat_map(|&(sq, p)| qrow(sq, p)).collect();
                            let runs = [(1, Split::Auto), (2, Split::Auto), (8, Split::Auto)]
                                .into_iter()
                                .chain([(2, Split::Never)]);
                            for (pi, (threads, split)) in runs.enumerate() {
                                let mut got = vec![f32::NAN; q.len()];
                                let mut scratch = AttnScratch::new(size, n_heads, hd, threads);
                                pools[pi % 3].install(|| {
                                    paged_attention_with(
                                        &q,
                                        &rows,
                                        &ids,
                                        &kv,
                                        n_heads,
                                        scale,
                                        window,
                                        &mut got,
                                        &mut scratch,
                                        isa,
                                        split,
                                    )
                                });
                                let w = n_heads * hd;
                                let same = got[at * w..(at + 1) * w]
                                    .iter()
                                    .zip(&alone)
                                    .all(|(a, b)| a.to_bits() == b.to_bits());
                                assert!(
                                    same,
                                    "{isa:?} {dt:?} K/V, window {window:?}: row {target:?} \
                                     differs in a batch of {size} (at {at}), split-K for \
                                     {threads} threads, {split:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Speed check (not run by default): `cargo test --release --lib -- --ignored --nocapture
/// timing`. Decode attention (one row, smollm's 9 heads on 3 K/V heads of 64) at contexts 512,
/// 2048 and 8192 in every K/V format, the formats interleaved round by round and each figure the
/// fastest call of its format (a busy moment of a shared machine slows every format alike, and
/// the fastest call is the one it did not touch); the median of the rounds' fastest beside it.
#[cfg(test)]
mod timing {
    use super::*;
    use std::time::Instant;

    #[test]
    #[ignore]
    fn timing_decode_attention() {
        let (n_heads, kvh, hd, bs) = (9usize, 3usize, 64usize, 16usize);
        let threads = rayon::current_num_threads();
        for &ctx in &[512usize, 2048, 8192] {
            let blocks = ctx / bs;
            let len = blocks * bs * kvh * hd;
            let k: Vec<f32> = (0..len).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
            let v: Vec<f32> = (0..len).map(|i| (i % 7) as f32 * 0.02 - 0.06).collect();
            let stored = tests::stored(k, v, bs, kvh, hd);
            let tables: Vec<u32> = (0..blocks as u32).rev().collect();
            let rows = [AttnRow {
                pos: ctx as u32 - 1,
                table_start: 0,
                table_len: blocks as u32,
            }];
            let q = vec![0.1f32; n_heads * hd];
            let mut out = vec![0.0f32; n_heads * hd];
            let mut scratch = AttnScratch::new(1, n_heads, hd, threads);
            let names = ["f32", "f16", "bf16", "q8_0"];
            let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
            for _ in 0..15 {
                for (f, round) in rounds.iter_mut().enumerate() {
                    let kv = stored.layer_of(f);
                    let mut best = f64::INFINITY;
                    for _ in 0..40 {
                        let t = Instant::now();
                        paged_attention(
                            &q,
                            &rows,
                            &tables,
                            &kv,
                            n_heads,
                            0.125,
                            None,
                            &mut out,
                            &mut scratch,
                        );
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    round.push(best);
                }
            }
            for (f, round) in rounds.iter_mut().enumerate() {
                round.sort_by(f64::total_cmp);
                let kv = stored.layer_of(f);
                let bytes = kv.k.bytes() + kv.v.bytes();
                println!(
                    "attention ctx {ctx} {}: {:.1} us (median of rounds {:.1} us), {:.1} GB/s of \
                     K/V",
                    names[f],
                    round[0] * 1e6,
                    round[round.len() / 2] * 1e6,
                    bytes as f64 / round[0] / 1e9
                );
            }
        }
    }
}
