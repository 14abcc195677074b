//! The x86-64 kernels of the linear layer: AVX-512 (16 lanes) and AVX2+FMA (8 lanes), the
//! weights widened to f32 in registers; `super`'s drivers pick one at run time.

use super::Out;
use std::arch::x86_64::*;

// ---- AVX-512: 16 lanes; weights widened to f32 in registers. ----

/// The fixed reduction tree of a 16-lane accumulator: lanes `i + (i+8)`, then `i + (i+4)`,
/// then `i + (i+2)`, then `0 + 1`. Written out (not `_mm512_reduce_add_ps`, whose order
/// the compiler may choose) so that every kernel reduces identically.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(super) unsafe fn hsum512(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    _mm_cvtss_f32(s1)
}

/// `hsum512` of 16 accumulators at once, with the same tree for each (every level adds
/// the same lane pairs; only the packing differs): lane `4j + p` of the result is the sum
/// of `v[4p + j]`. 30 shuffles and 15 adds instead of 16 x (4 shuffles + 4 adds).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(super) unsafe fn hsum512_x16(v: &[__m512; 16]) -> __m512 {
    // Lanes i + (i+8): l1[j] = [v[2j] | v[2j+1]], 8 lanes each.
    let mut l1 = [_mm512_setzero_ps(); 8];
    for (j, o) in l1.iter_mut().enumerate() {
        let (a, b) = (v[2 * j], v[2 * j + 1]);
        *o = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        );
    }
    // Lanes i + (i+4): l2[j] = [v[4j] | .. | v[4j+3]], 4 lanes each.
    let mut l2 = [_mm512_setzero_ps(); 4];
    for (j, o) in l2.iter_mut().enumerate() {
        let (a, b) = (l1[2 * j], l1[2 * j + 1]);
        *o = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        );
    }
    // Lanes i + (i+2), within 128-bit lanes: l3[j] lane q = [v[8j+q] x2 | v[8j+4+q] x2].
    let mut l3 = [_mm512_setzero_ps(); 2];
    for (j, o) in l3.iter_mut().enumerate() {
        let (a, b) = (l2[2 * j], l2[2 * j + 1]);
        *o = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        );
    }
    // Lanes 0 + 1: lane q = [v[q], v[4+q], v[8+q], v[12+q]].
    let (a, b) = (l3[0], l3[1]);
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(a, b),
        _mm512_shuffle_ps::<0xDD>(a, b),
    )
}

/// The sums of an R x T block of accumulators (`acc[t][r]`), each by the `hsum512` tree:
/// sixteen at a time through `hsum512_x16` (fewer than 4 one by one).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn reduce<const R: usize, const T: usize>(acc: &[[__m512; R]; T]) -> [[f32; R]; T] {
    let mut o = [[0f32; R]; T];
    let total = R * T;
    if total < 4 {
        for t in 0..T {
            for r in 0..R {
                o[t][r] = hsum512(acc[t][r]);
            }
        }
        return o;
    }
    let mut i0 = 0;
    while i0 < total {
        let cnt = (total - i0).min(16);
        // Accumulator i (token i / R, row i % R) goes in as v[q], q = i - i0 = 4p + j,
        // and comes out in lane 4j + p.
        let mut v = [_mm512_setzero_ps(); 16];
        for (q, vq) in v.iter_mut().enumerate().take(cnt) {
            let i = i0 + q;
            *vq = acc[i / R][i % R];
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), hsum512_x16(&v));
        for q in 0..cnt {
            let i = i0 + q;
            o[i / R][i % R] = lanes[4 * (q % 4) + q / 4];
        }
        i0 += 16;
    }
    o
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn l512_bf16(p: *const u16) -> __m512 {
    // bf16 is the top half of an f32: zero-extend to 32 bits and shift left by 16.
    let h = _mm256_loadu_si256(p.cast());
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn l512m_bf16(p: *const u16, m: __mmask16) -> __m512 {
    let h = _mm256_maskz_loadu_epi16(m, p.cast());
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn l512_f16(p: *const u16) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
}
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn l512m_f16(p: *const u16, m: __mmask16) -> __m512 {
    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast()))
}
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn l512_f32(p: *const f32) -> __m512 {
    _mm512_loadu_ps(p)
}
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn l512m_f32(p: *const f32, m: __mmask16) -> __m512 {
    _mm512_maskz_loadu_ps(m, p)
}

/// Generates, for one weight element type: the column loop of an R x T block (R weight
/// rows x T tokens, one 16-lane accumulator each), the whole-row block, and the stream
/// driver around it.
macro_rules! avx512_rows {
    ($rows:ident, $steps:ident, $block:ident, $elem:ty, $ld:ident, $ldm:ident) => {
        /// `acc[t][r] +=` columns `0..len` of weight row `r` (`w + r*wk`) times token row
        /// `t` (`x + t*xk`): lane `l` takes the columns `c ≡ l (mod 16)` in order, one FMA
        /// each; past the last multiple of 16, one masked step (lanes past `len` add
        /// 0 * 0). The pointers may start at any multiple of 16 columns into the rows:
        /// this continues the same per-lane sums.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        #[inline]
        unsafe fn $steps<const R: usize, const T: usize, const PF: bool>(
            w: *const $elem,
            wk: usize,
            x: *const f32,
            xk: usize,
            acc: &mut [[__m512; R]; T],
            len: usize,
        ) {
            let mut c = 0;
            while c + 16 <= len {
                let mut wv = [_mm512_setzero_ps(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    *v = $ld(w.add(r * wk + c));
                    // Rows are short (~1 KiB) streams, too short for the hardware
                    // prefetcher to ramp up: fetch the next row group's line explicitly.
                    if PF {
                        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((R + r) * wk + c).cast());
                    }
                }
                for (t, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_loadu_ps(x.add(t * xk + c));
                    for r in 0..R {
                        a[r] = _mm512_fmadd_ps(wv[r], xv, a[r]);
                    }
                }
                c += 16;
            }
            if c < len {
                let mask = ((1u32 << (len - c)) - 1) as __mmask16;
                let mut wv = [_mm512_setzero_ps(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    *v = $ldm(w.add(r * wk + c), mask);
                }
                for (t, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_maskz_loadu_ps(mask, x.add(t * xk + c));
                    for r in 0..R {
                        a[r] = _mm512_fmadd_ps(wv[r], xv, a[r]);
                    }
                }
            }
        }

        /// The R x T dot products of whole rows, reduced (`PF`: prefetch the next R rows).
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        #[inline]
        unsafe fn $block<const R: usize, const T: usize, const PF: bool>(
            w: *const $elem,
            k: usize,
            x: *const f32,
        ) -> [[f32; R]; T] {
            let mut acc = [[_mm512_setzero_ps(); R]; T];
            $steps::<R, T, PF>(w, k, x, k, &mut acc, k);
            reduce(&acc)
        }

        /// Stream driver: rows `r0..r1` for all `n` tokens, each group of weight rows read
        /// from memory once. Up to [`ONE_ROW_MAX_TOKENS`] tokens (decode) over rows of at
        /// most [`ONE_ROW_MAX_K`] columns: one row at a time, unprefetched, so the task's rows
        /// are one sequential stream that the hardware prefetcher follows. Up to 4 tokens: groups of 4 rows (4x4 accumulators
        /// and 4 weight vectors fit in 32 zmm), the next group prefetched. More tokens:
        /// groups of 3 rows against tiles of up to 8 tokens (24 accumulators), so that a
        /// weight vector is widened once per 8 tokens, not once per 4 (widening takes a
        /// shuffle-port uop that the FMAs also need).
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        pub(super) unsafe fn $rows(
            w: *const $elem,
            k: usize,
            r0: usize,
            r1: usize,
            x: *const f32,
            n: usize,
            out: Out,
        ) {
            // One R-row group against token tiles of up to T tokens (T <= 8).
            macro_rules! group {
                ($R:literal, $T:literal, $PF:literal, $wr:expr, $r:expr) => {{
                    let mut t = 0;
                    while t < n {
                        let xt = x.add(t * k);
                        let tt = (n - t).min($T);
                        match tt {
                            1 => out.store(&$block::<$R, 1, $PF>($wr, k, xt), t, $r),
                            2 => out.store(&$block::<$R, 2, $PF>($wr, k, xt), t, $r),
                            3 => out.store(&$block::<$R, 3, $PF>($wr, k, xt), t, $r),
                            4 => out.store(&$block::<$R, 4, $PF>($wr, k, xt), t, $r),
                            5 => out.store(&$block::<$R, 5, $PF>($wr, k, xt), t, $r),
                            6 => out.store(&$block::<$R, 6, $PF>($wr, k, xt), t, $r),
                            7 => out.store(&$block::<$R, 7, $PF>($wr, k, xt), t, $r),
                            _ => out.store(&$block::<$R, 8, $PF>($wr, k, xt), t, $r),
                        }
                        t += tt;
                    }
                }};
            }
            // 8-token tiles while 8 token rows stay in L1 beside the weights (k <= 768:
            // 24 KiB); past that the x traffic of 3-row groups outweighs what they save.
            let wide = n > 4 && n <= 16 && k <= WIDE_TILE_MAX_K;
            let one_row = n <= ONE_ROW_MAX_TOKENS && k <= ONE_ROW_MAX_K;
            let mut r = r0;
            while r < r1 {
                let wr = w.add(r * k);
                let left = r1 - r;
                if one_row {
                    group!(1, 4, false, wr, r);
                    r += 1;
                } else if wide && left >= 3 {
                    group!(3, 8, true, wr, r);
                    r += 3;
                } else if wide {
                    group!(1, 8, true, wr, r);
                    r += 1;
                } else if left >= 4 {
                    group!(4, 4, true, wr, r);
                    r += 4;
                } else {
                    group!(1, 4, true, wr, r);
                    r += 1;
                }
            }
        }
    };
}

avx512_rows!(
    rows_avx512_bf16,
    steps512_bf16,
    blk512_bf16,
    u16,
    l512_bf16,
    l512m_bf16
);
avx512_rows!(
    rows_avx512_f16,
    steps512_f16,
    blk512_f16,
    u16,
    l512_f16,
    l512m_f16
);
avx512_rows!(
    rows_avx512_f32,
    steps512_f32,
    blk512_f32,
    f32,
    l512_f32,
    l512m_f32
);

/// Longest rows for which the stream driver uses 3-row x 8-token tiles (see `$rows`).
const WIDE_TILE_MAX_K: usize = 768;

/// Tokens up to which the AVX-512 stream driver reads one weight row at a time, unprefetched:
/// a decode step's weights as one sequential stream, which the hardware prefetcher follows
/// closer to the memory's rate than 4 interleaved rows with explicit prefetches
/// (docs/benchmarks.md, "Decode of float weights: one row at a time"). Past it the widening
/// of each weight vector is shared by too few tokens. The AVX2 driver does so for one token
/// only (at two, its 8-lane widening already costs more than the stream saves).
const ONE_ROW_MAX_TOKENS: usize = 2;
/// Longest rows read one at a time: the token's f32 row (16 KiB here) stays in L1 beside the
/// stream. Longer ones (a down projection's) are read by 4-row groups, which load each input
/// vector once for 4 rows instead of once a row from L2.
const ONE_ROW_MAX_K: usize = 4096;

/// The panel driver's register tile: PANEL_R weight rows x PANEL_T tokens.
const PANEL_R: usize = 4;
const PANEL_T: usize = 6;
/// Columns per pass of the panel driver: with 4 weight rows and 6 token rows of this many
/// f32 in flight (30 KiB), a token tile stays in L1 from one row group to the next.
const PANEL_COLS: usize = 768;
/// Rows whose accumulators are parked between column passes.
const PARK_ROWS: usize = 256;

/// One R x T tile over columns `c0..c1`: weight rows `w + r*k`, the tile's token rows
/// (columns `c0..c1` only) at `xt + t*xk`. Starts from zero (`first`) or from the parked
/// accumulators in `slot`; ends by parking them again, or (`last`) by reducing and storing.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn pass_f32<const R: usize, const T: usize>(
    w: *const f32,
    k: usize,
    (xt, xk): (*const f32, usize),
    slot: &mut [__m512; PANEL_R * PANEL_T],
    (c0, c1): (usize, usize),
    (first, last): (bool, bool),
    out: Out,
    (t, r): (usize, usize),
) {
    let mut acc = [[_mm512_setzero_ps(); R]; T];
    if !first {
        for (tt, a) in acc.iter_mut().enumerate() {
            for (rr, v) in a.iter_mut().enumerate() {
                *v = slot[tt * R + rr];
            }
        }
    }
    // The panel is in L2 and read in order: no software prefetch.
    steps512_f32::<R, T, false>(w.add(c0), k, xt, xk, &mut acc, c1 - c0);
    if last {
        out.store(&reduce(&acc), t, r);
    } else {
        for (tt, a) in acc.iter().enumerate() {
            for (rr, v) in a.iter().enumerate() {
                slot[tt * R + rr] = *v;
            }
        }
    }
}

/// `pass_f32::<R, tt>(args)` for a run-time `tt` in `1..=PANEL_T`.
macro_rules! pass_tt {
    ($r:literal, $tt:expr, $args:tt, [$($t:literal),*]) => {
        match $tt {
            $($t => pass_f32::<$r, $t> $args,)*
            _ => unreachable!(),
        }
    };
}

/// Panel driver: rows `0..rows` of a cached f32 panel for all `n` tokens, in tiles of
/// PANEL_R rows x up to PANEL_T tokens; each token tile stays in L1 while the row groups
/// of the (L2-resident) panel pass it. Rows longer than `PANEL_COLS` go in several column
/// passes, the accumulators parked in between: the same FMAs in the same order, so the
/// same bits as the stream driver.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn panel_avx512_f32(
    w: *const f32,
    k: usize,
    rows: usize,
    x: *const f32,
    n: usize,
    out: Out,
) {
    let passes = k.div_ceil(PANEL_COLS);
    let kc = k.div_ceil(passes).next_multiple_of(16);
    let sub = if passes == 1 { rows } else { PARK_ROWS };
    // Parked accumulators, one slot per group of PANEL_R rows and per single row after
    // them; one pass parks nothing (a single slot, never read), so only then is the
    // 100 KiB store set up.
    let mut one = [[_mm512_setzero_ps(); PANEL_R * PANEL_T]; 1];
    let mut all;
    let park: &mut [[__m512; PANEL_R * PANEL_T]] = if passes == 1 {
        &mut one
    } else {
        all = [[_mm512_setzero_ps(); PANEL_R * PANEL_T]; PARK_ROWS / PANEL_R + PANEL_R];
        &mut all
    };
    // The token tile's columns of one pass, 64-byte aligned (row stride kc, a multiple of
    // 16): activation rows are not, and split loads would halve the L1 bandwidth.
    let mut xbuf = XTile([0.0; PANEL_T * PANEL_COLS]);
    let mut s0 = 0;
    while s0 < rows {
        let s1 = (s0 + sub).min(rows);
        let mut t = 0;
        while t < n {
            let tt = (n - t).min(PANEL_T);
            let mut c0 = 0;
            while c0 < k {
                let c1 = (c0 + kc).min(k);
                for j in 0..tt {
                    let src = std::slice::from_raw_parts(x.add((t + j) * k + c0), c1 - c0);
                    xbuf.0[j * kc..j * kc + (c1 - c0)].copy_from_slice(src);
                }
                let xt = (xbuf.0.as_ptr(), kc);
                let fl = (c0 == 0, c1 == k);
                let mut r = s0;
                let mut g = 0;
                while r < s1 {
                    let full = s1 - r >= PANEL_R;
                    let wr = w.add(r * k);
                    let slot = &mut park[if passes == 1 { 0 } else { g }];
                    let c = (c0, c1);
                    if full {
                        pass_tt!(
                            4,
                            tt,
                            (wr, k, xt, slot, c, fl, out, (t, r)),
                            [1, 2, 3, 4, 5, 6]
                        );
                    } else {
                        pass_tt!(
                            1,
                            tt,
                            (wr, k, xt, slot, c, fl, out, (t, r)),
                            [1, 2, 3, 4, 5, 6]
                        );
                    }
                    r += if full { PANEL_R } else { 1 };
                    g += 1;
                }
                c0 = c1;
            }
            t += tt;
        }
        s0 = s1;
    }
}

#[repr(C, align(64))]
struct XTile([f32; PANEL_T * PANEL_COLS]);

// ---- AVX2 + FMA: 8 lanes, scalar tail. ----

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn l256_bf16(p: *const u16) -> __m256 {
    let h = _mm_loadu_si128(p.cast());
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn l256_f16(p: *const u16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn l256_f32(p: *const f32) -> __m256 {
    _mm256_loadu_ps(p)
}
#[inline(always)]
fn s_bf16(v: u16) -> f32 {
    f32::from_bits((v as u32) << 16)
}
#[inline(always)]
fn s_f16(v: u16) -> f32 {
    half::f16::from_bits(v).to_f32()
}
#[inline(always)]
fn s_f32(v: f32) -> f32 {
    v
}

/// The fixed reduction tree of an 8-lane accumulator: `i + (i+4)`, `i + (i+2)`, `0 + 1`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

macro_rules! avx2_rows {
    ($rows:ident, $block:ident, $elem:ty, $ld:ident, $sc:ident) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn $block<const R: usize, const T: usize, const PF: bool>(
            w: *const $elem,
            k: usize,
            x: *const f32,
        ) -> [[f32; R]; T] {
            let mut acc = [[_mm256_setzero_ps(); R]; T];
            let mut c = 0;
            while c + 8 <= k {
                let mut wv = [_mm256_setzero_ps(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    *v = $ld(w.add(r * k + c));
                    // Next row group's line: see the AVX-512 kernel.
                    if PF {
                        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((R + r) * k + c).cast());
                    }
                }
                for (t, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(t * k + c));
                    for r in 0..R {
                        a[r] = _mm256_fmadd_ps(wv[r], xv, a[r]);
                    }
                }
                c += 8;
            }
            let mut o = [[0f32; R]; T];
            for t in 0..T {
                for r in 0..R {
                    let mut s = hsum256(acc[t][r]);
                    for cc in c..k {
                        s += $sc(*w.add(r * k + cc)) * *x.add(t * k + cc);
                    }
                    o[t][r] = s;
                }
            }
            o
        }

        /// Rows `r0..r1` for all `n` tokens, in blocks of 3 rows x up to 4 tokens: 12
        /// accumulators, 3 weight vectors and the token's vector fill the 16 ymm registers,
        /// and each weight vector loaded serves 4 tokens (a 4x2 block's served 2, which left
        /// the FMAs waiting on loads); one token (decode) over rows of at most
        /// [`ONE_ROW_MAX_K`] columns, one row at a time, unprefetched, as the AVX-512 driver
        /// ([`ONE_ROW_MAX_TOKENS`]). Every output's arithmetic is the
        /// block's whatever its shape (lane-strided FMA chains, `hsum256`, the scalar tail),
        /// so the tiling does not change a bit.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $rows(
            w: *const $elem,
            k: usize,
            r0: usize,
            r1: usize,
            x: *const f32,
            n: usize,
            out: Out,
        ) {
            let one_row = n == 1 && k <= ONE_ROW_MAX_K;
            let mut r = r0;
            while r < r1 {
                let wr = w.add(r * k);
                if one_row {
                    out.store(&$block::<1, 1, false>(wr, k, x), 0, r);
                    r += 1;
                    continue;
                }
                let three = r1 - r >= 3;
                let mut t = 0;
                while t < n {
                    let xt = x.add(t * k);
                    let tt = (n - t).min(4);
                    match (three, tt) {
                        (true, 1) => out.store(&$block::<3, 1, true>(wr, k, xt), t, r),
                        (true, 2) => out.store(&$block::<3, 2, true>(wr, k, xt), t, r),
                        (true, 3) => out.store(&$block::<3, 3, true>(wr, k, xt), t, r),
                        (true, _) => out.store(&$block::<3, 4, true>(wr, k, xt), t, r),
                        (false, 1) => out.store(&$block::<1, 1, true>(wr, k, xt), t, r),
                        (false, 2) => out.store(&$block::<1, 2, true>(wr, k, xt), t, r),
                        (false, 3) => out.store(&$block::<1, 3, true>(wr, k, xt), t, r),
                        (false, _) => out.store(&$block::<1, 4, true>(wr, k, xt), t, r),
                    }
                    t += tt;
                }
                r += if three { 3 } else { 1 };
            }
        }
    };
}

avx2_rows!(rows_avx2_bf16, blk256_bf16, u16, l256_bf16, s_bf16);
avx2_rows!(rows_avx2_f16, blk256_f16, u16, l256_f16, s_f16);
avx2_rows!(rows_avx2_f32, blk256_f32, f32, l256_f32, s_f32);

/// The AVX2 panel driver's register tile (as the stream driver's widest: 12 accumulators,
/// 3 weight vectors and a token vector fill the 16 ymm registers).
const PANEL2_R: usize = 3;
const PANEL2_T: usize = 4;
/// Columns per pass: 3 weight rows and 4 token rows of this many f32 (21 KiB) stay in L1.
const PANEL2_COLS: usize = 768;
/// Rows whose accumulators are parked between column passes (whole 3-row groups).
const PARK2_ROWS: usize = 255;

/// `acc[t][r] +=` columns `0..len` (a multiple of 8) of weight row `r` (`w + r*wk`)
/// times token row `t` (`x + t*xk`): lane `l` takes the columns `c ≡ l (mod 8)` in order,
/// one FMA each, as `blk256_*`; starting at a multiple of 8 columns into the rows, this
/// continues the same per-lane sums.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn steps256_f32<const R: usize, const T: usize>(
    w: *const f32,
    wk: usize,
    x: *const f32,
    xk: usize,
    acc: &mut [[__m256; R]; T],
    len: usize,
) {
    let mut c = 0;
    while c + 8 <= len {
        let mut wv = [_mm256_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(w.add(r * wk + c));
        }
        for (t, a) in acc.iter_mut().enumerate() {
            let xv = _mm256_load_ps(x.add(t * xk + c));
            for r in 0..R {
                a[r] = _mm256_fmadd_ps(wv[r], xv, a[r]);
            }
        }
        c += 8;
    }
}

/// One R x T tile over columns `c0..c1` (as `pass_f32`): from zero (`first`) or the
/// parked accumulators; parks them again, or (`last`) reduces by `hsum256`, adds the
/// columns past the last multiple of 8 in order (`blk256_*`'s tail) and stores.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn pass256_f32<const R: usize, const T: usize>(
    w: *const f32,
    k: usize,
    (xt, xk): (*const f32, usize),
    slot: &mut [__m256; PANEL2_R * PANEL2_T],
    (c0, c1): (usize, usize),
    (first, last): (bool, bool),
    out: Out,
    (t, r): (usize, usize),
) {
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    if !first {
        for (tt, a) in acc.iter_mut().enumerate() {
            for (rr, v) in a.iter_mut().enumerate() {
                *v = slot[tt * R + rr];
            }
        }
    }
    let len = (c1 - c0) / 8 * 8;
    steps256_f32::<R, T>(w.add(c0), k, xt, xk, &mut acc, len);
    if last {
        let mut o = [[0f32; R]; T];
        for (tt, row) in o.iter_mut().enumerate() {
            for (rr, v) in row.iter_mut().enumerate() {
                let mut s = hsum256(acc[tt][rr]);
                for cc in c0 + len..c1 {
                    s += *w.add(rr * k + cc) * *xt.add(tt * xk + cc - c0);
                }
                *v = s;
            }
        }
        out.store(&o, t, r);
    } else {
        for (tt, a) in acc.iter().enumerate() {
            for (rr, v) in a.iter().enumerate() {
                slot[tt * R + rr] = *v;
            }
        }
    }
}

/// `pass256_f32::<R, tt>(args)` for a run-time `tt` in `1..=PANEL2_T`.
macro_rules! pass256_tt {
    ($r:literal, $tt:expr, $args:tt) => {
        match $tt {
            1 => pass256_f32::<$r, 1> $args,
            2 => pass256_f32::<$r, 2> $args,
            3 => pass256_f32::<$r, 3> $args,
            4 => pass256_f32::<$r, 4> $args,
            _ => unreachable!(),
        }
    };
}

/// The AVX2 panel driver, as `panel_avx512_f32`: rows `0..rows` of a cached f32 panel for
/// all `n` tokens in tiles of 3 rows x up to 4 tokens, each token tile (one column pass of
/// it, copied to an aligned buffer) staying in L1 while the panel's row groups pass it.
/// The whole-row blocks read 3 weight rows and 4 token rows of `k` columns at once, more
/// than L1 holds at the model's widths, so every load came from L2. The same FMAs in the
/// same order, so the same bits as `rows_avx2_*`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel_avx2_f32(
    w: *const f32,
    k: usize,
    rows: usize,
    x: *const f32,
    n: usize,
    out: Out,
) {
    let passes = k.div_ceil(PANEL2_COLS);
    let kc = k.div_ceil(passes).next_multiple_of(8);
    let sub = if passes == 1 { rows } else { PARK2_ROWS };
    let mut one = [[_mm256_setzero_ps(); PANEL2_R * PANEL2_T]; 1];
    let mut all;
    let park: &mut [[__m256; PANEL2_R * PANEL2_T]] = if passes == 1 {
        &mut one
    } else {
        all = [[_mm256_setzero_ps(); PANEL2_R * PANEL2_T]; PARK2_ROWS / PANEL2_R + PANEL2_R];
        &mut all
    };
    let mut xbuf = XTile2([0.0; PANEL2_T * PANEL2_COLS]);
    let mut s0 = 0;
    while s0 < rows {
        let s1 = (s0 + sub).min(rows);
        let mut t = 0;
        while t < n {
            let tt = (n - t).min(PANEL2_T);
            let mut c0 = 0;
            while c0 < k {
                let c1 = (c0 + kc).min(k);
                for j in 0..tt {
                    let src = std::slice::from_raw_parts(x.add((t + j) * k + c0), c1 - c0);
                    xbuf.0[j * kc..j * kc + (c1 - c0)].copy_from_slice(src);
                }
                let xt = (xbuf.0.as_ptr(), kc);
                let fl = (c0 == 0, c1 == k);
                let mut r = s0;
                let mut g = 0;
                while r < s1 {
                    let full = s1 - r >= PANEL2_R;
                    let wr = w.add(r * k);
                    let slot = &mut park[if passes == 1 { 0 } else { g }];
                    let c = (c0, c1);
                    if full {
                        pass256_tt!(3, tt, (wr, k, xt, slot, c, fl, out, (t, r)));
                    } else {
                        pass256_tt!(1, tt, (wr, k, xt, slot, c, fl, out, (t, r)));
                    }
                    r += if full { PANEL2_R } else { 1 };
                    g += 1;
                }
                c0 = c1;
            }
            t += tt;
        }
        s0 = s1;
    }
}

#[repr(C, align(32))]
struct XTile2([f32; PANEL2_T * PANEL2_COLS]);

/// Widens `dst.len()` bf16 values to f32, 16 per step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn bf16_to_f32_avx512(src: &[half::bf16], dst: &mut [f32]) {
    let n = dst.len().min(src.len());
    let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        _mm512_storeu_ps(d.add(i), l512_bf16(s.add(i)));
        i += 16;
    }
    if i < n {
        let mask = ((1u32 << (n - i)) - 1) as __mmask16;
        _mm512_mask_storeu_ps(d.add(i), mask, l512m_bf16(s.add(i), mask));
    }
}

/// Converts `dst.len()` f16 values to f32 with F16C (16 per step on AVX-512).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn f16_to_f32_avx512(src: &[half::f16], dst: &mut [f32]) {
    let n = dst.len().min(src.len());
    let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        _mm512_storeu_ps(d.add(i), l512_f16(s.add(i)));
        i += 16;
    }
    if i < n {
        let mask = ((1u32 << (n - i)) - 1) as __mmask16;
        _mm512_mask_storeu_ps(d.add(i), mask, l512m_f16(s.add(i), mask));
    }
}
