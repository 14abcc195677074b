//! The Prometheus families `/metrics` reads from `Engine.stats()`: one table, [`table`],
//! exported as `strata_rs._core.stats_metrics()`. Each entry names a family, its type, help text
//! and labels, and the key paths in the stats dict ([`super::StatsSnapshot`]) its samples are
//! read from; `server/metrics.py` walks the table over one `stats()` snapshot per scrape, with no
//! per-metric code. A table of paths, rather than samples computed here, keeps the metrics a pure
//! function of the public dict (a scrape shows what `stats()` says) and needs no second call into
//! the engine per scrape.
//!
//! Path syntax (`server/metrics.py` `_samples` reads it): dot-separated keys; `*` is every key of
//! a dict, which becomes the value of the next label; `[]` is every record of a list, whose
//! fields named like the remaining labels give their values; `[field=value]` keeps only the
//! records where `field` is `value`. Samples with equal labels are summed.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::cache::{Gate, MoveResult, Tier};

/// A Prometheus family's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricKind {
    Gauge,
    Counter,
    Histogram,
}

/// Where some of a family's samples are: a path in the stats dict (see the module docs), and
/// the labels every sample from it has.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MetricSource {
    pub path: &'static str,
    pub labels: BTreeMap<&'static str, &'static str>,
}

/// One Prometheus family read from `stats()`. A counter's name is given without `_total`
/// (prometheus_client appends it).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MetricSpec {
    pub name: &'static str,
    #[serde(rename = "type")]
    pub kind: MetricKind,
    pub help: &'static str,
    pub labels: Vec<&'static str>,
    /// Read in order; a histogram has one source, the histogram's dict.
    pub sources: Vec<MetricSource>,
    /// Label values listed from the first scrape on, at 0 until counted, so that a `rate()`
    /// never starts from a missing series; before any a source adds.
    pub zeros: Vec<Vec<&'static str>>,
    /// A path to a dict whose keys are listed the same way (one label), after `zeros`.
    pub zeros_from: Option<&'static str>,
}

fn spec(
    kind: MetricKind,
    name: &'static str,
    help: &'static str,
    path: &'static str,
) -> MetricSpec {
    MetricSpec {
        name,
        kind,
        help,
        labels: Vec::new(),
        sources: vec![MetricSource {
            path,
            labels: BTreeMap::new(),
        }],
        zeros: Vec::new(),
        zeros_from: None,
    }
}

fn labelled(
    kind: MetricKind,
    name: &'static str,
    help: &'static str,
    labels: &[&'static str],
    path: &'static str,
) -> MetricSpec {
    MetricSpec {
        labels: labels.to_vec(),
        ..spec(kind, name, help, path)
    }
}

/// The Prometheus families of `stats()`, in exposition order (after `strata:engine_up`, which
/// says whether there is an engine to read at all and stays in `server/metrics.py`). The names
/// follow vLLM's where one exists (`vllm:` becomes `strata:`), and docs/operations.md lists them.
pub fn table() -> Vec<MetricSpec> {
    use MetricKind::{Counter, Gauge, Histogram};
    let routes = || Tier::ROUTES.iter().map(|(a, b)| vec![a.name(), b.name()]);
    vec![
        spec(
            Gauge,
            "strata:num_requests_running",
            "Sequences admitted (prefill or decode)",
            "running",
        ),
        spec(Gauge, "strata:num_requests_waiting", "Sequences waiting for admission", "waiting"),
        spec(
            Gauge,
            "strata:kv_cache_usage_perc",
            "Fraction of K/V blocks held by sequences (0-1)",
            "kv_usage",
        ),
        spec(Gauge, "strata:kv_blocks_total", "K/V blocks in the device pool", "kv_blocks_total"),
        spec(Gauge, "strata:kv_blocks_used", "K/V blocks held by sequences", "kv_blocks_used"),
        spec(
            Gauge,
            "strata:kv_blocks_cached",
            "K/V blocks indexed in the prefix cache (held or evictable)",
            "kv_blocks_cached",
        ),
        spec(
            Gauge,
            "strata:kv_window_slots_total",
            "Sliding-window layers' K/V slots (0 when they keep every block)",
            "kv_window_slots_total",
        ),
        spec(
            Gauge,
            "strata:kv_window_slots_used",
            "Sliding-window K/V slots held by a block",
            "kv_window_slots_used",
        ),
        spec(
            Counter,
            "strata:kv_window_slots_passed",
            "Sliding-window K/V slots given back because every window had passed their block",
            "kv_window_slots_passed",
        ),
        labelled(
            Gauge,
            "strata:memory_in_use_bytes",
            "Bytes of device memory in use, by device and purpose (weights, kv, workspace, graphs, \
             staging)",
            &["device", "purpose"],
            "memory.*.in_use_bytes.*",
        ),
        spec(Gauge, "strata:graph_cache_graphs", "Captured decode graphs cached", "graphs.graphs"),
        spec(
            Gauge,
            "strata:graph_cache_bytes",
            "Device bytes the cached decode graphs hold",
            "graphs.bytes",
        ),
        spec(
            Counter,
            "strata:graph_captures",
            "Decode graphs captured (kept or too large)",
            "graphs.captures",
        ),
        spec(
            Counter,
            "strata:graph_oom_fallbacks",
            "Decode steps run uncaptured because capturing their graph ran out of device memory",
            "graphs.oom_fallbacks",
        ),
        spec(
            Counter,
            "strata:graph_capture_failures",
            "Graph captures that failed for another reason (that batch size then runs uncaptured)",
            "graphs.capture_failures",
        ),
        spec(
            Gauge,
            "strata:copy_streams",
            "Copy streams the GPUs' cache moves have created (one per GPU, on its first move)",
            "copy_streams",
        ),
        labelled(
            Gauge,
            "strata:cache_bytes",
            "Bytes of cached K/V per tier",
            &["tier"],
            "cache.tiers.*.bytes",
        ),
        labelled(
            Gauge,
            "strata:cache_blocks",
            "Cached K/V blocks per tier",
            &["tier"],
            "cache.tiers.*.blocks",
        ),
        spec(
            Counter,
            "strata:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            "prefix_query_tokens",
        ),
        labelled(
            Counter,
            "strata:prefix_cache_hits",
            "Prompt tokens whose K/V came from the cache, per tier",
            &["tier"],
            "cache.hit_tokens.*",
        ),
        MetricSpec {
            zeros: routes()
                .flat_map(|route| {
                    MoveResult::ALL.iter().map(move |r| [route.clone(), vec![r.name()]].concat())
                })
                .collect(),
            ..labelled(
                Counter,
                "strata:cache_moves",
                "K/V blocks moved between cache tiers, by source, destination and result",
                &["from", "to", "result"],
                "cache.moves.[].blocks",
            )
        },
        MetricSpec {
            zeros: routes().collect(),
            ..labelled(
                Counter,
                "strata:cache_move_bytes",
                "Bytes of K/V moved between cache tiers (successful moves)",
                &["from", "to"],
                "cache.moves.[result=ok].bytes",
            )
        },
        spec(
            Counter,
            "strata:cache_corrupt_files",
            "Disk tier files found bad (at the startup scan or on a read) and deleted",
            "cache.corrupt_files",
        ),
        labelled(
            Counter,
            "strata:cache_faults_injected",
            "Faults injected by --cache-faults, per kind (each is also a failed or refused move)",
            &["kind"],
            "cache.faults_injected.*",
        ),
        spec(
            Counter,
            "strata:prompt_tokens",
            "Prompt tokens of admitted requests",
            "prompt_tokens",
        ),
        spec(Counter, "strata:generation_tokens", "Generated tokens", "generated_tokens"),
        spec(
            Counter,
            "strata:requests_finished",
            "Requests that ended (stop or length)",
            "requests_finished",
        ),
        spec(
            Counter,
            "strata:requests_cancelled",
            "Requests cancelled (client gone, stream dropped)",
            "requests_cancelled",
        ),
        MetricSpec {
            labels: vec!["gate"],
            // The queue (a full --max-waiting queue) is the engine's gate, the rest the cache's.
            sources: vec![
                MetricSource {
                    path: "requests_refused",
                    labels: BTreeMap::from([("gate", "queue")]),
                },
                MetricSource {
                    path: "cache.refusals.*",
                    labels: BTreeMap::new(),
                },
            ],
            zeros: std::iter::once("queue")
                .chain(Gate::ALL.iter().map(|g| g.name()))
                .map(|g| vec![g])
                .collect(),
            ..spec(
                Counter,
                "strata:admission_refusals",
                "Refusals per gate: requests (queue) and cache moves (ram, host_budget, \
                 disk_budget, device)",
                "",
            )
        },
        MetricSpec {
            zeros_from: Some("memory"),
            ..labelled(
                Counter,
                "strata:device_refusals",
                "Cache moves refused by one device's memory pool (its part of the staging \
                 buffer), by device; each is also counted under \
                 admission_refusals{gate=\"device\"}",
                &["device"],
                "cache.device_refusals.*",
            )
        },
        spec(
            Counter,
            "strata:num_preemptions",
            "Sequences preempted under K/V pressure",
            "preemptions",
        ),
        spec(
            Counter,
            "strata:spec_decode_draft_tokens",
            "Draft tokens proposed by speculative decoding",
            "spec_draft_tokens",
        ),
        spec(
            Counter,
            "strata:spec_decode_accepted_tokens",
            "Draft tokens accepted by speculative decoding",
            "spec_accepted_tokens",
        ),
        spec(
            Histogram,
            "strata:spec_decode_accepted_per_step",
            "Drafts accepted in one verification (one per drafting sequence and step)",
            "spec_accepted_per_step",
        ),
        spec(
            Counter,
            "strata:spec_decode_draft_detached",
            "Sequences whose draft model stopped (drafts stayed rejected, or cached K/V lacked it)",
            "spec_draft_detached",
        ),
        spec(
            Counter,
            "strata:spec_decode_draft_model_tokens",
            "Tokens a draft model fed (its proposals and its catch-up)",
            "spec_draft_model_tokens",
        ),
        spec(Counter, "strata:engine_steps", "Engine steps run", "steps"),
        spec(
            Histogram,
            "strata:engine_step_seconds",
            "Duration of one engine step",
            "step_seconds",
        ),
        spec(
            Histogram,
            "strata:engine_time_to_first_token_seconds",
            "From the request's arrival at the engine to its first token",
            "ttft_seconds",
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::stats::{EngineStats, StatsSnapshot};

    /// The values a path reaches in `v` (see the module docs), with the label values it took.
    fn walk<'a>(
        v: &'a serde_json::Value,
        path: &[&str],
        labels: Vec<String>,
        out: &mut Vec<(Vec<String>, &'a serde_json::Value)>,
    ) {
        let Some((seg, rest)) = path.split_first() else {
            out.push((labels, v));
            return;
        };
        if *seg == "*" {
            let map = v.as_object().expect("`*` on a dict");
            for (k, child) in map {
                walk(child, rest, [labels.clone(), vec![k.clone()]].concat(), out);
            }
        } else if let Some(cond) = seg.strip_prefix('[').and_then(|c| c.strip_suffix(']')) {
            for record in v.as_array().expect("`[]` on a list") {
                let keep = cond
                    .split_once('=')
                    .is_none_or(|(f, want)| record[f] == want);
                if keep {
                    walk(record, rest, labels.clone(), out);
                }
            }
        } else {
            let child = v.get(seg).unwrap_or_else(|| panic!("no key {seg}"));
            walk(child, rest, labels, out);
        }
    }

    #[test]
    fn every_metric_path_reaches_numbers_of_the_snapshot() {
        let mut stats = EngineStats {
            kv_blocks_total: 10,
            kv_blocks_used: 4,
            ..EngineStats::default()
        };
        let c = &mut stats.cache;
        c.moves
            .insert((Tier::Device, Tier::Host, MoveResult::Ok), 3);
        c.moves
            .insert((Tier::Host, Tier::Device, MoveResult::Failed), 1);
        c.refusals.insert(Gate::Ram, 2);
        c.device_refusals.insert("cpu".into(), 1);
        c.faults_injected.insert("read", 1);
        let pool = crate::device::memory_pool::MemoryPool::new("cpu", None);
        let snapshot = StatsSnapshot::new(stats, 64, vec![pool.snapshot()]);
        let v = serde_json::to_value(&snapshot).expect("serializes");
        assert_eq!(v["kv_usage"], 0.4);
        assert_eq!(v["requests_finished"], 0);
        assert_eq!(v["cache"]["moves"][0]["bytes"], 192);
        assert_eq!(v["cache"]["refusals"]["ram"], 2);
        assert_eq!(v["memory"]["cpu"]["in_use_bytes"]["staging"], 0);
        let mut names = std::collections::HashSet::new();
        for m in table() {
            assert!(names.insert(m.name), "{} twice", m.name);
            for source in &m.sources {
                let mut found = Vec::new();
                let path: Vec<&str> = source.path.split('.').collect();
                walk(&v, &path, Vec::new(), &mut found);
                assert!(
                    !found.is_empty(),
                    "{}: {} reaches nothing",
                    m.name,
                    source.path
                );
                for (labels, value) in found {
                    if m.kind == MetricKind::Histogram {
                        assert!(value["bounds"].is_array() && value["count"].is_u64());
                    } else {
                        assert!(value.is_number(), "{}: {} is {value}", m.name, source.path);
                        // A list's records give the labels left (by field) themselves.
                        if !source.path.contains('[') {
                            assert_eq!(labels.len() + source.labels.len(), m.labels.len());
                        }
                    }
                }
            }
            assert!(
                m.zeros.iter().all(|z| z.len() == m.labels.len()),
                "{}",
                m.name
            );
        }
    }
}
