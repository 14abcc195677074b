//! The linear-layer kernel: `y = x · Wᵀ (+ bias)` for every projection of the model.
//!
//! Two regimes:
//! - **Decode** (`n <= SMALL_N_MAX` tokens): memory-bandwidth bound. Output rows are split into
//!   coarse rayon tasks; every weight row is streamed from memory once, converted to f32 in
//!   registers and dotted against all `n` input rows. Explicit AVX-512 / AVX2+FMA kernels with a
//!   portable scalar fallback, selected at run time.
//! - **Prefill** (larger `n`): compute bound. f32 weights go straight to `gemm`. bf16/f16 weights
//!   are converted one panel of rows at a time into a per-task f32 scratch panel (allocated once
//!   in [`MatmulScratch`]) and multiplied with a single-threaded `gemm` call.

use super::{MatRef, WeightData};
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Up to this many tokens use the streaming (decode) kernel. Measured on the 2-core Sapphire
/// Rapids box (bf16 [1536, 576] and [576, 1536]): its 4x4 register-blocked dot kernel beats
/// convert-panel + gemm by 2-3x up to n = 32 and by ~1.3-2x at n = 64-128; they are even around
/// n = 512. 64 keeps the activations (n x k f32) L2-resident for the hidden sizes we serve.
pub const SMALL_N_MAX: usize = 64;

/// f32 bytes per prefill panel: half of a 2 MiB L2, so the panel stays cached while gemm
/// streams the activations past it.
const PANEL_BYTES: usize = 1 << 20;

/// Per-task f32 panels for the bf16/f16 prefill path, allocated once at model load.
pub struct MatmulScratch {
    /// One `panel_rows * max_cols` panel per pool thread.
    panels: Vec<Vec<f32>>,
    panel_rows: usize,
    max_cols: usize,
}

impl MatmulScratch {
    /// `threads`: threads of the pool that runs the forward; `max_cols`: the largest `w.cols`
    /// of any bf16/f16 matrix that will go through [`linear`].
    pub fn new(threads: usize, max_cols: usize) -> Self {
        // Rows per panel from the byte budget, a multiple of 16 in 16..=256.
        let rows = (PANEL_BYTES / (4 * max_cols.max(1))).clamp(16, 256) / 16 * 16;
        Self::with_panel_rows(threads, max_cols, rows)
    }

    fn with_panel_rows(threads: usize, max_cols: usize, panel_rows: usize) -> Self {
        let threads = threads.max(1);
        let panel_rows = panel_rows.max(1);
        Self {
            panels: (0..threads)
                .map(|_| vec![0.0; panel_rows * max_cols])
                .collect(),
            panel_rows,
            max_cols,
        }
    }
}

/// `y[t*m + r] = sum_c x[t*k + c] * w[r, c] (+ bias[r])` for `t in 0..n`, `m = w.rows`,
/// `k = w.cols`. `x` is `[n, k]` row-major, `y` is `[n, m]` row-major and is overwritten.
pub fn linear(
    x: &[f32],
    n: usize,
    w: MatRef,
    bias: Option<&[f32]>,
    y: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let (m, k) = (w.rows, w.cols);
    assert_eq!(x.len(), n * k, "linear: x is not [n, k]");
    assert_eq!(y.len(), n * m, "linear: y is not [n, m]");
    let wlen = match w.data {
        WeightData::F32(d) => d.len(),
        WeightData::F16(d) => d.len(),
        WeightData::Bf16(d) => d.len(),
    };
    assert_eq!(wlen, m * k, "linear: weight data is not [rows, cols]");
    if let Some(b) = bias {
        assert_eq!(b.len(), m, "linear: bias is not [rows]");
    }
    if n == 0 || m == 0 {
        return;
    }
    if k == 0 {
        for t in 0..n {
            for r in 0..m {
                y[t * m + r] = bias.map_or(0.0, |b| b[r]);
            }
        }
        return;
    }
    if n <= SMALL_N_MAX {
        linear_stream(x, n, w, bias, y);
        return;
    }
    match w.data {
        WeightData::F32(d) => linear_gemm_f32(x, n, d, m, k, bias, y),
        _ => {
            // A scratch sized for smaller matrices is a caller bug; stay correct (just slower).
            debug_assert!(k <= scratch.max_cols, "MatmulScratch too small for k = {k}");
            if k <= scratch.max_cols {
                linear_panels(x, n, w, bias, y, scratch);
            } else {
                linear_stream(x, n, w, bias, y);
            }
        }
    }
}

/// Raw output pointer shared by tasks that write disjoint elements of `y`.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: every task writes a disjoint set of indices (its own output rows of W).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    // A method (not field access) so closures capture the whole Send wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Scalar,
}

impl Isa {
    fn detect(dtype_is_f16: bool) -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && (!dtype_is_f16 || is_x86_feature_detected!("f16c"))
            {
                return Isa::Avx2;
            }
        }
        let _ = dtype_is_f16;
        Isa::Scalar
    }
}

/// Output rows per rayon task: at least ~64 KiB of weights (so scheduling overhead is noise)
/// and, for big matrices, about 1/16 of a thread's share (few, long streams keep the hardware
/// prefetchers busy); but at least ~4 tasks per thread so both cores stay busy to the end.
fn rows_per_task(m: usize, k: usize, elem_bytes: usize) -> usize {
    let row_bytes = (k * elem_bytes).max(1);
    let threads = rayon::current_num_threads().max(1);
    let total = row_bytes * m;
    let want_bytes = (64 * 1024).max(total / (16 * threads));
    let want = want_bytes.div_ceil(row_bytes).max(4);
    let cap = m.div_ceil(4 * threads).max(4);
    want.min(cap).div_ceil(4) * 4
}

/// Decode path: parallel over coarse chunks of output rows, each weight row read once.
fn linear_stream(x: &[f32], n: usize, w: MatRef, bias: Option<&[f32]>, y: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    let elem_bytes = match w.data {
        WeightData::F32(_) => 4,
        _ => 2,
    };
    let isa = Isa::detect(matches!(w.data, WeightData::F16(_)));
    let rpt = rows_per_task(m, k, elem_bytes);
    let tasks = m.div_ceil(rpt);
    let yp = SendPtr(y.as_mut_ptr());
    let work = |ti: usize| {
        let r0 = ti * rpt;
        let r1 = (r0 + rpt).min(m);
        // SAFETY: shapes were checked in `linear`; rows r0..r1 of every token's output belong
        // to this task alone.
        unsafe { rows_dispatch(isa, w.data, k, r0, r1, x, n, bias, yp.get(), m) }
    };
    if tasks == 1 {
        work(0);
    } else {
        (0..tasks).into_par_iter().for_each(work);
    }
}

/// Computes output rows `r0..r1` for all `n` tokens.
///
/// # Safety
/// `x` has `n*k` elements, `y` points at `n*m` writable floats, `r1 <= m`, weights are `m*k`.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_dispatch(
    isa: Isa,
    data: WeightData,
    k: usize,
    r0: usize,
    r1: usize,
    x: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    y: *mut f32,
    m: usize,
) {
    let out = Out { y, m, bias };
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => match data {
            WeightData::F32(d) => x86::rows_avx512_f32(d.as_ptr(), k, r0, r1, x.as_ptr(), n, out),
            WeightData::F16(d) => {
                x86::rows_avx512_f16(d.as_ptr().cast(), k, r0, r1, x.as_ptr(), n, out)
            }
            WeightData::Bf16(d) => {
                x86::rows_avx512_bf16(d.as_ptr().cast(), k, r0, r1, x.as_ptr(), n, out)
            }
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => match data {
            WeightData::F32(d) => x86::rows_avx2_f32(d.as_ptr(), k, r0, r1, x.as_ptr(), n, out),
            WeightData::F16(d) => {
                x86::rows_avx2_f16(d.as_ptr().cast(), k, r0, r1, x.as_ptr(), n, out)
            }
            WeightData::Bf16(d) => {
                x86::rows_avx2_bf16(d.as_ptr().cast(), k, r0, r1, x.as_ptr(), n, out)
            }
        },
        Isa::Scalar => match data {
            WeightData::F32(d) => rows_scalar(d, |v| v, k, r0, r1, x, n, out),
            WeightData::F16(d) => rows_scalar(d, |v| v.to_f32(), k, r0, r1, x, n, out),
            WeightData::Bf16(d) => rows_scalar(d, |v| v.to_f32(), k, r0, r1, x, n, out),
        },
    }
}

/// Where a block of results goes.
#[derive(Clone, Copy)]
struct Out<'a> {
    y: *mut f32,
    m: usize,
    bias: Option<&'a [f32]>,
}

impl Out<'_> {
    /// Stores `o[t][r]` as output row `r0 + r` of token `t0 + t`.
    ///
    /// # Safety
    /// The block lies inside `y` and belongs to the calling task.
    #[inline(always)]
    unsafe fn store<const R: usize, const T: usize>(self, o: &[[f32; R]; T], t0: usize, r0: usize) {
        for (t, row) in o.iter().enumerate() {
            for (r, &v) in row.iter().enumerate() {
                let b = self.bias.map_or(0.0, |b| b[r0 + r]);
                *self.y.add((t0 + t) * self.m + r0 + r) = v + b;
            }
        }
    }
}

/// Portable fallback: 8 independent partial sums per dot so the compiler can vectorise.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_scalar<E: Copy>(
    w: &[E],
    cvt: impl Fn(E) -> f32,
    k: usize,
    r0: usize,
    r1: usize,
    x: &[f32],
    n: usize,
    out: Out,
) {
    for r in r0..r1 {
        let wr = &w[r * k..(r + 1) * k];
        for t in 0..n {
            let xr = &x[t * k..(t + 1) * k];
            let mut acc = [0f32; 8];
            let mut wc = wr.chunks_exact(8);
            let mut xc = xr.chunks_exact(8);
            for (a, b) in (&mut wc).zip(&mut xc) {
                for l in 0..8 {
                    acc[l] += cvt(a[l]) * b[l];
                }
            }
            let mut s: f32 = acc.iter().sum();
            for (a, b) in wc.remainder().iter().zip(xc.remainder()) {
                s += cvt(*a) * b;
            }
            out.store(&[[s]], t, r);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Out;
    use std::arch::x86_64::*;

    // ---- AVX-512: 16 lanes; weights widened to f32 in registers. ----

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

    /// Generates an AVX-512 block kernel (R weight rows x T tokens, R*T accumulators) and the
    /// row-range driver around it.
    macro_rules! avx512_rows {
        ($rows:ident, $block:ident, $elem:ty, $ld:ident, $ldm:ident) => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            #[inline]
            unsafe fn $block<const R: usize, const T: usize>(
                w: *const $elem,
                k: usize,
                x: *const f32,
            ) -> [[f32; R]; T] {
                let mut acc = [[_mm512_setzero_ps(); R]; T];
                let mut c = 0;
                while c + 16 <= k {
                    let mut wv = [_mm512_setzero_ps(); R];
                    for (r, v) in wv.iter_mut().enumerate() {
                        *v = $ld(w.add(r * k + c));
                        // Rows are short (~1 KiB) streams, too short for the hardware
                        // prefetcher to ramp up: fetch the next row group's line explicitly.
                        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((R + r) * k + c).cast());
                    }
                    for (t, a) in acc.iter_mut().enumerate() {
                        let xv = _mm512_loadu_ps(x.add(t * k + c));
                        for r in 0..R {
                            a[r] = _mm512_fmadd_ps(wv[r], xv, a[r]);
                        }
                    }
                    c += 16;
                }
                if c < k {
                    // Masked tail: lanes past k load as zero.
                    let mask = ((1u32 << (k - c)) - 1) as __mmask16;
                    let mut wv = [_mm512_setzero_ps(); R];
                    for (r, v) in wv.iter_mut().enumerate() {
                        *v = $ldm(w.add(r * k + c), mask);
                    }
                    for (t, a) in acc.iter_mut().enumerate() {
                        let xv = _mm512_maskz_loadu_ps(mask, x.add(t * k + c));
                        for r in 0..R {
                            a[r] = _mm512_fmadd_ps(wv[r], xv, a[r]);
                        }
                    }
                }
                let mut o = [[0f32; R]; T];
                for t in 0..T {
                    for r in 0..R {
                        o[t][r] = _mm512_reduce_add_ps(acc[t][r]);
                    }
                }
                o
            }

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
                let mut r = r0;
                while r < r1 {
                    let four = r1 - r >= 4;
                    let wr = w.add(r * k);
                    let mut t = 0;
                    // Tokens in blocks of 4: 4x4 accumulators + 4 weight vectors fit in 32 zmm.
                    while t < n {
                        let xt = x.add(t * k);
                        let tt = (n - t).min(4);
                        match (four, tt) {
                            (true, 1) => out.store(&$block::<4, 1>(wr, k, xt), t, r),
                            (true, 2) => out.store(&$block::<4, 2>(wr, k, xt), t, r),
                            (true, 3) => out.store(&$block::<4, 3>(wr, k, xt), t, r),
                            (true, _) => out.store(&$block::<4, 4>(wr, k, xt), t, r),
                            (false, 1) => out.store(&$block::<1, 1>(wr, k, xt), t, r),
                            (false, 2) => out.store(&$block::<1, 2>(wr, k, xt), t, r),
                            (false, 3) => out.store(&$block::<1, 3>(wr, k, xt), t, r),
                            (false, _) => out.store(&$block::<1, 4>(wr, k, xt), t, r),
                        }
                        t += tt;
                    }
                    r += if four { 4 } else { 1 };
                }
            }
        };
    }

    avx512_rows!(rows_avx512_bf16, blk512_bf16, u16, l512_bf16, l512m_bf16);
    avx512_rows!(rows_avx512_f16, blk512_f16, u16, l512_f16, l512m_f16);
    avx512_rows!(rows_avx512_f32, blk512_f32, f32, l512_f32, l512m_f32);

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
            unsafe fn $block<const R: usize, const T: usize>(
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
                        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((R + r) * k + c).cast());
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
                let mut r = r0;
                while r < r1 {
                    let four = r1 - r >= 4;
                    let wr = w.add(r * k);
                    let mut t = 0;
                    // Tokens in pairs: 4x2 accumulators + 4 weight vectors fit in 16 ymm.
                    while t < n {
                        let xt = x.add(t * k);
                        let tt = (n - t).min(2);
                        match (four, tt) {
                            (true, 1) => out.store(&$block::<4, 1>(wr, k, xt), t, r),
                            (true, _) => out.store(&$block::<4, 2>(wr, k, xt), t, r),
                            (false, 1) => out.store(&$block::<1, 1>(wr, k, xt), t, r),
                            (false, _) => out.store(&$block::<1, 2>(wr, k, xt), t, r),
                        }
                        t += tt;
                    }
                    r += if four { 4 } else { 1 };
                }
            }
        };
    }

    avx2_rows!(rows_avx2_bf16, blk256_bf16, u16, l256_bf16, s_bf16);
    avx2_rows!(rows_avx2_f16, blk256_f16, u16, l256_f16, s_f16);
    avx2_rows!(rows_avx2_f32, blk256_f32, f32, l256_f32, s_f32);

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
}

/// Widens bf16/f16 rows to f32 (`dst.len()` elements).
fn convert_rows(data: WeightData, start: usize, dst: &mut [f32]) {
    let len = dst.len();
    match data {
        WeightData::F32(d) => dst.copy_from_slice(&d[start..start + len]),
        // Plain shift: auto-vectorises well without feature detection.
        WeightData::Bf16(d) => {
            for (o, v) in dst.iter_mut().zip(&d[start..start + len]) {
                *o = f32::from_bits((v.to_bits() as u32) << 16);
            }
        }
        WeightData::F16(d) => {
            let src = &d[start..start + len];
            #[cfg(target_arch = "x86_64")]
            if Isa::detect(true) == Isa::Avx512 {
                // SAFETY: AVX-512 F/BW/VL were detected; lengths are equal.
                unsafe { x86::f16_to_f32_avx512(src, dst) };
                return;
            }
            // half's slice conversion uses F16C itself when the CPU has it.
            use half::slice::HalfFloatSliceExt;
            src.convert_to_f32_slice(dst);
        }
    }
}

fn add_bias(y: &mut [f32], m: usize, bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(m) {
            for (o, bv) in row.iter_mut().zip(b) {
                *o += bv;
            }
        }
    }
}

/// Prefill with f32 weights: one parallel gemm call over the whole matrix.
fn linear_gemm_f32(
    x: &[f32],
    n: usize,
    w: &[f32],
    m: usize,
    k: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    // SAFETY: dst [n, m] row-major (rs = m, cs = 1); lhs x [n, k] (rs = k, cs = 1);
    // rhs = Wᵀ, a [k, m] view of row-major W (element (c, r) at r*k + c: rs = 1, cs = k).
    // All lengths were checked in `linear`. read_dst = false: y = 1.0 * x·Wᵀ.
    unsafe {
        gemm::gemm(
            n,
            m,
            k,
            y.as_mut_ptr(),
            1,
            m as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
    add_bias(y, m, bias);
}

/// Prefill with bf16/f16 weights.
///
/// Instead of locating a panel through `rayon::current_thread_index()`, we start exactly one
/// task per scratch panel; each task owns its panel (a disjoint `&mut`) and pulls panel indices
/// from a shared atomic counter until the matrix is done. This is safe whatever pool we run in
/// (more or fewer threads than `threads`, or no pool at all), needs no Mutex, and still balances
/// load dynamically.
fn linear_panels(
    x: &[f32],
    n: usize,
    w: MatRef,
    bias: Option<&[f32]>,
    y: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let (m, k) = (w.rows, w.cols);
    let prows = scratch.panel_rows;
    let npanels = m.div_ceil(prows);
    let tasks = scratch.panels.len().min(npanels);
    let next = AtomicUsize::new(0);
    let yp = SendPtr(y.as_mut_ptr());
    let data = w.data;
    scratch.panels[..tasks]
        .par_iter_mut()
        .for_each(|panel| loop {
            let p = next.fetch_add(1, Ordering::Relaxed);
            if p >= npanels {
                break;
            }
            let r0 = p * prows;
            let rows = prows.min(m - r0);
            let buf = &mut panel[..rows * k];
            convert_rows(data, r0 * k, buf);
            // SAFETY: dst is the [n, rows] sub-block of y at column r0 (rs = m, cs = 1), written
            // only by this task; lhs x is [n, k]; rhs is the panel viewed as [k, rows]
            // (rs = 1, cs = k). Parallelism::None: gemm does not re-enter rayon, so this worker
            // never interleaves two uses of its panel.
            unsafe {
                gemm::gemm(
                    n,
                    rows,
                    k,
                    yp.get().add(r0),
                    1,
                    m as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    buf.as_ptr(),
                    k as isize,
                    1,
                    0.0f32,
                    1.0f32,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
                if let Some(b) = bias {
                    for t in 0..n {
                        let row = yp.get().add(t * m + r0);
                        for (i, bv) in b[r0..r0 + rows].iter().enumerate() {
                            *row.add(i) += bv;
                        }
                    }
                }
            }
        });
}

/// Plain reference: f64 accumulation, one element at a time.
pub fn reference(x: &[f32], n: usize, w: MatRef, bias: Option<&[f32]>, y: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    let get = |i: usize| -> f64 {
        match w.data {
            WeightData::F32(d) => d[i] as f64,
            WeightData::F16(d) => d[i].to_f64(),
            WeightData::Bf16(d) => d[i].to_f64(),
        }
    };
    for t in 0..n {
        for r in 0..m {
            let mut s = bias.map_or(0.0, |b| b[r] as f64);
            for c in 0..k {
                s += x[t * k + c] as f64 * get(r * k + c);
            }
            y[t * m + r] = s as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    use crate::model::kernels::cpu::test_rng::Rng;

    /// Tolerance: 1e-4 relative to sum |x*w| (the scale of rounding in any summation order).
    fn check(x: &[f32], n: usize, w: MatRef, bias: Option<&[f32]>, got: &[f32]) {
        let (m, k) = (w.rows, w.cols);
        let mut want = vec![0.0; n * m];
        reference(x, n, w, bias, &mut want);
        let absw = |i: usize| -> f64 {
            match w.data {
                WeightData::F32(d) => d[i].abs() as f64,
                WeightData::F16(d) => d[i].to_f64().abs(),
                WeightData::Bf16(d) => d[i].to_f64().abs(),
            }
        };
        for t in 0..n {
            for r in 0..m {
                let scale: f64 = (0..k)
                    .map(|c| (x[t * k + c] as f64).abs() * absw(r * k + c))
                    .sum::<f64>()
                    + 1e-3;
                let (g, e) = (got[t * m + r] as f64, want[t * m + r] as f64);
                assert!(
                    (g - e).abs() <= 1e-4 * scale,
                    "n={n} m={m} k={k} t={t} r={r}: got {g}, want {e}"
                );
            }
        }
    }

    fn run_all(n: usize, m: usize, k: usize, with_bias: bool, seed: u64) {
        let mut rng = Rng(seed);
        let x = rng.vec(n * k);
        let wf = rng.vec(m * k);
        let bias = rng.vec(m);
        let bias = with_bias.then_some(&bias[..]);
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        // Small panels so multi-panel splitting is exercised at test sizes.
        let mut scratch = MatmulScratch::with_panel_rows(rayon::current_num_threads(), k, 16);
        for data in [
            WeightData::F32(&wf),
            WeightData::F16(&wh),
            WeightData::Bf16(&wb),
        ] {
            let w = MatRef {
                data,
                rows: m,
                cols: k,
            };
            let mut y = vec![f32::NAN; n * m];
            linear(&x, n, w, bias, &mut y, &mut scratch);
            check(&x, n, w, bias, &y);
            // Every ISA path this CPU has, including the ones dispatch would not pick.
            for isa in available_isas(matches!(data, WeightData::F16(_))) {
                let mut y2 = vec![f32::NAN; n * m];
                unsafe { rows_dispatch(isa, data, k, 0, m, &x, n, bias, y2.as_mut_ptr(), m) };
                check(&x, n, w, bias, &y2);
            }
            // The prefill path directly, whatever n is.
            if !matches!(data, WeightData::F32(_)) {
                let mut y3 = vec![f32::NAN; n * m];
                linear_panels(&x, n, w, bias, &mut y3, &mut scratch);
                check(&x, n, w, bias, &y3);
            }
        }
    }

    fn available_isas(f16: bool) -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && (!f16 || is_x86_feature_detected!("f16c"))
            {
                v.push(Isa::Avx2);
            }
            if Isa::detect(f16) == Isa::Avx512 {
                v.push(Isa::Avx512);
            }
        }
        let _ = f16;
        v
    }

    #[test]
    fn odd_shapes_all_dtypes() {
        for (i, &n) in [1usize, 3, 8, 33, 130].iter().enumerate() {
            run_all(n, 45, 67, i % 2 == 0, 1 + i as u64);
            run_all(n, 45, 67, i % 2 == 1, 100 + i as u64);
        }
    }

    #[test]
    fn aligned_and_multi_panel_shapes() {
        run_all(1, 203, 128, true, 7);
        run_all(5, 130, 96, false, 8);
        run_all(20, 150, 33, true, 9);
        run_all(2, 7, 16, false, 10);
        run_all(4, 3, 1, true, 11);
    }

    #[test]
    fn single_panel_scratch_and_empty() {
        let mut rng = Rng(3);
        let (n, m, k) = (20, 9, 40);
        let x = rng.vec(n * k);
        let wb: Vec<bf16> = rng.vec(m * k).into_iter().map(bf16::from_f32).collect();
        let w = MatRef {
            data: WeightData::Bf16(&wb),
            rows: m,
            cols: k,
        };
        let mut y = vec![0.0; n * m];
        // n == 0 is a no-op.
        linear(&[], 0, w, None, &mut [], &mut MatmulScratch::new(1, k));
        let mut scratch = MatmulScratch::new(1, k);
        linear(&x, n, w, None, &mut y, &mut scratch);
        check(&x, n, w, None, &y);
        // More tasks than panels would need, odd panel height.
        let mut y2 = vec![0.0; n * m];
        linear_panels(
            &x,
            n,
            w,
            None,
            &mut y2,
            &mut MatmulScratch::with_panel_rows(3, k, 7),
        );
        check(&x, n, w, None, &y2);
    }
}

/// Speed checks (not run by default): `cargo test --release -- --ignored --nocapture timing`.
#[cfg(test)]
mod timing {
    use super::*;
    use half::bf16;
    use std::time::Instant;

    /// Best of `reps` runs: robust to other processes on a shared machine.
    fn best(reps: usize, mut f: impl FnMut()) -> f64 {
        f();
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }

    #[test]
    #[ignore]
    fn timing_linear() {
        let threads = rayon::current_num_threads();
        for &(m, k, reps) in &[
            (49152usize, 576usize, 40),
            (1536, 576, 300),
            (576, 1536, 300),
        ] {
            let w: Vec<bf16> = (0..m * k)
                .map(|i| bf16::from_f32((i % 17) as f32 * 0.01))
                .collect();
            let mat = MatRef {
                data: WeightData::Bf16(&w),
                rows: m,
                cols: k,
            };
            let x = vec![0.5f32; 64 * k];
            let mut y = vec![0.0f32; 64 * m];
            let mut scratch = MatmulScratch::new(threads, k);
            for &n in &[1usize, 2, 4, 8, 12, 16, 24, 32, 64] {
                if m > 10000 && n > 1 {
                    break;
                }
                let ts = best(reps, || {
                    linear_stream(&x[..n * k], n, mat, None, &mut y[..n * m])
                });
                let tp = best(reps, || {
                    linear_panels(&x[..n * k], n, mat, None, &mut y[..n * m], &mut scratch)
                });
                println!(
                    "bf16 [{m},{k}] n={n:2}: stream {:8.1} us ({:5.1} GB/s)  panels {:8.1} us",
                    ts * 1e6,
                    (m * k * 2) as f64 / ts / 1e9,
                    tp * 1e6
                );
            }
        }
    }

    #[test]
    #[ignore]
    fn timing_prefill() {
        let threads = rayon::current_num_threads();
        let (m, k) = (1536usize, 576usize);
        let wf: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
        let w: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let mat = MatRef {
            data: WeightData::Bf16(&w),
            rows: m,
            cols: k,
        };
        let x = vec![0.5f32; 512 * k];
        let mut y = vec![0.0f32; 512 * m];
        let mut scratch = MatmulScratch::new(threads, k);
        for &n in &[16usize, 32, 64, 128, 512] {
            let (xs, ys) = (&x[..n * k], &mut y[..n * m]);
            let ts = best(20, || linear_stream(xs, n, mat, None, ys));
            let tp = best(20, || linear_panels(xs, n, mat, None, ys, &mut scratch));
            let tg = best(20, || linear_gemm_f32(xs, n, &wf, m, k, None, ys));
            let gf = |t: f64| (2 * n * m * k) as f64 / t / 1e9;
            println!(
                "prefill [{m},{k}] n={n:3}: stream {:6.2} ms ({:5.1} GF/s) panels {:6.2} ms ({:5.1}) f32 gemm {:6.2} ms ({:5.1})",
                ts * 1e3, gf(ts), tp * 1e3, gf(tp), tg * 1e3, gf(tg)
            );
        }
    }

    /// Plain parallel read of the same bytes (the bandwidth ceiling), interleaved with the
    /// kernel so both see the same machine load.
    fn read_all(w: &[u16]) -> u64 {
        w.par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0u32; 32];
                let mut it = c.chunks_exact(32);
                for ch in &mut it {
                    for l in 0..32 {
                        acc[l] = acc[l].wrapping_add(ch[l] as u32);
                    }
                }
                acc.iter().map(|&v| v as u64).sum::<u64>()
            })
            .sum()
    }

    #[test]
    #[ignore]
    fn timing_decode_vs_read() {
        for &(m, k) in &[(49152usize, 576usize), (1536, 576), (576, 1536)] {
            let w: Vec<bf16> = (0..m * k)
                .map(|i| bf16::from_f32((i % 17) as f32 * 0.01))
                .collect();
            let raw: Vec<u16> = w.iter().map(|v| v.to_bits()).collect();
            let mat = MatRef {
                data: WeightData::Bf16(&w),
                rows: m,
                cols: k,
            };
            let x = vec![0.5f32; k];
            let mut y = vec![0.0f32; m];
            let (mut tk, mut tr) = (f64::INFINITY, f64::INFINITY);
            let reps = if m > 10000 { 10 } else { 100 };
            for _ in 0..10 {
                tk = tk.min(best(reps, || linear_stream(&x, 1, mat, None, &mut y)));
                tr = tr.min(best(reps, || {
                    std::hint::black_box(read_all(&raw));
                }));
            }
            let gb = |t: f64| (m * k * 2) as f64 / t / 1e9;
            println!(
                "n=1 bf16 [{m},{k}]: kernel {:7.1} us {:5.1} GB/s | plain read {:7.1} us {:5.1} GB/s",
                tk * 1e6,
                gb(tk),
                tr * 1e6,
                gb(tr)
            );
        }
    }
}
