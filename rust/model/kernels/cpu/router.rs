//! The router of a mixture-of-experts layer: for one token, the k experts with the highest
//! softmax weight over its router logits, and their weights (renormalized over the k, or not).

/// One routed expert of a token, and the weight of its output.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Route {
    pub expert: u32,
    pub weight: f32,
}

/// Fills `out` (k entries) with the top-k experts of `logits` by softmax weight, highest first
/// (a tie goes to the lower expert id), as transformers' Qwen3-MoE and Mixtral blocks route:
/// softmax over every expert in f32, top-k, then, when `renormalize`, each weight divided by
/// the k weights' sum.
pub fn route(logits: &[f32], renormalize: bool, out: &mut [Route]) {
    let k = out.len();
    assert!(
        k > 0 && k <= logits.len(),
        "route: {k} of {} experts",
        logits.len()
    );
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    for i in 0..k {
        let mut best = usize::MAX;
        for (e, &l) in logits.iter().enumerate() {
            // k is small: the chosen are found by a scan of those before.
            let taken = out[..i].iter().any(|r| r.expert as usize == e);
            if !taken && (best == usize::MAX || l > logits[best]) {
                best = e;
            }
        }
        out[i] = Route {
            expert: best as u32,
            weight: (logits[best] - max).exp() / sum,
        };
    }
    if renormalize {
        let total: f32 = out.iter().map(|r| r.weight).sum();
        for r in out.iter_mut() {
            r.weight /= total;
        }
    }
}

/// Plain reference in f64: sort every expert by weight.
pub fn reference(logits: &[f32], renormalize: bool, k: usize) -> Vec<(u32, f64)> {
    let max = logits
        .iter()
        .map(|&l| l as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let mut all: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(e, &l)| (e as u32, (l as f64 - max).exp() / sum))
        .collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all.truncate(k);
    if renormalize {
        let total: f64 = all.iter().map(|r| r.1).sum();
        all.iter_mut().for_each(|r| r.1 /= total);
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::kernels::cpu::test_rng::Rng;

    #[test]
    fn routes_match_the_reference() {
        let mut rng = Rng(9);
        for (experts, k) in [(8, 2), (8, 1), (8, 8), (128, 8), (160, 6), (3, 2)] {
            for renormalize in [false, true] {
                for _ in 0..50 {
                    let logits: Vec<f32> = (0..experts).map(|_| rng.signed() * 4.0).collect();
                    let mut got = vec![Route::default(); k];
                    route(&logits, renormalize, &mut got);
                    let want = reference(&logits, renormalize, k);
                    for (g, (e, w)) in got.iter().zip(&want) {
                        assert_eq!(g.expert, *e, "{experts} experts, k {k}");
                        assert!((g.weight as f64 - w).abs() < 1e-6, "{g:?} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_worked_example() {
        // softmax([0, ln 3, ln 2, ln 4]) = [0.1, 0.3, 0.2, 0.4].
        let logits = [0.0f32, 3f32.ln(), 2f32.ln(), 4f32.ln()];
        let mut got = [Route::default(); 2];
        route(&logits, false, &mut got);
        assert_eq!((got[0].expert, got[1].expert), (3, 1));
        assert!((got[0].weight - 0.4).abs() < 1e-6 && (got[1].weight - 0.3).abs() < 1e-6);
        route(&logits, true, &mut got);
        assert!((got[0].weight - 4.0 / 7.0).abs() < 1e-6);
        assert!((got[1].weight - 3.0 / 7.0).abs() < 1e-6);
        // A tie goes to the lower id.
        route(&[1.0, 2.0, 2.0], true, &mut got);
        assert_eq!((got[0].expert, got[1].expert), (1, 2));
    }
}
