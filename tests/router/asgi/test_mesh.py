"""Simulated engines embedding the middleware (the mesh), following each other's real KV events."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import aiohttp

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.mesh.settings import MeshSettings, parse_worker_list

MOCK = MockConfig(block_size=16, num_blocks=4096, speedup=20.0)
SHARED = "You are a meticulous assistant working on the kvmesh project. " * 30  # ~ 60 blocks


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MOCK.model, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


async def _worker_of(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    body = {**body, "nvext": {**body.get("nvext", {}), "extra_fields": ["worker_id"]}}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        data = await r.json()
        assert r.status == 200, data
    return data["nvext"]["worker_id"]["decode_worker_id"], data


async def test_shared_prefix_follows_the_events_whichever_engine_is_asked() -> None:
    async with start_mesh(3, RouterConfig(), MOCK) as nodes, aiohttp.ClientSession() as http:
        first, _ = await _worker_of(http, nodes[0].url, chat(SHARED + "first question"))
        await asyncio.sleep(0.3)  # the engine's "stored" events reach every replica
        for i, node in enumerate(nodes * 2):
            worker, data = await _worker_of(http, node.url, chat(SHARED + f"follow-up {i}"))
            assert worker == first
            # the engine confirms the hit the router predicted
            usage = data["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.8 * usage["prompt_tokens"]
        # answers came back through whichever replica was asked; only `first` ever computed
        assert [n.engine.steps > 0 for n in nodes] == [n.url == first for n in nodes]


def _slow_events(engine: Any, delay: float) -> None:
    """Hold every KV-event batch back for ``delay`` seconds (a congested events network)."""
    publisher = engine.publisher
    flush = publisher.flush
    loop = asyncio.get_running_loop()
    publisher.flush = lambda: loop.call_later(delay, flush) and None


async def _sibling_workers(predicted_ttl: float | None, cost: str) -> list[tuple[str, set[str]]]:
    """Best-of-n bursts: the first sibling starts decoding, the other three follow at once."""
    config = RouterConfig(router_predicted_ttl_secs=predicted_ttl, router_cost_model=cost)  # type: ignore[arg-type]
    out = []
    async with start_mesh(3, config, MOCK.replace(speedup=1.0)) as nodes, aiohttp.ClientSession() as http:
        for node in nodes:
            _slow_events(node.engine, 1.0)
        for burst in range(3):
            body = chat(f"Problem {burst}: " + "prove the lemma step by step " * 200, max_tokens=16)
            streamed = {**body, "stream": True}
            async with http.post(nodes[0].url + "/v1/chat/completions", json=streamed) as first:
                await first.content.readuntil(b"\n\n")  # the role, announced at once
                await first.content.readuntil(b"\n\n")  # a token: the first sibling is past its prefill
                siblings = await asyncio.gather(*(_worker_of(http, nodes[0].url, body) for _ in range(3)))
                out.append((first.headers["x-kvmesh-worker-id"], {w for w, _ in siblings}))
                await first.read()
    return out


async def test_sibling_bursts_co_locate_with_predict_on_route() -> None:
    """The engine's "stored" events lag by a second: only predict-on-route knows where the
    siblings' prefix is about to be, and sends them to the first sibling's worker. With the default
    cost, which learns from these very requests: the siblings are not streamed, and a whole answer
    must not be taken for a time to first token (it once taught the model that prompt size does not
    matter, and the siblings scattered). The prompt is long (~2.3k tokens) so that its cached copy
    saves more than the short prefill stalls the first sibling's decoding there; for a prompt of a
    few hundred tokens the default cost rightly prefers an idle worker (see test_latency_cost)."""
    for first, siblings in await _sibling_workers(5.0, "latency"):
        assert siblings == {first}


async def test_sibling_bursts_co_locate_with_predict_on_route_under_dynamo_cost() -> None:
    """The side index's effect as the reference defines it (Dynamo's cost)."""
    for first, siblings in await _sibling_workers(5.0, "dynamo"):
        assert siblings == {first}


async def test_without_predict_on_route_lagging_events_scatter_siblings() -> None:
    """The contrast, under Dynamo's cost: without the side index the siblings look uncached
    everywhere, and the load model sends them away from the busy first worker. (The latency cost
    counts the blocks of requests in flight on a worker as cached there, so it needs no side index
    to keep them together.)"""
    bursts = await _sibling_workers(None, "dynamo")
    assert any(siblings != {first} for first, siblings in bursts)


async def test_pinned_request_is_served_by_the_peer_once_and_metrics_are_in_the_engine() -> None:
    async with start_mesh(2, RouterConfig(), MOCK) as nodes, aiohttp.ClientSession() as http:
        target = nodes[1]
        before = target.engine.steps
        worker, _ = await _worker_of(
            http, nodes[0].url, chat("pin me", nvext={"backend_instance_id": target.url})
        )
        assert worker == target.url
        assert target.engine.steps > before
        async with http.get(nodes[0].url + "/metrics") as r:
            text = await r.text()
        assert 'kvmesh_requests_total{endpoint="/v1/chat/completions",route="forwarded",status="200"}' in text
        assert "kvmesh_cached_tokens_reported_ratio" in text
        async with http.get(target.url + "/kvmesh/workers") as r:
            rows = (await r.json())["workers"]
        assert [row["state"] for row in rows] == ["up", "up"]
        assert [row["local"] for row in rows] == [False, True]


async def test_fire_and_forget_rpcs_are_held_until_done_and_cancelled_on_stop() -> None:
    """The event loop keeps only weak references to tasks: a spawned worker RPC must be held by
    the mesh (or it may be collected mid-flight) and must not outlive the mesh's stop()."""
    mesh = Mesh(MeshSettings(workers=parse_worker_list("http://127.0.0.1:9")))
    finished = asyncio.Event()
    cancelled = []

    async def rpc(hold: bool) -> None:
        try:
            await (asyncio.Event().wait() if hold else asyncio.sleep(0.05))
            finished.set()
        except asyncio.CancelledError:
            cancelled.append(hold)
            raise

    mesh.spawn(rpc(hold=False))
    mesh.spawn(rpc(hold=True))
    gc.collect()
    await asyncio.wait_for(finished.wait(), 2.0)
    await mesh.stop()
    await asyncio.sleep(0)
    assert cancelled == [True]
