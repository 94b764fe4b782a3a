"""Prometheus metrics, named like the reference router's with a ``kvmesh_`` prefix.

Everything registers once per process in prometheus-client's default ``REGISTRY``: that is the
registry vLLM's (and most engines') ``/metrics`` exposes, so an embedded middleware's metrics
appear there with no extra wiring, and the standalone router serves the same registry. Several
middleware instances in one process (tests, an in-process demo fleet) share the metric objects;
per-worker gauges are read at scrape time from every live router through one collector, with a
``replica`` label telling the instances apart.

Beyond the reference router: ``kvmesh_cached_tokens_predicted_total`` /
``kvmesh_cached_tokens_reported_total`` and the gauge ``kvmesh_cached_tokens_reported_ratio``
(reported / predicted, per worker). With a tokenizer or hash mismatch the router predicts hits
the engine never reports, and the ratio drops far below 1 instead of failing silently.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector, CollectorRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Observed over predicted: 1 is right, and an under-prediction (above 1) counts as much as an over.
_PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
PIN_OUTCOMES = ("pinned", "partial", "failed")
"""The ``outcome`` label of ``kvmesh_cache_control_pins_total``."""
EVENT_FAULTS = ("gap", "replayed", "malformed", "duplicate", "reset", "stale")
"""The ``fault`` label of ``kvmesh_kv_event_faults_total``."""
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
# Routing overhead per phase: tens of microseconds is normal, milliseconds is a problem.
_OVERHEAD_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
OVERHEAD_PHASES = ("tokenize", "hashing", "find_matches", "scheduling", "total", "forward", "relay_first")
"""The ``phase`` labels of ``kvmesh_router_overhead_seconds``, in the order a request meets them."""
_HIT_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

LIVE_MARKER = b"# TYPE kvmesh_queue_pending_requests gauge"
"""A line of every whole exposition that holds the live gauges. (A ``name[]`` filter never keeps
them: prometheus-client filters by the names a collector declares, and this one declares none.)"""

WorkerRow = tuple[str, int, float, float]
"""(worker id, dp rank, active decode blocks, active prefill tokens)"""


@dataclass(frozen=True, slots=True)
class GaugeSource:
    """What one router instance reports at scrape time."""

    replica: str
    workers: Callable[[], Iterable[WorkerRow]]
    queue: Callable[[], tuple[int, int]]  # (pending requests, pending tokens)
    cached_ratio: Callable[[], Iterable[tuple[str, float]]]
    event_plane: Callable[[], tuple[str, float]] = lambda: ("zmq", 1.0)
    """(plane kind, 1 if connected else 0): 0 means routing on the last known state."""
    engine_load: Callable[[], Iterable[tuple[str, float, float]]] = lambda: ()
    """(worker, running, waiting) as the engines' own /metrics report them."""
    sync: Callable[[], tuple[dict[str, int], int] | None] = lambda: None
    """Replica sync's counts by kind and the peers heard now; None without replica sync."""
    running: Callable[[], bool] = lambda: True
    """Whether the router serves now (a stopped one not yet collected reports only if no running
    one has its replica name)."""
    holder_searches: Callable[[], Iterable[tuple[str, str, int]]] = lambda: ()
    """(kind, outcome, count) of the searches for the engine holding a response or a session."""


class _LiveRouters(Collector):
    """Reads per-worker and queue gauges from every live router instance when scraped."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, owner: Any, source: GaugeSource) -> None:
        owner._kvmesh_gauge_source = source
        with self._lock:
            self._sources.add(owner)

    def collect(self) -> Iterator[Metric]:
        decode = GaugeMetricFamily(
            "kvmesh_worker_active_decode_blocks",
            "KV blocks held by requests the router has in flight on the worker",
            labels=["replica", "worker", "dp_rank"],
        )
        prefill = GaugeMetricFamily(
            "kvmesh_worker_active_prefill_tokens",
            "Prompt tokens not yet prefilled on the worker, as the router counts them",
            labels=["replica", "worker", "dp_rank"],
        )
        pending = GaugeMetricFamily(
            "kvmesh_queue_pending_requests", "Requests held in the admission queue", labels=["replica"]
        )
        pending_tokens = GaugeMetricFamily(
            "kvmesh_queue_pending_tokens", "Prompt tokens of requests in the queue", labels=["replica"]
        )
        ratio = GaugeMetricFamily(
            "kvmesh_cached_tokens_reported_ratio",
            "Engine-reported cached tokens / router-predicted cached tokens (far below 1: tokenizer or hash mismatch)",
            labels=["replica", "worker"],
        )
        plane = GaugeMetricFamily(
            "kvmesh_event_plane_connected",
            "1 while the router reaches its event plane (always 1 for zmq); 0: routing on the last known state",
            labels=["replica", "plane"],
        )
        engine = GaugeMetricFamily(
            "kvmesh_worker_engine_requests",
            "Requests the worker's engine reports in its own /metrics (state: running | waiting), "
            "beside the router's estimate",
            labels=["replica", "worker", "state"],
        )
        sync_counts = CounterMetricFamily(
            "kvmesh_replica_sync_messages",
            "Replica sync's counts by kind, as sync.stats in GET /kvmesh/router: messages published, "
            "send_dropped, received, malformed, unauthenticated (no valid seal), duplicates, lost; "
            "peer requests counted, unknown_worker, reconciled; peers_expired",
            labels=["replica", "kind"],
        )
        sync_peers = GaugeMetricFamily(
            "kvmesh_replica_sync_peers", "Router replicas heard on replica sync now", labels=["replica"]
        )
        searches = CounterMetricFamily(
            "kvmesh_holder_searches",
            "Requests naming a stored response or an SGLang session this router was not told of, by "
            "kind and outcome: searched (every worker asked), found (a holder among those), joined "
            "(waited for a search running for the same id), remembered (a recent miss, nobody asked)",
            labels=["replica", "kind", "outcome"],
        )
        with self._lock:
            owners = list(self._sources)
        sources: list[GaugeSource] = [owner._kvmesh_gauge_source for owner in owners]
        seen: set[str] = set()
        # (one series per replica name: two with the same labels make an exposition OpenMetrics
        # refuses. Two routers of one process share a name only when given one self id, as a
        # router stopped and not yet collected shares it with the one that replaced it: the
        # running one is reported.)
        for source in sorted(sources, key=lambda s: not s.running()):
            if source.replica in seen:
                continue
            seen.add(source.replica)
            for worker, rank, blocks, tokens in source.workers():
                decode.add_metric([source.replica, worker, str(rank)], blocks)
                prefill.add_metric([source.replica, worker, str(rank)], tokens)
            n, tokens_pending = source.queue()
            pending.add_metric([source.replica], n)
            pending_tokens.add_metric([source.replica], tokens_pending)
            for worker, value in source.cached_ratio():
                ratio.add_metric([source.replica, worker], value)
            kind, up = source.event_plane()
            plane.add_metric([source.replica, kind], up)
            for worker, running, waiting in source.engine_load():
                engine.add_metric([source.replica, worker, "running"], running)
                engine.add_metric([source.replica, worker, "waiting"], waiting)
            sync = source.sync()
            if sync is not None:
                counts, peers = sync
                for kind, n in counts.items():
                    sync_counts.add_metric([source.replica, kind], n)
                sync_peers.add_metric([source.replica], peers)
            for kind, outcome, n in source.holder_searches():
                searches.add_metric([source.replica, kind, outcome], n)
        yield from (
            decode,
            prefill,
            pending,
            pending_tokens,
            ratio,
            plane,
            engine,
            sync_counts,
            sync_peers,
            searches,
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())


class Metrics:
    """The process-wide metric objects; get them with :func:`get_metrics`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "kvmesh_requests_total",
            "Requests seen by the router, by endpoint, how they were served and the HTTP status",
            ["endpoint", "route", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "kvmesh_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "kvmesh_inter_token_latency_seconds",
            "Time between streamed chunks",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.isl = Histogram(
            "kvmesh_input_sequence_tokens",
            "Prompt length in tokens",
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.osl = Histogram(
            "kvmesh_output_sequence_tokens",
            "Output tokens per request (usage when the engine reports it, else the streamed text tokenized)",
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.kv_hit_rate = Histogram(
            "kvmesh_kv_hit_rate",
            "Predicted fraction of the prompt's blocks already cached on the chosen worker",
            buckets=_HIT_RATE_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            "kvmesh_router_overhead_seconds",
            "Routing overhead per phase (tokenize, hashing, find_matches, scheduling, total: arrival to "
            "decision; forward: decision to the request written; relay_first: the first token's "
            "bytes from the worker to the client)",
            ["phase"],
            buckets=_OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.events_applied = Counter(
            "kvmesh_kv_events_applied_total",
            "KV events applied to the index, by event type and status",
            ["event_type", "status"],
            registry=registry,
        )
        self.predicted_cached = Counter(
            "kvmesh_cached_tokens_predicted_total",
            "Prompt tokens the router predicted cached on the chosen worker",
            ["worker"],
            registry=registry,
        )
        self.reported_cached = Counter(
            "kvmesh_cached_tokens_reported_total",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            ["worker"],
            registry=registry,
        )
        self.ttft_predicted = Histogram(
            "kvmesh_ttft_predicted_seconds",
            "Time to first token the latency cost predicted for the chosen worker at dispatch",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft_observed = Histogram(
            "kvmesh_ttft_observed_seconds",
            "Time from dispatch to first token, for the requests in kvmesh_ttft_predicted_seconds",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft_prediction_ratio = Histogram(
            "kvmesh_ttft_prediction_ratio",
            "Observed over predicted time to first token per request (1 = the model is right)",
            ["worker"],
            buckets=_PREDICTION_RATIO_BUCKETS,
            registry=registry,
        )
        self.failovers = Counter(
            "kvmesh_failovers_total",
            "Forwarded requests retried on another worker after a connection failure before the first byte",
            registry=registry,
        )
        self.disagg_stages = Counter(
            "kvmesh_disagg_stage_total",
            "Disaggregated requests by stage (prefill, decode) and outcome (ok, failed, fallback)",
            ["stage", "outcome"],
            registry=registry,
        )
        self.disagg_prefill_seconds = Histogram(
            "kvmesh_disagg_prefill_seconds",
            "Time of the prefill stage, from dispatch to the prefill worker's answer (vLLM-style hand-off)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.pins = Counter(
            "kvmesh_cache_control_pins_total",
            "cache_control pins sent after a response, by worker and outcome "
            "(pinned: every full block; partial: fewer, e.g. evicted or over budget; failed: refused)",
            ["worker", "outcome"],
            registry=registry,
        )
        self.pinned_blocks = Counter(
            "kvmesh_cache_control_pinned_blocks_total",
            "KV blocks workers reported pinned for cache_control",
            ["worker"],
            registry=registry,
        )
        self.speculative_prefills = Counter(
            "kvmesh_speculative_prefills_total",
            "Next-turn warm-ups sent for agent_hints.speculative_prefill, by outcome "
            "(done, cancelled: the next turn came first, failed)",
            ["outcome"],
            registry=registry,
        )
        self.prefix_copies = Counter(
            "kvmesh_prefix_copies_total",
            "Copies of a hot shared prefix the router made by a one-token prefill of the prefix "
            "alone (--router-background-copies), by outcome (done, failed, cancelled)",
            ["outcome"],
            registry=registry,
        )
        self.relayed_chunk_paths = Counter(
            "kvmesh_relayed_chunks_total",
            "Body chunks of forwarded streamed answers after their first token, by path: direct "
            "(written to the client from the worker connection's callback) or send (the ASGI send)",
            ["path"],
            registry=registry,
        )
        self.refusals_rerouted = Counter(
            "kvmesh_refusals_rerouted_total",
            "Forwarded requests a worker refused for now (a 503, or a stream that opens with a 503 "
            "error: a paused engine's answer) and the router sent to another worker",
            registry=registry,
        )
        self.not_resent = Counter(
            "kvmesh_requests_not_resent_total",
            "Forwarded requests a live worker dropped after receiving them, answered 502 rather than "
            "sent twice",
            registry=registry,
        )
        self.event_faults = Counter(
            "kvmesh_kv_event_faults_total",
            "KV-event stream faults per worker: gap (sequence skipped), replayed (batches recovered "
            "by replay), malformed (undecodable message), duplicate (skipped), reset (index re-synced from kv_state), "
            "stale (event path silent while HTTP answered)",
            ["worker", "fault"],
            registry=registry,
        )
        self.worker_state_changes = Counter(
            "kvmesh_worker_state_changes_total", "Worker health transitions", ["state"], registry=registry
        )
        self._live = _LiveRouters()
        registry.register(self._live)
        # label children resolved once: the hot path should not re-hash label tuples.
        self.phase = {name: self.overhead.labels(name) for name in OVERHEAD_PHASES}
        self.relayed_chunks = {path: self.relayed_chunk_paths.labels(path) for path in ("direct", "send")}

    def observe_routing(self, route_seconds: float, find_matches: float | None, total: float) -> None:
        """One ``KvRouter.route()`` call of ``route_seconds``: its prefix lookups (``find_matches``,
        None when it did none) and the rest of it (``scheduling``: load model, costs, selection),
        plus the request's whole routing overhead since arrival (``total``)."""
        phase = self.phase
        if find_matches is not None:
            phase["find_matches"].observe(find_matches)
            route_seconds -= find_matches
        phase["scheduling"].observe(max(route_seconds, 0.0))
        phase["total"].observe(total)

    def forget_worker(self, worker_id: str) -> None:
        """Drop the series labelled with a worker that left the fleet (removed by the admin API,
        or gone from the NATS worker bucket). Kept, they were exported for ever: up to 73 lines a
        worker, so a fleet whose engines come and go under new ids (pods) grew every router's
        ``/metrics`` and memory without bound. A worker that comes back counts from zero, which
        Prometheus reads as a counter reset. (The metrics are the process's: a second router in
        the same process that still follows the worker has its series for it reset too.)"""
        by_worker = (
            self.predicted_cached,
            self.reported_cached,
            self.ttft_predicted,
            self.ttft_observed,
            self.ttft_prediction_ratio,
            self.pinned_blocks,
        )
        series: list[tuple[Any, tuple[str, ...]]] = [(m, (worker_id,)) for m in by_worker]
        series += [(self.pins, (worker_id, outcome)) for outcome in PIN_OUTCOMES]
        series += [(self.event_faults, (worker_id, fault)) for fault in EVENT_FAULTS]
        for metric, labels in series:
            with contextlib.suppress(KeyError):  # (never observed for this worker)
                metric.remove(*labels)

    def track(self, owner: Any, source: GaugeSource) -> None:
        """Report ``source``'s gauges while ``owner`` is alive."""
        self._live.add(owner, source)

    def render_live(self, names: Iterable[str] = (), *, openmetrics: bool = False) -> bytes:
        """The gauges read from live routers, alone (those in ``names`` when any are given), in the
        text format or OpenMetrics: what an engine's multiprocess ``/metrics`` cannot read."""
        wanted = set(names)
        families = [
            f for f in self._live.collect() if not wanted or f.name in wanted or f.name + "_total" in wanted
        ]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected(families))
        if openmetrics:
            return generate_openmetrics(registry)  # type: ignore[no-untyped-call,no-any-return]
        return generate_latest(registry)


class _Collected(Collector):
    """Metric families already collected, for an exposition writer to read."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)

    def describe(self) -> Iterator[Metric]:
        return iter(())


_lock = threading.Lock()
_instances: dict[int, Metrics] = {}


def get_metrics(registry: CollectorRegistry | None = None) -> Metrics:
    """The metrics for ``registry`` (default: prometheus-client's global one), created once."""
    reg = REGISTRY if registry is None else registry
    with _lock:
        metrics = _instances.get(id(reg))
        if metrics is None:
            metrics = _instances[id(reg)] = Metrics(reg)
        return metrics


def render(registry: CollectorRegistry | None = None) -> bytes:
    """The text exposition of ``registry`` (what ``/metrics`` serves)."""
    return generate_latest(REGISTRY if registry is None else registry)
