//! Rows' tiles read in place, without widening a copy first (decode rows, and row blocks with
//! too few query lanes for the lanes path): the `InPlace` kernels of [`super::row_avx512`] and
//! [`super::row_avx2`], and the tile walk that drives them.

use super::*;

/// A kernel that computes one tile for one row's heads read in place: [`row_avx512`] or [`row_avx2`].
pub(super) trait InPlace {
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

pub(super) struct InPlaceAvx512;
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

pub(super) struct InPlaceAvx2;
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

/// [`rows_in_place`] on AVX-512.
///
/// # Safety
/// As [`rows_in_place`]; AVX-512F/BW/VL, F16C and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub(super) unsafe fn rows_in_place_avx512<S: KvSource>(
    c: &Ctx<S>,
    first: usize,
    parts: &[(usize, usize)],
    heads: (usize, usize),
    accs: &mut [&mut [f32]],
    states: &mut [State],
) {
    rows_in_place::<S, InPlaceAvx512>(c, first, parts, heads, accs, states)
}

/// [`rows_in_place`] on AVX2.
///
/// # Safety
/// As [`rows_in_place`]; AVX2, F16C and FMA; `hd` is a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_in_place_avx2<S: KvSource>(
    c: &Ctx<S>,
    first: usize,
    parts: &[(usize, usize)],
    heads: (usize, usize),
    accs: &mut [&mut [f32]],
    states: &mut [State],
) {
    rows_in_place::<S, InPlaceAvx2>(c, first, parts, heads, accs, states)
}

/// Keys `parts[i]` (inside one segment) of rows `first + i` of one sequence, K/V heads
/// `heads.0..heads.0 + heads.1`, tile by tile, read in place by `P`'s kernel: what
/// [`segment_pass`] computes for those rows from widened tiles, to the bit. Row `i` of head
/// `heads.0 + j` keeps its state in `accs[j * parts.len() + i]` and `states[..]` at the same
/// index. Each tile of a K/V head is read from memory once: the rows after the first find it in
/// L1. The heads of a tile are taken one after the other, so a task with all of them reads each
/// block of the cache whole, in order (one head's slice of a block is 1/kv_heads of it, and
/// the heads taken as separate tasks made scattered reads; docs/benchmarks.md). The tile
/// [`PREFETCH_TILES`] ahead (up to the rows' last key, into their next segment) is prefetched
/// into L2.
///
/// # Safety
/// `bs % LANES == 0`; each part's keys are visible to its row; `accs[j * parts.len() + i]`
/// holds `group * hd` floats for every row `i` whose part is not empty and every head `j` of
/// the span; inlined into a function with `P`'s features.
#[inline(always)]
pub(super) unsafe fn rows_in_place<S: KvSource, P: InPlace>(
    c: &Ctx<S>,
    first: usize,
    parts: &[(usize, usize)],
    heads: (usize, usize),
    accs: &mut [&mut [f32]],
    states: &mut [State],
) {
    use tile_at::TileLocation;
    let (hd, group, bs, kvh) = (c.hd, c.group, c.bs, c.kvh);
    let geo = Geom { bs, kvh, hd };
    let n = parts.len();
    // The rows of a block share their sequence's table.
    let table = c.table(first);
    let mut lo = usize::MAX;
    let mut hi = 0;
    for &(a, b) in parts.iter().filter(|p| p.0 <= p.1) {
        (lo, hi) = (lo.min(a), hi.max(b));
    }
    let last = (first..first + n)
        .map(|t| visible(&c.rows[t], c.window).1)
        .max()
        .unwrap_or(0);
    let mut t0 = lo / LANES * LANES;
    while t0 <= hi {
        let ahead = t0 + PREFETCH_TILES * LANES;
        for j in 0..heads.1 {
            let g = heads.0 + j;
            if ahead <= last {
                c.kv.tile_at(geo, table[ahead / bs] as usize, ahead % bs, g)
                    .prefetch(hd);
            }
            let tile = c.kv.tile_at(geo, table[t0 / bs] as usize, t0 % bs, g);
            for (i, &(a, b)) in parts.iter().enumerate() {
                let (a, b) = (a.max(t0), b.min(t0 + LANES - 1));
                if a > b {
                    continue;
                }
                let lanes = (a - t0, b - t0);
                let q = c.q_group(first + i, g);
                let (acc, st) = (&mut *accs[j * n + i], &mut states[j * n + i]);
                let mut h = 0;
                while h < group {
                    h += match group - h {
                        1 => P::step::<S::Tile, 1>(q, h, hd, tile, lanes, c.scale, acc, st),
                        2 => P::step::<S::Tile, 2>(q, h, hd, tile, lanes, c.scale, acc, st),
                        3 => P::step::<S::Tile, 3>(q, h, hd, tile, lanes, c.scale, acc, st),
                        _ => P::step::<S::Tile, 4>(q, h, hd, tile, lanes, c.scale, acc, st),
                    };
                }
            }
        }
        t0 += LANES;
    }
}
