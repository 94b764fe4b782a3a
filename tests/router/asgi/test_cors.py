"""A client in a browser page served from another origin, calling the standalone router
(``kvmesh router --allowed-origins``, kvmesh.router.asgi.cors), over HTTP."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import pytest
from starlette.middleware.cors import CORSMiddleware

from kvmesh.router.asgi.cors import CorsPolicy, with_cors
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.engines import EngineState, engine_app
from tests.router.servers import bound_socket, serve

PAGE = "http://chat.example:3000"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 2}


def sglang_like(state: EngineState) -> Any:
    """A test engine answering CORS as SGLang's server does: every origin, with credentials."""
    return CORSMiddleware(
        engine_app(state),
        allow_origins=["*"],
        allow_credentials=True,
        allow_methods=["*"],
        allow_headers=["*"],
    )


@contextlib.asynccontextmanager
async def fronted(policy: CorsPolicy) -> AsyncIterator[tuple[str, EngineState]]:
    state = EngineState("engine")
    async with serve(sglang_like(state)) as engine:
        settings = MeshSettings(
            workers=(WorkerSpec(engine.url, "engine"),),
            router=RouterConfig(router_mode="round-robin"),
            health_interval=0.2,
        )
        async with serve(with_cors(build_router_app(settings), policy)) as front:
            yield front.url, state


async def test_a_page_from_an_allowed_origin_reads_the_routers_answers(http: aiohttp.ClientSession) -> None:
    async with fronted(CorsPolicy(origins=(PAGE,))) as (front, state):
        preflight = {
            "origin": PAGE,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        }
        async with http.options(front + "/v1/chat/completions", headers=preflight) as r:
            assert r.status == 200, await r.text()
            assert r.headers["access-control-allow-origin"] == PAGE
            assert "POST" in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"].lower() == "authorization, content-type"
        async with http.post(front + "/v1/chat/completions", json=CHAT, headers={"origin": PAGE}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["access-control-allow-origin"] == PAGE
            # the router's policy alone: the engine never saw the origin, and added nothing
            assert "access-control-allow-credentials" not in r.headers
        assert state.received and all("origin" not in h for h in state.headers)
        # the router's own answers carry it too: a 400 naming the field
        bad = {**CHAT, "nvext": {"backend_instance_id": "nobody"}}
        async with http.post(front + "/v1/chat/completions", json=bad, headers={"origin": PAGE}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "nvext.backend_instance_id"
            assert r.headers["access-control-allow-origin"] == PAGE
        async with http.get(front + "/metrics", headers={"origin": PAGE}) as r:
            assert r.status == 200 and r.headers["access-control-allow-origin"] == PAGE


async def test_a_page_from_another_origin_is_refused(http: aiohttp.ClientSession) -> None:
    async with fronted(CorsPolicy(origins=(PAGE,))) as (front, _):
        other = {"origin": "http://elsewhere.example", "access-control-request-method": "POST"}
        async with http.options(front + "/v1/chat/completions", headers=other) as r:
            assert r.status == 400
            assert "access-control-allow-origin" not in r.headers
        async with http.post(
            front + "/v1/chat/completions", json=CHAT, headers={"origin": other["origin"]}
        ) as r:
            assert r.status == 200  # (served: the browser, not the server, keeps it from the page)
            assert "access-control-allow-origin" not in r.headers


async def test_without_origins_the_router_is_as_before(http: aiohttp.ClientSession) -> None:
    policy = CorsPolicy()
    assert not policy.enabled
    async with fronted(policy) as (front, state):
        async with http.post(front + "/v1/chat/completions", json=CHAT, headers={"origin": PAGE}) as r:
            assert r.status == 200
        assert state.headers[-1].get("origin") == PAGE  # (passed on, as it always was)


async def test_credentials_are_allowed_when_asked_for(http: aiohttp.ClientSession) -> None:
    policy = CorsPolicy(origins=("*",), credentials=True, methods=("post",))
    async with fronted(policy) as (front, _):
        preflight = {"origin": PAGE, "access-control-request-method": "POST"}
        async with http.options(front + "/v1/chat/completions", headers=preflight) as r:
            assert r.status == 200
            assert r.headers["access-control-allow-origin"] == PAGE  # (any origin, echoed)
            assert r.headers["access-control-allow-credentials"] == "true"
        preflight["access-control-request-method"] = "DELETE"
        async with http.options(front + "/v1/chat/completions", headers=preflight) as r:
            assert r.status == 400


def _router(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh", "router", "--workers", "http://127.0.0.1:1", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--allowed-origins", "http://chat.example/"], "no trailing slash"),
        (["--allowed-origins", "chat.example"], "is not an origin"),
        (["--allowed-origins", ","], "must name at least one"),
        (["--allowed-origins", "*", "--allowed-methods", "GET POST"], "is not an HTTP method"),
        (["--allow-credentials"], "--allow-credentials needs --allowed-origins"),
        (["--allowed-headers", "x-key"], "--allowed-headers needs --allowed-origins"),
    ],
)
def test_the_router_refuses_a_cors_setting_it_cannot_use(flags: list[str], message: str) -> None:
    result = _router(*flags)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_kvmesh_router_answers_a_preflight_with_the_flags_policy() -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    flags = ["--port", str(port), "--allowed-origins", f"{PAGE},http://localhost:5173", "--allow-credentials"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "router", "--workers", "http://127.0.0.1:1", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        preflight = {"origin": "http://localhost:5173", "access-control-request-method": "POST"}
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                r = httpx.options(f"http://127.0.0.1:{port}/v1/chat/completions", headers=preflight)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "the router never listened"
                time.sleep(0.1)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert r.headers["access-control-allow-credentials"] == "true"
        r = httpx.get(f"http://127.0.0.1:{port}/live", headers={"origin": PAGE})
        assert r.headers["access-control-allow-origin"] == PAGE
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
