//! Picks the next token from a row of logits: penalties, temperature, top-k, top-p, min-p, and
//! log-probabilities of the raw logits.
//!
//! Conventions (each pinned by a test below):
//! - Non-finite logits: NaN counts as -inf; +inf counts as `f32::MAX`, so several +inf tokens share
//!   the probability equally. `-0.0` counts as `0.0`.
//! - If every logit is -inf or NaN (or the row is empty), token 0 is returned; a non-greedy step
//!   still draws from the RNG so that the stream stays in step.
//! - `temperature <= 0` (or NaN) is greedy. `top_p` is clamped to [0, 1]; 0 keeps the single most
//!   likely token. `min_p` above 1 acts as 1 (keeps only the most likely tokens).
//! - Probabilities that compare equal are ordered by lower token id (for top-k, top-p, the top
//!   logprobs and the greedy pick alike).
//! - The inverse-CDF draw walks the kept tokens in ascending token id: a fixed order that needs
//!   no sort of the vocabulary.
//! - Weights are `exp(x - max)` in f32 and are 0 below `exp(-87)` (under 1e-38 of the top
//!   token), sums are accumulated in f64.
//! - Token ids at or beyond `vocab` (or beyond the logits row) are ignored by the penalties.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::fmt;

use super::request::{PromptTokenLogprob, SamplingParams, TokenLogprob};

/// One sampled token and, when requested, log-probabilities from the raw logits.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log_softmax of the raw model logits at `token`; `None` unless logprobs were requested.
    pub logprob: Option<f32>,
    /// The highest raw log-probabilities, descending, ties by lower id.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Per-request sampling state: the parameters, the penalty history and the RNG.
#[derive(Clone)]
pub struct Sampler {
    greedy: bool,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    /// `min_p` clamped to [0, 1]; 0 when off.
    min_p: f32,
    repetition_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    logprobs: Option<usize>,
    logit_bias: Vec<(u32, f32)>,
    vocab: usize,
    rng: Xoshiro256StarStar,
    /// Whether `rep_seen` / `rep_tokens` are kept (repetition_penalty != 1).
    rep_active: bool,
    /// Tokens seen in the prompt or the output, one bit per vocab entry.
    rep_seen: Vec<u64>,
    /// The same tokens as a list, so a step costs O(distinct tokens) rather than O(vocab).
    rep_tokens: Vec<u32>,
    /// Whether `out_counts` is kept (presence or frequency penalty non-zero).
    pf_active: bool,
    /// Occurrences of each output token. Sized by the output, not the vocab.
    out_counts: HashMap<u32, u32>,
    // Scratch reused across steps so that sampling does not allocate in steady state.
    pool: Vec<Cand>,
    cands: Vec<Cand>,
    raw: Vec<f32>,
    sample_buf: Vec<f32>,
    hist: WeightHistogram,
}

impl fmt::Debug for Sampler {
    // The scratch buffers can hold a vocab's worth of numbers; leave them out.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sampler")
            .field("greedy", &self.greedy)
            .field("temperature", &self.temperature)
            .field("top_k", &self.top_k)
            .field("top_p", &self.top_p)
            .field("min_p", &self.min_p)
            .field("repetition_penalty", &self.repetition_penalty)
            .field("presence_penalty", &self.presence_penalty)
            .field("frequency_penalty", &self.frequency_penalty)
            .field("logprobs", &self.logprobs)
            .field("vocab", &self.vocab)
            .field("rep_tokens", &self.rep_tokens.len())
            .field("out_tokens", &self.out_counts.len())
            .finish()
    }
}

impl Sampler {
    /// `seed`: already resolved by the caller (from params.seed, or random). `prompt`: the prompt's
    /// token ids (for the repetition penalty). `vocab`: logits length.
    pub fn new(params: &SamplingParams, seed: u64, prompt: &[u32], vocab: usize) -> Sampler {
        let rep_active = params.repetition_penalty != 1.0;
        let pf_active = params.presence_penalty != 0.0 || params.frequency_penalty != 0.0;
        let mut sampler = Sampler {
            greedy: params.temperature.is_nan() || params.temperature <= 0.0,
            temperature: params.temperature,
            top_k: params.top_k,
            // NaN and anything >= 1 turn top-p off; negative means "only the top token", like 0.
            top_p: if params.top_p < 1.0 {
                params.top_p.max(0.0)
            } else {
                1.0
            },
            min_p: if params.min_p > 0.0 {
                params.min_p.min(1.0)
            } else {
                0.0
            },
            repetition_penalty: params.repetition_penalty,
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            logprobs: params.logprobs,
            logit_bias: params.logit_bias.clone(),
            vocab,
            rng: Xoshiro256StarStar::from_seed(seed),
            rep_active,
            rep_seen: Vec::new(),
            rep_tokens: Vec::new(),
            pf_active,
            out_counts: HashMap::new(),
            pool: Vec::new(),
            cands: Vec::new(),
            raw: Vec::new(),
            sample_buf: Vec::new(),
            hist: WeightHistogram::default(),
        };
        if rep_active {
            sampler.rep_seen = vec![0; vocab.div_ceil(64)];
            for &token in prompt {
                sampler.mark_seen(token);
            }
        }
        sampler
    }

    /// Picks the next token from one row of raw model logits (the slice may be used as scratch and
    /// overwritten), records it in the penalty state, and returns it.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        self.sample_with(logits, |_| {})
    }

    /// `sample`, with `constrain` (a grammar's mask) applied to the logits after the raw
    /// logprobs are taken and before the bias, the penalties and the pick.
    pub fn sample_with(
        &mut self,
        logits: &mut [f32],
        constrain: impl FnOnce(&mut [f32]),
    ) -> Sampled {
        self.sample_or_accept(logits, None, constrain).0
    }

    /// `sample_with` at a position where `draft` was proposed: true with the draft when it is
    /// accepted. The token is the one `sample_with` picks (one draw, drafted or not), and the
    /// draft is accepted when it is that token. Greedy: when it is the argmax. Sampling: that
    /// is speculative sampling's rule for a draft proposed with certainty (an n-gram lookup, a
    /// draft model's greedy pick): accepted with its probability p(draft) under the request's
    /// distribution, and when rejected the token is drawn from that distribution without the
    /// draft (the residual). Drawn this way, a seed's stream is the one decoding without drafts
    /// gives, however many drafts were proposed where.
    pub fn sample_or_accept(
        &mut self,
        logits: &mut [f32],
        draft: Option<u32>,
        constrain: impl FnOnce(&mut [f32]),
    ) -> (Sampled, bool) {
        if self.logprobs.is_some() {
            // Logprobs are of the raw logits, which the steps below overwrite.
            self.raw.clear();
            self.raw.extend_from_slice(logits);
            clean_in_place(&mut self.raw);
        }
        constrain(logits);
        for &(token, bias) in &self.logit_bias {
            if let Some(x) = logits.get_mut(token as usize) {
                *x += bias;
            }
        }
        self.apply_penalties(logits);
        let (token, accepted) = if self.greedy {
            let token = argmax(logits);
            (token, draft == Some(token))
        } else {
            // Drawn before anything can return early: exactly one draw per non-greedy step.
            let u = self.rng.next_f64();
            let kept = self.prepare(logits);
            let token = self.pick(logits, kept, u);
            (token, draft == Some(token))
        };
        let (logprob, top_logprobs) = match self.logprobs {
            Some(n) => {
                let (chosen, top) = raw_logprobs(
                    &mut self.raw,
                    token,
                    n,
                    &mut self.cands,
                    &mut self.sample_buf,
                );
                (Some(chosen), top)
            }
            None => (None, Vec::new()),
        };
        self.record(token);
        let sampled = Sampled {
            token,
            logprob,
            top_logprobs,
        };
        (sampled, accepted)
    }

    fn mark_seen(&mut self, token: u32) {
        let index = token as usize;
        if index >= self.vocab {
            return;
        }
        let (word, bit) = (index / 64, 1u64 << (index % 64));
        if self.rep_seen[word] & bit == 0 {
            self.rep_seen[word] |= bit;
            self.rep_tokens.push(token);
        }
    }

    fn record(&mut self, token: u32) {
        if self.rep_active {
            self.mark_seen(token);
        }
        if self.pf_active && (token as usize) < self.vocab {
            let count = self.out_counts.entry(token).or_insert(0);
            *count = count.saturating_add(1);
        }
    }

    /// Repetition penalty first, then presence and frequency (the order vLLM applies them in).
    fn apply_penalties(&self, logits: &mut [f32]) {
        if self.rep_active {
            let penalty = self.repetition_penalty;
            for &token in &self.rep_tokens {
                if let Some(x) = logits.get_mut(token as usize) {
                    *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
                }
            }
        }
        for (&token, &count) in &self.out_counts {
            if let Some(x) = logits.get_mut(token as usize) {
                *x -= self.presence_penalty + self.frequency_penalty * count as f32;
            }
        }
    }

    /// Applies temperature, top-k, softmax, top-p and min-p, and says where the kept weights are.
    fn prepare(&mut self, logits: &mut [f32]) -> Kept {
        let max = scale_in_place(logits, self.temperature);
        if max == f32::NEG_INFINITY {
            return Kept::Nothing;
        }
        let vocab = logits.len();
        let min_e = self.min_p;
        let top_p_on = self.top_p < 1.0;
        if self.top_k > 0 && self.top_k < vocab {
            top_k_pool(
                logits,
                self.top_k,
                &mut self.pool,
                &mut self.cands,
                &mut self.sample_buf,
            );
            let mut total = 0.0;
            for cand in &mut self.pool {
                cand.val = exp_nonpositive(cand.val - max);
                total += f64::from(cand.val);
            }
            let nucleus = if top_p_on {
                let threshold = nucleus_threshold(total, self.pool.len(), self.top_p, min_e);
                self.cands.clear();
                let pool = self.pool.iter();
                self.cands
                    .extend(pool.filter(|cand| cand.val >= threshold).copied());
                nucleus_len(&mut self.cands, f64::from(self.top_p) * total)
            } else {
                None
            };
            if let Some(len) = nucleus {
                self.cands[..len].sort_unstable_by_key(|cand| cand.id);
                return Kept::List(len);
            }
            if min_e > 0.0 {
                self.pool.retain(|cand| cand.val >= min_e);
            }
            return Kept::Pool;
        }

        let total = exp_in_place(logits, max);
        if top_p_on {
            let need = f64::from(self.top_p) * total;
            let threshold = nucleus_threshold(total, vocab, self.top_p, min_e);
            let cut = dense_nucleus_cut(logits, threshold, need, &mut self.cands, &mut self.hist);
            if let Some((last, size)) = cut {
                // A small nucleus is cheaper to list than the vocab is to scan.
                if size <= vocab / 16 {
                    self.cands.clear();
                    collect_at_least(logits, last.val, &mut self.cands);
                    self.cands
                        .retain(|cand| rank(cand, &last) != Ordering::Greater);
                    return Kept::List(self.cands.len());
                }
                // Unconditional stores of a select: these loops vectorize, `if ... { store }`
                // does not.
                for weight in logits.iter_mut() {
                    *weight = if *weight < last.val { 0.0 } else { *weight };
                }
                // Ties with the last kept token: only the lower ids are in.
                let after = (last.id as usize + 1).min(vocab);
                for weight in logits[after..].iter_mut() {
                    *weight = if *weight == last.val { 0.0 } else { *weight };
                }
                return Kept::Dense(dense_total(logits));
            }
        }
        if min_e > 0.0 {
            for weight in logits.iter_mut() {
                *weight = if *weight < min_e { 0.0 } else { *weight };
            }
            return Kept::Dense(dense_total(logits));
        }
        Kept::Dense(total)
    }

    /// Inverse CDF at `u` over the kept tokens in ascending id order.
    fn pick(&self, weights: &[f32], kept: Kept, u: f64) -> u32 {
        match kept {
            Kept::Nothing => 0,
            Kept::Dense(total) => pick_dense(weights, total, u),
            Kept::List(len) => pick_list(&self.cands[..len], u),
            Kept::Pool => pick_list(&self.pool, u),
        }
    }
}

/// Where `prepare` left the weights of the kept tokens (dropped tokens weigh 0 or are absent).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kept {
    /// Every logit was -inf or NaN.
    Nothing,
    /// In the logits row, indexed by token id; carries their total.
    Dense(f64),
    /// `cands[..len]`, in id order.
    List(usize),
    /// `pool`, sorted by id.
    Pool,
}

/// A token and a value (a scaled logit or a weight, depending on the stage).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Cand {
    val: f32,
    id: u32,
}

/// Sampling order: larger value first, then lower id. A total order even for odd floats, so the
/// std selection and sort routines cannot panic on it.
fn rank(a: &Cand, b: &Cand) -> Ordering {
    b.val.total_cmp(&a.val).then(a.id.cmp(&b.id))
}

/// NaN to -inf, +inf to `f32::MAX`, -0.0 to 0.0 (so `total_cmp` agrees with `==`). Written as
/// two comparisons (NaN fails the first) so that loops over it vectorize.
#[inline(always)]
fn clean(x: f32) -> f32 {
    let not_nan = if x >= f32::NEG_INFINITY {
        x
    } else {
        f32::NEG_INFINITY
    };
    (if not_nan > f32::MAX {
        f32::MAX
    } else {
        not_nan
    }) + 0.0
}

fn clean_in_place(values: &mut [f32]) {
    for x in values.iter_mut() {
        *x = clean(*x);
    }
}

/// Block size of the vectorized passes; `pick_dense` skips whole blocks by their sums and the
/// candidate scans skip blocks by their maxima.
const BLOCK: usize = 64;

/// Maximum of a block, ignoring NaN; eight independent lanes so that it vectorizes.
#[inline(always)]
fn block_max(block: &[f32]) -> f32 {
    let (octets, rest) = block.as_chunks::<8>();
    let mut lanes = [f32::NEG_INFINITY; 8];
    for octet in octets {
        for (lane, &x) in lanes.iter_mut().zip(octet) {
            *lane = if x > *lane { x } else { *lane };
        }
    }
    let max = lanes
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    rest.iter().fold(max, |m, &x| if x > m { x } else { m })
}

fn max_of(values: &[f32]) -> f32 {
    values
        .chunks(BLOCK)
        .map(block_max)
        .fold(f32::NEG_INFINITY, |m, x| if x > m { x } else { m })
}

/// Greedy pick: the first maximum, so ties go to the lowest id; NaN never compares greater, so it
/// is skipped; all -inf/NaN (or empty) gives 0. One pass: a block is searched only when its
/// (vectorized) maximum beats the best so far.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_val = f32::NEG_INFINITY;
    for (block_index, block) in logits.chunks(BLOCK).enumerate() {
        let max = block_max(block);
        if max > best_val {
            best_val = max;
            let offset = block.iter().position(|&x| x == max).unwrap_or(0);
            best = block_index * BLOCK + offset;
        }
    }
    best as u32
}

/// Divides by the temperature, cleans, and returns the maximum.
fn scale_in_place(logits: &mut [f32], temperature: f32) -> f32 {
    // Two simple passes vectorize; one fused pass does not.
    for x in logits.iter_mut() {
        *x = clean(*x / temperature);
    }
    max_of(logits)
}

/// f64 sum of one block with eight accumulators (vectorizes; a single chain does not).
#[inline(always)]
fn block_sum(block: &[f32]) -> f64 {
    let (octets, rest) = block.as_chunks::<8>();
    let mut lanes = [0.0f64; 8];
    for octet in octets {
        for (lane, &x) in lanes.iter_mut().zip(octet) {
            *lane += f64::from(x);
        }
    }
    let mut sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for &x in rest {
        sum += f64::from(x);
    }
    sum
}

/// Sum of the weights block by block, in the order `pick_dense` accumulates them.
fn dense_total(weights: &[f32]) -> f64 {
    weights.chunks(BLOCK).map(block_sum).sum()
}

/// Replaces each cleaned value by `exp(x - max)` and returns the sum (as `dense_total`).
fn exp_in_place(values: &mut [f32], max: f32) -> f64 {
    for x in values.iter_mut() {
        *x = exp_nonpositive(*x - max);
    }
    dense_total(values)
}

/// Appends, in id order, every value at or above `threshold` (values must be clean). Blocks whose
/// maximum is below it are skipped with one vectorized pass.
fn collect_at_least(values: &[f32], threshold: f32, out: &mut Vec<Cand>) {
    for (block_index, block) in values.chunks(BLOCK).enumerate() {
        if block_max(block) >= threshold {
            let base = block_index * BLOCK;
            for (offset, &val) in block.iter().enumerate() {
                if val >= threshold {
                    out.push(Cand {
                        val,
                        id: (base + offset) as u32,
                    });
                }
            }
        }
    }
}

/// `e^x` for `x <= 0` (or -inf), within about 2 ulp; 0 below -87, where weights are under 1e-38
/// of the top token's. Cephes' expf (Cody-Waite reduction, degree-5 minimax polynomial), written
/// without branches or libm calls so that loops over it vectorize: libm's expf does not, and a
/// full-vocab softmax is most of a sampling step.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LN2_HI: f32 = 355.0 / 512.0; // few bits, so n * LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer that lands in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let clamped = if x < -87.0 { -87.0 } else { x };
    let shifted = clamped * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let poly = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let exp_r = poly * (r * r) + r + 1.0;
    // n is in [-126, 0] here, so 2^n is a normal float.
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        exp_r * scale
    }
}

/// Inverse CDF over dense weights in id order; zero weights are never picked.
fn pick_dense(weights: &[f32], total: f64, u: f64) -> u32 {
    let target = u * total;
    let mut cum = 0.0;
    for (block_index, block) in weights.chunks(BLOCK).enumerate() {
        let block_mass = block_sum(block);
        if cum + block_mass > target {
            let mut within = cum;
            for (offset, &w) in block.iter().enumerate() {
                within += f64::from(w);
                if w > 0.0 && within > target {
                    return (block_index * BLOCK + offset) as u32;
                }
            }
            // Rounding in the element-wise sum fell just short; carry on from the block sum.
        }
        cum += block_mass;
    }
    // u * total rounded up to total: the last token with weight.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}

/// Inverse CDF over an id-sorted list of weighted tokens; zero weights are never picked.
fn pick_list(kept: &[Cand], u: f64) -> u32 {
    let total: f64 = kept.iter().map(|cand| f64::from(cand.val)).sum();
    let target = u * total;
    let mut cum = 0.0;
    let mut last = None;
    for cand in kept {
        if cand.val > 0.0 {
            cum += f64::from(cand.val);
            last = Some(cand.id);
            if cum > target {
                return cand.id;
            }
        }
    }
    last.unwrap_or(0)
}

/// A value at or below the k-th largest of `values` (`k >= 1`), found from a strided sample so
/// that only a few thousand candidates need exact selection; -inf when the cheap guess is not
/// worth it. Callers must check that at least k values pass and fall back to -inf otherwise.
fn prefilter_threshold(values: &[f32], k: usize, sample: &mut Vec<f32>) -> f32 {
    const SAMPLE: usize = 1024;
    let n = values.len();
    if n <= 4 * SAMPLE || k >= n / 8 {
        return f32::NEG_INFINITY;
    }
    sample.clear();
    sample.extend(values.iter().step_by(n / SAMPLE).take(SAMPLE).copied());
    // Sampled values expected above the k-th largest, plus four standard deviations and a margin.
    let expected = k as f64 * sample.len() as f64 / n as f64;
    let index = ((expected + 4.0 * expected.sqrt() + 8.0).ceil() as usize).min(sample.len() - 1);
    let (_, threshold, _) = sample.select_nth_unstable_by(index, |a, b| b.total_cmp(a));
    *threshold
}

/// Leaves in `out` the `k` top-ranked values (1 <= k < values.len()), in id order.
fn top_k_pool(
    values: &[f32],
    k: usize,
    out: &mut Vec<Cand>,
    scratch: &mut Vec<Cand>,
    sample: &mut Vec<f32>,
) {
    let threshold = prefilter_threshold(values, k, sample);
    out.clear();
    collect_at_least(values, threshold, out);
    if out.len() < k {
        out.clear();
        collect_at_least(values, f32::NEG_INFINITY, out);
    }
    scratch.clear();
    scratch.extend_from_slice(out);
    let (_, &mut last, _) = scratch.select_nth_unstable_by(k - 1, rank);
    out.retain(|cand| rank(cand, &last) != Ordering::Greater);
}

/// Weight below which a token cannot be in the top-p nucleus nor pass min-p. `count`: how many
/// weights there are, `total`: their sum.
fn nucleus_threshold(total: f64, count: usize, top_p: f32, min_e: f32) -> f32 {
    // The nucleus's lightest token outweighs (1 - top_p) * total / count: it and everything after
    // it weigh more than (1 - top_p) * total, with at most `count` tokens none heavier than it.
    // Halved against rounding. The top token (weight 1 >= total / count) always passes.
    let bound = (0.5 * (1.0 - f64::from(top_p)) * total / count as f64) as f32;
    bound.max(min_e)
}

/// Finds the top-p nucleus among `cands`, the weights at or above `nucleus_threshold`: the
/// smallest set of top-ranked tokens weighing at least `need` (top_p times the total), left
/// unordered in `cands[..len]`. `None` when that set reaches past the min-p cut, so min-p alone
/// decides.
///
/// Both filters keep a prefix of the ranking, so the candidates are one too: if they hold the
/// needed weight, the nucleus lies inside them (and inside the min-p set); if not, they are the
/// min-p set and the nucleus reaches past it.
fn nucleus_len(cands: &mut [Cand], need: f64) -> Option<usize> {
    let mass: f64 = cands.iter().map(|cand| f64::from(cand.val)).sum();
    if cands.is_empty() || mass < need {
        return None;
    }
    Some(smallest_prefix_with_mass(cands, need))
}

/// Up to this many candidates, `dense_nucleus_cut` selects among them directly.
const EXACT_LIMIT: usize = 4096;

/// Counts and weight sums of weights in (0, 1] by their top 13 bits (exponent and 4 mantissa
/// bits): buckets 1/16 of an octave wide, ordered like the weights.
#[derive(Clone, Debug, Default)]
struct WeightHistogram {
    counts: Vec<u32>,
    masses: Vec<f64>,
}

impl WeightHistogram {
    /// Bucket of 1.0 is (0x3F80_0000 >> 19) = 2032, the highest a weight can use.
    const BUCKETS: usize = 2048;

    fn bucket(weight: f32) -> usize {
        ((weight.to_bits() >> 19) as usize).min(Self::BUCKETS - 1)
    }

    /// Fills the buckets from the weights at or above `threshold`.
    fn fill(&mut self, weights: &[f32], threshold: f32) {
        self.counts.clear();
        self.counts.resize(Self::BUCKETS, 0);
        self.masses.clear();
        self.masses.resize(Self::BUCKETS, 0.0);
        for block in weights.chunks(BLOCK) {
            if block_max(block) >= threshold {
                for &weight in block {
                    if weight >= threshold {
                        let bucket = Self::bucket(weight);
                        self.counts[bucket] += 1;
                        self.masses[bucket] += f64::from(weight);
                    }
                }
            }
        }
    }
}

/// The top-p nucleus over dense weights (max weight 1), given `threshold` from
/// `nucleus_threshold` and `need` = top_p times the total: its last-ranked token and its size, or
/// `None` when it reaches past the min-p cut (see `nucleus_len`). Uses `cands` and `hist` as
/// scratch.
///
/// A peaked distribution leaves few tokens above the threshold, and they are selected among
/// directly. A flat one can leave most of the vocab, where selection would cost about as much as a
/// sort; then one histogram pass finds the bucket holding the cut, and only its tokens are
/// selected among.
fn dense_nucleus_cut(
    weights: &[f32],
    threshold: f32,
    need: f64,
    cands: &mut Vec<Cand>,
    hist: &mut WeightHistogram,
) -> Option<(Cand, usize)> {
    cands.clear();
    if collect_at_least_capped(weights, threshold, EXACT_LIMIT, cands) {
        let len = nucleus_len(cands, need)?;
        let last = cands[..len].iter().copied().max_by(rank)?;
        return Some((last, len));
    }
    hist.fill(weights, threshold);
    // Walk down from the heaviest bucket to the one where the needed weight is reached.
    let (mut mass_above, mut count_above) = (0.0, 0);
    let mut cut_bucket = None;
    for bucket in (0..WeightHistogram::BUCKETS).rev() {
        let mass = hist.masses[bucket];
        if mass > 0.0 && mass_above + mass >= need {
            cut_bucket = Some(bucket);
            break;
        }
        mass_above += mass;
        count_above += hist.counts[bucket] as usize;
    }
    // None: even everything above the threshold falls short, so min-p alone decides.
    let cut_bucket = cut_bucket?;
    cands.clear();
    for (block_index, block) in weights.chunks(BLOCK).enumerate() {
        if block_max(block) >= threshold {
            let base = block_index * BLOCK;
            for (offset, &val) in block.iter().enumerate() {
                if val >= threshold && WeightHistogram::bucket(val) == cut_bucket {
                    cands.push(Cand {
                        val,
                        id: (base + offset) as u32,
                    });
                }
            }
        }
    }
    let len = smallest_prefix_with_mass(cands, need - mass_above);
    let last = cands[..len].iter().copied().max_by(rank)?;
    Some((last, count_above + len))
}

/// Appends, in id order, the values at or above `threshold`; false (stopping early) once there
/// would be more than `cap` of them.
fn collect_at_least_capped(
    values: &[f32],
    threshold: f32,
    cap: usize,
    out: &mut Vec<Cand>,
) -> bool {
    for (block_index, block) in values.chunks(BLOCK).enumerate() {
        if block_max(block) >= threshold {
            let base = block_index * BLOCK;
            for (offset, &val) in block.iter().enumerate() {
                if val >= threshold {
                    out.push(Cand {
                        val,
                        id: (base + offset) as u32,
                    });
                }
            }
            if out.len() > cap {
                return false;
            }
        }
    }
    true
}

/// Reorders `cands` so that `cands[..len]` are the fewest top-ranked entries whose values sum to at
/// least `need` (at least one), and returns `len`. Expected linear time: halves the range around a
/// median each round and only sorts the last few entries.
fn smallest_prefix_with_mass(cands: &mut [Cand], need: f64) -> usize {
    let (mut lo, mut hi) = (0, cands.len());
    let mut need = need;
    // Invariant: cands[..lo] are top-ranked and kept, weighing less than the original need; the
    // nucleus ends within lo + 1 ..= hi.
    while hi - lo > 32 {
        let mid = (hi - lo) / 2;
        cands[lo..hi].select_nth_unstable_by(mid, rank);
        let upper = lo + mid + 1;
        let mass: f64 = cands[lo..upper].iter().map(|c| f64::from(c.val)).sum();
        if mass >= need {
            hi = upper;
        } else {
            need -= mass;
            lo = upper;
        }
    }
    cands[lo..hi].sort_unstable_by(rank);
    let mut cum = 0.0;
    for (index, cand) in cands[lo..hi].iter().enumerate() {
        cum += f64::from(cand.val);
        if cum >= need {
            return lo + index + 1;
        }
    }
    hi
}

/// Scratch space of `prompt_token_logprob`, kept across the rows of a prompt.
#[derive(Default)]
pub struct LogprobScratch {
    cands: Vec<Cand>,
    sample: Vec<f32>,
}

/// A prompt token's entry, as a generated token's: `row` holds the logits of the position before
/// it (cleaned here, as a step's, then overwritten), and the result is the token's logprob, the
/// `n` most likely tokens there, and the token's rank (1 + how many tokens are more likely).
pub fn prompt_token_logprob(
    row: &mut [f32],
    token: u32,
    n: usize,
    scratch: &mut LogprobScratch,
) -> PromptTokenLogprob {
    clean_in_place(row);
    let rank = match row.get(token as usize) {
        Some(&x) => 1 + row.iter().filter(|&&y| y > x).count(),
        None => row.len(),
    };
    let (logprob, top) = raw_logprobs(row, token, n, &mut scratch.cands, &mut scratch.sample);
    PromptTokenLogprob {
        logprob: TokenLogprob {
            token,
            logprob,
            top,
        },
        rank,
    }
}

/// log_softmax of the cleaned raw logits at `token`, and the `n` highest, descending, ties by id.
/// Overwrites `raw` (with the softmax weights).
fn raw_logprobs(
    raw: &mut [f32],
    token: u32,
    n: usize,
    cands: &mut Vec<Cand>,
    sample: &mut Vec<f32>,
) -> (f32, Vec<(u32, f32)>) {
    let max = max_of(raw);
    let chosen_raw = raw.get(token as usize).copied();
    let n = n.min(raw.len());
    cands.clear();
    if n > 0 {
        let threshold = prefilter_threshold(raw, n, sample);
        collect_at_least(raw, threshold, cands);
        if cands.len() < n {
            cands.clear();
            collect_at_least(raw, f32::NEG_INFINITY, cands);
        }
        if n < cands.len() {
            cands.select_nth_unstable_by(n - 1, rank);
            cands.truncate(n);
        }
        cands.sort_unstable_by(rank);
    }
    let log_total = if max == f32::NEG_INFINITY {
        0.0
    } else {
        exp_in_place(raw, max).ln()
    };
    // x - max is formed in f64 (exact), so only log_total carries rounding.
    let logprob = |x: f32| -> f32 {
        if x == f32::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            (f64::from(x) - f64::from(max) - log_total) as f32
        }
    };
    let chosen = chosen_raw.map_or(f32::NEG_INFINITY, logprob);
    let top = cands
        .iter()
        .map(|cand| (cand.id, logprob(cand.val)))
        .collect();
    (chosen, top)
}

/// xoshiro256** 1.0 (Blackman & Vigna, <https://prng.di.unimi.it/>), seeded by expanding the u64
/// seed through four steps of splitmix64, as its authors recommend. Pure integer arithmetic, so
/// a seed gives the same stream on every platform.
#[derive(Clone, Debug, PartialEq)]
struct Xoshiro256StarStar {
    state: [u64; 4],
}

/// splitmix64's output for `z` (one step from state `z`): how the engine derives a choice's seed.
pub fn splitmix(z: u64) -> u64 {
    let mut state = z;
    splitmix64(&mut state)
}

/// One step of splitmix64 (Steele, Lea & Flood), used to seed xoshiro.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Xoshiro256StarStar {
    fn from_seed(seed: u64) -> Self {
        let mut sm = seed;
        // splitmix64 never yields four zero words in a row, so the state is never all zero.
        let state = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        Xoshiro256StarStar { state }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1): the top 53 bits as a multiple of 2^-53.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            ..SamplingParams::default()
        }
    }

    fn greedy() -> SamplingParams {
        params(0.0, 0, 1.0, 0.0)
    }

    /// Test-only random source (the sampler's own generator, separately seeded).
    struct TestRng(Xoshiro256StarStar);

    impl TestRng {
        fn new(seed: u64) -> Self {
            TestRng(Xoshiro256StarStar::from_seed(seed))
        }
        fn uniform(&mut self) -> f64 {
            self.0.next_f64()
        }
        fn below(&mut self, n: usize) -> usize {
            (self.0.next_u64() % n as u64) as usize
        }
        fn normal(&mut self) -> f64 {
            // Box-Muller; 1 - u avoids ln(0).
            let (a, b) = (1.0 - self.uniform(), self.uniform());
            (-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()
        }
        fn choose<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.below(items.len())]
        }
    }

    /// Kept tokens with non-zero weight and their renormalized probabilities, in id order.
    fn kept_distribution(sampler: &Sampler, weights: &[f32], kept: Kept) -> Vec<(u32, f64)> {
        let list: Vec<(u32, f32)> = match kept {
            Kept::Nothing => Vec::new(),
            Kept::Dense(_) => (0u32..).zip(weights.iter().copied()).collect(),
            Kept::List(len) => sampler.cands[..len].iter().map(|c| (c.id, c.val)).collect(),
            Kept::Pool => sampler.pool.iter().map(|c| (c.id, c.val)).collect(),
        };
        let total: f64 = list.iter().map(|&(_, w)| f64::from(w)).sum();
        list.into_iter()
            .filter(|&(_, w)| w > 0.0)
            .map(|(id, w)| (id, f64::from(w) / total))
            .collect()
    }

    /// Sort-based reference: kept tokens in id order with renormalized probabilities.
    fn reference_distribution(
        logits: &[f32],
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
    ) -> Vec<(u32, f64)> {
        let scaled: Vec<f32> = logits
            .iter()
            .map(|&l| {
                let x = l / temperature;
                if x.is_nan() {
                    f32::NEG_INFINITY
                } else if x == f32::INFINITY {
                    f32::MAX
                } else {
                    x + 0.0
                }
            })
            .collect();
        let mut order: Vec<usize> = (0..scaled.len()).collect();
        order.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
        if top_k > 0 && top_k < order.len() {
            order.truncate(top_k);
        }
        let Some(&top) = order.first() else {
            return Vec::new();
        };
        let max = scaled[top];
        if max == f32::NEG_INFINITY {
            return Vec::new();
        }
        // The sampler's documented flush: weights below e^-87 of the top token count as 0.
        let weight = |id: usize| {
            let d = scaled[id] - max;
            if d < -87.0 {
                0.0
            } else {
                f64::from(d).exp()
            }
        };
        let mut ranked: Vec<(usize, f64)> = order.iter().map(|&id| (id, weight(id))).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: f64 = ranked.iter().map(|r| r.1).sum();
        if top_p < 1.0 {
            let need = f64::from(top_p.max(0.0)) * total;
            let mut cum = 0.0;
            let mut len = ranked.len();
            for (i, r) in ranked.iter().enumerate() {
                cum += r.1;
                if cum >= need {
                    len = i + 1;
                    break;
                }
            }
            ranked.truncate(len);
        }
        if min_p > 0.0 {
            let cut = f64::from(min_p.min(1.0)) * (ranked[0].1 / total);
            ranked.retain(|r| r.1 / total >= cut);
        }
        let kept_total: f64 = ranked.iter().map(|r| r.1).sum();
        ranked.sort_by_key(|r| r.0);
        ranked
            .into_iter()
            .filter(|r| r.1 > 0.0)
            .map(|(id, w)| (id as u32, w / kept_total))
            .collect()
    }

    /// Inverse CDF over a distribution in id order, as the sampler defines it.
    fn reference_pick(dist: &[(u32, f64)], u: f64) -> u32 {
        let mut cum = 0.0;
        for &(id, p) in dist {
            cum += p;
            if cum > u {
                return id;
            }
        }
        dist.last().map_or(0, |d| d.0)
    }

    fn assert_same_distribution(got: &[(u32, f64)], want: &[(u32, f64)], context: &str) {
        let got_ids: Vec<u32> = got.iter().map(|d| d.0).collect();
        let want_ids: Vec<u32> = want.iter().map(|d| d.0).collect();
        assert_eq!(got_ids, want_ids, "kept set differs: {context}");
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g.1 - w.1).abs() <= 1e-6,
                "token {}: {} vs {} ({context})",
                g.0,
                g.1,
                w.1
            );
        }
    }

    #[test]
    fn rng_matches_published_vectors() {
        // splitmix64 from state 0, and xoshiro256** from state {1, 2, 3, 4} (reference outputs).
        let mut sm = 0u64;
        let first: Vec<u64> = (0..4).map(|_| splitmix64(&mut sm)).collect();
        assert_eq!(
            first,
            [
                0xE220_A839_7B1D_CDAF,
                0x6E78_9E6A_A1B9_65F4,
                0x06C4_5D18_8009_454F,
                0xF88B_B8A8_724C_81EC
            ]
        );
        let mut rng = Xoshiro256StarStar {
            state: [1, 2, 3, 4],
        };
        let out: Vec<u64> = (0..6).map(|_| rng.next_u64()).collect();
        assert_eq!(
            out,
            [
                11520,
                0,
                1509978240,
                1215971899390074240,
                1216172134540287360,
                607988272756665600
            ]
        );
        let mut rng = Xoshiro256StarStar::from_seed(7);
        for _ in 0..10_000 {
            let u = rng.next_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn fast_exp_is_accurate_and_exact_at_zero() {
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-87.5), 0.0);
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_nonpositive(x));
            assert!(
                (got - want).abs() <= 3e-7 * want,
                "exp({x}) = {got}, want {want}"
            );
            x -= 0.0137;
        }
    }

    #[test]
    fn greedy_picks_argmax_with_lowest_id_on_ties() {
        let mut sampler = Sampler::new(&greedy(), 1, &[], 5);
        let fresh_rng = sampler.rng.clone();
        assert_eq!(sampler.sample(&mut [1.0, 3.0, 3.0, 2.0, -1.0]).token, 1);
        assert_eq!(sampler.sample(&mut [0.0, -0.0, 0.0, -5.0, -1.0]).token, 0);
        assert_eq!(sampler.sample(&mut [-0.0, 0.0, 0.0, -5.0, -1.0]).token, 0);
        assert_eq!(
            sampler
                .sample(&mut [f32::NAN, 2.0, f32::NAN, 2.0, 9.0])
                .token,
            4
        );
        assert_eq!(
            sampler
                .sample(&mut [f32::NAN, 2.0, f32::NAN, 2.0, 1.0])
                .token,
            1
        );
        assert_eq!(
            sampler
                .sample(&mut [1.0, f32::INFINITY, 2.0, f32::INFINITY, 1.0])
                .token,
            1
        );
        assert_eq!(sampler.sample(&mut [f32::NEG_INFINITY; 5]).token, 0);
        assert_eq!(sampler.sample(&mut [f32::NAN; 5]).token, 0);
        assert_eq!(sampler.sample(&mut []).token, 0);
        // Greedy never touches the RNG.
        assert_eq!(sampler.rng, fresh_rng);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let mut p = greedy();
        p.repetition_penalty = 2.0;
        // Prompt holds tokens 0 and 2 (twice: the set counts it once), and an out-of-range id.
        let mut sampler = Sampler::new(&p, 1, &[0, 2, 2, 99], 4);
        let raw = [4.0, 3.5, -1.0, -0.5];

        let mut logits = raw;
        // Unpenalized the argmax is 0; 4 / 2 = 2 < 3.5 flips it to 1.
        assert_eq!(sampler.sample(&mut logits).token, 1);
        assert_eq!(logits, [2.0, 3.5, -2.0, -0.5]);

        // Token 1 is now in the output: 3.5 / 2 = 1.75 < 2.
        let mut logits = raw;
        assert_eq!(sampler.sample(&mut logits).token, 0);
        assert_eq!(logits, [2.0, 1.75, -2.0, -0.5]);

        // Repeats do not compound: the penalty is per seen token, not per occurrence.
        let mut logits = raw;
        assert_eq!(sampler.sample(&mut logits).token, 0);
        assert_eq!(logits, [2.0, 1.75, -2.0, -0.5]);
        // The state holds each distinct token once, prompt first.
        assert_eq!(sampler.rep_tokens, [0, 2, 1]);
    }

    #[test]
    fn penalty_state_is_kept_only_for_active_penalties() {
        let prompt: Vec<u32> = (0..1000).collect();
        let mut sampler = Sampler::new(&greedy(), 1, &prompt, 1000);
        for _ in 0..5 {
            sampler.sample(&mut [1.0; 1000]);
        }
        assert!(sampler.rep_seen.is_empty() && sampler.rep_tokens.is_empty());
        assert!(sampler.out_counts.is_empty());

        let mut p = greedy();
        p.frequency_penalty = 0.5;
        let mut sampler = Sampler::new(&p, 1, &prompt, 1000);
        assert!(sampler.rep_seen.is_empty());
        for _ in 0..5 {
            // 3.0 - 0.5 * 4 = 1.0 still ties token 1 at the fifth step: lowest id keeps winning.
            sampler.sample(&mut [3.0, 1.0]);
        }
        assert_eq!(sampler.out_counts.get(&0), Some(&5));
        assert_eq!(sampler.out_counts.len(), 1);
    }

    #[test]
    fn presence_and_frequency_penalties_subtract_exact_amounts() {
        let mut p = greedy();
        p.presence_penalty = 0.5;
        p.frequency_penalty = 0.25;
        // Token 2 is in the prompt: presence/frequency look at the output only.
        let mut sampler = Sampler::new(&p, 1, &[2, 2, 2], 3);
        let raw = [2.0, 1.5, 1.0];
        let steps: [(u32, [f32; 3]); 4] = [
            // No output yet: unchanged.
            (0, [2.0, 1.5, 1.0]),
            // Token 0 once: 2 - (0.5 + 0.25) = 1.25.
            (1, [1.25, 1.5, 1.0]),
            // Tokens 0 and 1 once: 1.5 - 0.75 = 0.75.
            (0, [1.25, 0.75, 1.0]),
            // Token 0 twice: 2 - (0.5 + 2 * 0.25) = 1.0, tied with token 2: lowest id wins.
            (0, [1.0, 0.75, 1.0]),
        ];
        for (want_token, want_logits) in steps {
            let mut logits = raw;
            assert_eq!(sampler.sample(&mut logits).token, want_token);
            assert_eq!(logits, want_logits);
        }
    }

    #[test]
    fn repetition_penalty_applies_before_presence() {
        let mut p = greedy();
        p.repetition_penalty = 2.0;
        p.presence_penalty = 1.0;
        let mut sampler = Sampler::new(&p, 1, &[], 2);
        assert_eq!(sampler.sample(&mut [3.0, 1.0]).token, 0);
        // 3 / 2 - 1 = 0.5 (the other order would give (3 - 1) / 2 = 1.0, beating 0.75).
        let mut logits = [3.0, 0.75];
        assert_eq!(sampler.sample(&mut logits).token, 1);
        assert_eq!(logits, [0.5, 0.75]);
    }

    #[test]
    fn penalty_state_ignores_ids_outside_the_vocab() {
        let mut p = greedy();
        p.repetition_penalty = 1.5;
        p.frequency_penalty = 1.0;
        let mut sampler = Sampler::new(&p, 1, &[7, 1_000_000, u32::MAX], 4);
        // A longer row than the vocab: token 5 is picked but not tracked.
        let mut logits = [0.0, 0.0, 0.0, 0.0, 0.0, 9.0];
        assert_eq!(sampler.sample(&mut logits).token, 5);
        let mut logits = [0.0, 0.0, 0.0, 0.0, 0.0, 9.0];
        assert_eq!(sampler.sample(&mut logits).token, 5);
        assert_eq!(logits[5], 9.0);
        assert!(sampler.rep_tokens.is_empty() && sampler.out_counts.is_empty());
        // A shorter row than the vocab.
        assert_eq!(sampler.sample(&mut [1.0, 2.0]).token, 1);
    }

    #[test]
    fn fast_path_matches_sort_based_reference() {
        let mut rng = TestRng::new(2024);
        let sizes = [1, 2, 3, 7, 40, 300, 2000, 9000];
        let temperatures = [0.3, 0.7, 1.0, 1.9];
        let top_ps = [1.0, 0.97, 0.8, 0.33, 0.05, 0.0];
        let min_ps = [0.0, 0.0, 0.02, 0.3, 1.0];
        for case in 0..400 {
            let n = sizes[case % sizes.len()];
            let spread = rng.choose(&[0.5, 3.0, 20.0]);
            let quantized = rng.below(3) == 0;
            let mut logits: Vec<f32> = (0..n)
                .map(|_| {
                    let x = rng.normal() * spread;
                    // Quantized rows have many exact ties.
                    (if quantized {
                        (x * 2.0).round() / 2.0
                    } else {
                        x
                    }) as f32
                })
                .collect();
            if rng.below(4) == 0 {
                for _ in 0..1 + n / 10 {
                    let at = rng.below(n);
                    logits[at] = rng.choose(&[f32::NEG_INFINITY, f32::NAN, f32::INFINITY]);
                }
            }
            let temperature = rng.choose(&temperatures);
            let top_k = rng.choose(&[0, 0, 1, 2, 7, n / 3, n.saturating_sub(1), n, n + 3]);
            let top_p = rng.choose(&top_ps);
            let min_p = rng.choose(&min_ps);
            let context =
                format!("case {case}: n={n} t={temperature} k={top_k} p={top_p} min_p={min_p}");

            let p = params(temperature, top_k, top_p, min_p);
            check_against_reference(&logits, &p, &mut rng, 5, &context);
        }
    }

    /// The fast path keeps the reference's tokens with its probabilities, and picks what the
    /// reference picks for `draws` random draws.
    fn check_against_reference(
        logits: &[f32],
        p: &SamplingParams,
        rng: &mut TestRng,
        draws: usize,
        context: &str,
    ) {
        let want = reference_distribution(logits, p.temperature, p.top_k, p.top_p, p.min_p);
        let mut sampler = Sampler::new(p, 1, &[], logits.len());
        let mut weights = logits.to_vec();
        let kept = sampler.prepare(&mut weights);
        let got = kept_distribution(&sampler, &weights, kept);
        assert_same_distribution(&got, &want, context);
        for _ in 0..draws {
            let u = rng.uniform();
            assert_eq!(
                sampler.pick(&weights, kept, u),
                reference_pick(&want, u),
                "u={u} {context}"
            );
        }
    }

    #[test]
    fn large_vocab_paths_match_reference() {
        // Exercises the sampled prefilters (vocab > 4096, small k) and both nucleus layouts.
        let mut rng = TestRng::new(77);
        let n = 20_000;
        for case in 0..12 {
            let logits: Vec<f32> = (0..n)
                .map(|i| {
                    let base = rng.normal() * 2.0;
                    // A few boosted tokens make a small nucleus; without them it is large.
                    (if case % 2 == 0 && i % 997 == 0 {
                        base + 12.0
                    } else {
                        base
                    }) as f32
                })
                .collect();
            let (top_k, top_p, min_p) = [
                (0, 0.9, 0.0),
                (50, 1.0, 0.0),
                (40, 0.8, 0.0),
                (0, 1.0, 0.05),
                (0, 0.95, 0.001),
                (3000, 0.5, 0.0),
            ][case % 6];
            let context = format!("case {case}: k={top_k} p={top_p} min_p={min_p}");
            let p = params(0.8, top_k, top_p, min_p);
            check_against_reference(&logits, &p, &mut rng, 20, &context);
        }
    }

    #[test]
    fn flat_rows_find_the_nucleus_through_the_histogram() {
        // Nuclei larger than EXACT_LIMIT, so the cut is found through the weight histogram;
        // quantized rows put many exact ties in the cut's bucket.
        let mut rng = TestRng::new(404);
        let n = 30_000;
        for case in 0..8 {
            let quantized = case % 2 == 1;
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    let x = rng.normal();
                    (if quantized {
                        (x * 8.0).round() / 8.0
                    } else {
                        x
                    }) as f32
                })
                .collect();
            let top_p = [0.5, 0.9, 0.99, 0.7][case / 2];
            let min_p = if case == 7 { 0.01 } else { 0.0 };
            let context = format!("case {case}: p={top_p} min_p={min_p}");
            let want = reference_distribution(&logits, 1.0, 0, top_p, min_p);
            assert!(
                want.len() > EXACT_LIMIT,
                "{context}: nucleus {}",
                want.len()
            );
            let mut sampler = Sampler::new(&params(1.0, 0, top_p, min_p), 1, &[], n);
            let mut weights = logits.clone();
            let kept = sampler.prepare(&mut weights);
            let got = kept_distribution(&sampler, &weights, kept);
            assert_same_distribution(&got, &want, &context);
            for _ in 0..20 {
                let u = rng.uniform();
                assert_eq!(
                    sampler.pick(&weights, kept, u),
                    reference_pick(&want, u),
                    "{context}"
                );
            }
        }
    }

    #[test]
    fn top_k_prefilter_falls_back_when_the_sample_misleads() {
        // Every 19th value (exactly the strided sample for n = 20000) is high, so the sampled
        // threshold admits only 1053 tokens, fewer than k: the exact path must take over.
        let n = 20_000;
        let mut rng = TestRng::new(5);
        let logits: Vec<f32> = (0..n)
            .map(|i| {
                if i % 19 == 0 {
                    100.0
                } else {
                    rng.normal() as f32
                }
            })
            .collect();
        let threshold = prefilter_threshold(&logits, 2000, &mut Vec::new());
        assert_eq!(threshold, 100.0);
        let want = reference_distribution(&logits, 1.0, 2000, 1.0, 0.0);
        let mut sampler = Sampler::new(&params(1.0, 2000, 1.0, 0.0), 1, &[], n);
        let mut weights = logits.clone();
        let kept = sampler.prepare(&mut weights);
        assert_eq!(sampler.pool.len(), 2000);
        assert_same_distribution(
            &kept_distribution(&sampler, &weights, kept),
            &want,
            "fallback",
        );
    }

    /// Chi-square statistic of observed counts against expected probabilities.
    fn chi_square(counts: &[u32], probs: &[f64], draws: u32) -> f64 {
        counts
            .iter()
            .zip(probs)
            .map(|(&c, &p)| {
                let expected = p * f64::from(draws);
                (f64::from(c) - expected).powi(2) / expected
            })
            .sum()
    }

    #[test]
    fn temperature_one_draws_follow_softmax() {
        let logits = [0.0f32, 1.0, 2.0, -1.0, 0.5, 1.5, -2.0, 0.25];
        let max = 2.0f64;
        let weights: Vec<f64> = logits.iter().map(|&x| (f64::from(x) - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let probs: Vec<f64> = weights.iter().map(|w| w / total).collect();

        let draws = 20_000;
        let mut sampler = Sampler::new(&params(1.0, 0, 1.0, 0.0), 12345, &[], logits.len());
        let mut counts = [0u32; 8];
        for _ in 0..draws {
            let mut row = logits;
            counts[sampler.sample(&mut row).token as usize] += 1;
        }
        // 8 bins, 7 degrees of freedom: a correct sampler exceeds 24.32 with probability 0.001
        // (and the seed is fixed, so the test is deterministic). A real bias shows up well above
        // that: moving 2% of the probability between the two likeliest tokens (p = 0.388 and
        // 0.236) adds about 55, and any misplaced mass on the rarest (p = 0.0071, 142 expected
        // draws) far more.
        let chi2 = chi_square(&counts, &probs, draws);
        assert!(chi2 < 24.32, "chi-square {chi2}, counts {counts:?}");
        assert!(counts.iter().all(|&c| c > 0));
    }

    /// Draws of `sample_or_accept` with `draft` proposed at every draw, by token.
    fn counts_with_draft(
        params: &SamplingParams,
        logits: &[f32],
        draft: u32,
        draws: u32,
    ) -> Vec<u32> {
        let mut sampler = Sampler::new(params, 777, &[], logits.len());
        let mut counts = vec![0u32; logits.len()];
        for _ in 0..draws {
            let mut row = logits.to_vec();
            let (sampled, accepted) = sampler.sample_or_accept(&mut row, Some(draft), |_| {});
            assert_eq!(accepted, sampled.token == draft);
            counts[sampled.token as usize] += 1;
        }
        counts
    }

    #[test]
    fn drafted_draws_follow_the_target_distribution() {
        let logits = [0.0f32, 1.0, 2.0, -1.0, 0.5, 1.5, -2.0, 0.25];
        let probs = reference_distribution(&logits, 1.0, 0, 1.0, 0.0);
        let probs: Vec<f64> = probs.iter().map(|d| d.1).collect();
        let draws = 20_000;
        // A likely draft (p 0.39), a middling one and a rare one (p 0.007): 7 degrees of freedom,
        // p = 0.001 critical value 24.32 (fixed seed: deterministic).
        for draft in [2, 4, 6] {
            let counts = counts_with_draft(&params(1.0, 0, 1.0, 0.0), &logits, draft, draws);
            let chi2 = chi_square(&counts, &probs, draws);
            assert!(chi2 < 24.32, "draft {draft}: chi-square {chi2}, {counts:?}");
        }
        // Through the filtered paths too (a top-k list, a nucleus): the kept distribution.
        for (t, k, p) in [(1.0, 3, 1.0), (0.7, 0, 0.8)] {
            let dist = reference_distribution(&logits, t, k, p, 0.0);
            let draft = dist[1].0;
            let counts = counts_with_draft(&params(t, k, p, 0.0), &logits, draft, draws);
            let kept: Vec<u32> = dist.iter().map(|d| counts[d.0 as usize]).collect();
            assert_eq!(kept.iter().sum::<u32>(), draws, "a dropped token was drawn");
            let probs: Vec<f64> = dist.iter().map(|d| d.1).collect();
            let chi2 = chi_square(&kept, &probs, draws);
            let critical = [10.83, 13.82, 16.27, 18.47][dist.len() - 2];
            assert!(chi2 < critical, "top-k {k} top-p {p}: chi-square {chi2}");
        }
    }

    #[test]
    fn a_seeds_stream_is_the_same_with_drafts_or_without() {
        // Two samplers of one seed, one checking a draft at every step (right or wrong, by a
        // rule of its own): every token equal, each draft accepted exactly when it is the token.
        let logits = [0.0f32, 1.0, 2.0, -1.0, 0.5, 1.5, -2.0, 0.25];
        for (t, k, p, m) in [(1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, 0, 0.8, 0.05)] {
            let mut plain = Sampler::new(&params(t, k, p, m), 41, &[], logits.len());
            let mut drafted = Sampler::new(&params(t, k, p, m), 41, &[], logits.len());
            let mut accepted = 0;
            for step in 0..2_000u32 {
                let want = plain.sample(&mut logits.to_vec()).token;
                let draft = if step % 3 == 0 { want } else { step % 8 };
                let (got, ok) = drafted.sample_or_accept(&mut logits.to_vec(), Some(draft), |_| {});
                assert_eq!(got.token, want, "step {step}");
                assert_eq!(ok, draft == want);
                accepted += usize::from(ok);
            }
            assert!(accepted > 2_000 / 3, "{accepted}");
        }
    }

    #[test]
    fn drafted_draws_without_the_residual_correction_fail_the_same_test() {
        // The rule with its correction removed: a rejected draft redrawn from the whole
        // distribution (draft included) instead of the residual. The test above must catch it.
        let logits = [0.0f32, 1.0, 2.0, -1.0, 0.5, 1.5, -2.0, 0.25];
        let probs: Vec<f64> = reference_distribution(&logits, 1.0, 0, 1.0, 0.0)
            .iter()
            .map(|d| d.1)
            .collect();
        let draws = 20_000;
        let mut sampler = Sampler::new(&params(1.0, 0, 1.0, 0.0), 777, &[], logits.len());
        let mut rng = TestRng::new(5);
        let draft = 4u32;
        let mut counts = vec![0u32; logits.len()];
        for _ in 0..draws {
            let mut row = logits.to_vec();
            let token = if rng.uniform() < probs[draft as usize] {
                draft
            } else {
                sampler.sample(&mut row).token
            };
            counts[token as usize] += 1;
        }
        let chi2 = chi_square(&counts, &probs, draws);
        assert!(chi2 > 24.32 * 10.0, "chi-square {chi2} did not reject");
    }

    #[test]
    fn a_greedy_draft_is_accepted_exactly_when_it_is_the_argmax() {
        let logits = [0.5f32, 3.0, 2.9, -1.0];
        let mut sampler = Sampler::new(&greedy(), 1, &[], 4);
        for (draft, want) in [(Some(1), true), (Some(2), false), (None, false)] {
            let mut row = logits.to_vec();
            let (sampled, accepted) = sampler.sample_or_accept(&mut row, draft, |_| {});
            assert_eq!((sampled.token, accepted), (1, want));
        }
        // The grammar's mask applies before the check: a masked argmax is not accepted.
        let mut row = logits.to_vec();
        let (sampled, accepted) =
            sampler.sample_or_accept(&mut row, Some(1), |r| r[1] = f32::NEG_INFINITY);
        assert_eq!((sampled.token, accepted), (2, false));
    }

    #[test]
    fn filters_never_yield_dropped_tokens() {
        let logits = [
            1.0f32, 3.0, 2.5, -1.0, 2.9, 0.0, 2.0, 1.5, -3.0, 2.2, 0.7, 3.0,
        ];
        let configs = [
            (1.0, 3, 1.0, 0.0),
            (1.0, 0, 0.6, 0.0),
            (1.0, 0, 1.0, 0.3),
            (2.0, 6, 0.9, 0.1),
            (0.5, 0, 0.95, 0.0),
            (1.0, 1, 1.0, 0.0),
            (1.0, 0, 0.0, 0.0),
        ];
        for (config, &(t, k, p, min_p)) in configs.iter().enumerate() {
            let dist = reference_distribution(&logits, t, k, p, min_p);
            let draws = 4000;
            let mut counts = vec![0u32; logits.len()];
            let mut sampler = Sampler::new(&params(t, k, p, min_p), config as u64, &[], 12);
            for _ in 0..draws {
                let mut row = logits;
                let token = sampler.sample(&mut row).token;
                assert!(
                    dist.iter().any(|d| d.0 == token),
                    "config {config}: drew dropped token {token}"
                );
                counts[token as usize] += 1;
            }
            // And the kept tokens follow the renormalized distribution (chi-square, p = 0.001
            // critical values for up to 11 degrees of freedom).
            let critical = [
                10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26,
            ];
            if dist.len() > 1 {
                let kept_counts: Vec<u32> = dist.iter().map(|d| counts[d.0 as usize]).collect();
                let probs: Vec<f64> = dist.iter().map(|d| d.1).collect();
                let chi2 = chi_square(&kept_counts, &probs, draws);
                assert!(
                    chi2 < critical[dist.len() - 2],
                    "config {config}: chi-square {chi2}"
                );
            }
        }
        // Spot-check the reference itself on config 0: the top 3 are ids 1, 11 (both 3.0) and 4.
        let top3: Vec<u32> = reference_distribution(&logits, 1.0, 3, 1.0, 0.0)
            .iter()
            .map(|d| d.0)
            .collect();
        assert_eq!(top3, [1, 4, 11]);
        // top_p 0 keeps exactly the most likely token; of the tied two, the lower id.
        let only: Vec<u32> = reference_distribution(&logits, 1.0, 0, 0.0, 0.0)
            .iter()
            .map(|d| d.0)
            .collect();
        assert_eq!(only, [1]);
    }

    fn sample_sequence(seed: u64, steps: usize) -> Vec<u32> {
        let mut rng = TestRng::new(99);
        let rows: Vec<Vec<f32>> = (0..steps)
            .map(|_| (0..64).map(|_| rng.normal() as f32).collect())
            .collect();
        let mut sampler = Sampler::new(&params(1.0, 0, 0.95, 0.0), seed, &[], 64);
        rows.into_iter()
            .map(|mut row| sampler.sample(&mut row).token)
            .collect()
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        assert_eq!(sample_sequence(5, 200), sample_sequence(5, 200));
        assert_ne!(sample_sequence(5, 200), sample_sequence(6, 200));
    }

    #[test]
    fn interleaving_samplers_does_not_change_either() {
        let alone_a = sample_sequence(5, 100);
        let alone_b = sample_sequence(6, 100);
        let mut rng = TestRng::new(99);
        let rows: Vec<Vec<f32>> = (0..100)
            .map(|_| (0..64).map(|_| rng.normal() as f32).collect())
            .collect();
        let mut a = Sampler::new(&params(1.0, 0, 0.95, 0.0), 5, &[], 64);
        let mut b = Sampler::new(&params(1.0, 0, 0.95, 0.0), 6, &[], 64);
        let (mut seq_a, mut seq_b) = (Vec::new(), Vec::new());
        for row in &rows {
            seq_b.push(b.sample(&mut row.clone()).token);
            seq_a.push(a.sample(&mut row.clone()).token);
            // A greedy request in between must not matter either.
            Sampler::new(&greedy(), 5, &[], 64).sample(&mut row.clone());
        }
        assert_eq!(seq_a, alone_a);
        assert_eq!(seq_b, alone_b);
    }

    #[test]
    fn exactly_one_draw_per_non_greedy_step() {
        let mut sampler = Sampler::new(&params(0.7, 5, 0.5, 0.1), 31, &[], 4);
        let mut expected = Xoshiro256StarStar::from_seed(31);
        let rows = [
            vec![1.0, 2.0, 3.0, 4.0],
            vec![f32::NAN; 4],                      // nothing to pick
            vec![9.0, f32::NEG_INFINITY, 0.0, 0.0], // one dominant token
            vec![f32::INFINITY, 0.0, f32::INFINITY, 1.0],
        ];
        for mut row in rows {
            sampler.sample(&mut row);
            expected.next_u64();
            assert_eq!(sampler.rng, expected);
        }
        assert_eq!(sampler.sample(&mut []).token, 0);
    }

    #[test]
    fn non_finite_logits_are_handled() {
        let mut rng = TestRng::new(3);
        for seed in 0..50 {
            // NaN is -inf: never drawn.
            let mut sampler = Sampler::new(&params(1.0, 0, 1.0, 0.0), seed, &[], 4);
            let token = sampler.sample(&mut [f32::NAN, 0.0, f32::NAN, 0.1]).token;
            assert!(token == 1 || token == 3);
            // +inf tokens share all the mass.
            let token = sampler
                .sample(&mut [f32::INFINITY, 50.0, f32::INFINITY, 1.0])
                .token;
            assert!(token == 0 || token == 2);
            // All -inf/NaN: token 0.
            assert_eq!(
                sampler
                    .sample(&mut [f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY, f32::NAN])
                    .token,
                0
            );
            // Extreme finite values and temperatures: logits / t overflowing to +inf count as
            // f32::MAX, so tokens 0 and 2 may tie on top; top_p 0.5 then keeps the lower id.
            // Otherwise token 0 leads by far.
            let t = rng.choose(&[1e-30f32, 1e-3, 1.0, 1e30]);
            let mut sampler = Sampler::new(&params(t, 2, 0.5, 0.5), seed, &[], 4);
            let token = sampler
                .sample(&mut [f32::MAX, -f32::MAX, 3e38, f32::MIN_POSITIVE])
                .token;
            assert_eq!(token, 0, "t = {t}");
        }
        // Odd parameters do not panic: negative top_p, min_p above 1, huge top_k, logprobs > vocab.
        let mut p = params(1.0, 1000, -3.0, 7.0);
        p.logprobs = Some(10);
        p.repetition_penalty = 0.0;
        let mut sampler = Sampler::new(&p, 1, &[0, 1], 3);
        // A repetition penalty of 0 sends the seen positive logits to +inf: tokens 0 and 1 tie as
        // the most likely, and top_p 0 (clamped from -3) keeps the lower id.
        let out = sampler.sample(&mut [1.0, 2.0, 0.5]);
        assert_eq!(out.token, 0);
        assert_eq!(out.top_logprobs.len(), 3);
    }

    /// Straightforward f64 log_softmax for checking.
    fn log_softmax(logits: &[f32]) -> Vec<f64> {
        let max = logits
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let total: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
        logits
            .iter()
            .map(|&x| f64::from(x) - max - total.ln())
            .collect()
    }

    #[test]
    fn logprobs_match_f64_log_softmax_of_raw_logits() {
        let mut rng = TestRng::new(11);
        for &n in &[1usize, 5, 100, 9000] {
            let logits: Vec<f32> = (0..n).map(|_| (rng.normal() * 4.0) as f32).collect();
            let want = log_softmax(&logits);
            let mut p = params(0.7, 0, 0.9, 0.0);
            p.logprobs = Some(5);
            // Penalties and temperature must not leak into the logprobs.
            p.repetition_penalty = 1.3;
            p.frequency_penalty = 0.4;
            let mut sampler = Sampler::new(&p, 8, &[0, 1, 2], n);
            for _ in 0..3 {
                let out = sampler.sample(&mut logits.clone());
                let got = out.logprob.expect("logprobs requested");
                let exact = want[out.token as usize];
                assert!((f64::from(got) - exact).abs() <= 1e-5, "{got} vs {exact}");
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
                assert_eq!(out.top_logprobs.len(), n.min(5));
                for (&(id, lp), &want_id) in out.top_logprobs.iter().zip(&order) {
                    assert_eq!(id as usize, want_id);
                    assert!((f64::from(lp) - want[want_id]).abs() <= 1e-5);
                }
            }
        }
    }

    #[test]
    fn prompt_token_logprob_is_the_samplers_entry_with_a_rank() {
        let mut rng = TestRng::new(12);
        let mut scratch = LogprobScratch::default();
        for &n in &[1usize, 7, 9000] {
            let mut logits: Vec<f32> = (0..n).map(|_| (rng.normal() * 4.0) as f32).collect();
            // A tie with the token and a NaN (cleaned to -inf, as a step's logits are).
            if n > 2 {
                logits[1] = logits[0];
                logits[2] = f32::NAN;
            }
            let mut cleaned = logits.clone();
            clean_in_place(&mut cleaned);
            let want = log_softmax(&cleaned);
            for token in [0u32, (n - 1) as u32] {
                let mut row = logits.clone();
                let got = prompt_token_logprob(&mut row, token, 3, &mut scratch);
                let (entry, rank) = (got.logprob, got.rank);
                let x = cleaned[token as usize];
                assert_eq!(rank, 1 + cleaned.iter().filter(|&&y| y > x).count());
                assert_eq!(entry.token, token);
                assert!((f64::from(entry.logprob) - want[token as usize]).abs() <= 1e-5);
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
                let ids: Vec<usize> = entry.top.iter().map(|&(id, _)| id as usize).collect();
                assert_eq!(ids, order[..n.min(3)]);
            }
        }
    }

    #[test]
    fn top_logprobs_sorted_descending_ties_by_lower_id() {
        let mut p = greedy();
        p.logprobs = Some(4);
        let mut sampler = Sampler::new(&p, 1, &[], 6);
        let logits = [1.0f32, 2.0, 0.0, 2.0, f32::NAN, 1.0];
        let out = sampler.sample(&mut logits.clone());
        assert_eq!(out.token, 1);
        // Softmax over [1, 2, 0, 2, -inf, 1].
        let total = 2.0 * 1f64.exp() + 2.0 * 2f64.exp() + 1.0;
        let lp = |x: f64| (x - total.ln()) as f32;
        let ids: Vec<u32> = out.top_logprobs.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0, 5]);
        let expected = [lp(2.0), lp(2.0), lp(1.0), lp(1.0)];
        for (got, want) in out.top_logprobs.iter().zip(expected) {
            assert!((got.1 - want).abs() <= 1e-6, "{} vs {want}", got.1);
        }
        assert!((out.logprob.unwrap_or(f32::NAN) - lp(2.0)).abs() <= 1e-6);

        // n = 0: only the chosen token's logprob; NaN reports -inf.
        p.logprobs = Some(0);
        let mut sampler = Sampler::new(&p, 1, &[], 3);
        let out = sampler.sample(&mut [f32::NAN, f32::NAN, f32::NAN]);
        assert_eq!(out.token, 0);
        assert_eq!(out.logprob, Some(f32::NEG_INFINITY));
        assert!(out.top_logprobs.is_empty());
    }

    #[test]
    fn no_logprobs_unless_requested() {
        let mut sampler = Sampler::new(&params(1.0, 0, 1.0, 0.0), 1, &[], 3);
        let out = sampler.sample(&mut [1.0, 2.0, 3.0]);
        assert_eq!(out.logprob, None);
        assert!(out.top_logprobs.is_empty());
        assert!(sampler.raw.is_empty());
    }

    /// Prints µs per `sample` call (minus the cost of refreshing the row). Run with
    /// `cargo test --release -- --ignored --nocapture timing`.
    #[test]
    #[ignore]
    fn timing() {
        use std::hint::black_box;
        use std::time::Instant;

        let with_logprobs = |mut p: SamplingParams| {
            p.logprobs = Some(5);
            p
        };
        for vocab in [49_152usize, 151_936] {
            let mut rng = TestRng::new(1);
            // LLM-like: a broad N(0, 2) background and 30 tokens well above it.
            let mut peaked: Vec<f32> = (0..vocab).map(|_| (rng.normal() * 2.0) as f32).collect();
            for _ in 0..30 {
                let at = rng.below(vocab);
                peaked[at] = (10.0 + 6.0 * rng.uniform()) as f32;
            }
            // No dominant tokens: the top-p 0.9 nucleus is a large part of the vocab.
            let flat: Vec<f32> = (0..vocab).map(|_| rng.normal() as f32).collect();

            // The machine may be shared: report the fastest of several rounds.
            let (rounds, iterations) = (7, 100);
            let mut row = vec![0.0f32; vocab];
            let time_rounds = |row: &mut Vec<f32>, step: &mut dyn FnMut(&mut Vec<f32>)| {
                (0..rounds)
                    .map(|_| {
                        let start = Instant::now();
                        for _ in 0..iterations {
                            step(row);
                        }
                        start.elapsed().as_secs_f64() * 1e6 / f64::from(iterations)
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            let copy_us = time_rounds(&mut row, &mut |row| {
                row.copy_from_slice(black_box(&peaked));
                black_box(row);
            });

            let mut probe = Sampler::new(&params(0.8, 0, 0.9, 0.0), 1, &[], vocab);
            let mut nucleus_sizes = Vec::new();
            for source in [&peaked, &flat] {
                row.copy_from_slice(source);
                let kept = probe.prepare(&mut row);
                nucleus_sizes.push(kept_distribution(&probe, &row, kept).len());
            }
            println!(
                "vocab {vocab}: row refresh {copy_us:.1} µs (subtracted below); top_p 0.9 at \
                 t 0.8 keeps {} tokens (peaked), {} (flat)",
                nucleus_sizes[0], nucleus_sizes[1]
            );
            let configs: [(&str, SamplingParams, &Vec<f32>); 9] = [
                ("greedy", greedy(), &peaked),
                ("temperature 0.8", params(0.8, 0, 1.0, 0.0), &peaked),
                ("t 0.8, top_p 0.9", params(0.8, 0, 0.9, 0.0), &peaked),
                ("t 0.8, top_k 50", params(0.8, 50, 1.0, 0.0), &peaked),
                ("t 0.8, min_p 0.05", params(0.8, 0, 1.0, 0.05), &peaked),
                ("greedy, logprobs 5", with_logprobs(greedy()), &peaked),
                (
                    "t 0.8, top_p 0.9, logprobs 5",
                    with_logprobs(params(0.8, 0, 0.9, 0.0)),
                    &peaked,
                ),
                (
                    "t 0.8, top_p 0.9, flat row",
                    params(0.8, 0, 0.9, 0.0),
                    &flat,
                ),
                (
                    "t 0.8, top_k 50, flat row",
                    params(0.8, 50, 1.0, 0.0),
                    &flat,
                ),
            ];
            for (name, p, source) in configs {
                let mut sampler = Sampler::new(&p, 7, &[], vocab);
                let total_us = time_rounds(&mut row, &mut |row| {
                    row.copy_from_slice(black_box(source));
                    black_box(sampler.sample(row));
                });
                println!("  {name:<32} {:8.1} µs", total_us - copy_us);
            }
        }
    }
}
