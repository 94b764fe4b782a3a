"""Load the router did not route, seen through the engine's own gauges: a client that calls an
engine directly (a standalone router in front of three mock engines), or another replica of a mesh
without replica sync (four mock engines embedding the middleware), keeps an engine busy; at the
next health check the router reads the engine's ``/metrics``, shows the requests beyond its own as
``unseen_requests`` in ``/kvmesh/workers``, and its latency cost counts them as requests the size
of its own in flight."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.load import _SIZES_EVERY_S
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.clients import stream_chat
from tests.router.engines import EngineState, engine_app
from tests.router.servers import serve

BS = 16


def _body(model: str, text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def _served_by(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-kvmesh-worker-id"]


async def test_a_worker_busy_with_requests_the_router_never_sent_loses_the_next_one(
    http: aiohttp.ClientSession,
) -> None:
    context = "the shared context of this conversation, long enough to matter " * 40
    async with contextlib.AsyncExitStack() as stack:
        # a runs two sequences at a time (a third waits in its queue); c prefills 256 tokens a step
        a = await stack.enter_async_context(run_mock(block_size=BS, max_num_seqs=2))
        b = await stack.enter_async_context(run_mock(block_size=BS))
        c = await stack.enter_async_context(run_mock(block_size=BS, max_num_batched_tokens=256))
        settings = MeshSettings(
            workers=(WorkerSpec(a.base_url, "a"), WorkerSpec(b.base_url, "b"), WorkerSpec(c.base_url, "c")),
            router=RouterConfig(router_queue_threshold=None),
            health_interval=0.2,
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        model = a.config.model

        async def rows() -> dict[str, Any]:
            async with http.get(front.url + "/kvmesh/workers") as r:
                return {row["worker_id"]: row for row in (await r.json())["workers"]}

        # the context goes to a through the router, and a's KV events put it in the router's index
        pinned = _body(model, context, 4, nvext={"backend_instance_id": "a"})
        assert await _served_by(http, front.url, pinned) == "a"
        for _ in range(250):
            if (await rows())["a"]["indexed_blocks"] >= 40:
                break
            await asyncio.sleep(0.02)
        probe = _body(model, context + " first question", 4)
        assert await _served_by(http, front.url, probe) == "a"  # the holder wins while idle

        # the router's own long prefill on c (~20k tokens, 256 a step): the size it gives a request
        # queued where it cannot see
        long = _body(model, "a very long document to read " * 4000, 4, nvext={"backend_instance_id": "c"})
        own = asyncio.ensure_future(stream_chat(http, front.url, long))
        # a client keeps a busy with six long answers, none of them through the router: two run,
        # four wait, and a request sent to a now would wait behind them
        direct = [
            asyncio.ensure_future(stream_chat(http, a.base_url, _body(model, f"other work {i} " * 120, 4000)))
            for i in range(6)
        ]
        try:
            reported = None
            for _ in range(250):  # until a health check reads them from a's /metrics
                now = await rows()
                reported = now["a"]["engine_load"]
                in_prefill = now["c"]["ranks"][0]["active_prefill_tokens"] > 10_000  # (the router's own)
                if reported is not None and reported["waiting"] == 4.0 and in_prefill:
                    break
                await asyncio.sleep(0.02)
            assert reported is not None and reported["running"] == 2.0
            # The size an unseen request is given is measured again at most every
            # _SIZES_EVERY_S, at a health check: wait for one measured with c's prefill in flight
            # (the last may predate it, and a's queue then counts as requests of no size; under
            # load this once sent the question to a).
            await asyncio.sleep(_SIZES_EVERY_S + 2 * settings.health_interval)
            now = await rows()
            assert now["a"]["ranks"][0]["unseen_requests"] == 6.0
            assert now["b"]["ranks"][0]["unseen_requests"] == 0.0
            assert now["c"]["ranks"][0]["active_prefill_tokens"] > 10_000, "c's prefill ended too soon"
            question = _body(model, context + " second question", 4)
            assert await _served_by(http, front.url, question) == "b"
        finally:
            for task in (*direct, own):
                task.cancel()
            await asyncio.gather(*direct, own, return_exceptions=True)
        for _ in range(250):  # aborted on a: the next health check reads an idle engine
            if (await rows())["a"]["ranks"][0]["unseen_requests"] == 0.0:
                break
            await asyncio.sleep(0.02)
        assert (await rows())["a"]["ranks"][0]["unseen_requests"] == 0.0


async def test_a_replica_counts_the_queue_another_replica_put_on_a_peer() -> None:
    """The mesh (four mock engines embedding the middleware, no replica sync): replica 1 queues six
    long answers on engine 2, which counts them as hops; replica 0 routed none of them, sees them
    through engine 2's own counts, and sends a question whose context engine 2 caches elsewhere."""
    mock = MockConfig(block_size=BS, speedup=1.0, max_num_seqs=2, max_num_batched_tokens=256)
    context = "the shared context of this conversation, long enough to matter " * 40
    config = RouterConfig(router_queue_threshold=None)
    async with start_mesh(4, config, mock) as nodes, aiohttp.ClientSession() as http:
        n0, n1, n2, n3 = (node.url for node in nodes)
        model = mock.model

        async def seen_by_n0() -> dict[str, Any]:
            async with http.get(n0 + "/kvmesh/workers") as r:
                return {row["worker_id"]: row for row in (await r.json())["workers"]}

        pinned = _body(model, context, 4, nvext={"backend_instance_id": n2})
        assert await _served_by(http, n0, pinned) == n2
        for _ in range(250):  # engine 2's KV events reach replica 0's index
            if (await seen_by_n0())[n2]["indexed_blocks"] >= 40:
                break
            await asyncio.sleep(0.02)
        # replica 0's own long prefill on engine 3: the size it gives a request it cannot see
        long = _body(model, "a very long document to read " * 4000, 4, nvext={"backend_instance_id": n3})
        tasks = [asyncio.ensure_future(stream_chat(http, n0, long))]
        # replica 1 sends six long answers to engine 2: two run there, four wait
        tasks += [
            asyncio.ensure_future(
                stream_chat(
                    http,
                    n1,
                    _body(model, f"other work {i} " * 120, 4000, nvext={"backend_instance_id": n2}),
                )
            )
            for i in range(6)
        ]
        try:
            rows: dict[str, Any] = {}
            for _ in range(250):
                rows = await seen_by_n0()
                load = rows[n2]["engine_load"]
                in_prefill = rows[n3]["ranks"][0]["active_prefill_tokens"] > 10_000  # (replica 0's own)
                if load is not None and load["waiting"] == 4.0 and in_prefill:
                    break
                await asyncio.sleep(0.02)
            # (a size of an unseen request measured with that prefill in flight, as above)
            await asyncio.sleep(_SIZES_EVERY_S + 2 * 0.5)
            rows = await seen_by_n0()
            assert rows[n2]["active_requests"] == 0  # replica 0 routed none of them
            assert rows[n2]["ranks"][0]["unseen_requests"] == 6.0
            assert rows[n3]["ranks"][0]["active_prefill_tokens"] > 10_000, "the prefill ended too soon"
            question = _body(model, context + " second question", 4)
            assert await _served_by(http, n0, question) not in (n2, n3)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_an_engine_s_dp_ranks_each_carry_the_queue_its_metrics_label_them_with(
    http: aiohttp.ClientSession,
) -> None:
    """A worker with two DP ranks whose ``/metrics`` labels each rank's gauges, as vLLM (``engine``)
    and SGLang (``dp_rank``, one series per TP rank) do: the standalone router's health check puts
    the three waiting on rank 1 there, and none on rank 0; a page without rank labels spreads its
    totals over both ranks."""
    vllm_page = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="test-model"} 0.0\n'
        'vllm:num_requests_running{engine="1",model_name="test-model"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="test-model"} 0.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="test-model"} 3.0\n'
    )
    sglang_page = "".join(
        f'sglang:num_{name}{{dp_rank="{rank}",engine_type="unified",model_name="m",tp_rank="{tp}"}} {n}\n'
        for rank, tp in ((0, 0), (0, 1), (1, 2), (1, 3))
        for name, n in (("running_reqs", 4.0 * rank), ("queue_reqs", 0.0))
    )
    state = EngineState("dp", dp_size=2, metrics=vllm_page)
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(serve(engine_app(state)))
        settings = MeshSettings(  # the test engine publishes no KV events: the router predicts its cache
            workers=(WorkerSpec(engine.url, "dp"),),
            router=RouterConfig(use_kv_events=False),
            health_interval=0.1,
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))

        async def unseen_when(expected: list[float]) -> list[float]:
            got: list[float] = []
            for _ in range(250):  # until a health check has read the page
                async with http.get(front.url + "/kvmesh/workers") as r:
                    rows = (await r.json())["workers"]
                got = [rank["unseen_requests"] for rank in rows[0]["ranks"]] if rows else []
                if got == expected:
                    break
                await asyncio.sleep(0.02)
            return got

        assert await unseen_when([0.0, 5.0]) == [0.0, 5.0]
        state.metrics = sglang_page  # rank 1 runs 4, reported by both of its TP ranks: counted once
        assert await unseen_when([0.0, 4.0]) == [0.0, 4.0]
        state.metrics = 'vllm:num_requests_waiting{model_name="test-model"} 6.0\n'  # no rank labels
        assert await unseen_when([3.0, 3.0]) == [3.0, 3.0]
