"""The standalone router's fleet-wide engine controls in front of vLLM 0.33.0's own control routes
(engine tier; kvmesh/router/asgi/fleet_control.py).

Two servers carry vLLM's real ``/pause``, ``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``,
``/is_sleeping``, ``/update_weight_version`` and ``/weight_info`` (its RL and sleep routers, which
``vllm serve`` mounts with ``VLLM_SERVER_DEV_MODE=1``), with vLLM's own query and body parsing and its own answers to a bad argument. What
needs a model, the engine client, is a recorder of the calls vLLM's handlers make on it. The router
runs on loopback in front of both, and each call through it must reach both engines as vLLM parses
it, and come back as the fleet's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import httpx
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.rl.online.api_router import router as rl_router
    from vllm.entrypoints.serve.dev.cache.api_router import router as cache_router
    from vllm.entrypoints.serve.dev.sleep.api_router import router as sleep_router
    from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve

pytestmark = pytest.mark.engine_vllm


class RecordingEngineClient:
    """The engine client calls vLLM's control handlers make, recorded; answers as an engine would."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.paused = False
        self.asleep = False
        self.version = "v0"

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode, clear_cache))
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def sleep(self, level: int, mode: str) -> None:
        self.calls.append(("sleep", level, mode))
        self.asleep = True

    async def wake_up(self, tags: list[str] | None) -> bool:
        self.calls.append(("wake_up", tags))
        self.asleep = False
        return True

    async def is_sleeping(self) -> bool:
        return self.asleep or self.paused

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("version", version))
        self.version = version

    async def get_weight_version(self) -> str:
        return self.version

    async def reset_mm_cache(self) -> None:
        self.calls.append(("reset_mm_cache",))

    async def reset_encoder_cache(self) -> None:
        self.calls.append(("reset_encoder_cache",))


def _vllm_app(client: RecordingEngineClient) -> FastAPI:
    app = FastAPI()
    app.include_router(rl_router)
    app.include_router(sleep_router)
    app.include_router(cache_router)
    app.state.engine_client = client
    # (vLLM's server registers its own answer to a bad argument: a 400 naming it)
    app.exception_handler(RequestValidationError)(validation_exception_handler)
    app.state.args = argparse.Namespace(log_error_stack=False)  # (what that handler reads)

    @app.get("/v1/models")
    async def models() -> JSONResponse:  # (what the router's health check reads)
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    return app


@contextlib.asynccontextmanager
async def router_in_front(*apps: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """``apps`` served on loopback as vLLM workers ``w0``, ``w1``, ... behind a standalone router:
    a client of the router."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [(await stack.enter_async_context(serve(app))).url for app in apps]
        workers = tuple(WorkerSpec(u, f"w{i}", backend="vllm") for i, u in enumerate(urls))
        settings = MeshSettings(
            workers=workers, router=RouterConfig(use_kv_events=False), health_interval=0.2
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        yield await stack.enter_async_context(httpx.AsyncClient(base_url=front.url, timeout=30))


@contextlib.asynccontextmanager
async def _fleet() -> AsyncIterator[tuple[httpx.AsyncClient, list[RecordingEngineClient]]]:
    clients = [RecordingEngineClient(), RecordingEngineClient()]
    async with router_in_front(*(_vllm_app(c) for c in clients)) as http:
        yield http, clients


async def _until_paused_rows(http: httpx.AsyncClient, paused: bool) -> None:
    """Until the router's worker list says every worker is (or is not) paused."""
    async with asyncio.timeout(10):
        while {row["paused"] for row in (await http.get("/kvmesh/workers")).json()["workers"]} != {paused}:
            await asyncio.sleep(0.05)


async def test_a_pause_and_a_resume_reach_every_vllm_engine_as_vllm_parses_them() -> None:
    async with _fleet() as (http, clients):
        r = await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "paused" and set(r.json()["workers"]) == {"w0", "w1"}
        assert [c.calls for c in clients] == [[("pause", "keep", False)]] * 2
        r = await http.get("/is_paused")
        assert r.json() == {
            "is_paused": True,
            "workers": {"w0": {"is_paused": True}, "w1": {"is_paused": True}},
        }
        # the router's own health checks read vLLM's /is_paused too (kvmesh.router.mesh.registry)
        await _until_paused_rows(http, True)
        r = await http.post("/resume")
        assert r.status_code == 200 and r.json()["status"] == "resumed", r.text
        assert (await http.get("/is_paused")).json()["is_paused"] is False
        await _until_paused_rows(http, False)
        # a mode vLLM does not know is refused by vLLM itself, naming the field, on every engine
        r = await http.post("/pause", params={"mode": "sideways"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "query.mode"
        assert all(c.calls[-1] == ("resume",) for c in clients)


async def test_sleep_and_wake_up_with_their_query_and_the_weight_version_with_its_body() -> None:
    async with _fleet() as (http, clients):
        r = await http.post("/sleep", params={"level": "1", "mode": "wait"})
        assert r.status_code == 200 and r.json()["level"] == 1, r.text
        assert (await http.get("/is_sleeping")).json()["is_sleeping"] is True
        r = await http.post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")])
        assert r.status_code == 200 and r.json()["status"] == "awake", r.text
        assert [c.calls for c in clients] == [
            [("sleep", 1, "wait"), ("wake_up", ["weights", "kv_cache"])]
        ] * 2
        r = await http.post("/sleep", params={"level": "3"})  # (vLLM takes 0 to 2)
        assert r.status_code == 400 and r.json()["error"]["param"] == "query.level", r.text
        r = await http.post("/update_weight_version", json={"new_version": "step-7"})
        assert r.status_code == 200 and r.json()["new_version"] == "step-7", r.text
        r = await http.get("/weight_info")
        assert r.json()["weight_version"] == "step-7"
        assert all(c.version == "step-7" for c in clients)


async def test_the_multimodal_and_encoder_cache_resets_reach_every_vllm_engine() -> None:
    async with _fleet() as (http, clients):
        for path in ("/reset_mm_cache", "/reset_encoder_cache"):
            r = await http.post(path)
            assert r.status_code == 200, r.text
            assert set(r.json()["workers"]) == {"w0", "w1"}
        assert [c.calls for c in clients] == [[("reset_mm_cache",), ("reset_encoder_cache",)]] * 2


def test_every_vllm_control_the_router_knows_is_on_vllms_routers() -> None:
    """Each vLLM path kvmesh sends to every worker, and each it refuses to (a weight transfer with
    per-engine arguments), is one of vLLM's, with the method the router serves it with."""
    from kvmesh.router.asgi import fleet_control

    methods: dict[str, set[str]] = {}
    for route in (*rl_router.routes, *sleep_router.routes, *cache_router.routes):
        methods.setdefault(route.path, set()).update(route.methods)
    fanned = {p for p in (*fleet_control.POSTS, *fleet_control.GETS) if p in methods}
    assert fanned == {
        *("/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping"),
        *("/release_kv_cache_memory", "/update_weight_version", "/weight_info"),
        *("/reset_mm_cache", "/reset_encoder_cache"),
        *("/weight_checker", "/get_world_size"),  # (an RL loop's reads after a weight update)
    }
    for path in fanned:
        assert methods[path] == ({"GET"} if path in fleet_control.GETS else {"POST"}), path
    refused = {p for p in fleet_control.PER_ENGINE if p in methods}
    assert "/init_weight_transfer_engine" in refused and "/update_weights" in refused


def test_vllms_answers_to_a_request_refused_while_paused_are_what_the_router_routes_around() -> None:
    """While paused, vLLM's engine finishes a new request with a retryable error: a whole answer
    is its 503, a stream a 200 that opens with the error as its first event (the chat stream's
    ``ErrorResponse`` chunk, the completion stream's converted error). kvmesh sends each of these
    to another worker (``refused_for_now``); a non-retryable generation error it passes on."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError, RetryableRequestError

    from kvmesh.router.asgi.forwarding import refused_for_now

    serving = GenerateBaseServing.__new__(GenerateBaseServing)

    def streams(error: GenerationError) -> list[bytes]:
        chat_chunk = serving.create_error_response(
            str(error), err_type="InternalServerError", status_code=error.status_code
        ).model_dump_json()
        completion_event = serving._convert_generation_error_to_streaming_response(error)
        return [f"data: {e}\n\ndata: [DONE]\n\n".encode() for e in (chat_chunk, completion_event)]

    paused = RetryableRequestError("Generation is paused. Please retry after it resumes.")
    assert paused.status_code == 503
    assert all(refused_for_now(200, first) for first in streams(paused))
    assert not any(refused_for_now(200, first) for first in streams(GenerationError("boom")))


def test_vllms_profiler_paths_are_among_those_the_router_sends_to_every_worker() -> None:
    from vllm.entrypoints.serve.profile.api_router import router as profile_router

    from kvmesh.router.asgi import fleet_control

    posts = {r.path for r in profile_router.routes if "POST" in r.methods}
    assert posts == {"/start_profile", "/stop_profile"}
    assert posts <= set(fleet_control.EITHER)  # (sent on with the client's method: vLLM's POST)
