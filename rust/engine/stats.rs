//! EngineStats: what the engine thread publishes after every step, read by `Engine::stats`
//! without a round trip to the thread.

use std::time::Duration;

use crate::cache::CacheStats;
use crate::device::graphs::GraphCacheStats;

/// Counts of observations at or below each bound (Prometheus-style cumulative buckets are
/// derived on export), with their sum.
#[derive(Clone, Debug)]
pub struct Histogram {
    pub bounds: &'static [f64],
    /// `counts[i]`: observations in `(bounds[i-1], bounds[i]]`; the last slot is `> bounds[-1]`.
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn push(&mut self, v: f64) {
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// Drafts accepted in one verification: 0 .. 8 (speculative decoding).
pub const ACCEPTED_DRAFT_BOUNDS: &[f64] = &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];

/// Seconds: 1 ms .. 60 s.
pub const LATENCY_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Clone, Debug)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    /// Blocks indexed in the prefix cache (held or evictable).
    pub kv_blocks_cached: usize,
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub finished: u64,
    pub cancelled: u64,
    /// Requests refused because the queue was full.
    pub refused: u64,
    pub steps: u64,
    pub step_tokens: u64,
    /// A step's time: scheduling (with the cache moves it makes), the forward, sampling and
    /// detokenizing; not the hand-over of its deltas to the streams.
    pub last_step_seconds: f64,
    pub step_seconds: Histogram,
    /// Arrival to first token, per sequence.
    pub ttft_seconds: Histogram,
    /// Speculative decoding: drafts proposed and accepted, and the drafts accepted per
    /// verification (one per drafting sequence and step).
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_accepted_per_step: Histogram,
    /// Why the engine loop stopped, once it has.
    pub stopped: Option<String>,
    /// The conversation cache's tiers, moves and refusals.
    pub cache: CacheStats,
    /// The captured decode graphs (all zero on the CPU, which captures none).
    pub graphs: GraphCacheStats,
    /// Copy streams the GPUs' tier moves have made (one per GPU at most, on its first move).
    pub copy_streams: usize,
}

impl Default for EngineStats {
    fn default() -> Self {
        EngineStats {
            running: 0,
            waiting: 0,
            kv_blocks_total: 0,
            kv_blocks_used: 0,
            kv_blocks_cached: 0,
            prefix_query_tokens: 0,
            prefix_hit_tokens: 0,
            preemptions: 0,
            prompt_tokens: 0,
            generated_tokens: 0,
            finished: 0,
            cancelled: 0,
            refused: 0,
            steps: 0,
            step_tokens: 0,
            last_step_seconds: 0.0,
            step_seconds: Histogram::new(LATENCY_BOUNDS),
            ttft_seconds: Histogram::new(LATENCY_BOUNDS),
            spec_draft_tokens: 0,
            spec_accepted_tokens: 0,
            spec_accepted_per_step: Histogram::new(ACCEPTED_DRAFT_BOUNDS),
            stopped: None,
            cache: CacheStats::default(),
            graphs: GraphCacheStats::default(),
            copy_streams: 0,
        }
    }
}

impl EngineStats {
    pub fn record_step(&mut self, d: Duration, tokens: usize) {
        let s = d.as_secs_f64();
        self.steps += 1;
        self.step_tokens += tokens as u64;
        self.last_step_seconds = s;
        self.step_seconds.push(s);
    }

    /// One drafting sequence's verification: `accepted` of its `proposed` drafts.
    pub fn record_drafts(&mut self, proposed: usize, accepted: usize) {
        self.spec_draft_tokens += proposed as u64;
        self.spec_accepted_tokens += accepted as u64;
        self.spec_accepted_per_step.push(accepted as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_upper_inclusive() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.0, 1.5, 2.0, 3.0] {
            h.push(v);
        }
        assert_eq!(h.counts, vec![2, 2, 1]);
        assert_eq!((h.count, h.sum), (5, 8.0));
    }
}
