"""Background copies of a hot prefix when the engines refuse them: over HTTP, the standalone router
in front of two simulated engines at real step times that answer a token-id ``/v1/completions``
prompt with a 400 (as a custom engine without token prompts would). The router gives up making
copies itself after a few refusals, says so, and its requests make them again: the prefix still
spreads. (The copies the engines take are asserted in tests/bench/test_copies_fleet.py.)"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh._http import replay_body
from kvmesh.bench.runner import LoadSpec, run_workload
from kvmesh.bench.workloads import WorkloadSpec, build
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.json_io import read_body
from kvmesh.router.asgi.prefix_copy import REFUSALS_TO_STOP
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve

pytestmark = pytest.mark.slow

SPEC = WorkloadSpec("hot-prefix", sessions=120, groups=1, prefix_words=1200, question_words=60,
                    max_tokens=16, seed=5)  # fmt: skip


class RefuseTokenPrompts:
    """An engine front that answers a ``/v1/completions`` body whose prompt is token ids with a 400
    and counts them; everything else reaches the engine."""

    def __init__(self, app: ASGIApp, refused: list[int]) -> None:
        self.app = app
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        body = await read_body(scope, receive, limit=1 << 24)
        assert body is not None
        if isinstance(json.loads(body).get("prompt"), list):
            self.refused.append(1)
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": "prompt must be text"}'})
            return
        await self.app(scope, replay_body(body, receive), send)


@contextlib.asynccontextmanager
async def _fleet(refused: list[int]) -> AsyncIterator[str]:
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(
                run_mock(
                    block_size=16, speedup=1.0, middleware=[Middleware(RefuseTokenPrompts, refused=refused)]
                )
            )
            for _ in range(2)
        ]
        workers = tuple(WorkerSpec(e.base_url, "ab"[i]) for i, e in enumerate(engines))
        front = await stack.enter_async_context(serve(build_router_app(MeshSettings(workers=workers))))
        yield front.url


async def test_engines_that_refuse_the_routers_copies_get_them_from_requests_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused: list[int] = []
    caplog.set_level(logging.WARNING, logger="kvmesh.router.asgi.prefix_copy")
    async with _fleet(refused) as url:
        load = LoadSpec(urls=(url,), concurrency=None, rate=15.0, seed=5)
        run = await run_workload("latency", build(SPEC), load)
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            exposition = await r.text()
    assert all(r.error is None for r in run.results)
    assert len(refused) >= REFUSALS_TO_STOP
    (family,) = [f for f in text_string_to_metric_families(exposition) if f.name == "kvmesh_prefix_copies"]
    failed = [
        s.value for s in family.samples if s.name.endswith("_total") and s.labels["outcome"] == "failed"
    ]
    assert failed == [len(refused)]
    assert any("from now on the requests routed make the copies" in r.getMessage() for r in caplog.records)
    # the copy a request then made: both engines serve the prefix, each computed it once
    per_engine = Counter(r.worker_id for r in run.results)
    cold = [r.worker_id for r in run.results if (r.cached_tokens or 0) < 0.5 * (r.prompt_tokens or 1)]
    assert len(per_engine) == 2 and len(cold) == len(set(cold)) == 2
