"""The standalone router's engine utility endpoints (kvmesh/router/asgi/any_worker.py), over HTTP:
``/v1/messages/count_tokens``, ``/tokenize`` and their kin, answered by whichever worker has them.

Two stand-in engines: one with vLLM's paths (``/tokenize``, ``/v1/messages/count_tokens``,
``GET /version``) and one with SGLang's (``/v1/tokenize``, ``GET /get_model_info``,
``/separate_reasoning``), each keeping what it was asked."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.asgi.test_agent_features import mock_fleet
from tests.router.asgi.test_pooling import Engine, _fleet, _until
from tests.router.servers import serve

READS = ("/get_model_info", "/get_server_info", "/version", "/health_generate")


def _engine(name: str, paths: tuple[str, ...], asked: list[tuple[str, str, Any, str | None]]) -> Starlette:
    async def info(request: Request) -> Response:
        return JSONResponse({"backend": name, "model": "m", "block_size": 16})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def answer(request: Request) -> Response:
        body = await request.json() if request.method == "POST" else None
        asked.append((name, request.url.path, body, request.headers.get("authorization")))
        if request.url.path.endswith("count_tokens"):
            return JSONResponse({"input_tokens": 7})
        return JSONResponse({"count": 3, "tokens": [1, 2, 3], "served_by": name})

    routes = [Route("/kvmesh/info", info), Route("/health", models), Route("/v1/models", models)]
    routes += [Route(path, answer, methods=["GET" if path in READS else "POST"]) for path in paths]
    return Starlette(routes=routes)


async def test_a_utility_request_is_answered_by_a_worker_that_has_the_path() -> None:
    asked: list[tuple[str, str, Any, str | None]] = []
    vllm = _engine(
        "vllm",
        (
            "/tokenize",
            "/v1/messages/count_tokens",
            "/version",
            "/v1/chat/completions/render",
            "/v1/responses/render",
        ),
        asked,
    )
    sglang = _engine(
        "sglang", ("/v1/tokenize", "/get_model_info", "/separate_reasoning", "/health_generate"), asked
    )
    async with serve(vllm) as v, serve(sglang) as s, aiohttp.ClientSession() as http:
        settings = MeshSettings(
            workers=(WorkerSpec(v.url, "v"), WorkerSpec(s.url, "s")),
            router=RouterConfig(use_kv_events=False),
            health_interval=0.2,
        )
        async with serve(build_router_app(settings)) as front:
            count = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            auth = {"authorization": "Bearer k"}
            for _ in range(3):  # (whichever worker is asked first: the one with the path answers)
                async with http.post(front.url + "/v1/messages/count_tokens", json=count, headers=auth) as r:
                    assert r.status == 200 and await r.json() == {"input_tokens": 7}
            async with http.post(front.url + "/v1/tokenize", json={"prompt": "abc"}) as r:
                assert r.status == 200 and (await r.json())["served_by"] == "sglang"
            async with http.post(front.url + "/tokenize", json={"prompt": "abc"}) as r:
                assert r.status == 200 and (await r.json())["served_by"] == "vllm"
            async with http.post(front.url + "/detokenize", json={"tokens": [1]}) as r:
                assert r.status == 404  # (no worker has it: the last 404 is the answer)
            for bad in (b"[1]", b"{", b'{"metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
                async with http.post(front.url + "/tokenize", data=bad) as r:  # (no worker is asked)
                    assert r.status == 400 and (await r.json())["error"]["param"] == "body"
            async with http.get(front.url + "/tokenize") as r:
                assert r.status == 405
            # what a client reads at start (a GET), and SGLang's parsers
            async with http.get(front.url + "/get_model_info") as r:
                assert r.status == 200 and (await r.json())["served_by"] == "sglang"
            async with http.get(front.url + "/version") as r:
                assert r.status == 200 and (await r.json())["served_by"] == "vllm"
            async with http.post(front.url + "/separate_reasoning", json={"text": "a"}) as r:
                assert r.status == 200 and (await r.json())["served_by"] == "sglang"
            async with http.get(front.url + "/get_server_info") as r:
                assert r.status == 404  # (no worker has it)
            async with http.get(front.url + "/health_generate") as r:
                assert r.status == 200 and (await r.json())["served_by"] == "sglang"
            # vLLM's renderers; /v1/responses/render names no stored response (it was looked for,
            # and the standalone router answered 404 naming response_id)
            for path in ("/v1/chat/completions/render", "/v1/responses/render"):
                async with http.post(front.url + path, json=count) as r:
                    assert r.status == 200 and (await r.json())["served_by"] == "vllm", path
    assert [a[:2] for a in asked] == [
        ("vllm", "/v1/messages/count_tokens"),
        ("vllm", "/v1/messages/count_tokens"),
        ("vllm", "/v1/messages/count_tokens"),
        ("sglang", "/v1/tokenize"),
        ("vllm", "/tokenize"),
        ("sglang", "/get_model_info"),
        ("vllm", "/version"),
        ("sglang", "/separate_reasoning"),
        ("sglang", "/health_generate"),
        ("vllm", "/v1/chat/completions/render"),
        ("vllm", "/v1/responses/render"),
    ]
    assert asked[0][2] == count and asked[0][3] == "Bearer k"  # the body and the client's key, as sent


async def test_a_worker_that_cannot_be_reached_is_passed_over() -> None:
    asked: list[tuple[str, str, Any, str | None]] = []
    async with (
        serve(_engine("vllm", ("/tokenize",), asked)) as v,
        contextlib.AsyncExitStack() as going,
        aiohttp.ClientSession() as http,
    ):
        gone = await going.enter_async_context(serve(_engine("vllm", ("/tokenize",), asked)))
        settings = MeshSettings(
            workers=(WorkerSpec(v.url, "v"), WorkerSpec(gone.url, "gone")),
            router=RouterConfig(use_kv_events=False),
            health_interval=30.0,  # (no health check sees it go: it stays routable)
        )
        async with serve(build_router_app(settings)) as front:
            async with http.get(front.url + "/kvmesh/workers") as r:
                assert [w["state"] for w in (await r.json())["workers"]] == ["up", "up"]
            await going.aclose()  # one engine stops
            for _ in range(2):  # (each worker is asked first once)
                async with http.post(front.url + "/tokenize", json={"prompt": "x"}) as r:
                    assert r.status == 200, await r.text()
        assert len(asked) == 2


async def test_a_count_through_the_router_is_the_engines_own() -> None:
    """In front of ``kvmesh mock`` engines (which answer as vLLM does), as Claude Code asks it."""
    async with mock_fleet(2) as (front, mocks, _), aiohttp.ClientSession() as http:
        body = {
            "model": mocks[0].config.model,
            "messages": [{"role": "user", "content": "How long is this?"}],
        }
        async with http.post(mocks[0].base_url + "/v1/messages/count_tokens", json=body) as r:
            direct = await r.json()
        for _ in range(2):
            async with http.post(front.url + "/v1/messages/count_tokens", json=body) as r:
                assert r.status == 200 and await r.json() == direct


async def test_a_client_that_leaves_before_the_answer_stops_the_engines_request() -> None:
    """SGLang's ``/health_generate`` generates a token on the engine: a client that gives up on it
    closes the router's connection to the engine, as a pooling request's does. Before, the engine's
    request ran on for nobody."""
    engine = Engine("s", ("/health_generate",))
    engine.hold = asyncio.Event()
    async with _fleet(engine) as (front, http):
        with contextlib.suppress(asyncio.TimeoutError):
            async with http.get(front.url + "/health_generate", timeout=aiohttp.ClientTimeout(total=0.5)):
                pass
        await _until(lambda: engine.abandoned == 1)  # the engine saw its client go
        assert engine.holding == 0
        engine.hold.set()
        async with http.get(front.url + "/health_generate") as r:  # and the router still answers
            assert r.status == 200
            assert (await r.json())["served_by"] == "s"
