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
//! AVX-512 a full block of rows computes the tile for 16 (row, query head) lanes at a time with
//! the lanes in the vector lanes ([`lanes_step_avx512`]), so the online softmax is vertical too;
//! each lane's arithmetic is the row-by-row path's, operation for operation. On AVX-512 and
//! AVX2, a decode row and the rows of a shorter block (a verification of drafts) read each
//! tile in place instead, converting as they compute ([`rows_in_place`], [`reads_in_place`]).
//!
//! **Batch invariance.** A row's visible keys are cut into fixed segments by absolute key
//! position (`SEGMENT` keys, aligned to multiples of `SEGMENT`), each segment's softmax state is
//! computed from scratch over its tiles, and the states are merged in key order. That arithmetic
//! depends only on the row (its position, window, queries and cache), never on which rows share
//! its tiles, the thread count or the instruction set (FMA rounds once everywhere, and no step
//! reassociates): batches with few (block of rows, K/V head) tasks (decode rows, a verification
//! of drafts, a short new turn over a long history) run the segments in parallel (split-K, as
//! in flash-decoding; a task is one segment of a block of rows) so that every thread has work;
//! bigger batches run one task per (block of rows, K/V head) that walks its segments in order.
//! A batch whose row blocks all read their tiles in place runs split-K wherever its partial
//! states fit the scratch, a task taking the segment for all of a block's K/V heads
//! ([`task_heads`]): one head's share of a block is a slice of it (K) or short
//! rows strided through it (V), and a task per head read the cache as scattered pieces. All
//! give the same bits.

#[cfg(target_arch = "x86_64")]
mod in_place;
#[cfg(target_arch = "x86_64")]
mod lanes;
#[cfg(target_arch = "x86_64")]
mod lanes_avx2;
#[cfg(target_arch = "x86_64")]
mod lanes_avx512;
#[cfg(target_arch = "x86_64")]
mod row_avx2;
#[cfg(target_arch = "x86_64")]
mod row_avx512;
#[cfg(target_arch = "x86_64")]
mod tile_at;
#[cfg(target_arch = "x86_64")]
mod widen_x86;

#[cfg(target_arch = "x86_64")]
use in_place::*;
#[cfg(target_arch = "x86_64")]
use lanes::*;
#[cfg(target_arch = "x86_64")]
use lanes_avx2::*;
#[cfg(target_arch = "x86_64")]
use lanes_avx512::*;
#[cfg(target_arch = "x86_64")]
use widen_x86::*;

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
/// Segments run as parallel tasks (split-K) while there are fewer than this many (block of
/// rows, K/V head) tasks per thread.
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

/// One split-K segment: keys `lo..=hi` (inside one segment of the grid) of the row block
/// `t..t + n`, K/V head `g`; its rows' partial states go to `parts[at..at + n * slot]`.
/// One split-K task: keys `lo..=hi` (inside one segment) of the row block `t..t + n`, K/V
/// heads `g..g + gn`; its partial states at `at` in [`AttnScratch::parts`], `[head][row]`.
#[derive(Clone, Copy, Debug, Default)]
struct Segment {
    t: u32,
    n: u32,
    g: u32,
    gn: u32,
    lo: u32,
    hi: u32,
    at: u32,
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

    /// The keys any of rows `first..first + n` sees: `lo..=hi`.
    fn block_span(&self, first: usize, n: usize) -> (usize, usize) {
        let spans = self.rows[first..first + n]
            .iter()
            .map(|r| visible(r, self.window));
        spans.fold((usize::MAX, 0), |(lo, hi), (a, b)| (lo.min(a), hi.max(b)))
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

/// The output rows of the unsplit path (or the split path's partial states), written by tasks
/// that each own distinct slices.
#[derive(Clone, Copy)]
struct OutRows(*mut f32);
// SAFETY: tasks write disjoint slices (see `run`); the pointer outlives the parallel loop.
unsafe impl Send for OutRows {}
unsafe impl Sync for OutRows {}

impl OutRows {
    /// `len` floats from float `at`.
    ///
    /// # Safety
    /// In bounds, and no other live reference to them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

fn run<S: KvSource>(
    c: &Ctx<S>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    isa: Isa,
    split: Split,
) {
    let (hd, group) = (c.hd, c.group);
    plan_row_blocks(c, &mut scratch.blocks);
    if split == Split::Auto && plan_segments(c, scratch, isa) {
        let slot = group * (hd + 2);
        let AttnScratch {
            segments, parts, ..
        } = scratch;
        let ptr = OutRows(parts.as_mut_ptr());
        segments.par_iter().for_each(|s| {
            // SAFETY: plan_segments lays the segments' slices of `parts` end to end, inside it;
            // each task writes its own.
            let p = unsafe { ptr.slice(s.at as usize, (s.gn * s.n) as usize * slot) };
            dispatch(isa, c, Task::Segment { seg: *s, parts: p });
        });
        // Each row's segments merged in key order: those of one (row block, span of K/V heads)
        // are consecutive, in key order; a row skips those it does not reach.
        let part = |p: &[f32]| {
            let mut st = State::EMPTY;
            st.mx[..group].copy_from_slice(&p[group * hd..group * hd + group]);
            st.sum[..group].copy_from_slice(&p[group * hd + group..slot]);
            st
        };
        let n = segments.len();
        let mut i = 0;
        while i < n {
            let s0 = segments[i];
            let mut e = i + 1;
            while e < n && segments[e].t == s0.t && segments[e].g == s0.g {
                e += 1;
            }
            let rows = s0.n as usize;
            for (j, r) in (0..s0.gn as usize).flat_map(|j| (0..rows).map(move |r| (j, r))) {
                let (t, g) = (s0.t as usize + r, s0.g as usize + j);
                let (lo, hi) = visible(&c.rows[t], c.window);
                let o = &mut out[(t * c.n_heads + g * group) * hd..][..group * hd];
                let mut state: Option<State> = None;
                for s in &segments[i..e] {
                    let (a, b) = segment(lo, hi, s.lo as usize / SEGMENT);
                    if a > b {
                        continue;
                    }
                    let p = &parts[s.at as usize + (j * rows + r) * slot..][..slot];
                    match &mut state {
                        None => {
                            o.copy_from_slice(&p[..group * hd]);
                            state = Some(part(p));
                        }
                        Some(st) => combine(o, st, &p[..group * hd], &part(p), group, hd),
                    }
                }
                // Every row sees its own position, inside its block's segments.
                debug_assert!(state.is_some());
                if let Some(st) = state {
                    finish(o, &st, group, hd);
                }
            }
            i = e;
        }
        return;
    }
    // One task per (block of consecutive rows of a sequence, K/V head).
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

/// K/V heads per split-K task for a row block of `n` rows on `isa`: all of them (as many as the
/// rows leave room for in a task's arrays) where its rows read their tiles in place, else one.
fn task_heads<S>(c: &Ctx<S>, isa: Isa, n: usize) -> usize {
    let in_place = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => reads_in_place::<Avx512, S>(c, n),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => reads_in_place::<Avx2, S>(c, n),
        Isa::Plain => false,
    };
    if in_place {
        c.kvh.min(ROW_BLOCK / n.max(1)).max(1)
    } else {
        1
    }
}

/// Fills `scratch.segments` with the split-K plan: every row block's (`scratch.blocks`, from
/// [`plan_row_blocks`]) segments, per span of [`task_heads`] K/V heads (fewer where the
/// segments are too few to give every thread [`TASKS_PER_THREAD`] tasks), in key order, and
/// where each one's partial states go in `scratch.parts`. False when split-K does not pay
/// (enough tasks already, or no block with two segments, unless every block takes its heads
/// together) or does not fit the scratch.
fn plan_segments<S>(c: &Ctx<S>, scratch: &mut AttnScratch, isa: Isa) -> bool {
    let heads = |n: usize| task_heads(c, isa, n);
    if c.rows.is_empty() || c.rows.len() > scratch.max_rows {
        return false;
    }
    let AttnScratch {
        threads,
        segments,
        parts,
        blocks,
        ..
    } = scratch;
    // Row blocks whose heads go together read their blocks of the cache whole, which pays
    // even where the unsplit plan has enough tasks.
    let together = blocks.iter().all(|&(_, n)| heads(n as usize) > 1);
    let tasks = blocks.len() * c.kvh;
    if tasks >= TASKS_PER_THREAD * *threads && !together {
        return false;
    }
    let slot = c.group * (c.hd + 2);
    let seg_count = |first: u32, n: u32| {
        let (lo, hi) = c.block_span(first as usize, n as usize);
        segment_range(lo, hi).count()
    };
    // Heads per task at most what leaves TASKS_PER_THREAD tasks per thread: a short context's
    // few segments would otherwise leave a thread idle.
    let all: usize = blocks.iter().map(|&(first, n)| seg_count(first, n)).sum();
    let cap = (c.kvh * all / (TASKS_PER_THREAD * *threads)).max(1);
    let span = |n: u32| heads(n as usize).min(cap);
    let (mut total, mut per_head, mut floats) = (0, 0, 0);
    for &(first, n) in blocks.iter() {
        let count = seg_count(first, n);
        per_head += count * c.kvh;
        total += count * c.kvh.div_ceil(span(n));
        floats += count * c.kvh * n as usize * slot;
    }
    if (per_head == tasks && !together) || floats > parts.len() || total > segments.capacity() {
        return false;
    }
    segments.clear();
    let mut at = 0;
    for &(first, n) in blocks.iter() {
        let (lo, hi) = c.block_span(first as usize, n as usize);
        let span = span(n);
        for g in (0..c.kvh).step_by(span) {
            let gn = span.min(c.kvh - g);
            for j in segment_range(lo, hi) {
                let (a, b) = segment(lo, hi, j);
                segments.push(Segment {
                    t: first,
                    n,
                    g: g as u32,
                    gn: gn as u32,
                    lo: a as u32,
                    hi: b as u32,
                    at: at as u32,
                });
                at += gn * n as usize * slot;
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

/// A K/V element format, widened to f32 exactly (read by the x86-64 kernels only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum ElemKind {
    F32,
    F16,
    Bf16,
}

/// A K/V element type.
trait KvElem: Copy + Send + Sync {
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
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
    /// One split-K segment of a row block: each row's unnormalised accumulators and softmax
    /// state into its slot of `parts` (`[group * hd acc | group max | group sum]`).
    Segment { seg: Segment, parts: &'a mut [f32] },
}

/// Runs `task` compiled for `isa`.
fn dispatch<S: KvSource>(isa: Isa, c: &Ctx<S>, task: Task) {
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
unsafe fn task_avx512<S: KvSource>(c: &Ctx<S>, task: Task) {
    run_task::<Avx512, S>(c, task)
}
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2<S: KvSource>(c: &Ctx<S>, task: Task) {
    run_task::<Avx2, S>(c, task)
}

/// A tile's K (transposed: `kt[d * LANES + lane]`) and V (`vt[lane * hd + d]`) in f32.
struct TileBuf {
    kt: [MaybeUninit<f32>; MAX_HEAD_DIM * LANES],
    vt: [MaybeUninit<f32>; LANES * MAX_HEAD_DIM],
}

#[inline(always)]
fn run_task<W: Widen, S: KvSource>(c: &Ctx<S>, task: Task) {
    let mut tile = TileBuf {
        kt: [MaybeUninit::uninit(); MAX_HEAD_DIM * LANES],
        vt: [MaybeUninit::uninit(); LANES * MAX_HEAD_DIM],
    };
    match task {
        Task::Segment { seg, parts } => segment_task::<W, S>(c, seg, parts, &mut tile),
        Task::Rows { first, n, g, out } => rows_task::<W, S>(c, first, n, g, out, &mut tile),
    }
}

/// Whether a row block of `n` rows reads its tiles in place ([`rows_in_place`]) rather than
/// widening each tile once for all its rows: where the ISA has an in-place kernel for the
/// geometry, for every block shorter than a full one ([`Ctx::row_block_limit`]). The lanes
/// path computes whole vectors of (row, query head) lanes whatever the block fills of them, so
/// a verification of a few drafts over a long history paid for 16 lanes to use 6; in place,
/// each lane costs its own arithmetic, and the tile, read from memory for the first row, is in
/// L1 for the others. Full blocks (prefill chunks) keep the lanes path, which was a few percent
/// faster there (docs/benchmarks.md). A lane's arithmetic is [`tile_step`]'s on both, so the
/// choice changes speed, not bits.
#[inline(always)]
fn reads_in_place<W: Widen, S>(c: &Ctx<S>, n: usize) -> bool {
    let ql = W::QUERY_LANES;
    ql > 0
        && c.bs.is_multiple_of(LANES)
        && (ql == LANES || c.hd.is_multiple_of(8))
        && (n == 1 || n < c.row_block_limit())
}

/// Rows `first..first + n`'s queries of K/V head `g` transposed for the lanes path (lane =
/// `i * group + h`, `QL` = `W::QUERY_LANES` lanes per vector: `qt[(v * hd + d) * QL + lane %
/// QL]`, `v = lane / QL`, unused lanes zero), in `buf`; `None` for one row, where the ISA
/// has no lanes path, or where the rows read their tiles in place ([`reads_in_place`]).
#[inline(always)]
fn transposed_queries<'b, W: Widen, S>(
    c: &Ctx<S>,
    first: usize,
    n: usize,
    g: usize,
    buf: &'b mut [MaybeUninit<f32>; LANE_BLOCK * MAX_HEAD_DIM],
) -> Option<&'b [f32]> {
    let (hd, group, ql) = (c.hd, c.group, W::QUERY_LANES);
    if ql == 0 || n < 2 || reads_in_place::<W, S>(c, n) {
        return None;
    }
    let lanes = n * group;
    let vectors = lanes.div_ceil(ql);
    debug_assert!(lanes <= LANE_BLOCK && LANE_BLOCK.is_multiple_of(ql));
    // SAFETY: vectors * hd * ql <= LANE_BLOCK * MAX_HEAD_DIM (row_block_limit keeps n * group
    // <= LANE_BLOCK, a multiple of ql, so whole vectors fit too); every float is written here
    // before it is read.
    let qt = unsafe {
        let p = buf.as_mut_ptr().cast::<f32>();
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
    Some(qt)
}

/// One split-K segment (`seg`: keys inside one segment of the grid) of the row block
/// `seg.t..seg.t + seg.n`, K/V heads `seg.g..seg.g + seg.gn`: each row's part of it (as
/// `rows_task` cuts it), its unnormalised accumulators and state per head into its slot of
/// `parts` (head-major); a row that does not reach the segment leaves its slots as they were
/// (the merge skips them).
#[inline(always)]
fn segment_task<W: Widen, S: KvSource>(
    c: &Ctx<S>,
    seg: Segment,
    parts: &mut [f32],
    tile: &mut TileBuf,
) {
    let (hd, group) = (c.hd, c.group);
    let (gh, slot) = (group * hd, group * (hd + 2));
    let (first, n, g, gn) = (
        seg.t as usize,
        seg.n as usize,
        seg.g as usize,
        seg.gn as usize,
    );
    // plan_segments keeps a task's (head, row) pairs within the arrays below.
    debug_assert!(gn * n <= ROW_BLOCK);
    let j = seg.lo as usize / SEGMENT;
    let mut row_parts = [(1usize, 0usize); ROW_BLOCK];
    for (i, p) in row_parts.iter_mut().take(n).enumerate() {
        let (lo, hi) = visible(&c.rows[first + i], c.window);
        *p = segment(lo, hi, j);
    }
    let mut qt_buf = [MaybeUninit::<f32>::uninit(); LANE_BLOCK * MAX_HEAD_DIM];
    let qt = transposed_queries::<W, S>(c, first, n, g, &mut qt_buf);
    let mut states = [State::EMPTY; ROW_BLOCK];
    {
        let mut accs: [&mut [f32]; ROW_BLOCK] = std::array::from_fn(|_| Default::default());
        for (k, (a, p)) in accs
            .iter_mut()
            .zip(parts.chunks_exact_mut(slot))
            .take(gn * n)
            .enumerate()
        {
            let i = k % n;
            if row_parts[i].0 <= row_parts[i].1 {
                *a = &mut p[..gh];
                a.fill(0.0);
            }
        }
        segment_pass::<W, S>(
            c,
            first,
            &row_parts[..n],
            (g, gn),
            (seg.lo as usize, seg.hi as usize),
            &mut accs[..gn * n],
            &mut states[..gn * n],
            tile,
            qt,
        );
    }
    for (p, st) in parts.chunks_exact_mut(slot).zip(&states).take(gn * n) {
        p[gh..gh + group].copy_from_slice(&st.mx[..group]);
        p[gh + group..].copy_from_slice(&st.sum[..group]);
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
    // Rows on the lanes path: their queries transposed.
    let mut qt_buf = [MaybeUninit::<f32>::uninit(); LANE_BLOCK * MAX_HEAD_DIM];
    let qt = transposed_queries::<W, S>(c, first, n, g, &mut qt_buf);
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
                (g, 1),
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
/// are not empty, K/V heads `heads.0..heads.0 + heads.1`: tile by tile, each row's softmax
/// state (`states[j * n + i]`, accumulators `accs[j * n + i]` for head `heads.0 + j`) updated
/// over its own keys. Read in place where [`reads_in_place`] says so (the only path that takes
/// more than one head); else each tile is widened once for all the rows, and with `qt` (the
/// rows' queries transposed, see `rows_task`) computed for 16 query lanes at a time by
/// [`lanes_step_avx512`], without it row by row by [`tile_step`]: the same arithmetic per row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn segment_pass<W: Widen, S: KvSource>(
    c: &Ctx<S>,
    first: usize,
    parts: &[(usize, usize)],
    heads: (usize, usize),
    span: (usize, usize),
    accs: &mut [&mut [f32]],
    states: &mut [State],
    tile: &mut TileBuf,
    qt: Option<&[f32]>,
) {
    let (hd, group, bs, kvh) = (c.hd, c.group, c.bs, c.kvh);
    // Only the x86-64 kernels read the transposed queries.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = qt;
    // Rows that read their tiles in place (`reads_in_place`; the others widen each tile once
    // for all of them).
    #[cfg(target_arch = "x86_64")]
    if reads_in_place::<W, S>(c, parts.len()) {
        // SAFETY: W = Avx512 (16 query lanes) or Avx2 (8), so the CPU has the features
        // (detect_isa), and the AVX2 kernel's hd is a multiple of 8 (reads_in_place); each
        // part's keys are at most its row's position, so their blocks are in the rows' table
        // and in the cache (checked on entry); accs[i] holds the group's accumulators for
        // every row whose part is not empty.
        unsafe {
            if W::QUERY_LANES == LANES {
                rows_in_place_avx512(c, first, parts, heads, accs, states)
            } else {
                rows_in_place_avx2(c, first, parts, heads, accs, states)
            }
        };
        return;
    }
    debug_assert_eq!(heads.1, 1, "more than one head off the in-place path");
    let g = heads.0;
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
mod tests;

/// Speed check (not run by default): `cargo test --release --lib -- --ignored --nocapture
/// timing`. Decode attention (one row, smollm's 9 heads on 3 K/V heads of 64) at contexts 512,
/// 2048 and 8192 in every K/V format, the formats interleaved round by round and each figure the
/// fastest call of its format (a busy moment of a shared machine slows every format alike, and
/// the fastest call is the one it did not touch); the median of the rounds' fastest beside it.
#[cfg(test)]
mod timing;
