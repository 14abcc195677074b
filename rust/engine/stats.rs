//! EngineStats: what the engine thread publishes after every step, read by `Engine::stats`
//! without a round trip to the thread; and the one definition of its public schema.
//!
//! `Engine.stats()` in Python is a [`StatsSnapshot`] serialized with serde (pythonize): the
//! derives and `#[serde(...)]` attributes here (and on `GraphCacheStats`, `RestoreRecord`) are
//! the dict's keys, names and nesting; nothing builds that dict by hand. The Prometheus families
//! read from it are the table in [`metrics`].

pub mod metrics;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Serialize, Serializer};

use crate::cache::{CacheStats, Gate, MoveResult, RestoreRecord, Tier};
use crate::device::graphs::GraphCacheStats;
use crate::device::memory_pool::{PoolSnapshot, Purpose};

/// Counts of observations at or below each bound (Prometheus-style cumulative buckets are
/// derived on export), with their sum.
#[derive(Clone, Debug, Serialize)]
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

/// The field order is the order of the keys of `stats()`.
#[derive(Clone, Debug, Serialize)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    /// Blocks indexed in the prefix cache (held or evictable).
    pub kv_blocks_cached: usize,
    /// The sliding-window layers' slots (0 when they keep every block, `kv::window`), those a
    /// block holds, and those given back because every window had passed their block.
    pub kv_window_slots_total: usize,
    pub kv_window_slots_used: usize,
    pub kv_window_slots_passed: u64,
    /// `kv_blocks_used / kv_blocks_total` (0 with no pool); set by [`StatsSnapshot::new`].
    pub kv_usage: f64,
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    #[serde(rename = "requests_finished")]
    pub finished: u64,
    #[serde(rename = "requests_cancelled")]
    pub cancelled: u64,
    /// Requests refused because the queue was full.
    #[serde(rename = "requests_refused")]
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
    /// Sequences whose draft model stopped: its drafts stayed rejected, or a prefix hit found
    /// blocks without its K/V.
    pub spec_draft_detached: u64,
    /// Tokens a draft model fed: its proposals and its catch-up over what the target computed.
    pub spec_draft_model_tokens: u64,
    /// Why the engine loop stopped, once it has.
    pub stopped: Option<String>,
    /// The conversation cache's tiers, moves and refusals (published as [`CacheReport`]).
    #[serde(skip)]
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
            kv_window_slots_total: 0,
            kv_window_slots_used: 0,
            kv_window_slots_passed: 0,
            kv_usage: 0.0,
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
            spec_draft_detached: 0,
            spec_draft_model_tokens: 0,
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

/// `Engine.stats()`: the engine's counters (their fields first, in order), then `cache` and
/// `memory`.
#[derive(Clone, Debug, Serialize)]
pub struct StatsSnapshot {
    #[serde(flatten)]
    pub engine: EngineStats,
    pub cache: CacheReport,
    /// Each device's memory accounting, read at the call.
    pub memory: MemoryReport,
}

impl StatsSnapshot {
    /// `stats` as `Engine::stats` gives them, the block's bytes (`EngineInfo::kv_block_bytes`)
    /// and the devices' memory pools (`Engine::memory`).
    pub fn new(mut stats: EngineStats, block_bytes: usize, memory: Vec<PoolSnapshot>) -> Self {
        stats.kv_usage = stats.kv_blocks_used as f64 / stats.kv_blocks_total.max(1) as f64;
        let kv_bytes = memory.iter().map(|p| p.in_use(Purpose::Kv)).sum();
        let cache = CacheReport::new(&stats, block_bytes, kv_bytes);
        StatsSnapshot {
            engine: stats,
            cache,
            memory: MemoryReport(memory),
        }
    }
}

/// `stats()["cache"]`: tiers, hits per tier, moves, refusals, the last restore.
#[derive(Clone, Debug, Serialize)]
pub struct CacheReport {
    pub tiers: CacheTiers,
    pub hit_tokens: HitTokens,
    pub moves: Vec<CacheMove>,
    /// Per gate, only those that refused.
    pub refusals: BTreeMap<Gate, u64>,
    pub device_refusals: BTreeMap<String, u64>,
    pub corrupt_files: u64,
    pub adopted_files: u64,
    pub faults_injected: BTreeMap<&'static str, u64>,
    pub last_restore: Option<RestoreRecord>,
}

#[derive(Clone, Debug, Serialize)]
pub struct CacheTiers {
    pub device: TierReport,
    pub host: TierReport,
    pub disk: DiskTierReport,
}

#[derive(Clone, Debug, Serialize)]
pub struct TierReport {
    pub blocks: usize,
    pub bytes: u64,
    pub budget_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DiskTierReport {
    #[serde(flatten)]
    pub tier: TierReport,
    pub dir: Option<String>,
    pub enabled: bool,
}

/// Prompt tokens whose K/V came from each tier (`device`: already there).
#[derive(Clone, Debug, Serialize)]
pub struct HitTokens {
    pub device: u64,
    pub host: u64,
    pub disk: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct CacheMove {
    pub from: Tier,
    pub to: Tier,
    pub result: MoveResult,
    pub blocks: u64,
    pub bytes: u64,
}

impl CacheReport {
    /// `block_bytes`: a block as the tiers move it; `kv_bytes`: what the device pools hold for
    /// K/V (the device tier's budget: with window slots, less than a whole block per block).
    fn new(s: &EngineStats, block_bytes: usize, kv_bytes: u64) -> Self {
        let c = &s.cache;
        let block_bytes = block_bytes as u64;
        // Cached blocks' share of the pool (without window slots, `block_bytes` each).
        let held = |blocks: usize| {
            (blocks as u128 * kv_bytes as u128 / s.kv_blocks_total.max(1) as u128) as u64
        };
        let tier = |blocks: usize, bytes: u64, budget_bytes: u64| TierReport {
            blocks,
            bytes,
            budget_bytes,
        };
        CacheReport {
            tiers: CacheTiers {
                device: tier(s.kv_blocks_cached, held(s.kv_blocks_cached), kv_bytes),
                host: tier(c.host_blocks, c.host_bytes, c.host_budget),
                disk: DiskTierReport {
                    tier: tier(c.disk_blocks, c.disk_bytes, c.disk_budget),
                    dir: c.disk_dir.clone(),
                    enabled: c.disk_dir.is_some(),
                },
            },
            hit_tokens: HitTokens {
                device: s.prefix_hit_tokens,
                host: c.hit_tokens_host,
                disk: c.hit_tokens_disk,
            },
            moves: c
                .moves
                .iter()
                .map(|(&(from, to, result), &blocks)| CacheMove {
                    from,
                    to,
                    result,
                    blocks,
                    bytes: blocks * block_bytes,
                })
                .collect(),
            // Every gate, at 0 until it refuses.
            refusals: Gate::ALL
                .iter()
                .map(|&g| (g, c.refusals.get(&g).copied().unwrap_or(0)))
                .collect(),
            device_refusals: c.device_refusals.clone(),
            corrupt_files: c.corrupt_files,
            adopted_files: c.adopted_files,
            faults_injected: c.faults_injected.clone(),
            last_restore: c.last_restore.clone(),
        }
    }
}

/// `stats()["memory"]`: `{device: {"capacity_bytes": int | None, "in_use_bytes": {purpose:
/// int}}}`, every purpose listed (at 0 when nothing holds it), devices in the engine's order.
#[derive(Clone, Debug)]
pub struct MemoryReport(pub Vec<PoolSnapshot>);

impl Serialize for MemoryReport {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|pool| (&pool.device, PoolReport(pool))))
    }
}

struct PoolReport<'a>(&'a PoolSnapshot);

impl Serialize for PoolReport<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut pool = serializer.serialize_struct("PoolReport", 2)?;
        pool.serialize_field("capacity_bytes", &self.0.capacity)?;
        pool.serialize_field("in_use_bytes", &InUse(self.0))?;
        pool.end()
    }
}

struct InUse<'a>(&'a PoolSnapshot);

impl Serialize for InUse<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(Purpose::COUNT))?;
        for (purpose, bytes) in self.0.by_purpose() {
            map.serialize_entry(&purpose, &bytes)?;
        }
        map.end()
    }
}

/// The cache's and the memory pool's names are their `name()`s, in stats and labels alike.
macro_rules! serialize_by_name {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.name())
            }
        }
    )*};
}

serialize_by_name!(Tier, MoveResult, Gate, Purpose);

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
