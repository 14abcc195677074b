//! SwiGLU activation: `gate = silu(gate) * up`, plus the vectorisable `exp` shared with attention.

use rayon::prelude::*;

/// Elements per rayon task; below one task's worth we stay on the calling thread.
const PAR_CHUNK: usize = 32 * 1024;

/// `gate[i] = silu(gate[i]) * up[i]` where `silu(g) = g / (1 + exp(-g))`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(
        gate.len(),
        up.len(),
        "silu_mul: gate and up differ in length"
    );
    if gate.len() <= PAR_CHUNK {
        silu_mul_dispatch(gate, up);
    } else {
        gate.par_chunks_mut(PAR_CHUNK)
            .zip(up.par_chunks(PAR_CHUNK))
            .for_each(|(g, u)| silu_mul_dispatch(g, u));
    }
}

fn silu_mul_dispatch(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let cpu = super::isa::cpu();
        if cpu.avx512 {
            // SAFETY: feature detected.
            unsafe { silu_mul_avx512(gate, up) };
            return;
        }
        if cpu.avx2 {
            // SAFETY: features detected.
            unsafe { silu_mul_avx2(gate, up) };
            return;
        }
    }
    silu_mul_body(gate, up);
}

// The same plain loop compiled three times: the compiler vectorises it for each ISA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
    silu_mul_body(gate, up)
}
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
    silu_mul_body(gate, up)
}

#[inline(always)]
fn silu_mul_body(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + fast_exp(-*g)) * u;
    }
}

/// `exp(x)` in f32 without a libm call, so loops using it vectorise. Relative error ~2e-7
/// for x in [-87, 88]; saturates outside (about 1e-38 below, 3e38 above), -inf gives ~1e-38.
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    // Taylor series to r^6 on |r| <= ln2/2: truncation error < 2e-7.
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (C3 + r * (C4 + r * (C5 + r * C6)))));
    // n as an integer, read from t's low mantissa bits (t = 1.5 * 2^23 + n exactly): `n as i32`
    // saturates and checks for NaN, which does not vectorise.
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let scale = f32::from_bits((ni.wrapping_add(127) << 23) as u32);
    p * scale
}

const EXP_MIN: f32 = -87.3;
const EXP_MAX: f32 = 88.7;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5 * 2^23: adding and subtracting rounds to the nearest integer without round().
const MAGIC: f32 = 12_582_912.0;
const C3: f32 = 1.0 / 6.0;
const C4: f32 = 1.0 / 24.0;
const C5: f32 = 1.0 / 120.0;
const C6: f32 = 1.0 / 720.0;

/// [`fast_exp`] of 16 lanes, operation for operation (the same bits in every lane, for inputs
/// that are not NaN), for kernels written with AVX-512 intrinsics.
///
/// # Safety
/// The CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn fast_exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm512_set1_ps(v);
    let x = _mm512_min_ps(_mm512_max_ps(x, c(EXP_MIN)), c(EXP_MAX));
    let t = _mm512_add_ps(_mm512_mul_ps(x, c(LOG2E)), c(MAGIC));
    let n = _mm512_sub_ps(t, c(MAGIC));
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, c(LN2_HI))),
        _mm512_mul_ps(n, c(LN2_LO)),
    );
    let mut p = _mm512_add_ps(c(C5), _mm512_mul_ps(r, c(C6)));
    for k in [C4, C3, 0.5, 1.0, 1.0] {
        p = _mm512_add_ps(c(k), _mm512_mul_ps(r, p));
    }
    let ni = _mm512_sub_epi32(
        _mm512_castps_si512(t),
        _mm512_set1_epi32(MAGIC.to_bits() as i32),
    );
    let scale = _mm512_slli_epi32::<23>(_mm512_add_epi32(ni, _mm512_set1_epi32(127)));
    _mm512_mul_ps(p, _mm512_castsi512_ps(scale))
}

/// [`fast_exp`] on 8 lanes with AVX2: the same operations in the same order, so the same bits
/// (tested), for the AVX2 attention's lanes path.
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn fast_exp_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = |v: f32| _mm256_set1_ps(v);
    let x = _mm256_min_ps(_mm256_max_ps(x, c(EXP_MIN)), c(EXP_MAX));
    let t = _mm256_add_ps(_mm256_mul_ps(x, c(LOG2E)), c(MAGIC));
    let n = _mm256_sub_ps(t, c(MAGIC));
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, c(LN2_HI))),
        _mm256_mul_ps(n, c(LN2_LO)),
    );
    let mut p = _mm256_add_ps(c(C5), _mm256_mul_ps(r, c(C6)));
    for k in [C4, C3, 0.5, 1.0, 1.0] {
        p = _mm256_add_ps(c(k), _mm256_mul_ps(r, p));
    }
    let ni = _mm256_sub_epi32(
        _mm256_castps_si256(t),
        _mm256_set1_epi32(MAGIC.to_bits() as i32),
    );
    let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(ni, _mm256_set1_epi32(127)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(scale))
}

/// Plain reference in f64.
pub fn reference(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let gv = *g as f64;
        *g = (gv / (1.0 + (-gv).exp()) * *u as f64) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::kernels::cpu::test_rng::Rng;

    #[test]
    fn fast_exp_accuracy() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (g, e) = (fast_exp(x) as f64, (x as f64).exp());
            assert!((g - e).abs() <= 4e-7 * e, "exp({x}) = {g}, want {e}");
            x += 0.0137;
        }
        assert!(fast_exp(f32::NEG_INFINITY) < 1e-37);
        // Attention skips its rescale when the running max is unchanged: that relies on this.
        assert_eq!(fast_exp(0.0), 1.0);
    }

    /// Inputs for the vector exps' bit-for-bit tests: a wide range, tiny values and the edges,
    /// padded to whole vectors of `lanes`.
    #[cfg(target_arch = "x86_64")]
    fn exp_inputs(lanes: usize) -> Vec<f32> {
        let mut rng = Rng(17);
        let mut xs: Vec<f32> = (0..100_000).map(|_| rng.signed() * 200.0).collect();
        xs.extend((0..20_000).map(|_| rng.signed() * 1e-3));
        xs.extend([
            0.0,
            -0.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            EXP_MIN,
            EXP_MAX,
            -87.3001,
            88.70001,
            1e-30,
            -1e-30,
        ]);
        xs.resize(xs.len().div_ceil(lanes) * lanes, 1.0);
        xs
    }

    /// The AVX-512 exp is the scalar one, bit for bit: attention's two paths rely on it.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fast_exp_avx512_equals_scalar() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let xs = exp_inputs(16);
        #[target_feature(enable = "avx512f")]
        unsafe fn lanes(x: &[f32], out: &mut [f32]) {
            use std::arch::x86_64::*;
            for (i, o) in x.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
                _mm512_storeu_ps(o.as_mut_ptr(), fast_exp_avx512(_mm512_loadu_ps(i.as_ptr())));
            }
        }
        let mut got = vec![0f32; xs.len()];
        // SAFETY: AVX-512F detected above.
        unsafe { lanes(&xs, &mut got) };
        for (x, g) in xs.iter().zip(&got) {
            assert_eq!(g.to_bits(), fast_exp(*x).to_bits(), "exp({x})");
        }
    }

    /// The AVX2 exp is the scalar one, bit for bit: the AVX2 lanes path relies on it.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fast_exp_avx2_equals_scalar() {
        if !is_x86_feature_detected!("avx2") {
            eprintln!("skipped: no AVX2 on this CPU");
            return;
        }
        let xs = exp_inputs(8);
        #[target_feature(enable = "avx2")]
        unsafe fn lanes(x: &[f32], out: &mut [f32]) {
            use std::arch::x86_64::*;
            for (i, o) in x.chunks_exact(8).zip(out.chunks_exact_mut(8)) {
                _mm256_storeu_ps(o.as_mut_ptr(), fast_exp_avx2(_mm256_loadu_ps(i.as_ptr())));
            }
        }
        let mut got = vec![0f32; xs.len()];
        // SAFETY: AVX2 detected above.
        unsafe { lanes(&xs, &mut got) };
        for (x, g) in xs.iter().zip(&got) {
            assert_eq!(g.to_bits(), fast_exp(*x).to_bits(), "exp({x})");
        }
    }

    #[test]
    fn matches_reference() {
        let mut rng = Rng(9);
        // Odd lengths, and one long enough to take the parallel path.
        for &len in &[1usize, 15, 17, 1000, 3 * PAR_CHUNK + 5] {
            let gate: Vec<f32> = (0..len).map(|_| rng.signed() * 30.0).collect();
            let up: Vec<f32> = (0..len).map(|_| rng.signed() * 3.0).collect();
            let mut got = gate.clone();
            let mut want = gate.clone();
            let mut portable = gate.clone();
            silu_mul(&mut got, &up);
            silu_mul_body(&mut portable, &up);
            reference(&mut want, &up);
            for i in 0..len {
                assert!((portable[i] - want[i]).abs() <= 1e-6 * want[i].abs() + 1e-12);
                // 1e-6 relative plus a tiny absolute floor (silu of very negative g is ~0).
                let tol = 1e-6 * want[i].abs() + 1e-12;
                assert!(
                    (got[i] - want[i]).abs() <= tol,
                    "i={i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
        }
    }
}
