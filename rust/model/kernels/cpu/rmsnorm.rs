//! RMSNorm as in HF Llama: `x * 1/sqrt(mean(x^2) + eps) * w`, all in f32.

use rayon::prelude::*;

/// Below this many elements in total the norm stays on the calling thread (splitting it into
/// rayon tasks would cost more than it saves).
const PAR_MIN_ELEMS: usize = 64 * 1024;

/// For each of the `out.len() / w.len()` rows: `out = x * 1/sqrt(mean(x^2) + eps) * w`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert!(d > 0, "rmsnorm: empty weight");
    assert_eq!(x.len(), out.len(), "rmsnorm: x and out differ in length");
    assert_eq!(
        x.len() % d,
        0,
        "rmsnorm: length is not a multiple of the weight"
    );
    if x.len() < PAR_MIN_ELEMS {
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            norm_row(xr, w, eps, or);
        }
    } else {
        x.par_chunks_exact(d)
            .zip(out.par_chunks_exact_mut(d))
            .for_each(|(xr, or)| norm_row(xr, w, eps, or));
    }
}

/// In-place variant (Qwen3's per-head q/k norm): `x` holds rows of `w.len()`.
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    assert!(d > 0, "rmsnorm_inplace: empty weight");
    assert_eq!(
        x.len() % d,
        0,
        "rmsnorm_inplace: length is not a multiple of the weight"
    );
    if x.len() < PAR_MIN_ELEMS {
        for r in x.chunks_exact_mut(d) {
            norm_row_inplace(r, w, eps);
        }
    } else {
        x.par_chunks_exact_mut(d)
            .for_each(|r| norm_row_inplace(r, w, eps));
    }
}

/// 1/sqrt(mean(x^2) + eps), with 16 partial sums so the loop vectorises.
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for l in 0..16 {
            acc[l] += c[l] * c[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for v in it.remainder() {
        s += v * v;
    }
    1.0 / (s / x.len() as f32 + eps).sqrt()
}

#[inline]
fn norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, xv), wv) in out.iter_mut().zip(x).zip(w) {
        *o = xv * inv * wv;
    }
}

#[inline]
fn norm_row_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = inv_rms(x, eps);
    for (xv, wv) in x.iter_mut().zip(w) {
        *xv = *xv * inv * wv;
    }
}

/// Plain reference, accumulating in f64.
pub fn reference(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ms: f64 = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = (xv as f64 * inv * wv as f64) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::kernels::cpu::test_rng::Rng;

    #[test]
    fn matches_reference() {
        let mut rng = Rng(5);
        // Odd widths, and enough rows to take the parallel path.
        for &(rows, d) in &[(1usize, 576usize), (3, 67), (5, 1), (2000, 64), (7, 128)] {
            let x: Vec<f32> = (0..rows * d).map(|_| rng.signed() * 4.0).collect();
            let w: Vec<f32> = (0..d).map(|_| rng.signed() + 1.0).collect();
            let mut want = vec![0.0; rows * d];
            reference(&x, &w, 1e-6, &mut want);
            let mut got = vec![f32::NAN; rows * d];
            rmsnorm(&x, &w, 1e-6, &mut got);
            let mut inplace = x.clone();
            rmsnorm_inplace(&mut inplace, &w, 1e-6);
            for i in 0..rows * d {
                // f32 sum of squares vs f64: a few ulp.
                let tol = 1e-5 * want[i].abs() + 1e-6;
                assert!(
                    (got[i] - want[i]).abs() <= tol,
                    "i={i}: {} vs {}",
                    got[i],
                    want[i]
                );
                assert_eq!(got[i], inplace[i]);
            }
        }
    }
}
