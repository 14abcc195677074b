//! Grouped-query attention for one batch of query rows over a paged K/V cache.
//!
//! K/V rows are stored as f32 or f16 ([`KvData`]); all arithmetic is f32.
//!
//! **Batch invariance.** A row's visible keys are cut into fixed segments by absolute key
//! position (`SEGMENT` keys, aligned to multiples of `SEGMENT`), each segment's softmax state is
//! computed from scratch, and the states are merged in key order. That arithmetic depends only on
//! the row (its position, window, queries and cache), never on the rest of the batch or the
//! thread count: decode batches with few (row, K/V head) tasks run the segments in parallel
//! (split-K, as in flash-decoding) so that every thread has work; bigger batches run one task per
//! (row, K/V head) that walks its segments in order. Both give the same bits.

use super::swiglu::fast_exp;
use half::f16;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Largest supported head dimension (stack accumulators are sized for it).
pub const MAX_HEAD_DIM: usize = 256;
/// Largest supported query heads per K/V head.
pub const MAX_GROUP: usize = 16;
/// Keys scored per online-softmax step: one rescale of the accumulators per tile.
const TILE: usize = 32;
/// Keys per segment (a multiple of TILE): segment `j` is keys `j*SEGMENT..(j+1)*SEGMENT`,
/// intersected with a row's visible keys.
const SEGMENT: usize = 128;
/// Segments run as parallel tasks (split-K) while there are fewer than this many (row, K/V
/// head) tasks per thread.
const TASKS_PER_THREAD: usize = 4;
/// Floats of split-K partial states in [`AttnScratch`] (4 MiB): with smollm's 3 heads of 64
/// per K/V head, 5300 segments, e.g. 2 rows of 3 K/V heads at 110k keys. Bigger plans run
/// one task per (row, K/V head): the same bits, less parallel.
const PARTS_FLOATS: usize = 1 << 20;

/// One layer's K or V storage, `[num_blocks, block_size, kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub enum KvData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl KvData<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvData::F32(x) => x.len(),
            KvData::F16(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as f32.
    pub fn get(&self, i: usize) -> f32 {
        match self {
            KvData::F32(x) => x[i],
            KvData::F16(x) => x[i].to_f32(),
        }
    }
}

/// The K/V cache of one layer: `k`, `v` are each `[num_blocks, block_size, kv_heads, head_dim]`.
pub struct KvLayer<'a> {
    pub k: KvData<'a>,
    pub v: KvData<'a>,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
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

/// Preallocated split-K scratch: the segment list and each segment's partial softmax state.
pub struct AttnScratch {
    threads: usize,
    max_rows: usize,
    segments: Vec<Segment>,
    /// `[group * hd acc | group max | group sum]` per segment.
    parts: Vec<f32>,
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
        }
    }
}

/// How to run the segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// Split-K when the batch has few tasks, else one task per (row, K/V head).
    Auto,
    /// One task per (row, K/V head) always (the tests' baseline).
    #[cfg_attr(not(test), allow(dead_code))]
    Never,
}

/// The instruction set the kernel runs with.
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
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx512;
        }
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
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
    assert_eq!(kv.k.len(), kv.v.len(), "attention: k and v differ");
    assert_eq!(kv.k.len() % (bs * kvh * hd), 0, "attention: cache shape");
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
    }
    macro_rules! go {
        ($k:expr, $v:expr) => {{
            let c = Ctx {
                q,
                rows,
                tables,
                k: $k,
                v: $v,
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
        (KvData::F32(k), KvData::F32(v)) => go!(k, v),
        (KvData::F16(k), KvData::F16(v)) => go!(k, v),
        _ => panic!("attention: k and v differ in dtype"),
    }
}

/// One call's validated arguments, with K/V of element type `E`.
struct Ctx<'a, E> {
    q: &'a [f32],
    rows: &'a [AttnRow],
    tables: &'a [u32],
    k: &'a [E],
    v: &'a [E],
    bs: usize,
    kvh: usize,
    hd: usize,
    n_heads: usize,
    group: usize,
    scale: f32,
    window: Option<usize>,
}

/// The visible keys `lo..=pos` of a row.
fn visible(r: &AttnRow, window: Option<usize>) -> (usize, usize) {
    let pos = r.pos as usize;
    (window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos)
}

impl<E> Ctx<'_, E> {
    fn group_args(&self, t: usize, g: usize, lo: usize, hi: usize) -> Group<'_, E> {
        let row = self.rows[t];
        let (hd, group) = (self.hd, self.group);
        Group {
            c: self,
            q: &self.q[t * self.n_heads * hd + g * group * hd..][..group * hd],
            table: &self.tables
                [row.table_start as usize..(row.table_start + row.table_len) as usize],
            g,
            lo,
            hi,
        }
    }
}

/// Segment `j` of a row whose visible keys are `lo..=hi`.
fn segment(lo: usize, hi: usize, j: usize) -> (usize, usize) {
    (lo.max(j * SEGMENT), hi.min((j + 1) * SEGMENT - 1))
}

/// The segment indices `j` of a row whose visible keys are `lo..=hi`.
fn segment_range(lo: usize, hi: usize) -> std::ops::RangeInclusive<usize> {
    lo / SEGMENT..=hi / SEGMENT
}

fn run<E: KvElem>(c: &Ctx<E>, out: &mut [f32], scratch: &mut AttnScratch, isa: Isa, split: Split) {
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
                let a = c.group_args(s.t as usize, s.g as usize, s.lo as usize, s.hi as usize);
                let (acc, st) = p.split_at_mut(group * hd);
                let state = kernel(isa, &a, acc);
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
                let mut st = State {
                    mx: [0.0; MAX_GROUP],
                    sum: [0.0; MAX_GROUP],
                };
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
    // One task per (row, kv head): its query heads are contiguous in q and out.
    out.par_chunks_mut(group * hd)
        .enumerate()
        .for_each(|(i, o)| {
            let (t, g) = (i / c.kvh, i % c.kvh);
            let (lo, hi) = visible(&c.rows[t], c.window);
            let mut js = segment_range(lo, hi);
            let (a, b) = segment(lo, hi, *js.start());
            let mut state = kernel(isa, &c.group_args(t, g, a, b), o);
            js.next();
            if !js.is_empty() {
                // The next segment's accumulators: only `group * hd` of the stack buffer are
                // used, so only those are initialised (zeroing all 16 KiB per task is
                // measurable in prefill).
                let mut buf = [MaybeUninit::<f32>::uninit(); MAX_GROUP * MAX_HEAD_DIM];
                let need = group * hd;
                // SAFETY: `need <= buf.len()` (group and hd were checked against the maxima);
                // the first `need` floats are written before the slice is made.
                let acc = unsafe {
                    let p = buf.as_mut_ptr().cast::<f32>();
                    std::ptr::write_bytes(p, 0, need);
                    std::slice::from_raw_parts_mut(p, need)
                };
                for j in js {
                    let (a, b) = segment(lo, hi, j);
                    let next = kernel(isa, &c.group_args(t, g, a, b), acc);
                    combine(o, &mut state, acc, &next, group, hd);
                }
            }
            finish(o, &state, group, hd);
        });
}

/// Fills `scratch.segments` with the split-K plan: every row's segments, per K/V head, in key
/// order. False when split-K does not pay (enough tasks already, or no row with two segments)
/// or does not fit the scratch.
fn plan_segments<E>(c: &Ctx<E>, scratch: &mut AttnScratch) -> bool {
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

/// One task: the query heads of K/V head `g` for one row, over keys `lo..=hi`; the shared
/// geometry and K/V come from the call's `Ctx`.
struct Group<'a, E> {
    c: &'a Ctx<'a, E>,
    q: &'a [f32],
    table: &'a [u32],
    g: usize,
    /// Keys `lo..=hi`.
    lo: usize,
    hi: usize,
}

/// A K/V element type.
trait KvElem: Copy + Send + Sync {
    const HALF: bool;
    fn to_f32(self) -> f32;
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
}
impl KvElem for f32 {
    const HALF: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
}
impl KvElem for f16 {
    const HALF: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
}

/// One segment through [`attend`] on `isa`.
fn kernel<E: KvElem>(isa: Isa, a: &Group<E>, acc: &mut [f32]) -> State {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: detect_isa checked the features (tests only pass ISAs they detected).
        Isa::Avx512 => unsafe { attend_avx512(a, acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { attend_avx2(a, acc) },
        Isa::Plain => attend::<Plain, E>(a, acc),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn attend_avx512<E: KvElem>(a: &Group<E>, acc: &mut [f32]) -> State {
    attend::<Avx512, E>(a, acc)
}
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2<E: KvElem>(a: &Group<E>, acc: &mut [f32]) -> State {
    attend::<Avx2, E>(a, acc)
}

/// The vector primitives of the attention loop, per ISA.
trait Vops {
    /// `s[h] = q[h*hd..][..hd] · kr` for every `h < s.len()`.
    ///
    /// # Safety
    /// The CPU supports the implementation's ISA.
    unsafe fn dots<E: KvElem>(q: &[f32], kr: &[E], s: &mut [f32]);
    /// `acc += sum_j p[j] * v[offs[j]..][..acc.len()]`.
    ///
    /// # Safety
    /// As for `dots`; every `offs[j] + acc.len() <= v.len()`.
    unsafe fn tile_axpy<E: KvElem>(acc: &mut [f32], p: &[f32], v: &[E], offs: &[usize]);
    /// `s[h][j] = (q[h*hd..][..hd] · k[offs[j]..][..hd]) * scale` for a whole tile, when the
    /// implementation has a special case for this shape; false (nothing written) otherwise.
    ///
    /// # Safety
    /// As for `dots`; every `offs[j] + hd <= k.len()`, `q.len() >= s.len() * hd`.
    #[inline(always)]
    unsafe fn tile_dots<E: KvElem>(
        _q: &[f32],
        _k: &[E],
        _offs: &[usize],
        _hd: usize,
        _s: &mut [[f32; TILE]],
        _scale: f32,
    ) -> bool {
        false
    }
}

/// Portable dot with 16 independent partial sums (vectorisable without fast-math).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut ac = a.chunks_exact(16);
    let mut bc = b.chunks_exact(16);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
        s += x * y;
    }
    s
}

struct Plain;
impl Vops for Plain {
    #[inline(always)]
    unsafe fn dots<E: KvElem>(q: &[f32], kr: &[E], s: &mut [f32]) {
        let hd = kr.len();
        let mut buf = [0f32; MAX_HEAD_DIM];
        let kf = match E::as_f32(kr) {
            Some(k) => k,
            None => {
                for (b, &x) in buf.iter_mut().zip(kr) {
                    *b = x.to_f32();
                }
                &buf[..hd]
            }
        };
        for (h, sv) in s.iter_mut().enumerate() {
            *sv = dot(&q[h * hd..(h + 1) * hd], kf);
        }
    }
    #[inline(always)]
    unsafe fn tile_axpy<E: KvElem>(acc: &mut [f32], p: &[f32], v: &[E], offs: &[usize]) {
        let hd = acc.len();
        match E::as_f32(v) {
            Some(vf) => {
                for (&pj, &o) in p.iter().zip(offs) {
                    for (x, &vv) in acc.iter_mut().zip(&vf[o..o + hd]) {
                        *x += pj * vv;
                    }
                }
            }
            None => {
                for (&pj, &o) in p.iter().zip(offs) {
                    for (x, &vv) in acc.iter_mut().zip(&v[o..o + hd]) {
                        *x += pj * vv.to_f32();
                    }
                }
            }
        }
    }
}

/// Explicit AVX2 + F16C: 8 lanes, f16 rows widened with `vcvtph2ps`; tails in scalar code.
#[cfg(target_arch = "x86_64")]
struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Avx2 {
    #[inline(always)]
    unsafe fn load8<E: KvElem>(p: *const E) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        if E::HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            _mm256_loadu_ps(p as *const f32)
        }
    }
    #[inline(always)]
    unsafe fn hsum(x: std::arch::x86_64::__m256) -> f32 {
        use std::arch::x86_64::*;
        let s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
    /// `s[h] = q[h*hd..][..hd] · kr` for `h < N`; returns N.
    #[inline(always)]
    unsafe fn dots_n<E: KvElem, const N: usize>(q: &[f32], kr: &[E], s: &mut [f32]) -> usize {
        use std::arch::x86_64::*;
        let hd = kr.len();
        assert!(q.len() >= N * hd && s.len() >= N);
        let body = hd - hd % 8;
        let mut acc = [_mm256_setzero_ps(); N];
        let (kp, qp) = (kr.as_ptr(), q.as_ptr());
        let mut c = 0;
        while c < body {
            let kv = Self::load8(kp.add(c));
            for (h, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(h * hd + c)), kv, *a);
            }
            c += 8;
        }
        for (h, a) in acc.iter().enumerate() {
            let mut x = Self::hsum(*a);
            for i in body..hd {
                x += q[h * hd + i] * kr[i].to_f32();
            }
            s[h] = x;
        }
        N
    }
    /// `acc[c..c + 8N] += sum_j p[j] * v[offs[j] + c..][..8N]`, the 8N floats kept in registers.
    #[inline(always)]
    unsafe fn axpy_pass<E: KvElem, const N: usize>(
        ap: *mut f32,
        p: &[f32],
        vp: *const E,
        offs: &[usize],
        c: usize,
    ) {
        use std::arch::x86_64::*;
        let mut a = [_mm256_setzero_ps(); N];
        for (i, x) in a.iter_mut().enumerate() {
            *x = _mm256_loadu_ps(ap.add(c + 8 * i));
        }
        for (&pj, &o) in p.iter().zip(offs) {
            let pv = _mm256_set1_ps(pj);
            let row = vp.add(o + c);
            for (i, x) in a.iter_mut().enumerate() {
                *x = _mm256_fmadd_ps(pv, Self::load8(row.add(8 * i)), *x);
            }
        }
        for (i, x) in a.iter().enumerate() {
            _mm256_storeu_ps(ap.add(c + 8 * i), *x);
        }
    }
}
#[cfg(target_arch = "x86_64")]
impl Vops for Avx2 {
    #[inline(always)]
    unsafe fn dots<E: KvElem>(q: &[f32], kr: &[E], s: &mut [f32]) {
        let hd = kr.len();
        let g = s.len();
        assert!(q.len() >= g * hd);
        // Fixed head counts keep the accumulators in registers (see Avx512::dots).
        let mut h = 0;
        while h < g {
            h += match g - h {
                1 => Self::dots_n::<E, 1>(&q[h * hd..], kr, &mut s[h..]),
                2 => Self::dots_n::<E, 2>(&q[h * hd..], kr, &mut s[h..]),
                3 => Self::dots_n::<E, 3>(&q[h * hd..], kr, &mut s[h..]),
                _ => Self::dots_n::<E, 4>(&q[h * hd..], kr, &mut s[h..]),
            };
        }
    }
    #[inline(always)]
    unsafe fn tile_axpy<E: KvElem>(acc: &mut [f32], p: &[f32], v: &[E], offs: &[usize]) {
        let hd = acc.len();
        let body = hd - hd % 8;
        let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
        let mut c = 0;
        while c + 32 <= body {
            Self::axpy_pass::<E, 4>(ap, p, vp, offs, c);
            c += 32;
        }
        while c < body {
            Self::axpy_pass::<E, 1>(ap, p, vp, offs, c);
            c += 8;
        }
        if body < hd {
            for (&pj, &o) in p.iter().zip(offs) {
                for i in body..hd {
                    acc[i] += pj * v[o + i].to_f32();
                }
            }
        }
    }
}

/// Explicit AVX-512: the auto-vectorised dot ended in a serial 16-lane sum per key, which made
/// scoring latency-bound. Here the K row is loaded once for all heads of the group; f16 rows are
/// widened with `vcvtph2ps` (16 halves to 16 floats).
#[cfg(target_arch = "x86_64")]
struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Avx512 {
    /// The lanes of `mask` from `p` as f32; masked-off lanes read nothing and are zero.
    #[inline(always)]
    unsafe fn load16<E: KvElem>(
        mask: std::arch::x86_64::__mmask16,
        p: *const E,
    ) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        if E::HALF {
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16))
        } else {
            _mm512_maskz_loadu_ps(mask, p as *const f32)
        }
    }

    /// Tile scores for N heads of head_dim 64; returns N.
    #[inline(always)]
    unsafe fn tile_dots64<E: KvElem, const N: usize>(
        qp: *const f32,
        kp: *const E,
        offs: &[usize],
        s: &mut [[f32; TILE]],
        scale: f32,
    ) -> usize {
        use std::arch::x86_64::*;
        let mut qv = [[_mm512_setzero_ps(); 4]; N];
        for (h, qh) in qv.iter_mut().enumerate() {
            for (c, x) in qh.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(qp.add(h * 64 + 16 * c));
            }
        }
        for (jj, &o) in offs.iter().enumerate() {
            let row = kp.add(o);
            let kv = [
                Self::load16(0xffff, row),
                Self::load16(0xffff, row.add(16)),
                Self::load16(0xffff, row.add(32)),
                Self::load16(0xffff, row.add(48)),
            ];
            for (h, qh) in qv.iter().enumerate() {
                let a = _mm512_mul_ps(qh[0], kv[0]);
                let b = _mm512_mul_ps(qh[1], kv[1]);
                let a = _mm512_fmadd_ps(qh[2], kv[2], a);
                let b = _mm512_fmadd_ps(qh[3], kv[3], b);
                s[h][jj] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
            }
        }
        N
    }

    /// `s[h] = q[h*hd..][..hd] · k[..hd]` for `h < N`; returns N.
    #[inline(always)]
    unsafe fn dots_n<E: KvElem, const N: usize>(
        qp: *const f32,
        kp: *const E,
        hd: usize,
        s: *mut f32,
    ) -> usize {
        use std::arch::x86_64::*;
        let mut acc = [_mm512_setzero_ps(); N];
        let mut c = 0;
        while c < hd {
            let mask: __mmask16 = if hd - c >= 16 {
                0xffff
            } else {
                ((1u32 << (hd - c)) - 1) as __mmask16
            };
            let kv = Self::load16(mask, kp.add(c));
            for (h, a) in acc.iter_mut().enumerate() {
                let qv = _mm512_maskz_loadu_ps(mask, qp.add(h * hd + c));
                *a = _mm512_fmadd_ps(qv, kv, *a);
            }
            c += 16;
        }
        for (h, a) in acc.iter().enumerate() {
            *s.add(h) = _mm512_reduce_add_ps(*a);
        }
        N
    }
}
#[cfg(target_arch = "x86_64")]
impl Vops for Avx512 {
    #[inline(always)]
    unsafe fn dots<E: KvElem>(q: &[f32], kr: &[E], s: &mut [f32]) {
        let hd = kr.len();
        let g = s.len();
        assert!(q.len() >= g * hd);
        let (kp, qp, sp) = (kr.as_ptr(), q.as_ptr(), s.as_mut_ptr());
        // Heads in groups of at most 4 with a fixed count, so the accumulators stay in
        // registers (a run-time count kept them in memory).
        let mut h = 0;
        while h < g {
            let (qh, sh) = (qp.add(h * hd), sp.add(h));
            h += match g - h {
                1 => Self::dots_n::<E, 1>(qh, kp, hd, sh),
                2 => Self::dots_n::<E, 2>(qh, kp, hd, sh),
                3 => Self::dots_n::<E, 3>(qh, kp, hd, sh),
                _ => Self::dots_n::<E, 4>(qh, kp, hd, sh),
            };
        }
    }
    /// head_dim 64: the group's query rows stay in registers (up to 4 heads x 4 vectors) for the
    /// whole tile instead of being reloaded for every key.
    #[inline(always)]
    unsafe fn tile_dots<E: KvElem>(
        q: &[f32],
        k: &[E],
        offs: &[usize],
        hd: usize,
        s: &mut [[f32; TILE]],
        scale: f32,
    ) -> bool {
        if hd != 64 {
            return false;
        }
        let g = s.len();
        assert!(q.len() >= g * hd && offs.len() <= TILE);
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let mut h = 0;
        while h < g {
            let (qh, sh) = (qp.add(h * hd), &mut s[h..]);
            h += match g - h {
                1 => Self::tile_dots64::<E, 1>(qh, kp, offs, sh, scale),
                2 => Self::tile_dots64::<E, 2>(qh, kp, offs, sh, scale),
                3 => Self::tile_dots64::<E, 3>(qh, kp, offs, sh, scale),
                _ => Self::tile_dots64::<E, 4>(qh, kp, offs, sh, scale),
            };
        }
        true
    }
    /// 64 output floats per pass held in 4 registers across the whole tile of keys, so the
    /// accumulators do not round-trip through memory once per key.
    #[inline(always)]
    unsafe fn tile_axpy<E: KvElem>(acc: &mut [f32], p: &[f32], v: &[E], offs: &[usize]) {
        use std::arch::x86_64::*;
        let hd = acc.len();
        let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
        let mask_at = |c: usize| -> __mmask16 {
            if c >= hd {
                0
            } else if hd - c >= 16 {
                0xffff
            } else {
                ((1u32 << (hd - c)) - 1) as __mmask16
            }
        };
        let mut c = 0;
        while c < hd {
            let m = [
                mask_at(c),
                mask_at(c + 16),
                mask_at(c + 32),
                mask_at(c + 48),
            ];
            let mut a = [_mm512_setzero_ps(); 4];
            for i in 0..4 {
                // Masked-off lanes are never touched, so no access past the row.
                a[i] = _mm512_maskz_loadu_ps(m[i], ap.wrapping_add(c + 16 * i));
            }
            for (&pj, &o) in p.iter().zip(offs) {
                let pv = _mm512_set1_ps(pj);
                let row = vp.wrapping_add(o + c);
                for i in 0..4 {
                    let y = Self::load16(m[i], row.wrapping_add(16 * i));
                    a[i] = _mm512_fmadd_ps(pv, y, a[i]);
                }
            }
            for i in 0..4 {
                _mm512_mask_storeu_ps(ap.wrapping_add(c + 16 * i), m[i], a[i]);
            }
            c += 64;
        }
    }
}

/// Max of a tile in 16 independent lanes (`f32::max` in a fold does not vectorise).
#[inline(always)]
fn lane_max(x: &[f32; TILE]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    for c in x.chunks_exact(16) {
        for l in 0..16 {
            m[l] = if c[l] > m[l] { c[l] } else { m[l] };
        }
    }
    m.iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// Sum of a tile in 16 independent lanes (a serial sum is one add latency per key).
#[inline(always)]
fn lane_sum(x: &[f32; TILE]) -> f32 {
    let mut m = [0f32; 16];
    for c in x.chunks_exact(16) {
        for l in 0..16 {
            m[l] += c[l];
        }
    }
    m.iter().sum()
}

/// Streaming (online) softmax over the keys `lo..=hi` of one segment, TILE keys at a time from
/// `lo`: scores for the tile go to a small stack buffer, the running max/sum and the output
/// accumulators are rescaled once per tile. Each K and V row is read once for all query heads of
/// the group. Writes the unnormalised accumulators `[group, hd]` into `acc` and returns the
/// segment's state: per head, the running max and the sum of exponentials.
// Scores are indexed [head][key] from both loop orders; index loops read clearest here.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn attend<V: Vops, E: KvElem>(a: &Group<E>, acc: &mut [f32]) -> State {
    let (hd, kvh, bs) = (a.c.hd, a.c.kvh, a.c.bs);
    let group = a.c.group;
    // The output accumulates in place: no per-call stack array to zero beyond what is used.
    let acc = &mut acc[..group * hd];
    acc.fill(0.0);
    let mut mx = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0f32; MAX_GROUP];
    let mut s = [[0f32; TILE]; MAX_GROUP];
    // Walk the block table: one division per call instead of two per key.
    let mut bi = a.lo / bs;
    let mut r = a.lo % bs;
    let mut base = a.table[bi] as usize * bs;
    let mut j0 = a.lo;
    while j0 <= a.hi {
        let cnt = TILE.min(a.hi + 1 - j0);
        // Row offsets once per tile (K and V share the layout).
        let mut offs = [0usize; TILE];
        for o in offs[..cnt].iter_mut() {
            if r == bs {
                r = 0;
                bi += 1;
                base = a.table[bi] as usize * bs;
            }
            *o = ((base + r) * kvh + a.g) * hd;
            r += 1;
        }
        // Every K (and V) row of the tile lies inside the cache.
        let last = offs[..cnt].iter().max().copied().unwrap_or(0);
        assert!(last + hd <= a.c.k.len() && a.c.k.len() == a.c.v.len());
        // SAFETY: `V` was chosen by run-time feature detection (detect_isa); rows checked above,
        // and `a.q` holds `group` rows of `hd`.
        let done =
            unsafe { V::tile_dots(a.q, a.c.k, &offs[..cnt], hd, &mut s[..group], a.c.scale) };
        if !done {
            for jj in 0..cnt {
                let kr = &a.c.k[offs[jj]..][..hd];
                let mut sc = [0f32; MAX_GROUP];
                // SAFETY: as above.
                unsafe { V::dots(a.q, kr, &mut sc[..group]) };
                for h in 0..group {
                    s[h][jj] = sc[h] * a.c.scale;
                }
            }
        }
        for h in 0..group {
            let sh = &mut s[h];
            // Fixed-width passes over the whole tile vectorise; a short last tile is padded
            // with -inf for the max and with 0 for the sum.
            sh[cnt..].fill(f32::NEG_INFINITY);
            let tile_max = lane_max(sh);
            let new_max = mx[h].max(tile_max);
            // First tile: nothing accumulated yet, so no rescale (avoids exp(-inf - -inf)).
            let corr = if mx[h] == f32::NEG_INFINITY {
                0.0
            } else {
                fast_exp(mx[h] - new_max)
            };
            mx[h] = new_max;
            // Exponentials first, then the sum.
            for v in sh.iter_mut() {
                *v = fast_exp(*v - new_max);
            }
            sh[cnt..].fill(0.0);
            let tile_sum = lane_sum(sh);
            sum[h] = sum[h] * corr + tile_sum;
            if corr != 1.0 {
                for x in acc[h * hd..(h + 1) * hd].iter_mut() {
                    *x *= corr;
                }
            }
        }
        for h in 0..group {
            // SAFETY: as above; every offset was bounds-checked against K, and V has K's length.
            unsafe {
                V::tile_axpy(
                    &mut acc[h * hd..(h + 1) * hd],
                    &s[h][..cnt],
                    a.c.v,
                    &offs[..cnt],
                )
            };
        }
        j0 += cnt;
    }
    State { mx, sum }
}

/// Naive reference: dense scores and softmax in f64 (on the stored values, f16 widened exactly).
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
            let off = |j: usize| {
                let b = tables[r.table_start as usize + j / bs] as usize;
                ((b * bs + j % bs) * kvh + g) * hd
            };
            let scores: Vec<f64> = (lo..=pos)
                .map(|j| {
                    let o = off(j);
                    qh.iter()
                        .enumerate()
                        .map(|(d, &a)| a as f64 * kv.k.get(o + d) as f64)
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
                    acc += e[idx] * kv.v.get(off(j) + d) as f64;
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

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Dt {
        F32,
        F16,
    }

    /// Every ISA this CPU can run.
    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Plain];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx2);
            }
            if detect_isa() == Isa::Avx512 {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    /// Builds a cache with `seq_lens.len()` sequences on shuffled blocks, queries the given
    /// (sequence, position) rows, and compares with the f64 reference on the stored (for F16,
    /// f16-rounded) values: every ISA, split-K planned for 1, 2 and 8 threads and never split.
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
        let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let (kd, vd) = match dt {
            Dt::F32 => (KvData::F32(&k), KvData::F32(&v)),
            Dt::F16 => (KvData::F16(&k16), KvData::F16(&v16)),
        };
        let kv = KvLayer {
            k: kd,
            v: vd,
            block_size: bs,
            kv_heads,
            head_dim,
        };
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
                    let c = Ctx::<f32> {
                        q: &q,
                        rows: &rows,
                        tables: &tables,
                        k: &[],
                        v: &[],
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
        for dt in [Dt::F32, Dt::F16] {
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
        for dt in [Dt::F32, Dt::F16] {
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
        let c = Ctx::<f32> {
            q: &[],
            rows: &rows,
            tables: &[],
            k: &[],
            v: &[],
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
    /// other sequences and runs of consecutive prefill rows, short and long), whichever way the
    /// segments run (split-K planned for 1, 2 or 8 threads, or never) and on 1 to 3 threads:
    /// long (3000-key) and short target rows, with and without a sliding window, f32 and f16
    /// K/V, every ISA.
    #[test]
    fn attention_rows_are_batch_invariant() {
        let (n_heads, kvh, hd, bs) = (9usize, 3usize, 64usize, 16usize);
        let seq_lens = [3000usize, 700, 300, 45];
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
        let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
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
        // Other rows to mix in: decode rows of every sequence, then a prefill run of sequence 1.
        let mut others: Vec<(usize, usize)> = vec![(0, 2500), (1, 699), (2, 299), (3, 44)];
        others.extend((600..640).map(|p| (1, p)));
        let pools = thread_pools(&[1, 2, 3]);
        let scale = 1.0 / (hd as f32).sqrt();
        for (dt, kd, vd) in [
            ("f32", KvData::F32(&k), KvData::F32(&v)),
            ("f16", KvData::F16(&k16), KvData::F16(&v16)),
        ] {
            let kv = KvLayer {
                k: kd,
                v: vd,
                block_size: bs,
                kv_heads: kvh,
                head_dim: hd,
            };
            for window in [None, Some(1000)] {
                for isa in isas() {
                    for target in [(0usize, 2999usize), (2, 130), (3, 40)] {
                        let tq = qrow(target.0, target.1);
                        let mut alone = vec![f32::NAN; tq.len()];
                        paged_attention_with(
                            &tq,
                            &[row(target.0, target.1)],
                            &ids,
                            &kv,
                            n_heads,
                            scale,
                            window,
                            &mut alone,
                            &mut AttnScratch::new(1, n_heads, hd, 2),
                            isa,
                            Split::Auto,
                        );
                        for (bi, &size) in [1usize, 2, 3, 5, 8, 13, 24, 40].iter().enumerate() {
                            // The target at a varying place among size - 1 others.
                            let at = (bi * 7) % size;
                            let mut batch: Vec<(usize, usize)> = others
                                .iter()
                                .cycle()
                                .skip(bi)
                                .take(size - 1)
                                .copied()
                                .collect();
                            batch.insert(at, target);
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
                                    "{isa:?} {dt} K/V, window {window:?}: row {target:?} \
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

/// Speed check (not run by default): `cargo test --release -- --ignored --nocapture timing`.
#[cfg(test)]
mod timing {
    use super::*;
    use std::time::Instant;

    #[test]
    #[ignore]
    fn timing_decode_attention() {
        let (n_heads, kvh, hd, bs) = (9usize, 3usize, 64usize, 16usize);
        let threads = rayon::current_num_threads();
        for &ctx in &[512usize, 2048] {
            let blocks = ctx / bs;
            let len = blocks * bs * kvh * hd;
            let k: Vec<f32> = (0..len).map(|i| (i % 13) as f32 * 0.01).collect();
            let v = k.clone();
            let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let v16 = k16.clone();
            let tables: Vec<u32> = (0..blocks as u32).rev().collect();
            for half in [false, true] {
                let kv = KvLayer {
                    k: if half {
                        KvData::F16(&k16)
                    } else {
                        KvData::F32(&k)
                    },
                    v: if half {
                        KvData::F16(&v16)
                    } else {
                        KvData::F32(&v)
                    },
                    block_size: bs,
                    kv_heads: kvh,
                    head_dim: hd,
                };
                let rows = [AttnRow {
                    pos: ctx as u32 - 1,
                    table_start: 0,
                    table_len: blocks as u32,
                }];
                let q = vec![0.1f32; n_heads * hd];
                let mut out = vec![0.0f32; n_heads * hd];
                let mut scratch = AttnScratch::new(1, n_heads, hd, threads);
                let mut best = f64::INFINITY;
                for _ in 0..300 {
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
                let bytes = 2 * len * if half { 2 } else { 4 };
                println!(
                    "attention ctx {ctx} {}: {:.1} us, {:.1} GB/s of K/V",
                    if half { "f16" } else { "f32" },
                    best * 1e6,
                    bytes as f64 / best / 1e9
                );
            }
        }
    }
}
