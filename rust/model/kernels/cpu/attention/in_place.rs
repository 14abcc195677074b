//! One row's tiles read in place, without widening a copy first (the decode path): the
//! `InPlace` kernels of [`super::row_avx512`] and [`super::row_avx2`], and the row walk that
//! drives them.

use super::*;

/// A kernel that computes one tile for one row read in place: [`row_avx512`] or [`row_avx2`].
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

/// [`row_in_place`] on AVX-512.
///
/// # Safety
/// As [`row_in_place`]; AVX-512F/BW/VL, F16C and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub(super) unsafe fn row_in_place_avx512<S: KvSource>(
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
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_in_place_avx2<S: KvSource>(
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
#[inline(always)]
pub(super) unsafe fn row_in_place<S: KvSource, P: InPlace>(
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
