"""Prometheus exposition: a collector that reads ``engine.stats()`` at scrape time, plus the
server's own histograms (time to first token and inter-token latency as the HTTP client sees them,
end-to-end latency) and a request counter.

The engine's families are not written here: ``strata_rs._core.stats_metrics()`` is their table
(``rust/engine/stats/metrics.rs``, next to the stats schema it reads: name, type, help text,
labels and the key paths of their samples in the ``stats()`` dict), which the collector walks
over one snapshot per scrape. Only ``strata:engine_up`` is the collector's own: it says whether
there is an engine to read at all. Every registry is per app, so two apps in one process never
share counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from strata_rs._core import stats_metrics

if TYPE_CHECKING:
    from strata_rs._core import MetricSpec

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

# Read once: the table is fixed for the extension's build.
SPECS: list[MetricSpec] = stats_metrics()


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


def _get(node: Any, path: str) -> Any:
    for key in path.split("."):
        node = node[key]
    return node


def _samples(
    node: Any, path: list[str], labels: dict[str, str], free: list[str]
) -> Iterator[tuple[dict[str, str], float]]:
    """The numbers at `path` below `node`, with their labels (the path syntax of
    rust/engine/stats/metrics.rs): `*` gives each key of a dict to the next of the `free` labels,
    `[]` / `[field=value]` each record of a list, which gives all of them by field."""
    if not path:
        yield labels, node
        return
    key, rest = path[0], path[1:]
    if key == "*":
        for k, child in node.items():
            yield from _samples(child, rest, {**labels, free[0]: k}, free[1:])
    elif key.startswith("["):
        field, _, want = key[1:-1].partition("=")
        for record in node:
            if not field or record[field] == want:
                yield from _samples(record, rest, labels | {n: record[n] for n in free}, [])
    else:
        yield from _samples(node[key], rest, labels, free)


def _family(spec: MetricSpec, s: Mapping[str, Any]) -> Metric:
    """One family of the table, read from one `stats()` snapshot."""
    if spec["type"] == "histogram":
        return _histogram(spec["name"], spec["help"], _get(s, spec["sources"][0]["path"]))
    names = spec["labels"]
    values: dict[tuple[str, ...], float] = {tuple(z): 0 for z in spec["zeros"]}
    if spec["zeros_from"] is not None:
        values |= {(k,): 0 for k in _get(s, spec["zeros_from"])}
    for source in spec["sources"]:
        fixed = dict(source["labels"])
        free = [n for n in names if n not in fixed]
        for labels, n in _samples(s, source["path"].split("."), fixed, free):
            key = tuple(labels[name] for name in names)
            values[key] = values.get(key, 0) + n
    kind = GaugeMetricFamily if spec["type"] == "gauge" else CounterMetricFamily
    family = kind(spec["name"], spec["help"], labels=names)
    for key, n in values.items():
        family.add_metric(list(key), n)
    return family


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
        for spec in SPECS:
            yield _family(spec, s)


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
