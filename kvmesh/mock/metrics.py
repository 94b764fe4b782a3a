"""The mock engine's Prometheus metrics, named like vLLM's so dashboards and scrapers carry over.

Each engine owns a registry (several mocks can share a process in tests). Gauges are read at
scrape time from the engine's state, so the step loop pays nothing for them; counters are bumped
once per step with that step's totals.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class EngineMetrics:
    def __init__(
        self,
        model: str,
        *,
        cache_config: dict[str, str],
        num_running: Callable[[], float],
        num_waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        num_retained: Callable[[], float],
        modelled_seconds: Callable[[], float],
        busy_seconds: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            g = Gauge(name, doc, labels, registry=r)
            g.labels(model).set_function(fn)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", num_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage)
        gauge("kvmesh_mock_retained_blocks", "KV blocks held by pins and open sessions.", num_retained)
        # Their ratio is the simulation's fidelity: above 1, Python overhead stretches the steps.
        gauge(
            "kvmesh_mock_modelled_step_seconds",
            "Sum of the step times the timing model asked for.",
            modelled_seconds,
        )
        gauge("kvmesh_mock_busy_step_seconds", "Sum of the wall time the steps really took.", busy_seconds)
        # vLLM's info gauge of its cache config (set to 1, the facts in its labels, one series per
        # engine core): a router without /kvmesh/info reads the block size and count from it
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*cache_config, "engine"],
            registry=r,
        )
        info.labels(**cache_config, engine="0").set(1)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model)  # type: ignore[no-any-return]

        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.steps = counter("kvmesh_mock_steps", "Engine steps executed.")
        self._success = Counter(
            "vllm:request_success", "Count of finished requests.", [*labels, "finished_reason"], registry=r
        )
        self._model = model
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time from a request's arrival to the first step that schedules it, in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency, in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)

    def finished(self, reason: str) -> None:
        self._success.labels(self._model, reason).inc()
