//! The lanes path on AVX2: 8 (row, query head) lanes a vector over one key tile.

use super::*;

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
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
pub(super) unsafe fn lanes_step_avx2(
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
    use crate::model::kernels::cpu::swiglu::fast_exp_avx2;
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
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn pv_lanes_avx2<const N: usize>(
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
