//! A row's key tiles read in place on AVX2: decode rows and the rows of short blocks, as
//! [`super::row_avx512`] is on AVX-512.
//!
//! A tile's 16 keys are two vectors of 8 here. The arithmetic is [`super::tile_step`]'s
//! operation for operation, so the bits are those of the portable build (which
//! `attention_rows_are_batch_invariant` and `in_place_rows_equal_the_portable_build` check):
//! each half's scores come from the same four FMA chains over the head's elements (element `d`
//! into chain `d % 4`), run two chains at a time so that four heads' accumulators fit the 16
//! registers (the chains are independent, so their interleaving changes no result); the same
//! [`super::tree16`] orders (lane `l` meets lane `l + 8` first: the two halves); the same
//! rescale and `p · V` in key order, with 16 outputs per head held in registers at a time.
//! `fast_exp_avx2` is `fast_exp`.
//!
//! Taken when the head dimension is a multiple of 8 (whole vectors of a value row); other
//! heads take the widening path.

use std::arch::x86_64::*;

use super::tile_at::{Q8TileAt, TileAt, TileLocation};
use super::{raise_max, ElemKind, KvElem, State, LANES};
use crate::model::kernels::cpu::kv_q8::QK;
use crate::model::kernels::cpu::swiglu::fast_exp_avx2;

/// Value-row outputs per head held in registers in one pass over the tile (2 vectors: four
/// heads' accumulators and the value vectors fit the 16 registers).
const V_CHUNK8: usize = 16;

/// 8 elements at `src` as f32 (exact).
///
/// # Safety
/// AVX2 and F16C; `src` holds 8 elements.
#[inline(always)]
unsafe fn load8<E: KvElem>(src: *const E) -> __m256 {
    match E::KIND {
        ElemKind::F32 => _mm256_loadu_ps(src.cast()),
        ElemKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(src.cast())),
        // bf16: the upper half of an f32.
        ElemKind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(src.cast()),
        ))),
    }
}

/// 8 int8s at `q` times `scales` (a q8_0 element, exact in f32).
///
/// # Safety
/// AVX2; `q` holds 8 bytes.
#[inline(always)]
unsafe fn q8x8(q: *const i8, scales: __m256) -> __m256 {
    let q = _mm_loadl_epi64(q.cast());
    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scales)
}

/// `tree16(x, |a, b| if b > a { b } else { a })` of the 16 lanes `lo, hi`: lane `l` meets lane
/// `l + n` for n = 8, 4, 2, 1, the upper one as `b`, which is `max_ps(upper, lower)`.
#[inline(always)]
unsafe fn tree16_max(lo: __m256, hi: __m256) -> f32 {
    let t = _mm256_max_ps(hi, lo);
    let t = _mm_max_ps(_mm256_extractf128_ps::<1>(t), _mm256_castps256_ps128(t));
    let t = _mm_max_ps(_mm_movehl_ps(t, t), t);
    _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(t), t))
}

/// `tree16(x, |a, b| a + b)` of `lo, hi`, in the same pairing as [`tree16_max`].
#[inline(always)]
unsafe fn tree16_sum(lo: __m256, hi: __m256) -> f32 {
    let t = _mm256_add_ps(lo, hi);
    let t = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
    let t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
}

/// One tile of one K/V head as the in-place kernel reads it on AVX2: 8 keys' element `d` and
/// 8 elements of a value row, widened to f32 with the values the widening path stores.
pub(super) trait TileRead: TileLocation {
    /// Whether K elements carry a scale per group of [`QK`] elements ([`TileRead::k_scales`]).
    const SCALED: bool;

    /// Element `d` of keys `8 * half..8 * half + 8` of the tile as f32, `scales` being
    /// [`TileRead::k_scales`] of its group and half when [`TileRead::SCALED`] (ignored
    /// otherwise).
    ///
    /// # Safety
    /// AVX2 and F16C; `d < hd`, `half < 2`; the tile lies in the cache.
    unsafe fn k8(self, d: usize, half: usize, scales: __m256) -> __m256;

    /// The scales of group `j` of keys `8 * half..8 * half + 8` (only called when
    /// [`TileRead::SCALED`]).
    ///
    /// # Safety
    /// As [`TileRead::k8`], for a group of the head.
    unsafe fn k_scales(self, j: usize, half: usize) -> __m256;

    /// Elements `off..off + 8` of key `l`'s value row as f32; `off` is a multiple of 8.
    ///
    /// # Safety
    /// As [`TileRead::k8`]; the elements lie in the head's row.
    unsafe fn v8(self, l: usize, off: usize) -> __m256;
}

impl<E: KvElem> TileRead for TileAt<E> {
    const SCALED: bool = false;

    #[inline(always)]
    unsafe fn k8(self, d: usize, half: usize, _: __m256) -> __m256 {
        load8(self.k.add(d * self.k_stride + 8 * half))
    }

    #[inline(always)]
    unsafe fn k_scales(self, _: usize, _: usize) -> __m256 {
        _mm256_setzero_ps()
    }

    #[inline(always)]
    unsafe fn v8(self, l: usize, off: usize) -> __m256 {
        load8(self.v.add(l * self.v_stride + off))
    }
}

impl TileRead for Q8TileAt {
    const SCALED: bool = true;

    #[inline(always)]
    unsafe fn k8(self, d: usize, half: usize, scales: __m256) -> __m256 {
        q8x8(self.k_q.add(d * self.k_stride + 8 * half), scales)
    }

    #[inline(always)]
    unsafe fn k_scales(self, j: usize, half: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(
            self.k_scales.add(j * self.scale_stride + 16 * half).cast(),
        ))
    }

    #[inline(always)]
    unsafe fn v8(self, l: usize, off: usize) -> __m256 {
        // `off` is a multiple of 8, so the 8 elements lie in one group of 32.
        let group = self.v.add(l * self.v_stride + off / QK * (QK + 2));
        let bits = group.cast::<i16>().read_unaligned();
        let scale = _mm256_cvtph_ps(_mm_set1_epi16(bits));
        q8x8(group.add(2 + off % QK).cast(), scale)
    }
}

/// Two of the four score chains (`j0`, `j0 + 1`) of heads `0..N` over keys `8 * half..8 * half
/// + 8`, added: `c[j0] + c[j0 + 1]` per head, each chain's FMAs in element order.
///
/// # Safety
/// As [`tile_step_in_place`]; `hd` is a multiple of 4.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn chain_pair<T: TileRead, const N: usize>(
    q: *const f32,
    hd: usize,
    at: T,
    half: usize,
    j0: usize,
) -> [__m256; N] {
    let zero = _mm256_setzero_ps();
    let mut c = [[zero; 2]; N];
    let mut scales = zero;
    let mut d = 0;
    while d < hd {
        if T::SCALED && d % QK == 0 {
            scales = at.k_scales(d / QK, half);
        }
        for j in 0..2 {
            let k = at.k8(d + j0 + j, half, scales);
            for h in 0..N {
                let x = _mm256_broadcast_ss(&*q.add(h * hd + d + j0 + j));
                c[h][j] = _mm256_fmadd_ps(x, k, c[h][j]);
            }
        }
        d += 4;
    }
    // A loop, not `array::from_fn`: a closure would not inherit the caller's features.
    let mut sum = [zero; N];
    for h in 0..N {
        sum[h] = _mm256_add_ps(c[h][0], c[h][1]);
    }
    sum
}

/// One tile for query heads `h0..h0 + N` of one row (`q` holds the row's group of heads): what
/// [`super::tile_step`] computes from the widened tile, read in place. Returns N.
///
/// # Safety
/// AVX2, F16C and FMA; `hd` is a multiple of 8; `at` addresses a tile of `hd`-element keys and
/// values that lies in the cache (all 16 keys' K, the value rows of the lanes
/// `lanes.0..=lanes.1`); `acc` holds the group's `hd`-float accumulators.
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
    debug_assert!(hd.is_multiple_of(8));
    let q = &q[h0 * hd..(h0 + N) * hd];
    let acc = &mut acc[h0 * hd..(h0 + N) * hd];
    let (a, b) = lanes;
    debug_assert!(a <= b && b < LANES);
    let mut valid_bits = [0i32; LANES];
    for v in &mut valid_bits[a..=b] {
        *v = -1;
    }
    let valid = [
        _mm256_castsi256_ps(_mm256_loadu_si256(valid_bits.as_ptr().cast())),
        _mm256_castsi256_ps(_mm256_loadu_si256(valid_bits.as_ptr().add(8).cast())),
    ];
    // Scores ((c0 + c1) + (c2 + c3)) * scale, the invisible lanes -inf.
    let mut s = [[_mm256_setzero_ps(); 2]; N];
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    for half in 0..2 {
        let c01 = chain_pair::<T, N>(q.as_ptr(), hd, at, half, 0);
        let c23 = chain_pair::<T, N>(q.as_ptr(), hd, at, half, 2);
        for h in 0..N {
            let x = _mm256_mul_ps(_mm256_add_ps(c01[h], c23[h]), _mm256_set1_ps(scale));
            s[h][half] = _mm256_blendv_ps(neg_inf, x, valid[half]);
        }
    }
    let mut p = [[0f32; LANES]; N];
    let mut corr = [1f32; N];
    for h in 0..N {
        let tile_max = tree16_max(s[h][0], s[h][1]);
        let (mx, sum) = (&mut st.mx[h0 + h], &mut st.sum[h0 + h]);
        corr[h] = raise_max(mx, tile_max);
        let m = _mm256_set1_ps(*mx);
        let mut e = [_mm256_setzero_ps(); 2];
        for i in 0..2 {
            e[i] = _mm256_and_ps(fast_exp_avx2(_mm256_sub_ps(s[h][i], m)), valid[i]);
        }
        _mm256_storeu_ps(p[h].as_mut_ptr(), e[0]);
        _mm256_storeu_ps(p[h].as_mut_ptr().add(8), e[1]);
        *sum = *sum * corr[h] + tree16_sum(e[0], e[1]);
    }
    // acc = acc * corr, then acc += p · V in key order, V_CHUNK8 outputs per head in registers.
    let ap = acc.as_mut_ptr();
    let mut d0 = 0;
    while d0 < hd {
        let nv = (hd - d0).min(V_CHUNK8) / 8;
        let mut r = [[_mm256_setzero_ps(); V_CHUNK8 / 8]; N];
        for h in 0..N {
            for x in 0..nv {
                r[h][x] = _mm256_loadu_ps(ap.add(h * hd + d0 + 8 * x));
                if corr[h] != 1.0 {
                    r[h][x] = _mm256_mul_ps(r[h][x], _mm256_set1_ps(corr[h]));
                }
            }
        }
        for l in a..=b {
            let mut vr = [_mm256_setzero_ps(); V_CHUNK8 / 8];
            for x in 0..nv {
                vr[x] = at.v8(l, d0 + 8 * x);
            }
            for h in 0..N {
                let ph = _mm256_set1_ps(p[h][l]);
                for x in 0..nv {
                    r[h][x] = _mm256_fmadd_ps(ph, vr[x], r[h][x]);
                }
            }
        }
        for h in 0..N {
            for x in 0..nv {
                _mm256_storeu_ps(ap.add(h * hd + d0 + 8 * x), r[h][x]);
            }
        }
        d0 += 8 * nv;
    }
    N
}
