//! A row's key tiles read in place on AVX-512: decode rows, and the rows of blocks shorter than
//! a full one (a verification of drafts, a short turn), each row in turn over each tile.
//!
//! [`super::tile_step`] takes a tile widened to f32 into a buffer, which pays for itself when
//! many rows share the tile (full prefill row blocks). A decode row uses each tile once, so the
//! widening's stores and reloads were a third of its time; here each vector of 16 keys' element
//! `d`, and each value row, is loaded and widened straight into the arithmetic (a q8_0 tile's
//! int8s times their f16 scales, the product `kv_q8` defines and the widening path stores). The arithmetic
//! is `tile_step`'s operation for operation: the same four FMA chains over the head's elements,
//! the same [`super::tree16`] orders (done across the vector's halves), the same rescale and
//! `p · V` in key order, `fast_exp_avx512` being `fast_exp`. So the bits are those of the
//! portable build, which `attention_rows_are_batch_invariant` and the tests below check.

use std::arch::x86_64::*;

use super::tile_at::{Q8TileAt, TileAt, TileLocation};
use super::{mask16, raise_max, ElemKind, KvElem, State, LANES, V_CHUNK};
use crate::model::kernels::cpu::kv_q8::QK;
use crate::model::kernels::cpu::swiglu::fast_exp_avx512;

/// 16 elements at `src` as f32 (exact).
///
/// # Safety
/// AVX-512F/BW and F16C; `src` holds 16 elements.
#[inline(always)]
unsafe fn load16<E: KvElem>(src: *const E) -> __m512 {
    match E::KIND {
        ElemKind::F32 => _mm512_loadu_ps(src.cast()),
        ElemKind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(src.cast())),
        // bf16: the upper half of an f32.
        ElemKind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(src.cast()),
        ))),
    }
}

/// The elements of `m` at `src` as f32 (the others zero).
///
/// # Safety
/// As [`load16`], for the elements of `m`.
#[inline(always)]
unsafe fn load16_masked<E: KvElem>(src: *const E, m: __mmask16) -> __m512 {
    match E::KIND {
        ElemKind::F32 => _mm512_maskz_loadu_ps(m, src.cast()),
        ElemKind::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src.cast())),
        ElemKind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(m, src.cast()),
        ))),
    }
}

/// The upper 8 lanes of `x`.
#[inline(always)]
unsafe fn upper8(x: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)))
}

/// `tree16(x, |a, b| if b > a { b } else { a })`: lane `l` meets lane `l + n` for n = 8, 4, 2,
/// 1, the upper one as `b`, which is `max_ps(upper, lower)`.
#[inline(always)]
unsafe fn tree16_max(x: __m512) -> f32 {
    let t = _mm256_max_ps(upper8(x), _mm512_castps512_ps256(x));
    let t = _mm_max_ps(_mm256_extractf128_ps::<1>(t), _mm256_castps256_ps128(t));
    let t = _mm_max_ps(_mm_movehl_ps(t, t), t);
    _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(t), t))
}

/// `tree16(x, |a, b| a + b)`, in the same pairing as [`tree16_max`].
#[inline(always)]
unsafe fn tree16_sum(x: __m512) -> f32 {
    let t = _mm256_add_ps(_mm512_castps512_ps256(x), upper8(x));
    let t = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
    let t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
}

/// One tile of one K/V head as the in-place kernel reads it: 16 keys' element `d` and a value
/// row's 16 elements, widened to f32 with the values the widening path stores.
pub(super) trait TileRead: TileLocation {
    /// Whether K elements carry a scale per group of [`QK`] elements ([`TileRead::k_scales`]).
    const SCALED: bool;

    /// Element `d` of the tile's 16 keys as f32, `scales` being [`TileRead::k_scales`] of its
    /// group when [`TileRead::SCALED`] (ignored otherwise).
    ///
    /// # Safety
    /// AVX-512F/BW/VL and F16C; `d < hd`; the tile lies in the cache.
    unsafe fn k16(self, d: usize, scales: __m512) -> __m512;

    /// The 16 keys' scales of group `j` (only called when [`TileRead::SCALED`]).
    ///
    /// # Safety
    /// As [`TileRead::k16`], for a group of the head.
    unsafe fn k_scales(self, j: usize) -> __m512;

    /// Elements `off..off + 16` of key `l`'s value row as f32, those outside `m` zero; `off` is
    /// a multiple of 16.
    ///
    /// # Safety
    /// As [`TileRead::k16`]; the elements of `m` lie in the head's row.
    unsafe fn v16(self, l: usize, off: usize, m: __mmask16) -> __m512;
}

impl<E: KvElem> TileRead for TileAt<E> {
    const SCALED: bool = false;

    #[inline(always)]
    unsafe fn k16(self, d: usize, _: __m512) -> __m512 {
        load16(self.k.add(d * self.k_stride))
    }

    #[inline(always)]
    unsafe fn k_scales(self, _: usize) -> __m512 {
        _mm512_setzero_ps()
    }

    #[inline(always)]
    unsafe fn v16(self, l: usize, off: usize, m: __mmask16) -> __m512 {
        let src = self.v.add(l * self.v_stride + off);
        if m == 0xffff {
            load16(src)
        } else {
            load16_masked(src, m)
        }
    }
}

impl TileRead for Q8TileAt {
    const SCALED: bool = true;

    #[inline(always)]
    unsafe fn k16(self, d: usize, scales: __m512) -> __m512 {
        let q = _mm_loadu_si128(self.k_q.add(d * self.k_stride).cast());
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scales)
    }

    #[inline(always)]
    unsafe fn k_scales(self, j: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(
            self.k_scales.add(j * self.scale_stride).cast(),
        ))
    }

    #[inline(always)]
    unsafe fn v16(self, l: usize, off: usize, m: __mmask16) -> __m512 {
        // `off` is a multiple of 16, so the 16 elements lie in one group of 32.
        let group = self.v.add(l * self.v_stride + off / QK * (QK + 2));
        let q = _mm_maskz_loadu_epi8(m, group.add(2 + off % QK).cast());
        let bits = group.cast::<i16>().read_unaligned();
        let scale = _mm512_cvtph_ps(_mm256_set1_epi16(bits));
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale)
    }
}

/// One tile for query heads `h0..h0 + N` of one row (`q` holds the row's group of heads): what
/// [`super::tile_step`] computes from the widened tile, read in place. Returns N.
///
/// # Safety
/// AVX-512F/BW/VL, F16C and FMA; `at` addresses a tile of `hd`-element keys and values that lies
/// in the cache (all 16 keys' K, the value rows of the lanes `lanes.0..=lanes.1`); `acc` holds
/// the group's `hd`-float accumulators.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
pub(super) unsafe fn tile_step_in_place<T: TileRead, const N: usize>(
    q: &[f32],
    h0: usize,
    hd: usize,
    at: T,
    lanes: (usize, usize),
    scale: f32,
    acc: &mut [f32],
    st: &mut State,
) -> usize {
    let q = &q[h0 * hd..(h0 + N) * hd];
    let acc = &mut acc[h0 * hd..(h0 + N) * hd];
    let (a, b) = lanes;
    debug_assert!(a <= b && b < LANES);
    let valid = (((1u32 << (b + 1)) - 1) & !((1u32 << a) - 1)) as __mmask16;
    let zero = _mm512_setzero_ps();
    // Scores: element d of the head into chain d % 4, in order.
    let mut c = [[zero; 4]; N];
    let qp = q.as_ptr();
    let body = hd - hd % 4;
    // A q8_0 tile's scales of the current group (QK is a multiple of 4, so a group starts at a
    // step of the loops below).
    let mut scales = zero;
    let mut d = 0;
    while d < body {
        if T::SCALED && d % QK == 0 {
            scales = at.k_scales(d / QK);
        }
        for j in 0..4 {
            let k = at.k16(d + j, scales);
            for h in 0..N {
                let x = _mm512_set1_ps(*qp.add(h * hd + d + j));
                c[h][j] = _mm512_fmadd_ps(x, k, c[h][j]);
            }
        }
        d += 4;
    }
    for d in body..hd {
        if T::SCALED && d % QK == 0 {
            scales = at.k_scales(d / QK);
        }
        let k = at.k16(d, scales);
        for h in 0..N {
            let x = _mm512_set1_ps(*qp.add(h * hd + d));
            c[h][d % 4] = _mm512_fmadd_ps(x, k, c[h][d % 4]);
        }
    }
    let mut p = [[0f32; LANES]; N];
    let mut corr = [1f32; N];
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    for h in 0..N {
        let x = _mm512_mul_ps(
            _mm512_add_ps(
                _mm512_add_ps(c[h][0], c[h][1]),
                _mm512_add_ps(c[h][2], c[h][3]),
            ),
            _mm512_set1_ps(scale),
        );
        let s = _mm512_mask_blend_ps(valid, neg_inf, x);
        let tile_max = tree16_max(s);
        let (mx, sum) = (&mut st.mx[h0 + h], &mut st.sum[h0 + h]);
        corr[h] = raise_max(mx, tile_max);
        let e = fast_exp_avx512(_mm512_sub_ps(s, _mm512_set1_ps(*mx)));
        let ph = _mm512_maskz_mov_ps(valid, e);
        _mm512_storeu_ps(p[h].as_mut_ptr(), ph);
        *sum = *sum * corr[h] + tree16_sum(ph);
    }
    // acc = acc * corr, then acc += p · V in key order, V_CHUNK outputs per head in registers.
    let ap = acc.as_mut_ptr();
    let mut d0 = 0;
    while d0 < hd {
        let w = V_CHUNK.min(hd - d0);
        let nv = w.div_ceil(LANES);
        let mut masks = [0xffff as __mmask16; V_CHUNK / LANES];
        masks[nv - 1] = mask16(w - (nv - 1) * LANES);
        let mut r = [[zero; V_CHUNK / LANES]; N];
        for h in 0..N {
            for x in 0..nv {
                let o = ap.add(h * hd + d0 + x * LANES);
                r[h][x] = _mm512_maskz_loadu_ps(masks[x], o);
                if corr[h] != 1.0 {
                    r[h][x] = _mm512_mul_ps(r[h][x], _mm512_set1_ps(corr[h]));
                }
            }
        }
        for l in a..=b {
            let mut vr = [zero; V_CHUNK / LANES];
            for x in 0..nv {
                vr[x] = at.v16(l, d0 + x * LANES, masks[x]);
            }
            for h in 0..N {
                let ph = _mm512_set1_ps(p[h][l]);
                for x in 0..nv {
                    r[h][x] = _mm512_fmadd_ps(ph, vr[x], r[h][x]);
                }
            }
        }
        for h in 0..N {
            for x in 0..nv {
                _mm512_mask_storeu_ps(ap.add(h * hd + d0 + x * LANES), masks[x], r[h][x]);
            }
        }
        d0 += w;
    }
    N
}
