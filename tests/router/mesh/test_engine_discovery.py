"""A plain engine (no kvmesh plugin, so no ``/kvmesh/info``) behind a router given only its URL
(kvmesh.router.mesh.engine_discovery): a vLLM's KV-event publisher is read from its
``/kv_event_sources`` and its block size and count from ``/metrics``; an SGLang's from the
``kv_events`` description of its ``/server_info``. Before, such a worker was ``down`` with "no
/kvmesh/info; describe it in the config" until every fact was written by hand.

The engines over HTTP are ``kvmesh mock --no-worker-rpc``, which serves vLLM's routes as vLLM 0.33
does; the engine tier holds the reading to vLLM's and SGLang's own routes, metrics and publishers
(tests/engines/test_vllm_discovery.py, test_sglang_discovery.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.mock.testing import RunningMock, run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.engine_discovery import NotDiscovered, cache_config, described_sglang, described_vllm
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.fuzz.strategies import ANY_JSON
from tests.router.mesh.test_registry import _until_state, _workers
from tests.router.servers import serve

BS = 16
_SGLANG_COUNTS = ("block_size", "dp_size", "endpoint_port_base", "replay_endpoint_port_base")
PROMPT = "The pump's maintenance manual, section by section, with every torque value listed. " * 12

METRICS = (
    b"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    b"# TYPE vllm:cache_config_info gauge\n"
    b'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
    b'engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0\n'
    b'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
)


def source(endpoint: str, replay: str | None = None, publisher: str = "zmq") -> dict[str, Any]:
    return {
        "enable_kv_cache_events": True,
        "publisher": publisher,
        "endpoint": endpoint,
        "replay_endpoint": replay,
    }


# --------------------------------------------------------------------------- reading the answers
def test_two_ranks_bound_to_every_interface_are_dialled_at_the_workers_host() -> None:
    sources = {"1": source("tcp://*:5558", "tcp://*:5560"), "0": source("tcp://*:5557", "tcp://*:5559")}
    models = {"data": [{"id": "sql-lora", "parent": "llama"}, {"id": "llama", "parent": None}]}
    facts = described_vllm(sources, METRICS, "http://10.0.0.7:8000", models)
    assert facts == {
        "backend": "vllm",
        "dp_size": 2,
        "kv_events_endpoints": ["tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"],
        "kv_replay_endpoints": ["tcp://10.0.0.7:5559", "tcp://10.0.0.7:5560"],
        "block_size": 16,
        "total_kv_blocks": 27000,
        "model": "llama",
    }


def test_an_endpoint_naming_a_host_is_kept_and_an_ipv6_worker_is_bracketed() -> None:
    sources = {"0": source("tcp://0.0.0.0:5557"), "1": source("tcp://10.1.1.1:6000")}
    facts = described_vllm(sources, b"", "http://[fd00::7]:8000")
    assert facts["kv_events_endpoints"] == ["tcp://[fd00::7]:5557", "tcp://10.1.1.1:6000"]
    assert facts["kv_replay_endpoints"] == [None, None]
    assert "block_size" not in facts and "model" not in facts  # (no metrics, no models: not guessed)


def test_a_loopback_publisher_of_a_worker_on_another_host_is_named() -> None:
    """Dialled as told, it would be the router's own loopback: the worker would be up, its index
    empty for good. A worker on this host may bind loopback."""
    with pytest.raises(NotDiscovered, match=r"tcp://127\.0\.0\.1:5557, a loopback address"):
        described_vllm({"0": source("tcp://127.0.0.1:5557")}, METRICS, "http://10.0.0.7:8000")
    with pytest.raises(NotDiscovered, match=r"tcp://\[::1\]:5557, a loopback address"):
        described_sglang(sglang_info(endpoint_host="::1"), "http://gpu-2:30000")
    here = described_vllm({"0": source("tcp://127.0.0.1:5557")}, METRICS, "http://localhost:8000")
    assert here["kv_events_endpoints"] == ["tcp://127.0.0.1:5557"]


def test_an_engine_without_kv_events_is_told_how_to_start() -> None:
    with pytest.raises(NotDiscovered, match="--kv-events-config"):
        described_vllm({}, METRICS, "http://h:1")
    with pytest.raises(NotDiscovered, match="--kv-events-config"):  # (the null publisher on each rank)
        described_vllm({"0": source("tcp://*:5557", publisher="null")}, METRICS, "http://h:1")


@pytest.mark.parametrize(
    "sources",
    [[], "x", {"zero": source("tcp://*:1")}, {"0": "tcp://*:1"}, {"0": source("tcp://*:1", replay=5)}],
)
def test_an_answer_vllm_does_not_give_is_named(sources: Any) -> None:
    with pytest.raises(NotDiscovered, match="is not vLLM's answer"):
        described_vllm(sources, METRICS, "http://h:1")


def test_the_cache_config_wants_positive_integers() -> None:
    assert cache_config(METRICS) == {"block_size": 16, "num_gpu_blocks": 27000}
    profiling = b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1.0\n'
    assert cache_config(profiling) == {"block_size": 16}
    assert cache_config(b'vllm:cache_config_info{block_size="0"} 1.0\n') == {}
    assert cache_config(b"vllm:cache_config_info_other 1\nnot prometheus at all\n") == {}


def sglang_info(**events: Any) -> dict[str, Any]:
    """A ``/server_info`` answer of SGLang 0.5.23's shape (its fields that are read)."""
    described = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": ""}
    described.update(block_size=16, dp_size=2, replay_endpoint_port_base=5567)
    return {
        "model_path": "/models/qwen",
        "served_model_name": "qwen",
        "page_size": 16,
        "chunked_prefill_size": 8192,
        "max_prefill_tokens": 16384,
        "enable_priority_scheduling": True,
        "schedule_low_priority_values_first": True,
        "max_total_num_tokens": 320000,
        "kv_events": {**described, **events},
    }


def test_sglangs_description_is_each_rank_on_its_port_at_the_workers_host() -> None:
    assert described_sglang(sglang_info(), "http://10.0.0.8:30000") == {
        "backend": "sglang",
        "block_size": 16,
        "dp_size": 2,
        "kv_events_endpoints": ["tcp://10.0.0.8:5557", "tcp://10.0.0.8:5558"],
        "kv_replay_endpoints": ["tcp://10.0.0.8:5567", "tcp://10.0.0.8:5568"],
        "priority_polarity": "lower_first",
        "total_kv_blocks": 20000,
        "max_num_batched_tokens": 8192,
        "model": "qwen",
    }
    named = described_sglang(
        sglang_info(endpoint_host="fd00::9", replay_endpoint_port_base=None), "http://h:1"
    )
    assert named["kv_events_endpoints"] == ["tcp://[fd00::9]:5557", "tcp://[fd00::9]:5558"]
    assert named["kv_replay_endpoints"] == [None, None]
    wildcard = described_sglang(sglang_info(endpoint_host="::", dp_size=1), "http://[fd00::7]:30000")
    assert wildcard["kv_events_endpoints"] == ["tcp://[fd00::7]:5557"]


def test_sglang_without_kv_events_or_with_a_description_it_does_not_write_is_named() -> None:
    info = sglang_info()
    info["kv_events"] = None
    with pytest.raises(NotDiscovered, match="--kv-events-config"):
        described_sglang(info, "http://h:1")
    for bad in ({"block_size": 0}, {"dp_size": "2"}, {"endpoint_port_base": 65535}, {"publisher": "nats"}):
        with pytest.raises(NotDiscovered, match=r"kv_events|cannot dial"):
            described_sglang(sglang_info(**bad), "http://h:1")
    with pytest.raises(NotDiscovered, match="an object"):
        described_sglang(["not", "sglang"], "http://h:1")


_VLLM_RANK = st.fixed_dictionaries(
    {},
    optional={
        "publisher": st.sampled_from(["zmq", "null", "kvmesh", 3]),
        "endpoint": st.one_of(st.sampled_from(["tcp://*:5557", "tcp://[::]:1", "ipc:///x", ""]), ANY_JSON),
        "replay_endpoint": st.one_of(st.none(), st.just("tcp://*:5558"), ANY_JSON),
    },
)
_SGLANG_EVENTS = st.fixed_dictionaries(
    {},
    optional={
        "publisher": st.sampled_from(["zmq", "nats", None]),
        "endpoint_host": st.one_of(st.sampled_from(["*", "::", "10.0.0.1", "fd00::1", ""]), ANY_JSON),
        **{k: st.one_of(st.integers(-2, 70000), ANY_JSON) for k in _SGLANG_COUNTS},
    },
)


@settings(max_examples=300, deadline=None)
@given(
    sources=st.one_of(ANY_JSON, st.dictionaries(st.sampled_from(["0", "1", "x", "-1"]), _VLLM_RANK)),
    metrics=st.binary(max_size=300) | st.just(METRICS),
    models=ANY_JSON,
)
def test_any_vllm_answer_is_facts_or_a_named_refusal(sources: Any, metrics: bytes, models: Any) -> None:
    """Whatever a worker answers (it is another server's word), the reading is facts or
    NotDiscovered, never a fault of its own; and facts of a dialable kind."""
    try:
        facts = described_vllm(sources, metrics, "http://10.0.0.2:8000", models)
    except NotDiscovered:
        return
    assert facts["dp_size"] == len(facts["kv_events_endpoints"]) == len(facts["kv_replay_endpoints"]) > 0
    assert all(isinstance(e, str) for e in facts["kv_events_endpoints"])


@settings(max_examples=300, deadline=None)
@given(
    info=st.one_of(
        ANY_JSON,
        st.builds(
            lambda e, extra: {**extra, "kv_events": e},
            _SGLANG_EVENTS,
            st.dictionaries(
                st.sampled_from(
                    [
                        "max_total_num_tokens",
                        "chunked_prefill_size",
                        "served_model_name",
                        "enable_priority_scheduling",
                    ]
                ),
                ANY_JSON,
            ),
        ),
    )
)
def test_any_sglang_answer_is_facts_or_a_named_refusal(info: Any) -> None:
    try:
        facts = described_sglang(info, "http://[fd00::2]:30000")
    except NotDiscovered:
        return
    assert facts["dp_size"] == len(facts["kv_events_endpoints"]) > 0
    assert all(e.startswith("tcp://") and ":" in e[6:] for e in facts["kv_events_endpoints"])


# --------------------------------------------------------------------------- a fleet over HTTP
@contextlib.asynccontextmanager
async def plain_fleet(n: int, **mock: Any) -> AsyncIterator[tuple[str, list[RunningMock]]]:
    """``n`` mock engines without kvmesh's RPCs behind a router told nothing but their URLs."""
    async with contextlib.AsyncExitStack() as stack:
        mocks = [
            await stack.enter_async_context(run_mock(block_size=BS, speedup=50.0, worker_rpc=False, **mock))
            for _ in range(n)
        ]
        settings = MeshSettings(
            workers=tuple(WorkerSpec(m.base_url, m.base_url) for m in mocks), health_interval=0.1
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        yield front.url, mocks


async def test_a_plain_vllm_needs_only_its_url(http: aiohttp.ClientSession) -> None:
    """Two engines with no ``/kvmesh/info``: both come up with the block size and events their own
    routes give, and a prompt is routed back to the engine that cached it, which reports the hit."""
    async with plain_fleet(2) as (front, mocks):
        async with http.get(mocks[0].base_url + "/kvmesh/info") as r:
            assert r.status == 404  # (the engine really has none)
        for m in mocks:
            await _until_state(http, front, m.base_url, "up")
        rows = await _workers(http, front)
        for m in mocks:
            row = rows[m.base_url]
            assert (row["backend"], row["block_size"], row["dp_size"]) == ("vllm", BS, 1), row
            assert row["described_by"] == "/kv_event_sources", row
            assert row["model"] == m.config.model
            assert row["kv_events_endpoints"] == [m.engine.events_endpoint], row
        model = mocks[0].config.model
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
        async with http.post(front + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            first = r.headers["x-kvmesh-worker-id"]
        for _ in range(250):  # (until the router has indexed what the engine stored)
            if (await _workers(http, front))[first]["indexed_blocks"] >= len(PROMPT) // 4 // BS:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(
                f"{first}'s KV events never reached the router: {await _workers(http, front)}"
            )
        for _ in range(3):
            async with http.post(front + "/v1/completions", json=body) as r:
                doc = await r.json()
                assert r.headers["x-kvmesh-worker-id"] == first, doc
            assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, doc["usage"]


def describing(mock: RunningMock) -> dict[str, Any]:
    """SGLang's ``/server_info``, its ``kv_events`` naming a mock engine's publisher and replay."""
    events, replay = mock.engine.events_endpoint, mock.engine.replay_endpoint
    assert events is not None and replay is not None
    return sglang_info(
        endpoint_host="127.0.0.1",
        endpoint_port_base=int(events.rpartition(":")[2]),
        replay_endpoint_port_base=int(replay.rpartition(":")[2]),
        block_size=BS,
        dp_size=1,
    )


async def _until_indexed_after_a_prompt(
    http: aiohttp.ClientSession, front: str, worker: str, mock: RunningMock, what: str
) -> None:
    """Send a prompt to ``mock`` itself, then wait until the router's row of ``worker`` indexes
    blocks (what the mock published reached the router)."""
    body = {"model": mock.config.model, "prompt": PROMPT, "max_tokens": 2}
    async with http.post(mock.base_url + "/v1/completions", json=body) as r:
        assert r.status == 200
    for _ in range(250):
        if (await _workers(http, front))[worker]["indexed_blocks"] > 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(what)


async def test_a_plain_sglang_is_read_from_its_server_info(http: aiohttp.ClientSession) -> None:
    """A server with neither ``/kvmesh/info`` nor vLLM's ``/kv_event_sources`` but SGLang's
    ``/server_info``: the router follows the publisher its ``kv_events`` describes (a mock
    engine's, here) and indexes what that engine caches."""
    async with run_mock(block_size=BS, speedup=50.0, worker_rpc=False) as mock:
        info = describing(mock)
        stand_in = Starlette(
            routes=[
                Route("/server_info", lambda _: JSONResponse(info)),
                Route("/health", lambda _: Response(status_code=200)),
            ]
        )
        async with serve(stand_in) as sglang:
            settings = MeshSettings(workers=(WorkerSpec(sglang.url, "sglang"),), health_interval=0.1)
            async with serve(build_router_app(settings)) as front:
                await _until_state(http, front.url, sglang.url, "up")
                row = (await _workers(http, front.url))[sglang.url]
                assert (row["backend"], row["priority_polarity"], row["model"]) == (
                    "sglang",
                    "lower_first",
                    "qwen",
                )
                assert row["kv_events_endpoints"] == [mock.engine.events_endpoint], row
                assert row["described_by"] == "/server_info", row
                await _until_indexed_after_a_prompt(
                    http,
                    front.url,
                    sglang.url,
                    mock,
                    "the events SGLang's description names never reached the router",
                )


async def test_a_plain_vllm_without_kv_events_is_down_saying_how_to_start_it(
    http: aiohttp.ClientSession,
) -> None:
    async with run_mock(block_size=BS, worker_rpc=False, events=False) as mock:
        settings = MeshSettings(workers=(WorkerSpec(mock.base_url, mock.base_url),), health_interval=0.1)
        async with serve(build_router_app(settings)) as front:
            await _until_state(http, front.url, mock.base_url, "down")
            reason = (await _workers(http, front.url))[mock.base_url]["reason"]
            assert "a vLLM without kvmesh's plugin that publishes no KV events" in reason, reason
            assert "--kv-events-config" in reason, reason


async def test_a_server_that_describes_itself_nowhere_is_down_saying_what_to_give(
    http: aiohttp.ClientSession,
) -> None:
    bare = Starlette(routes=[Route("/health", lambda _: Response(status_code=200))])
    async with serve(bare) as server:
        settings = MeshSettings(workers=(WorkerSpec(server.url, server.url),), health_interval=0.1)
        async with serve(build_router_app(settings)) as front:
            await _until_state(http, front.url, server.url, "down")
            reason = (await _workers(http, front.url))[server.url]["reason"]
            assert "describe it in the config" in reason, reason
            assert reason.startswith(
                "no /kvmesh/info, no /kv_event_sources (vLLM's), and SGLang's /server_info answered "
                "HTTP 404; "
            ), reason


async def test_a_configured_fact_wins_over_what_the_engine_tells(http: aiohttp.ClientSession) -> None:
    """The config entry still takes precedence, fact by fact: here the served model's name, while
    the events and the block size still come from the engine."""
    async with run_mock(block_size=BS, worker_rpc=False) as mock:
        spec = WorkerSpec(mock.base_url, mock.base_url, model="configured-name")
        async with serve(build_router_app(MeshSettings(workers=(spec,), health_interval=0.1))) as front:
            await _until_state(http, front.url, mock.base_url, "up")
            row = (await _workers(http, front.url))[mock.base_url]
            assert (row["model"], row["block_size"]) == ("configured-name", BS), row
            assert row["kv_events_endpoints"] == [mock.engine.events_endpoint], row


async def test_each_worker_shows_where_its_facts_came_from(http: aiohttp.ClientSession) -> None:
    """``described_by`` in ``GET /kvmesh/workers``: its own ``/kvmesh/info``, or its config entry
    alone when that describes it in full (the router then asks nothing)."""
    async with run_mock(block_size=BS) as told, run_mock(block_size=BS, worker_rpc=False) as entry:
        described = WorkerSpec(
            entry.base_url,
            entry.base_url,
            block_size=BS,
            kv_events_endpoints=(str(entry.engine.events_endpoint),),
            max_num_batched_tokens=8192,
            total_kv_blocks=1024,
        )
        settings = MeshSettings(
            workers=(WorkerSpec(told.base_url, told.base_url), described), health_interval=0.1
        )
        async with serve(build_router_app(settings)) as front:
            for m in (told, entry):
                await _until_state(http, front.url, m.base_url, "up")
            rows = await _workers(http, front.url)
            assert rows[told.base_url]["described_by"] == "/kvmesh/info"
            assert rows[entry.base_url]["described_by"] == "config"


async def test_an_engine_that_moved_its_events_is_followed_where_it_publishes_now(
    http: aiohttp.ClientSession,
) -> None:
    """An engine restarted between two health checks publishes elsewhere (ports the OS chose, or
    another config) while its URL answers as before. Its description is read again every few
    checks: the worker goes down saying what changed, comes back up on the new endpoints, and what
    the engine caches there is indexed. (Before, it stayed up, followed at the old endpoints.) A
    route that fails for a while changes nothing: the health checks judge the worker."""
    async with (
        run_mock(block_size=BS, speedup=50.0, worker_rpc=False) as old,
        run_mock(block_size=BS, speedup=50.0, worker_rpc=False) as new,
    ):
        answer: dict[str, Any] = {"info": describing(old), "status": 200}
        stand_in = Starlette(
            routes=[
                Route("/server_info", lambda _: JSONResponse(answer["info"], status_code=answer["status"])),
                Route("/health", lambda _: Response(status_code=200)),
            ]
        )
        async with serve(stand_in) as sglang:
            settings = MeshSettings(workers=(WorkerSpec(sglang.url, "sglang"),), health_interval=0.05)
            async with serve(build_router_app(settings)) as front:
                await _until_state(http, front.url, sglang.url, "up")
                assert (await _workers(http, front.url))[sglang.url]["kv_events_endpoints"] == [
                    old.engine.events_endpoint
                ]
                answer["status"] = 503  # (a route that fails for a while is no new description)
                await asyncio.sleep(0.75)  # (three re-reads, at every fifth check of 0.05 s)
                assert (await _workers(http, front.url))[sglang.url]["state"] == "up"
                answer["status"] = 200
                answer["info"] = describing(new)  # (the engine came back publishing elsewhere)
                reason = ""
                for _ in range(200):
                    row = (await _workers(http, front.url))[sglang.url]
                    if row["state"] == "down":
                        reason = row["reason"]
                        break
                    await asyncio.sleep(0.02)
                assert reason.startswith("its description changed (events ['"), reason
                assert f"-> ['{new.engine.events_endpoint}']" in reason, reason
                await _until_state(http, front.url, sglang.url, "up")
                row = (await _workers(http, front.url))[sglang.url]
                assert row["kv_events_endpoints"] == [new.engine.events_endpoint], row
                await _until_indexed_after_a_prompt(
                    http,
                    front.url,
                    sglang.url,
                    new,
                    "the events at the new endpoints never reached the router",
                )
