//! The lanes path on AVX-512: 16 (row, query head) lanes a vector over one key tile.

use super::*;

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
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
pub(super) unsafe fn lanes_step_avx512(
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
    use crate::model::kernels::cpu::swiglu::fast_exp_avx512;
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
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn pv_lanes_avx512<const N: usize>(
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
