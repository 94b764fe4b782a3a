"""A vLLM 0.33.0 server without kvmesh's plugin behind the standalone router, told only its URL
(engine tier; kvmesh/router/mesh/engine_discovery.py).

What is vLLM's own here: the ``/kv_event_sources`` route (its instrumentator router, answering
from ``engine_client.get_kv_event_sources()``), the publisher config that route serves (from a
real ``ZmqEventPublisher`` bound to every interface), the ``vllm:cache_config_info`` gauge (its
Prometheus logger's ``log_metrics_info`` over a real ``CacheConfig``), and the KV events (its
``BlockPool``, published by that publisher). What is not: the model, and the rest of the server.

Run inside the env from ``scripts/engine-env.sh vllm`` (``make test-engines``).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.engine_discovery import described_vllm
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.engines.enginekit import import_engine_module, router_rows, until_indexed, until_up
from tests.engines.test_events_vllm import BLOCK_SIZE, VllmCache, vllm, vllm_publisher  # noqa: F401
from tests.events.eventkit import free_tcp_port
from tests.router.servers import serve

pytestmark = [pytest.mark.engine_vllm, pytest.mark.timeout(180)]


NUM_GPU_BLOCKS = 24


def cache_info_page() -> bytes:
    """vLLM's ``vllm:cache_config_info`` as its Prometheus logger writes it, for a cache config of
    :data:`BLOCK_SIZE`-token blocks after the engine profiled :data:`NUM_GPU_BLOCKS` of them."""
    loggers = import_engine_module("vllm.v1.metrics.loggers")
    cache_config = import_engine_module("vllm.config.cache").CacheConfig(block_size=BLOCK_SIZE)
    cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    registry = CollectorRegistry()
    # (the logger's own method, on just the two attributes it reads; its gauges go to a registry
    # of this test's, not the process's)
    logger = SimpleNamespace(_gauge_cls=functools.partial(Gauge, registry=registry), engine_indexes=[0])
    loggers.PrometheusStatLogger.log_metrics_info(logger, "cache_config", cache_config)
    return generate_latest(registry)


def plain_vllm_app(publisher_config: Any, metrics: bytes) -> Any:
    """vLLM's instrumentator routes (``/kv_event_sources`` among them) on a FastAPI app whose
    engine client reports ``publisher_config`` for DP rank 0 (or a dict of them by rank), plus the
    pages a router reads."""
    sources = publisher_config if isinstance(publisher_config, dict) else {0: publisher_config}
    fastapi = import_engine_module("fastapi")
    responses = import_engine_module("fastapi.responses")
    basic = import_engine_module("vllm.entrypoints.serve.instrumentator.basic")
    app = fastapi.FastAPI()
    app.include_router(basic.router)
    app.state.engine_client = SimpleNamespace(get_kv_event_sources=lambda: sources)

    @app.get("/metrics")
    async def _metrics() -> Any:
        return responses.Response(metrics, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def _models() -> Any:
        return {"object": "list", "data": [{"id": "plain-model", "object": "model", "parent": None}]}

    @app.get("/health")
    async def _health() -> Any:
        return responses.Response(status_code=200)

    return app


def test_vllms_route_and_gauge_give_the_endpoints_block_size_and_count(vllm: SimpleNamespace) -> None:  # noqa: F811
    """What vLLM's ``/kv_event_sources`` serves for a publisher bound to every interface, and the
    gauge its logger writes, read as the worker's facts."""
    from starlette.testclient import TestClient

    config = vllm.config.KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558"
    )
    with TestClient(plain_vllm_app(config, b"")) as client:
        sources = client.get("/kv_event_sources").json()
    facts = described_vllm(sources, cache_info_page(), "http://10.2.3.4:8000")
    assert facts["block_size"] == BLOCK_SIZE and facts["total_kv_blocks"] == NUM_GPU_BLOCKS
    assert facts["kv_events_endpoints"] == ["tcp://10.2.3.4:5557"]
    assert facts["kv_replay_endpoints"] == ["tcp://10.2.3.4:5558"]


async def test_a_plain_vllm_told_by_url_is_followed_through_its_own_publisher(
    vllm: SimpleNamespace,  # noqa: F811
) -> None:
    """The router reads the publisher from vLLM's route (bound to every interface, dialled at the
    worker's host) and the block size from its gauge, and indexes what vLLM's BlockPool cached,
    block for block, through vLLM's publisher (replay covering what went out before it joined)."""
    pub, replay = free_tcp_port(), free_tcp_port()
    with vllm_publisher(vllm, f"tcp://*:{pub}", f"tcp://*:{replay}") as publisher:
        config = publisher.get_publisher_config()
        assert config.endpoint == f"tcp://*:{pub}"  # (what the route serves: the bind, not a host)
        cache = VllmCache(vllm)
        sent = 0

        def publish(count: int) -> None:
            nonlocal sent
            while count:
                events = cache.step()
                if events:
                    batch = vllm.kv_events.KVEventBatch(ts=1.8e9 + sent, events=events, data_parallel_rank=0)
                    publisher.publish(batch)
                    sent += 1
                    count -= 1

        publish(40)  # (before any router listens: these come back through vLLM's replay socket)
        async with serve(plain_vllm_app(config, cache_info_page())) as engine:
            settings = MeshSettings(workers=(WorkerSpec(engine.url, "plain"),), health_interval=0.1)
            async with serve(build_router_app(settings)) as front:
                await until_up(front.url, engine.url)
                row = (await router_rows(front.url))[engine.url]
                assert (row["backend"], row["block_size"], row["model"]) == (
                    "vllm",
                    BLOCK_SIZE,
                    "plain-model",
                )
                assert row["kv_events_endpoints"] == [f"tcp://127.0.0.1:{pub}"], row
                assert row["described_by"] == "/kv_event_sources", row
                publish(160)
                expected = len(cache.pool.cached_block_hash_to_block)
                row = await until_indexed(front.url, engine.url, expected)
                assert row["indexed_blocks"] == expected > 0, row


async def test_two_dp_ranks_on_ports_the_os_chose_are_each_followed(vllm: SimpleNamespace) -> None:  # noqa: F811
    """vLLM started with ``tcp://*:0`` for its two DP ranks: each engine core binds the node's IP
    on a free port and reports it, and the router follows each rank on its own: what rank 1's
    BlockPool cached is indexed as rank 1's."""
    config = vllm.config.KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
    )
    publishers = [vllm.kv_events.EventPublisherFactory.create(config, data_parallel_rank=r) for r in (0, 1)]
    try:
        configs = {r: p.get_publisher_config() for r, p in enumerate(publishers)}
        assert all(not c.endpoint.endswith(":0") for c in configs.values())  # (resolved by vLLM)
        cache, sent = VllmCache(vllm, seed=3), 0
        async with serve(plain_vllm_app(configs, cache_info_page())) as engine:
            settings = MeshSettings(workers=(WorkerSpec(engine.url, "plain"),), health_interval=0.1)
            async with serve(build_router_app(settings)) as front:
                await until_up(front.url, engine.url)
                row = (await router_rows(front.url))[engine.url]
                assert row["dp_size"] == 2, row
                assert row["kv_events_endpoints"] == [configs[0].endpoint, configs[1].endpoint], row
                while sent < 120:
                    events = cache.step()
                    if events:
                        batch = vllm.kv_events.KVEventBatch(
                            ts=1.8e9 + sent, events=events, data_parallel_rank=1
                        )
                        publishers[1].publish(batch)
                        sent += 1
                expected = len(cache.pool.cached_block_hash_to_block)
                row = await until_indexed(front.url, engine.url, expected)
                by_rank = {r["dp_rank"]: r["indexed_blocks"] for r in row["ranks"]}
                assert by_rank == {0: 0, 1: expected} and expected > 0, row
    finally:
        for publisher in publishers:
            publisher.shutdown()
