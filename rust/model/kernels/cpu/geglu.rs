//! GeGLU activation (Gemma): `gate = gelu_tanh(gate) * up`, GELU in its tanh approximation
//! (PyTorch's `gelu(approximate="tanh")`, transformers' `gelu_pytorch_tanh`).

use rayon::prelude::*;

use super::swiglu::fast_exp;

/// Elements per rayon task; below one task's worth we stay on the calling thread.
const PAR_CHUNK: usize = 32 * 1024;

/// sqrt(2 / pi).
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const CUBIC: f32 = 0.044_715;

/// `gate[i] = gelu_tanh(gate[i]) * up[i]`.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(
        gate.len(),
        up.len(),
        "gelu_tanh_mul: gate and up differ in length"
    );
    if gate.len() <= PAR_CHUNK {
        dispatch(gate, up);
    } else {
        gate.par_chunks_mut(PAR_CHUNK)
            .zip(up.par_chunks(PAR_CHUNK))
            .for_each(|(g, u)| dispatch(g, u));
    }
}

fn dispatch(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let cpu = super::isa::cpu();
        if cpu.avx512 {
            // SAFETY: feature detected.
            unsafe { body_avx512(gate, up) };
            return;
        }
        if cpu.avx2 {
            // SAFETY: features detected.
            unsafe { body_avx2(gate, up) };
            return;
        }
    }
    body(gate, up);
}

// The same plain loop compiled three times: the compiler vectorises it for each ISA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn body_avx512(gate: &mut [f32], up: &[f32]) {
    body(gate, up)
}
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn body_avx2(gate: &mut [f32], up: &[f32]) {
    body(gate, up)
}

/// 0.5 g (1 + tanh(u)) is g * sigmoid(2u) = g / (1 + exp(-2u)): one exp, no tanh call, so the
/// loop vectorises (and saturates cleanly: a large negative g gives -0, a large positive g).
#[inline(always)]
fn body(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let inner = SQRT_2_OVER_PI * (x + CUBIC * x * x * x);
        *g = x / (1.0 + fast_exp(-2.0 * inner)) * u;
    }
}

/// Plain reference in f64, from the formula as PyTorch writes it.
pub fn reference(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g as f64;
        let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
        *g = (0.5 * x * (1.0 + inner.tanh()) * *u as f64) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::kernels::cpu::test_rng::Rng;

    fn inputs() -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng(5);
        let mut g: Vec<f32> = (0..70_001).map(|_| rng.signed() * 12.0).collect();
        g.extend([0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 200.0, -200.0]);
        let u: Vec<f32> = (0..g.len()).map(|_| rng.signed() * 3.0).collect();
        (g, u)
    }

    /// Every path this CPU runs (the parallel split included) against the f64 formula.
    #[test]
    fn gelu_tanh_mul_matches_the_reference() {
        let (g, u) = inputs();
        let mut want = g.clone();
        reference(&mut want, &u);
        let mut paths: Vec<(&str, Vec<f32>)> = Vec::new();
        let mut plain = g.clone();
        body(&mut plain, &u);
        paths.push(("portable", plain));
        let mut whole = g.clone();
        gelu_tanh_mul(&mut whole, &u);
        paths.push(("dispatched", whole));
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = crate::model::kernels::cpu::isa::cpu();
            if cpu.avx2 {
                let mut v = g.clone();
                // SAFETY: feature detected.
                unsafe { body_avx2(&mut v, &u) };
                paths.push(("avx2", v));
            }
            if cpu.avx512 {
                let mut v = g.clone();
                // SAFETY: feature detected.
                unsafe { body_avx512(&mut v, &u) };
                paths.push(("avx512", v));
            }
        }
        for (name, got) in paths {
            for i in 0..g.len() {
                let (a, b) = (got[i], want[i]);
                // fast_exp's ~2e-7 relative error and the f32 arithmetic around it; far in the
                // negative tail (gelu < 1e-9 |x|) the f32 cubic's rounding dominates, and an
                // absolute bound far below any activation's scale applies.
                assert!(
                    (a - b).abs() <= 2e-6 * b.abs() + 1e-12 * u[i].abs(),
                    "{name}: gelu_tanh({}) * {} = {a}, want {b}",
                    g[i],
                    u[i]
                );
            }
        }
    }

    #[test]
    fn known_values() {
        // PyTorch: gelu(tensor([1.0, -1.0, 3.0]), approximate="tanh").
        let mut g = [1.0f32, -1.0, 3.0, 0.0];
        gelu_tanh_mul(&mut g, &[1.0; 4]);
        let want = [0.841_192, -0.158_808, 2.996_362_6, 0.0];
        for (a, b) in g.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{g:?}");
        }
    }
}
