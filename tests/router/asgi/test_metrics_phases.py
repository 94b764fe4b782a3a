"""Per-phase routing overhead: hashing, find_matches, scheduling and total, then the write to the worker
(forward) and the first token's way through the front (relay_first), as /metrics shows them."""

from __future__ import annotations

import asyncio
import itertools
import random

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.hashing import block_hashes
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig, RouterMode
from kvmesh.router.core.kv_router import Decision, KvRouter, RouteRequest
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve

PHASES = ("tokenize", "hashing", "find_matches", "scheduling", "total", "forward", "relay_first")


async def _phases(http: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, float]]:
    """phase -> (count, sum) of kvmesh_router_overhead_seconds."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, list[float]] = {p: [0.0, 0.0] for p in PHASES}
    for family in text_string_to_metric_families(text):
        if family.name != "kvmesh_router_overhead_seconds":
            continue
        for sample in family.samples:
            phase = sample.labels.get("phase", "")
            if sample.name.endswith("_count"):
                out[phase][0] = sample.value
            elif sample.name.endswith("_sum"):
                out[phase][1] = sample.value
    return {p: (c, s) for p, (c, s) in out.items()}


async def _route_some(mode: RouterMode, n: int, *, stream: bool = False) -> dict[str, tuple[float, float]]:
    """Send ``n`` requests through a standalone router; the phases' (count, sum) increments."""
    async with run_mock(block_size=16, speedup=50.0) as mock, aiohttp.ClientSession() as http:
        config = RouterConfig(router_mode=mode)
        settings = MeshSettings(workers=(WorkerSpec(mock.base_url, "m"),), router=config)
        async with serve(build_router_app(settings)) as front:
            before = await _phases(http, front.url)
            for i in range(n):
                # each a prompt of its own: the same messages again are not tokenized again
                body = {
                    "model": mock.config.model,
                    "messages": [{"role": "user", "content": f"measure the routing phases {i} " * 20}],
                    "max_tokens": 3,
                    "stream": stream,
                }
                async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
            after = await _phases(http, front.url)
    return {p: (after[p][0] - before[p][0], after[p][1] - before[p][1]) for p in PHASES}


async def test_kv_routing_observes_every_phase_once_per_request() -> None:
    delta = await _route_some("kv", 5, stream=True)
    assert {p: c for p, (c, _) in delta.items()} == dict.fromkeys(PHASES, 5)
    assert all(s > 0 for _, s in delta.values())
    # find_matches and scheduling split route(); total spans the whole routing path
    assert delta["find_matches"][1] + delta["scheduling"][1] < delta["total"][1]


async def test_round_robin_has_no_find_matches_phase() -> None:
    delta = await _route_some("round-robin", 3)
    assert delta["find_matches"][0] == 0
    assert delta["scheduling"][0] == 3
    assert delta["total"][0] == 3
    assert delta["forward"][0] == 3
    # a whole JSON answer has no first token to time on its way through
    assert delta["relay_first"][0] == 0


def test_route_reports_the_lookup_time_measured_with_the_injected_clock() -> None:
    """The core never reads a clock: the caller's clock times the prefix lookup inside route()."""
    ticks = itertools.count(0.0, 0.5)
    router = KvRouter(RouterConfig(router_queue_threshold=None), random.Random(0), clock=lambda: next(ticks))
    router.add_worker("w", total_blocks=100, max_num_batched_tokens=8192, block_size=16)
    hashes = block_hashes(list(range(64)), 16)
    result = router.route(RouteRequest("r1", hashes, 64), now=0.0)
    assert isinstance(result, Decision)
    assert router.last_find_matches == 0.5  # exactly one lookup, two clock reads
    untimed = KvRouter(RouterConfig(router_queue_threshold=None), random.Random(0))
    untimed.add_worker("w", total_blocks=100, max_num_batched_tokens=8192, block_size=16)
    untimed.route(RouteRequest("r1", hashes, 64), now=0.0)
    assert untimed.last_find_matches is None


async def test_the_first_token_is_timed_from_its_own_arrival_not_the_role_announcement() -> None:
    # The simulated engine announces the role as soon as a request arrives and sends the first
    # token after the prefill (about 60 ms for this prompt at speed 1): relay_first times the
    # token's chunk alone, so it is a small part of each request's time to first token.
    async with run_mock(block_size=16, speedup=1.0) as mock, aiohttp.ClientSession() as http:
        settings = MeshSettings(workers=(WorkerSpec(mock.base_url, "m"),), router=RouterConfig())
        async with serve(build_router_app(settings)) as front:
            before = await _phases(http, front.url)
            ttfts = []
            for i in range(3):
                body = {
                    "model": mock.config.model,
                    "messages": [{"role": "user", "content": f"time the first token {i} " * 600}],
                    "max_tokens": 2,
                    "stream": True,
                }
                t0 = asyncio.get_running_loop().time()
                async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                    async for line in r.content:
                        if b'"content"' in line and b'"content":""' not in line.replace(b" ", b""):
                            ttfts.append(asyncio.get_running_loop().time() - t0)
                            break
                    await r.read()
            after = await _phases(http, front.url)
    count = after["relay_first"][0] - before["relay_first"][0]
    seconds = after["relay_first"][1] - before["relay_first"][1]
    assert count == 3 and len(ttfts) == 3
    assert seconds / count < 0.25 * min(ttfts)
