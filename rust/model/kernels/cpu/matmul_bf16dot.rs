//! The linear layer on bf16 weights with the CPU's bf16 dot products (AVX512_BF16 `vdpbf16ps`),
//! when the engine asks for them (`bf16_dot=True`, off by default since it rounds the
//! activations; `MatmulScratch::enable_bf16_dot`).
//!
//! `vdpbf16ps` multiplies pairs of bf16 and adds them into f32 lanes: 32 multiply-adds per
//! instruction, twice the f32 FMA's 16, which is what bounds a prefill on bf16 weights. Its
//! operands are both bf16, so the activation rows are rounded to bf16 once per call (round to
//! nearest even, as llama.cpp does for bf16 weights and as a bf16 model computes in PyTorch):
//! each product then carries the relative error of that rounding, at most 2^-9, on top of the
//! f32 accumulation. The weights are read as stored (no widening).
//!
//! **Arithmetic, fixed per output.** Output `(t, r)` accumulates in 16 f32 lanes, one
//! `vdpbf16ps` per 32 columns in column order (lane `l` takes the pair at columns `32c + 2l,
//! 32c + 2l + 1`; a last partial chunk is zero-padded), then [`hsum`]'s fixed tree, then the
//! bias. Tiles (1 row x 1 token at decode, up to 4 rows x 6 tokens else) only decide which
//! outputs share a pass over memory, so a token's output row has the same bits whatever `n`,
//! the tiling or the thread count (batch invariance), as on the other paths of
//! [`super::matmul`] (this path's bits are its own: a CPU without the instructions computes in
//! f32).

use super::SendPtr;
use super::{MatRef, WeightData};
use rayon::prelude::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether this CPU has the instructions (AVX-512 F/BW/VL and BF16).
pub fn available() -> bool {
    super::isa::cpu().avx512_bf16
}

/// The activation rows rounded to bf16, allocated once at model load.
pub struct Bf16Scratch {
    x: Vec<u16>,
    max_cols: usize,
}

impl Bf16Scratch {
    /// None: bf16 weights take the f32 path.
    pub fn disabled() -> Self {
        Bf16Scratch {
            x: Vec::new(),
            max_cols: 0,
        }
    }

    /// Room for `max_tokens` rows of `max_cols` (nothing unless [`available`]). Larger calls
    /// run in chunks of tokens.
    pub fn new(max_tokens: usize, max_cols: usize) -> Self {
        let len = if available() {
            max_tokens.max(1) * max_cols.max(1)
        } else {
            0
        };
        Bf16Scratch {
            x: vec![0; len],
            max_cols,
        }
    }

    pub fn bytes(&self) -> usize {
        2 * self.x.capacity()
    }

    /// Whether this scratch serves rows of `k` columns (and the CPU has the instructions).
    pub fn serves(&self, k: usize) -> bool {
        !self.x.is_empty() && k <= self.max_cols
    }
}

/// One product: `y = x · wᵀ (+ bias)`, `w` bf16, `y` `[n, w.rows]`.
pub struct Bf16Out<'w, 'y> {
    pub w: MatRef<'w>,
    pub bias: Option<&'w [f32]>,
    pub y: &'y mut [f32],
}

/// Most products in one call.
const GROUP_MAX: usize = 4;

/// Tokens per tile, rows per tile.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const T_MAX: usize = 6;
const R_MAX: usize = 4;

/// Several bf16 products of the same `x` (`[n, k]`), as one parallel loop over all their row
/// chunks. Panics unless the scratch [`Bf16Scratch::serves`] `k` and the shapes agree.
pub fn linear_bf16dot(x: &[f32], n: usize, outs: &mut [Bf16Out], scratch: &mut Bf16Scratch) {
    assert!(
        outs.len() <= GROUP_MAX,
        "linear_bf16dot: more than {GROUP_MAX} products"
    );
    let Some(k) = outs.first().map(|o| o.w.cols) else {
        return;
    };
    assert!(
        scratch.serves(k),
        "linear_bf16dot: no bf16 scratch for {k} columns"
    );
    assert_eq!(x.len(), n * k, "linear_bf16dot: x is not [n, k]");
    for o in outs.iter() {
        assert_eq!(o.w.cols, k, "linear_bf16dot: products of different cols");
        let WeightData::Bf16(d) = o.w.data else {
            panic!("linear_bf16dot: weights are not bf16");
        };
        assert_eq!(d.len(), o.w.rows * k, "linear_bf16dot: w is not [rows, k]");
        assert_eq!(
            o.y.len(),
            n * o.w.rows,
            "linear_bf16dot: y is not [n, rows]"
        );
        if let Some(b) = o.bias {
            assert_eq!(b.len(), o.w.rows, "linear_bf16dot: bias is not [rows]");
        }
    }
    if n == 0 || k == 0 {
        for o in outs.iter_mut() {
            for (i, v) in o.y.iter_mut().enumerate() {
                *v = o.bias.map_or(0.0, |b| b[i % o.w.rows]);
            }
        }
        return;
    }
    let chunk = (scratch.x.len() / k).max(1);
    let mut t0 = 0;
    while t0 < n {
        let tn = chunk.min(n - t0);
        let xb = &mut scratch.x[..tn * k];
        round_rows(&x[t0 * k..(t0 + tn) * k], xb);
        run_products(outs, t0, tn, k, xb);
        t0 += tn;
    }
}

/// `x` rounded to bf16 (nearest even), into `out`.
fn round_rows(x: &[f32], out: &mut [u16]) {
    // Rows in parallel for a prefill; a decode row is short.
    const PIECE: usize = 1 << 14;
    out.par_chunks_mut(PIECE)
        .zip(x.par_chunks(PIECE))
        .for_each(|(o, v)| {
            for (o, &v) in o.iter_mut().zip(v) {
                *o = half::bf16::from_f32(v).to_bits();
            }
        });
}

/// Tokens `t0 .. t0 + n` of every product (their bf16 rows in `xb`).
fn run_products(outs: &mut [Bf16Out], t0: usize, n: usize, k: usize, xb: &[u16]) {
    let threads = rayon::current_num_threads().max(1);
    let total: usize = outs.iter().map(|o| o.w.rows * k * 2).sum();
    // About 1/8 of a thread's share of the bytes per task (decode: few long streams), at
    // least 64 KiB; rows in multiples of the tile.
    let per_task = (total / (8 * threads)).max(64 * 1024);
    type Job<'w> = (&'w [half::bf16], usize, Option<&'w [f32]>, SendPtr, usize);
    let mut jobs: [Option<Job>; GROUP_MAX] = [None; GROUP_MAX];
    let mut first_task = [0usize; GROUP_MAX + 1];
    for (i, o) in outs.iter_mut().enumerate() {
        let WeightData::Bf16(d) = o.w.data else {
            unreachable!("checked by linear_bf16dot")
        };
        let m = o.w.rows;
        let rpt = per_task
            .div_ceil(2 * k)
            .clamp(R_MAX, m.max(R_MAX))
            .next_multiple_of(R_MAX);
        // SAFETY: t0 < the call's n, so t0 * m is inside y.
        let y = SendPtr(unsafe { o.y.as_mut_ptr().add(t0 * m) });
        jobs[i] = Some((d, m, o.bias, y, rpt));
        first_task[i + 1] = first_task[i] + m.div_ceil(rpt);
    }
    let products = outs.len();
    let work = |ti: usize| {
        let i = (0..products).rfind(|&i| first_task[i] <= ti).unwrap_or(0);
        let Some((w, m, bias, y, rpt)) = jobs[i] else {
            return;
        };
        let r0 = (ti - first_task[i]) * rpt;
        let r1 = (r0 + rpt).min(m);
        let out = Out {
            y: y.get(),
            m,
            bias,
        };
        // SAFETY: shapes checked in linear_bf16dot; rows r0..r1 of every token's output of
        // product i belong to this task; the CPU has the instructions (the scratch exists).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            let (w, x) = (w.as_ptr().cast(), xb.as_ptr());
            // One token (decode): a row at a time, so that a task's weights are one sequential
            // stream (4 rows side by side are 4 streams a row apart, measurably slower). More
            // tokens: 4 rows share each activation vector.
            if n == 1 {
                rows::<1>(w, k, r0, r1, x, n, out)
            } else {
                rows::<R_MAX>(w, k, r0, r1, x, n, out)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (w, r1, out, n, xb);
    };
    let tasks = first_task[products];
    if tasks == 1 {
        work(0);
    } else {
        (0..tasks).into_par_iter().for_each(work);
    }
}

/// Where results go: output row `r` of token `t` is `y[t*m + r]`, plus `bias[r]`.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Out<'a> {
    y: *mut f32,
    m: usize,
    bias: Option<&'a [f32]>,
}

/// Rows `r0..r1` of `w` (`[rows, k]` bf16 bits) for the `n` bf16 token rows of `xb`, in tiles
/// of `R` rows: token blocks that stay in L2, row groups whose weights stay in L1 while the
/// block's token tiles pass.
///
/// # Safety
/// `w` holds at least `r1 * k` values, `xb` `n * k`; the outputs of rows `r0..r1` belong to
/// the caller; the CPU has AVX-512 F/BW/VL/BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn rows<const R: usize>(
    w: *const u16,
    k: usize,
    r0: usize,
    r1: usize,
    xb: *const u16,
    n: usize,
    out: Out,
) {
    let block = ((256 * 1024) / (2 * k)).max(T_MAX) / T_MAX * T_MAX;
    let mut tb = 0;
    while tb < n {
        let tb_end = (tb + block).min(n);
        let mut r = r0;
        while r < r1 {
            let vr = (r1 - r).min(R);
            let mut t = tb;
            while t < tb_end {
                let vt = (tb_end - t).min(T_MAX);
                let wr = w.add(r * k);
                let xt = xb.add(t * k);
                match vt {
                    1 => tile::<R, 1>(wr, k, vr, xt, 1, out, r, t),
                    2 => tile::<R, 2>(wr, k, vr, xt, 2, out, r, t),
                    3 => tile::<R, 3>(wr, k, vr, xt, 3, out, r, t),
                    4 => tile::<R, 4>(wr, k, vr, xt, 4, out, r, t),
                    _ => tile::<R, T_MAX>(wr, k, vr, xt, vt, out, r, t),
                }
                t += vt;
            }
            r += R;
        }
        tb = tb_end;
    }
}

/// One tile of `R` rows x `T` tokens (rows past `vr` and tokens past `vt` are clamped copies of
/// the last: computed, not stored).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const T: usize>(
    w: *const u16,
    k: usize,
    vr: usize,
    x: *const u16,
    vt: usize,
    out: Out,
    r0: usize,
    t0: usize,
) {
    let rows: [*const u16; R] = std::array::from_fn(|r| w.add(r.min(vr - 1) * k));
    let toks: [*const u16; T] = std::array::from_fn(|t| x.add(t.min(vt - 1) * k));
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let body = k / 32 * 32;
    let mut c = 0;
    while c < body {
        let xv: [__m512bh; T] = std::array::from_fn(|t| load(toks[t].add(c)));
        for (a, row) in acc.iter_mut().zip(&rows) {
            let wv = load(row.add(c));
            for (at, xt) in a.iter_mut().zip(&xv) {
                *at = _mm512_dpbf16_ps(*at, wv, *xt);
            }
        }
        c += 32;
    }
    if body < k {
        // The last partial chunk, zero-padded (0 * 0 pairs add nothing).
        let mask: __mmask32 = (1u32 << (k - body)) - 1;
        let xv: [__m512bh; T] = std::array::from_fn(|t| load_masked(toks[t].add(body), mask));
        for (a, row) in acc.iter_mut().zip(&rows) {
            let wv = load_masked(row.add(body), mask);
            for (at, xt) in a.iter_mut().zip(&xv) {
                *at = _mm512_dpbf16_ps(*at, wv, *xt);
            }
        }
    }
    for (r, a) in acc.iter().enumerate().take(vr) {
        for (t, at) in a.iter().enumerate().take(vt) {
            let v = hsum(*at);
            let v = match out.bias {
                Some(b) => v + b[r0 + r],
                None => v,
            };
            *out.y.add((t0 + t) * out.m + r0 + r) = v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn load(p: *const u16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast()))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn load_masked(p: *const u16, mask: __mmask32) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, p.cast()))
}

/// The 16 lanes summed by a fixed tree: halves, then quarters, then pairs, then the last two.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn hsum(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    _mm_cvtss_f32(s1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::cpu::test_rng::{thread_pools, Rng};
    use half::bf16;

    fn bits(y: &[f32]) -> Vec<u32> {
        y.iter().map(|v| v.to_bits()).collect()
    }

    fn run(x: &[f32], n: usize, w: MatRef, bias: Option<&[f32]>, cap: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; n * w.rows];
        let mut scratch = Bf16Scratch::new(cap, w.cols);
        linear_bf16dot(x, n, &mut [Bf16Out { w, bias, y: &mut y }], &mut scratch);
        y
    }

    /// Against f64 dot products of the bf16-rounded activations with the weights: only the
    /// f32 accumulation differs (1e-5 of sum |x w|); against the unrounded activations, the
    /// rounding's own bound on top (2^-9 of sum |x w|).
    #[test]
    fn matches_the_f64_reference_of_rounded_activations() {
        if !available() {
            return;
        }
        let mut rng = Rng(41);
        for &(n, m, k) in &[
            (1usize, 9usize, 64usize),
            (3, 5, 100),
            (7, 13, 31),
            (40, 6, 777),
        ] {
            let w: Vec<bf16> = rng.vec(m * k).iter().map(|&v| bf16::from_f32(v)).collect();
            let mat = MatRef {
                data: WeightData::Bf16(&w),
                rows: m,
                cols: k,
            };
            let x = rng.vec(n * k);
            let bias = rng.vec(m);
            let got = run(&x, n, mat, Some(&bias), n);
            for t in 0..n {
                for r in 0..m {
                    let (mut rounded, mut exact, mut mag) = (bias[r] as f64, bias[r] as f64, 0f64);
                    for c in 0..k {
                        let (xv, wv) = (x[t * k + c], w[r * k + c].to_f32() as f64);
                        rounded += bf16::from_f32(xv).to_f32() as f64 * wv;
                        exact += xv as f64 * wv;
                        mag += (xv as f64 * wv).abs();
                    }
                    let g = got[t * m + r] as f64;
                    let tol = 1e-5 * mag + 1e-6;
                    assert!(
                        (g - rounded).abs() <= tol,
                        "n={n} k={k} t={t} r={r}: {g} vs {rounded}"
                    );
                    let tol = mag / 512.0 + 1e-5 * mag + 1e-6;
                    assert!(
                        (g - exact).abs() <= tol,
                        "n={n} k={k} t={t} r={r}: {g} vs {exact}"
                    );
                }
            }
        }
    }

    /// A token's output row is bitwise the same alone (decode) and inside calls of 2, 7, 33
    /// and 100 tokens, at several places, on 1 and 2 threads, through a scratch of the call's
    /// size and one of 8 tokens (chunked), with and without bias; and a group equals its
    /// products alone.
    #[test]
    fn rows_are_batch_invariant_and_groups_equal_products() {
        if !available() {
            return;
        }
        let mut rng = Rng(43);
        let pools = thread_pools(&[1, 2]);
        let (m, k) = (37, 200);
        let w: Vec<bf16> = rng.vec(m * k).iter().map(|&v| bf16::from_f32(v)).collect();
        let mat = MatRef {
            data: WeightData::Bf16(&w),
            rows: m,
            cols: k,
        };
        let target = rng.vec(k);
        let bias = rng.vec(m);
        for bias in [None, Some(&bias[..])] {
            let alone = run(&target, 1, mat, bias, 1);
            for &n in &[2usize, 7, 33, 100] {
                for at in [0, n / 2, n - 1] {
                    let mut x = rng.vec(n * k);
                    x[at * k..(at + 1) * k].copy_from_slice(&target);
                    for pool in &pools {
                        for cap in [n, 8] {
                            let y = pool.install(|| run(&x, n, mat, bias, cap));
                            assert_eq!(
                                bits(&y[at * m..(at + 1) * m]),
                                bits(&alone),
                                "n={n} at={at} cap={cap} threads={}",
                                pool.current_num_threads()
                            );
                        }
                    }
                }
            }
        }
        let w2: Vec<bf16> = rng.vec(11 * k).iter().map(|&v| bf16::from_f32(v)).collect();
        let mat2 = MatRef {
            data: WeightData::Bf16(&w2),
            rows: 11,
            cols: k,
        };
        let x = rng.vec(5 * k);
        let (mut y1, mut y2) = (vec![0f32; 5 * m], vec![0f32; 5 * 11]);
        let mut scratch = Bf16Scratch::new(5, k);
        linear_bf16dot(
            &x,
            5,
            &mut [
                Bf16Out {
                    w: mat,
                    bias: None,
                    y: &mut y1,
                },
                Bf16Out {
                    w: mat2,
                    bias: None,
                    y: &mut y2,
                },
            ],
            &mut scratch,
        );
        assert_eq!(bits(&y1), bits(&run(&x, 5, mat, None, 5)));
        assert_eq!(bits(&y2), bits(&run(&x, 5, mat2, None, 5)));
    }

    /// Decode from DRAM (16 distinct [8192, 2048] matrices in turn), GB/s of weights against a
    /// plain read of the same bytes: `cargo test --lib -- --ignored --nocapture timing_bf16dot`.
    #[test]
    #[ignore]
    fn timing_bf16dot() {
        if !available() {
            return;
        }
        let (m, k, copies) = (8192usize, 2048usize, 16usize);
        let w: Vec<bf16> = (0..m * k * copies)
            .map(|i| bf16::from_f32((i % 17) as f32 * 0.01))
            .collect();
        let x = vec![0.5f32; k];
        let mut y = vec![0f32; m];
        let mut scratch = Bf16Scratch::new(1, k);
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            for i in 0..4 * copies {
                let c = i % copies;
                let mat = MatRef {
                    data: WeightData::Bf16(&w[c * m * k..(c + 1) * m * k]),
                    rows: m,
                    cols: k,
                };
                linear_bf16dot(
                    &x,
                    1,
                    &mut [Bf16Out {
                        w: mat,
                        bias: None,
                        y: &mut y,
                    }],
                    &mut scratch,
                );
            }
            let tk = t0.elapsed().as_secs_f64() / (4 * copies) as f64;
            let t0 = std::time::Instant::now();
            let raw: &[u16] = unsafe { std::slice::from_raw_parts(w.as_ptr().cast(), w.len()) };
            for _ in 0..4 {
                let s: u64 = raw
                    .par_chunks(1 << 16)
                    .map(|c| c.iter().map(|&v| v as u64).sum::<u64>())
                    .sum();
                std::hint::black_box(s);
            }
            let tr = t0.elapsed().as_secs_f64() / (4 * copies) as f64;
            let gb = |t: f64| (m * k * 2) as f64 / t / 1e9;
            println!("kernel {:.1} GB/s, plain read {:.1} GB/s", gb(tk), gb(tr));
        }
    }
}
