"""SGLang's ``/generate`` through a standalone router in front of mock engines, over HTTP.

The mock serves ``/generate`` as SGLang 0.5.23 does (kvmesh.mock.native_generate). A ``/generate``
prompt is routed on the tokens its completion twin has, so the two share cached blocks; the router
reads the answer's ``meta_info`` (its cached tokens, its length) and frees its load; a worker whose
server has no ``/generate`` is never chosen for one.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.asgi.test_agent_features import BS, mock_fleet, until
from tests.router.asgi.test_responses_api import WORKER, reported_cached, twin_served
from tests.router.servers import serve

TEXT = "Draft a polite reply declining the meeting and proposing two other dates. " * 8


async def generate(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, Any, str | None]:
    """(status, the answer, or the last streamed event, or the error; the worker that served it)."""
    async with http.post(url + "/generate", json=body) as r:
        worker = r.headers.get(WORKER)
        if r.status != 200 or not body.get("stream"):
            return r.status, await r.json(), worker
        raw = (await r.read()).decode()
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", raw[-300:]
    return 200, json.loads(events[-2]), worker


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_generate_prompt_goes_where_its_completion_twin_is_cached(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with mock_fleet(3) as (front, mocks, app):
        twin = {"model": mocks[0].config.model, "prompt": TEXT, "max_tokens": 2}
        home, reported_before = await twin_served(http, front.url, app, "/v1/completions", twin)
        body = {"text": TEXT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}, "stream": stream}
        status, answer, worker = await generate(http, front.url, body)
        assert status == 200, answer
        assert worker == home
        meta = answer["meta_info"]
        assert meta["completion_tokens"] == 5
        assert meta["cached_tokens"] == (meta["prompt_tokens"] - 1) // BS * BS > 0
        decision = app.mesh.router.recent_decisions(1)[-1][1]
        assert decision.cached_tokens == meta["cached_tokens"]  # routed on the engine's own tokens
        await until(lambda: not app.mesh.router.tracking(decision.request_id))
        # the engine's count of cached tokens, read from meta_info
        assert await reported_cached(http, front.url, home) == reported_before + meta["cached_tokens"]


async def test_n_samples_a_pinned_worker_and_what_is_refused(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        other = mocks[1].base_url
        body = {
            "input_ids": list(range(300, 340)),
            "sampling_params": {"n": 2, "max_new_tokens": 3, "ignore_eos": True},
            "nvext": {"backend_instance_id": other},
        }
        status, answers, worker = await generate(http, front.url, body)
        assert status == 200, answers
        assert worker == other and [a["meta_info"]["completion_tokens"] for a in answers] == [3, 3]
        decision = app.mesh.router.recent_decisions(1)[-1][1]
        await until(lambda: not app.mesh.router.tracking(decision.request_id))
        for bad, field in (
            ({"text": TEXT, "sampling_params": [{}, {}]}, "sampling_params"),
            ({"text": TEXT, "session_params": {"id": "s1"}}, "session_params.id"),  # (not opened here)
            ({"text": TEXT, "bootstrap_room": 3}, "bootstrap_room"),
            ({"text": TEXT, "stream": True, "nvext": {"extra_fields": ["worker_id"]}}, "nvext.extra_fields"),
            ({"text": TEXT, "nvext": {"agent_hints": {"speculative_prefill": True}}},
             "nvext.agent_hints.speculative_prefill"),
        ):  # fmt: skip
            status, error, _ = await generate(http, front.url, bad)
            assert status == 400, error
            assert error["error"]["param"] == field, error


def _vllm_like() -> Starlette:
    """A worker whose server is vLLM's: no /generate."""

    async def info(request: Request) -> Response:
        return JSONResponse({"backend": "vllm", "model": "m", "block_size": BS, "dp_size": 1})

    async def ok(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    return Starlette(routes=[Route("/kvmesh/info", info), Route("/health", ok), Route("/v1/models", models)])


async def test_a_worker_without_generate_is_never_chosen_for_it(http: aiohttp.ClientSession) -> None:
    async with serve(_vllm_like()) as vllm:
        settings = MeshSettings(workers=(WorkerSpec(vllm.url, "v"),), health_interval=0.2)
        async with serve(build_router_app(settings)) as front:
            status, error, _ = await generate(http, front.url, {"text": TEXT})
        assert status == 404 and "/generate" in error["error"]["message"]
        async with run_mock(block_size=BS, speedup=50.0) as mock:
            both = MeshSettings(
                workers=(WorkerSpec(vllm.url, "v"), WorkerSpec(mock.base_url, "s")), health_interval=0.2
            )
            async with serve(build_router_app(both)) as front:
                for _ in range(4):  # (load alone would send every other one to v)
                    status, answer, worker = await generate(
                        http, front.url, {"text": TEXT, "sampling_params": {"max_new_tokens": 2}}
                    )
                    assert (status, worker) == (200, "s"), answer
