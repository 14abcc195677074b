"""Prometheus exposition: a collector that reads ``engine.stats()`` at scrape time, plus the
server's own histograms (time to first token and inter-token latency as the HTTP client sees them,
end-to-end latency) and a request counter.

Names follow vLLM's where one exists (``vllm:`` becomes ``strata:``) and docs/design.md's for
the cache (``stats()["cache"]``: bytes and blocks per tier, hits per tier, moves, gate refusals,
corrupt disk files) and the device memory pool (``stats()["memory"]``: bytes in use by device
and purpose). Every registry is per app, so two apps in one process never share counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

TIERS = ("device", "host", "disk")
# The moves the conversation cache makes: offloads down, onloads up.
MOVES = (
    ("device", "host"),
    ("device", "disk"),
    ("host", "disk"),
    ("host", "device"),
    ("disk", "device"),
)
MOVE_RESULTS = ("ok", "refused", "failed")
# The cache's gates; "queue" (a full --max-waiting queue) is the engine's own.
CACHE_GATES = ("ram", "host_budget", "disk_budget", "device")


def _histogram(name: str, doc: str, h: Mapping[str, Any]) -> HistogramMetricFamily:
    """The engine's histogram (per-bucket counts, the last above every bound) as Prometheus'
    cumulative buckets."""
    buckets = []
    total = 0
    for bound, count in zip(h["bounds"], h["counts"], strict=False):
        total += count
        buckets.append((repr(float(bound)), total))
    buckets.append(("+Inf", h["count"]))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])


class EngineCollector(Collector):
    """Reads one ``stats()`` snapshot per scrape. `source` returns (stats, info), or None while the
    model loads (then only ``strata:engine_up 0`` is exposed)."""

    def __init__(
        self, source: Callable[[], tuple[Mapping[str, Any], Mapping[str, Any]] | None]
    ) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        got = self._source()
        up = GaugeMetricFamily(
            "strata:engine_up", "1 while the engine loop serves, else 0 (loading or stopped)"
        )
        if got is None:
            up.add_metric([], 0)
            yield up
            return
        s, _info = got
        up.add_metric([], 1 if s["stopped"] is None else 0)
        yield up

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge(
            "strata:num_requests_running", "Sequences admitted (prefill or decode)", s["running"]
        )
        yield gauge("strata:num_requests_waiting", "Sequences waiting for admission", s["waiting"])
        yield gauge(
            "strata:kv_cache_usage_perc",
            "Fraction of K/V blocks held by sequences (0-1)",
            s["kv_usage"],
        )
        yield gauge("strata:kv_blocks_total", "K/V blocks in the device pool", s["kv_blocks_total"])
        yield gauge("strata:kv_blocks_used", "K/V blocks held by sequences", s["kv_blocks_used"])
        yield gauge(
            "strata:kv_blocks_cached",
            "K/V blocks indexed in the prefix cache (held or evictable)",
            s["kv_blocks_cached"],
        )
        memory = GaugeMetricFamily(
            "strata:memory_in_use_bytes",
            "Bytes of device memory in use, by device and purpose (weights, kv, workspace, "
            "graphs, staging)",
            labels=["device", "purpose"],
        )
        for device, pool in s["memory"].items():
            for purpose, n in pool["in_use_bytes"].items():
                memory.add_metric([device, purpose], n)
        yield memory
        graphs = s["graphs"]
        yield gauge("strata:graph_cache_graphs", "Captured decode graphs cached", graphs["graphs"])
        yield gauge(
            "strata:graph_cache_bytes",
            "Device bytes the cached decode graphs hold",
            graphs["bytes"],
        )
        yield counter(
            "strata:graph_captures",
            "Decode graphs captured (kept or too large)",
            graphs["captures"],
        )
        yield counter(
            "strata:graph_oom_fallbacks",
            "Decode steps run uncaptured because capturing their graph ran out of device memory",
            graphs["oom_fallbacks"],
        )
        yield counter(
            "strata:graph_capture_failures",
            "Graph captures that failed for another reason (that batch size then runs uncaptured)",
            graphs["capture_failures"],
        )
        yield gauge(
            "strata:copy_streams",
            "Copy streams the GPUs' cache moves have created (one per GPU, on its first move)",
            s["copy_streams"],
        )
        cache = s["cache"]
        tiers = cache["tiers"]
        cache_bytes = GaugeMetricFamily(
            "strata:cache_bytes", "Bytes of cached K/V per tier", labels=["tier"]
        )
        cache_blocks = GaugeMetricFamily(
            "strata:cache_blocks", "Cached K/V blocks per tier", labels=["tier"]
        )
        for tier in TIERS:
            cache_bytes.add_metric([tier], tiers[tier]["bytes"])
            cache_blocks.add_metric([tier], tiers[tier]["blocks"])
        yield cache_bytes
        yield cache_blocks
        yield counter(
            "strata:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            s["prefix_query_tokens"],
        )
        hits = CounterMetricFamily(
            "strata:prefix_cache_hits",
            "Prompt tokens whose K/V came from the cache, per tier",
            labels=["tier"],
        )
        for tier in TIERS:
            hits.add_metric([tier], cache["hit_tokens"][tier])
        yield hits
        # Every move the cache makes is listed from the first scrape on (at 0), so that a rate()
        # over it never starts from a missing series.
        blocks_moved = {(a, b, r): 0 for a, b in MOVES for r in MOVE_RESULTS}
        bytes_moved = dict.fromkeys(MOVES, 0)
        for m in cache["moves"]:
            key = (m["from"], m["to"], m["result"])
            blocks_moved[key] = blocks_moved.get(key, 0) + m["blocks"]
            if m["result"] == "ok":
                route = key[:2]
                bytes_moved[route] = bytes_moved.get(route, 0) + m["bytes"]
        moves = CounterMetricFamily(
            "strata:cache_moves",
            "K/V blocks moved between cache tiers, by source, destination and result",
            labels=["from", "to", "result"],
        )
        for key, n in blocks_moved.items():
            moves.add_metric(list(key), n)
        yield moves
        move_bytes = CounterMetricFamily(
            "strata:cache_move_bytes",
            "Bytes of K/V moved between cache tiers (successful moves)",
            labels=["from", "to"],
        )
        for route, n in bytes_moved.items():
            move_bytes.add_metric(list(route), n)
        yield move_bytes
        yield counter(
            "strata:cache_corrupt_files",
            "Disk tier files found bad (at the startup scan or on a read) and deleted",
            cache["corrupt_files"],
        )
        injected = CounterMetricFamily(
            "strata:cache_faults_injected",
            "Faults injected by --cache-faults, per kind (each is also a failed or refused move)",
            labels=["kind"],
        )
        for kind, n in cache["faults_injected"].items():
            injected.add_metric([kind], n)
        yield injected
        yield counter(
            "strata:prompt_tokens", "Prompt tokens of admitted requests", s["prompt_tokens"]
        )
        yield counter("strata:generation_tokens", "Generated tokens", s["generated_tokens"])
        yield counter(
            "strata:requests_finished",
            "Requests that ended (stop or length)",
            s["requests_finished"],
        )
        yield counter(
            "strata:requests_cancelled",
            "Requests cancelled (client gone, stream dropped)",
            s["requests_cancelled"],
        )
        refusals = CounterMetricFamily(
            "strata:admission_refusals",
            "Refusals per gate: requests (queue) and cache moves (ram, host_budget, disk_budget, "
            "device)",
            labels=["gate"],
        )
        refusals.add_metric(["queue"], s["requests_refused"])
        cache_refusals = dict.fromkeys(CACHE_GATES, 0) | dict(cache["refusals"])
        for gate, n in cache_refusals.items():
            refusals.add_metric([gate], n)
        yield refusals
        device_refusals = CounterMetricFamily(
            "strata:device_refusals",
            "Cache moves refused by one device's memory pool (its part of the staging buffer), "
            'by device; each is also counted under admission_refusals{gate="device"}',
            labels=["device"],
        )
        by_device = dict.fromkeys(s["memory"], 0) | dict(cache.get("device_refusals", {}))
        for device, n in by_device.items():
            device_refusals.add_metric([device], n)
        yield device_refusals
        yield counter(
            "strata:num_preemptions", "Sequences preempted under K/V pressure", s["preemptions"]
        )
        yield counter(
            "strata:spec_decode_draft_tokens",
            "Draft tokens proposed by speculative decoding",
            s["spec_draft_tokens"],
        )
        yield counter(
            "strata:spec_decode_accepted_tokens",
            "Draft tokens accepted by speculative decoding",
            s["spec_accepted_tokens"],
        )
        yield _histogram(
            "strata:spec_decode_accepted_per_step",
            "Drafts accepted in one verification (one per drafting sequence and step)",
            s["spec_accepted_per_step"],
        )
        yield counter("strata:engine_steps", "Engine steps run", s["steps"])
        yield _histogram(
            "strata:engine_step_seconds", "Duration of one engine step", s["step_seconds"]
        )
        yield _histogram(
            "strata:engine_time_to_first_token_seconds",
            "From the request's arrival at the engine to its first token",
            s["ttft_seconds"],
        )


class ServerMetrics:
    """The app's registry: the engine collector and the server's own measurements."""

    def __init__(
        self, source: Callable[[], tuple[Mapping[str, Any], Mapping[str, Any]] | None]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(source))
        self.ttft = Histogram(
            "strata:time_to_first_token_seconds",
            "From the HTTP request's arrival to its first token sent",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "strata:inter_token_latency_seconds",
            "Time between tokens sent to a streaming client",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "strata:e2e_request_latency_seconds",
            "From the HTTP request's arrival to its last token",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.http_requests = Counter(
            "strata:http_requests",
            "HTTP requests answered, by endpoint and status",
            labelnames=["endpoint", "status"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
