//! Rotary position embeddings: HF's "rotate_half" convention (dimension `i` pairs with
//! `i + head_dim/2`), or adjacent pairs (`2i` with `2i + 1`), the order GGUF files of the llama
//! architecture store q and k rows in (llama.cpp's converter permutes them so).

/// Frequency scaling variants from the HF config's `rope_scaling`.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (equivalently `inv_freq / factor`).
    Linear {
        factor: f64,
    },
    /// Llama 3.x frequency-dependent scaling (transformers `_compute_llama3_parameters`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// One divisor per frequency (GGUF's `rope_freqs` tensor: what the converter computed from
    /// the model's Llama 3 parameters).
    Factors(Vec<f64>),
    /// Phi-3's LongRoPE (transformers `_compute_longrope_parameters`): one divisor per frequency,
    /// the long set when the served context runs past the original one, else the short set;
    /// cos and sin are multiplied by `attention_factor`. transformers switches sets with the
    /// length of the sequence in hand, which would change the K/V of positions already
    /// cached; choosing once by the context served (as llama.cpp does) keeps every position's
    /// rotation fixed.
    LongRope {
        short_factors: Vec<f64>,
        long_factors: Vec<f64>,
        original_max_position_embeddings: f64,
        attention_factor: f64,
    },
    /// YaRN (transformers `_compute_yarn_parameters`, as Qwen's long-context configs set it):
    /// frequencies that turn fewer than `beta_slow` times over the original context are divided
    /// by `factor`, those that turn more than `beta_fast` times are kept, a linear ramp over the
    /// dimensions between; cos and sin are multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        /// Round the ramp's ends out to whole dimensions (transformers' default).
        truncate: bool,
    },
}

impl RopeScaling {
    /// The context a model with this scaling serves by default: for YaRN its original context
    /// stretched by the factor (what vLLM serves too), else `stated` (the config's).
    pub fn context(&self, stated: usize) -> usize {
        match *self {
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                ..
            } => (orig * factor).round() as usize,
            _ => stated,
        }
    }

    /// The factor cos and sin are multiplied by (YaRN's and LongRoPE's attention scaling; 1
    /// otherwise).
    pub fn attention_factor(&self) -> f64 {
        match *self {
            RopeScaling::Yarn {
                attention_factor, ..
            }
            | RopeScaling::LongRope {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }

    /// Whether LongRoPE uses its long factors when serving `context` positions.
    pub fn uses_long_factors(&self, context: usize) -> bool {
        match *self {
            RopeScaling::LongRope {
                original_max_position_embeddings: orig,
                ..
            } => context as f64 > orig,
            _ => false,
        }
    }
}

/// YaRN's default attention factor for `factor` with the multiplier `mscale`: `0.1 * mscale *
/// ln(factor) + 1` (1 when the context is not stretched).
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// YaRN's ramp over the frequency index `i`: 0 where the frequency is kept, 1 where it is divided
/// by the factor.
fn yarn_ramp(i: usize, head_dim: usize, theta: f64, scaling: &RopeScaling) -> f64 {
    let RopeScaling::Yarn {
        original_max_position_embeddings: orig,
        beta_fast,
        beta_slow,
        truncate,
        ..
    } = *scaling
    else {
        return 0.0;
    };
    let dim = head_dim as f64;
    // The dimension whose frequency turns `rotations` times over the original context.
    let correction_dim = |rotations: f64| {
        dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001;
    }
    ((i as f64 - low) / (high - low)).clamp(0.0, 1.0)
}

/// Which dimensions of a head rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RopePairing {
    /// `i` with `i + head_dim/2` (Hugging Face checkpoints; GGUF qwen2/qwen3).
    #[default]
    Half,
    /// `2i` with `2i + 1` (GGUF llama-architecture files).
    Adjacent,
}

/// cos/sin for every position and frequency, computed in f64 at load and stored in f32.
pub struct RopeTable {
    /// `rotary_dim / 2`: the frequencies per position.
    half: usize,
    /// The head's size: its first `rotary_dim` dimensions rotate, the rest pass through (Phi's
    /// partial rotary factor); `rotary_dim` unless `with_head_dim` says otherwise.
    head_dim: usize,
    pairing: RopePairing,
    max_positions: usize,
    /// `[max_positions, half]`.
    cos: Vec<f32>,
    /// `[max_positions, half]`.
    sin: Vec<f32>,
}

/// `inv_freq[i]` for `i in 0..rotary_dim/2`, with the scaling applied for a model serving
/// `context` positions (which only LongRoPE reads).
pub fn inv_freqs(rotary_dim: usize, theta: f64, scaling: &RopeScaling, context: usize) -> Vec<f64> {
    let half = rotary_dim / 2;
    let long = scaling.uses_long_factors(context);
    (0..half)
        .map(|i| {
            let f = 1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64);
            match *scaling {
                RopeScaling::None => f,
                RopeScaling::Linear { factor } => f / factor,
                RopeScaling::Factors(ref factors) => f / factors[i],
                RopeScaling::LongRope {
                    ref short_factors,
                    ref long_factors,
                    ..
                } => {
                    f / if long {
                        long_factors[i]
                    } else {
                        short_factors[i]
                    }
                }
                RopeScaling::Yarn { factor, .. } => {
                    let ramp = yarn_ramp(i, rotary_dim, theta, scaling);
                    f / factor * ramp + f * (1.0 - ramp)
                }
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: orig,
                } => {
                    let low_freq_wavelen = orig / low_freq_factor;
                    let high_freq_wavelen = orig / high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (orig / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

impl RopeTable {
    /// The table rotating `rotary_dim` dimensions of each head over `max_positions` positions
    /// (the context served). `None` when it cannot be allocated (a context far beyond the
    /// machine's memory): the caller reports it, where an infallible allocation would abort.
    pub fn try_new(
        rotary_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        max_positions: usize,
    ) -> Option<Self> {
        assert!(
            rotary_dim >= 2 && rotary_dim.is_multiple_of(2),
            "rope: rotary_dim must be even"
        );
        let half = rotary_dim / 2;
        let freqs = inv_freqs(rotary_dim, theta, scaling, max_positions);
        let attention_factor = scaling.attention_factor();
        let len = max_positions.checked_mul(half)?;
        let mut cos: Vec<f32> = Vec::new();
        let mut sin: Vec<f32> = Vec::new();
        cos.try_reserve_exact(len).ok()?;
        sin.try_reserve_exact(len).ok()?;
        for p in 0..max_positions {
            for &f in &freqs {
                let a = p as f64 * f;
                cos.push((a.cos() * attention_factor) as f32);
                sin.push((a.sin() * attention_factor) as f32);
            }
        }
        Some(Self {
            half,
            head_dim: rotary_dim,
            pairing: RopePairing::Half,
            max_positions,
            cos,
            sin,
        })
    }

    /// The same table, rotating `pairing`'s pairs.
    pub fn with_pairing(mut self, pairing: RopePairing) -> Self {
        self.pairing = pairing;
        self
    }

    /// The same table for heads of `head_dim` (at least the rotary size), whose dimensions past
    /// the rotary ones pass through.
    pub fn with_head_dim(mut self, head_dim: usize) -> Self {
        assert!(head_dim >= 2 * self.half, "rope: head_dim below rotary_dim");
        self.head_dim = head_dim;
        self
    }

    /// The dimensions of a head that rotate.
    pub fn rotary_dim(&self) -> usize {
        2 * self.half
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn pairing(&self) -> RopePairing {
        self.pairing
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// `rotary_dim / 2`: the frequencies per position.
    pub fn half(&self) -> usize {
        self.half
    }

    /// The `[max_positions, half]` cosines (what a GPU copy of the table uploads).
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// The `[max_positions, half]` sines.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }

    /// Bytes the cos and sin tables hold (for the device's memory accounting).
    pub fn bytes(&self) -> usize {
        (self.cos.capacity() + self.sin.capacity()) * std::mem::size_of::<f32>()
    }

    /// Rotates every head of one token in place: `x` is `[n_heads * head_dim]` at position `pos`.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, pos: usize) {
        let half = self.half;
        assert!(
            pos < self.max_positions,
            "rope: position {pos} beyond table ({})",
            self.max_positions
        );
        assert_eq!(
            x.len(),
            n_heads * self.head_dim,
            "rope: x is not [n_heads * head_dim]"
        );
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        if self.pairing == RopePairing::Adjacent {
            for head in x.chunks_exact_mut(self.head_dim) {
                for ((pair, &c), &s) in head[..2 * half].chunks_exact_mut(2).zip(cos).zip(sin) {
                    let (u, v) = (pair[0], pair[1]);
                    pair[0] = u * c - v * s;
                    pair[1] = v * c + u * s;
                }
            }
            return;
        }
        for head in x.chunks_exact_mut(self.head_dim) {
            let (x1, x2) = head[..2 * half].split_at_mut(half);
            // Plain zipped loop: vectorises.
            for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
                let (u, v) = (*a, *b);
                *a = u * c - v * s;
                *b = v * c + u * s;
            }
        }
    }
}

/// Plain reference: angles and rotation in f64, straight from the definition. The first
/// `rotary_dim` dimensions of each head rotate, for a model serving `context` positions.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    pos: usize,
    theta: f64,
    scaling: &RopeScaling,
    context: usize,
) {
    let half = rotary_dim / 2;
    let freqs = inv_freqs(rotary_dim, theta, scaling, context);
    let m = scaling.attention_factor();
    for h in 0..n_heads {
        for (i, &f) in freqs.iter().enumerate() {
            let a = pos as f64 * f;
            let (cos, sin) = (a.cos() * m, a.sin() * m);
            let (x1, x2) = (
                x[h * head_dim + i] as f64,
                x[h * head_dim + i + half] as f64,
            );
            x[h * head_dim + i] = (x1 * cos - x2 * sin) as f32;
            x[h * head_dim + i + half] = (x2 * cos + x1 * sin) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::kernels::cpu::test_rng::Rng;

    #[test]
    fn llama3_frequency_bands() {
        // Llama 3.1 parameters: check the three bands against a direct f64 computation.
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let f = inv_freqs(128, 500000.0, &s, 131072);
        let base: Vec<f64> = (0..64)
            .map(|i| 1.0 / 500000f64.powf(2.0 * i as f64 / 128.0))
            .collect();
        assert_eq!(f[0], base[0]); // highest frequency: unchanged
        assert!((f[63] - base[63] / 8.0).abs() < 1e-18); // lowest: divided by factor
        let mut saw_medium = false;
        for i in 0..64 {
            let wl = 2.0 * std::f64::consts::PI / base[i];
            if (2048.0..=8192.0).contains(&wl) {
                saw_medium = true;
                let sm = (8192.0 / wl - 1.0) / 3.0;
                let want = (1.0 - sm) * base[i] / 8.0 + sm * base[i];
                assert!((f[i] - want).abs() <= 1e-15 * want);
            }
        }
        assert!(saw_medium);
    }

    #[test]
    fn yarn_frequency_bands() {
        // Qwen2.5's YaRN at head_dim 64, theta 1e4, from 4,096 positions: the frequency that
        // turns 32 times over 4,096 positions is dimension 10.47 (kept up to index 10), the one
        // that turns once is 22.51 (divided by the factor from index 23), linear between.
        let s = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: yarn_mscale(4.0, 1.0),
            truncate: true,
        };
        let got = inv_freqs(64, 10000.0, &s, 16384);
        for (i, &g) in got.iter().enumerate() {
            let f = 1.0 / 10000f64.powf(i as f64 / 32.0);
            let ramp = ((i as f64 - 10.0) / 13.0).clamp(0.0, 1.0);
            let want = f * (1.0 - ramp) + f / 4.0 * ramp;
            assert!((g - want).abs() <= 1e-15 * f, "i={i}: {g} vs {want}");
        }
        assert_eq!(got[10], 1.0 / 10000f64.powf(10.0 / 32.0));
        assert_eq!(got[23], 1.0 / 10000f64.powf(23.0 / 32.0) / 4.0);
        assert_eq!(s.attention_factor(), 0.1 * 4f64.ln() + 1.0);
        // Without truncation the ramp runs from 10.47 to 22.51.
        let s = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.0,
            truncate: false,
        };
        let got = inv_freqs(64, 10000.0, &s, 16384);
        let low =
            64.0 * (4096.0 / (32.0 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * 10000f64.ln());
        let high = 64.0 * (4096.0 / (2.0 * std::f64::consts::PI)).ln() / (2.0 * 10000f64.ln());
        let f16 = 1.0 / 10000f64.powf(0.5);
        let ramp = (16.0 - low) / (high - low);
        assert!((got[16] - (f16 * (1.0 - ramp) + f16 / 4.0 * ramp)).abs() <= 1e-15);
        assert_eq!(yarn_mscale(1.0, 1.0), 1.0);
    }

    fn longrope(original: f64) -> RopeScaling {
        RopeScaling::LongRope {
            short_factors: (0..32).map(|i| 1.0 + 0.05 * i as f64).collect(),
            long_factors: (0..32).map(|i| 1.0 + 0.5 * i as f64).collect(),
            original_max_position_embeddings: original,
            attention_factor: 1.19,
        }
    }

    #[test]
    fn matches_reference_all_scalings() {
        let scalings = [
            RopeScaling::None,
            RopeScaling::Linear { factor: 4.0 },
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64.0,
            },
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 64.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: yarn_mscale(4.0, 1.0),
                truncate: true,
            },
            // The long factors (300 positions served, past 64) and the short ones.
            longrope(64.0),
            longrope(300.0),
        ];
        let mut rng = Rng(11);
        for s in &scalings {
            // (head_dim, rotary_dim, heads, theta): whole heads, and Phi's partial rotation.
            for &(head_dim, rotary_dim, n_heads, theta) in &[
                (64usize, 64usize, 9usize, 10000.0),
                (34, 34, 3, 1e6),
                (64, 48, 3, 10000.0),
                (34, 16, 2, 1e6),
            ] {
                let max = 300;
                let table = RopeTable::try_new(rotary_dim, theta, s, max)
                    .expect("table")
                    .with_head_dim(head_dim);
                assert_eq!(table.max_positions(), max);
                assert_eq!(
                    (table.rotary_dim(), table.head_dim()),
                    (rotary_dim, head_dim)
                );
                // Includes positions past original_max_position_embeddings (64).
                for &pos in &[0usize, 1, 17, 63, 64, 65, 200, 299] {
                    let x: Vec<f32> = (0..n_heads * head_dim).map(|_| rng.signed()).collect();
                    let mut got = x.clone();
                    let mut want = x.clone();
                    table.apply(&mut got, n_heads, pos);
                    reference(&mut want, n_heads, head_dim, rotary_dim, pos, theta, s, max);
                    for i in 0..x.len() {
                        // f32 cos/sin (rounded from f64) and f32 arithmetic: a few ulp of |x| <= 1.
                        assert!(
                            (got[i] - want[i]).abs() <= 1e-6,
                            "{s:?} pos={pos} i={i}: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                    // The dimensions past the rotary ones pass through untouched.
                    for h in 0..n_heads {
                        let tail = h * head_dim + rotary_dim..(h + 1) * head_dim;
                        assert_eq!(got[tail.clone()], x[tail]);
                    }
                }
            }
        }
    }

    #[test]
    fn longrope_chooses_its_factors_by_the_context_served() {
        let s = longrope(64.0);
        let base = |i: usize| 1.0 / 10000f64.powf(2.0 * i as f64 / 16.0);
        let short = inv_freqs(16, 10000.0, &s, 64);
        let long = inv_freqs(16, 10000.0, &s, 65);
        for i in 0..8 {
            assert_eq!(short[i], base(i) / (1.0 + 0.05 * i as f64));
            assert_eq!(long[i], base(i) / (1.0 + 0.5 * i as f64));
        }
        assert!(!s.uses_long_factors(64) && s.uses_long_factors(65));
        // cos and sin carry the attention factor whichever set is in use.
        for max in [64, 65] {
            let t = RopeTable::try_new(16, 10000.0, &s, max).expect("table");
            assert_eq!(t.cos()[0], 1.19f32);
            assert_eq!(t.sin()[0], 0.0);
        }
    }

    #[test]
    fn adjacent_pairs_rotate_the_permuted_rows_alike() {
        // GGUF llama files store each head's rows as (0, half, 1, half + 1, ...): rotating
        // adjacent pairs of that order gives the same numbers as rotate_half in HF order.
        let (head_dim, n_heads, half) = (16usize, 3usize, 8usize);
        let factors: Vec<f64> = (0..half).map(|i| 1.0 + i as f64).collect();
        let s = RopeScaling::Factors(factors.clone());
        let freqs = inv_freqs(head_dim, 10000.0, &s, 50);
        for (i, &f) in freqs.iter().enumerate() {
            let base = 1.0 / 10000f64.powf(2.0 * i as f64 / head_dim as f64);
            assert_eq!(f, base / factors[i]);
        }
        let half_table = RopeTable::try_new(head_dim, 10000.0, &s, 50).expect("table");
        let adjacent = RopeTable::try_new(head_dim, 10000.0, &s, 50)
            .expect("table")
            .with_pairing(RopePairing::Adjacent);
        let mut rng = Rng(5);
        let x: Vec<f32> = (0..n_heads * head_dim).map(|_| rng.signed()).collect();
        let permute = |v: &[f32]| -> Vec<f32> {
            let mut p = vec![0.0; v.len()];
            for h in 0..n_heads {
                for i in 0..half {
                    p[h * head_dim + 2 * i] = v[h * head_dim + i];
                    p[h * head_dim + 2 * i + 1] = v[h * head_dim + half + i];
                }
            }
            p
        };
        for pos in [0, 1, 31, 49] {
            let mut hf = x.clone();
            half_table.apply(&mut hf, n_heads, pos);
            let mut gguf = permute(&x);
            adjacent.apply(&mut gguf, n_heads, pos);
            assert_eq!(gguf, permute(&hf), "pos {pos}");
        }
    }

    #[test]
    fn a_table_beyond_memory_is_none() {
        assert!(RopeTable::try_new(8, 10000.0, &RopeScaling::None, usize::MAX / 2).is_none());
        assert!(RopeTable::try_new(8, 10000.0, &RopeScaling::None, 1 << 50).is_none());
    }

    #[test]
    #[should_panic]
    fn position_past_table_panics() {
        let t = RopeTable::try_new(8, 10000.0, &RopeScaling::None, 4).expect("table");
        t.apply(&mut [0.0; 8], 1, 4);
    }
}
