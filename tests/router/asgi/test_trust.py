"""Trust boundaries (docs/security.md): the internal hop headers count only from a proven peer, and
the token the router presents to workers is not the one that guards the router."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from starlette.middleware import Middleware

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.middleware import KvMeshMiddleware
from kvmesh.router.asgi.peer_auth import hop_headers
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.engines import EngineState, engine_app
from tests.router.fleet import chat, mock_finished
from tests.router.servers import bound_socket, serve, wait_until


@contextlib.asynccontextmanager
async def embedded(secret: str | None) -> AsyncIterator[tuple[str, EngineState]]:
    """One test engine embedding the middleware, alone in its fleet (approximate KV mode)."""
    state = EngineState("self")
    sock = bound_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    settings = MeshSettings(
        workers=(WorkerSpec(url, url),),
        self_url=url,
        router=RouterConfig(use_kv_events=False),
        health_interval=0.2,
        mesh_secret=secret,
    )
    app = KvMeshMiddleware(engine_app(state), settings=settings)
    async with serve(app, sock) as server:
        yield server.url, state


async def _load(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/kvmesh/workers") as r:
        return sum(row["active_requests"] for row in (await r.json())["workers"])


def _internal(headers: dict[str, str]) -> set[str]:
    return {k for k in headers if k.startswith("x-kvmesh-hop") or k == "x-kvmesh-request-id"}


async def test_without_a_secret_a_client_hop_header_does_not_skip_validation(
    http: aiohttp.ClientSession,
) -> None:
    async with embedded(None) as (url, state):
        hop = {"x-kvmesh-hop": "evil", "x-kvmesh-request-id": "victim-1"}
        bad = chat("hi", nvext={"agent_hints": {"priority": "high"}})
        async with http.post(url + "/v1/chat/completions", json=bad, headers=hop) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "nvext.agent_hints.priority"
        good = chat("hi", nvext={"agent_hints": {"priority": 3}})
        async with http.post(url + "/v1/chat/completions", json=good, headers=hop) as r:
            assert r.status == 200
        deep = (
            b'{"model":"test-model","messages":[{"role":"user","content":"hi"}],"x":'
            + b"[" * 1000
            + b"]" * 1000
            + b"}"
        )
        async with http.post(url + "/v1/chat/completions", data=deep, headers=hop) as r:
            assert r.status == 400  # the hop path used to raise RecursionError: a 500
            assert (await r.json())["error"]["param"] == "body"
        # the engine never sees nvext, nor the internal headers (priority in its own polarity)
        assert len(state.received) == 1
        assert "nvext" not in state.received[0] and state.received[0]["priority"] == -3
        assert _internal(state.headers[0]) == set()
        assert await _load(http, url) == 0


async def test_with_a_secret_only_a_signed_hop_is_served_as_one(http: aiohttp.ClientSession) -> None:
    async with embedded("s3cret") as (url, state):
        forged = {"x-kvmesh-hop": "evil", "x-kvmesh-request-id": "r-1", "x-kvmesh-hop-auth": "00" * 32}
        async with http.post(url + "/v1/chat/completions", json=chat("a"), headers=forged) as r:
            assert r.status == 200
            # routed like any client request (the routed path names the worker it chose)
            assert r.headers.get("x-kvmesh-worker-id") == url
        signed = {k.decode(): v.decode() for k, v in hop_headers("s3cret", "peer", "r-2")}
        async with http.post(url + "/v1/chat/completions", json=chat("b"), headers=signed) as r:
            assert r.status == 200
            assert "x-kvmesh-worker-id" not in r.headers  # served as a hop
        assert [_internal(h) for h in state.headers] == [set(), set()]
        await wait_until(lambda: state.active == 0)
        assert await _load(http, url) == 0


async def test_a_warm_up_reaches_a_peer_sharing_the_secret_as_a_proven_hop(
    http: aiohttp.ClientSession,
) -> None:
    """A speculative prefill is the front's own request: a replica sharing the mesh secret serves it
    where it is sent, as it serves the turn the front forwarded, and routes neither again."""
    with bound_socket() as sock:
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    replica = MeshSettings(
        workers=(WorkerSpec(url, url),), self_url=url, health_interval=0.2, mesh_secret="s3"
    )
    middleware = [Middleware(KvMeshMiddleware, settings=replica)]
    async with contextlib.AsyncExitStack() as stack:
        mock = await stack.enter_async_context(
            run_mock(block_size=16, speedup=50.0, port=port, middleware=middleware)
        )
        settings = MeshSettings(workers=(WorkerSpec(url, url),), health_interval=0.2, mesh_secret="s3")
        app = build_router_app(settings)
        front = await stack.enter_async_context(serve(app))
        await wait_until(lambda: app.mesh.registry.get(url) is not None and app.mesh.kv_mode)
        messages = [{"role": "user", "content": "warm the next turn of this conversation " * 6}]
        body = {**chat("", messages=messages, max_tokens=8), "model": mock.config.model}
        body["nvext"] = {"agent_hints": {"speculative_prefill": True}}
        async with http.post(front.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
        await wait_until(lambda: not app.mesh._warmups)
        # the warm-up ran on the engine, after the turn ...
        assert mock_finished(mock.engine) == 2
        # ... and the replica made no routing decision: both requests were the front's hops
        async with http.get(url + "/kvmesh/decisions") as r:
            assert r.status == 200
            assert (await r.json())["decisions"] == []


def _recorder(state: EngineState, seen: list[dict[str, str]]) -> Any:
    inner = engine_app(state)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/kvmesh/"):
            seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await inner(scope, receive, send)

    return app


@pytest.mark.parametrize("worker_token", [None, "w-token"])
async def test_the_admin_token_is_never_sent_to_workers(
    http: aiohttp.ClientSession, worker_token: str | None
) -> None:
    seen: list[dict[str, str]] = []
    async with serve(_recorder(EngineState("w"), seen)) as worker:
        settings = MeshSettings(
            workers=(WorkerSpec(worker.url, worker.url),),
            router=RouterConfig(use_kv_events=False),
            admin_token="a-token",
            worker_token=worker_token,
            health_interval=0.2,
        )
        async with serve(build_router_app(settings)) as front:
            async with http.get(
                front.url + "/kvmesh/workers", headers={"x-kvmesh-admin-token": "a-token"}
            ) as r:
                assert r.status == 200
            await wait_until(lambda: len(seen) > 0)
            presented = {h.get("x-kvmesh-admin-token") for h in seen}
            assert presented == {worker_token}  # the worker token, or nothing: never "a-token"
            if worker_token is not None:
                # the worker token opens the replica description peers ask for, not the admin API
                wt = {"x-kvmesh-admin-token": worker_token}
                async with http.get(front.url + "/kvmesh/workers", headers=wt) as r:
                    assert r.status == 401
                async with http.get(front.url + "/kvmesh/router", headers=wt) as r:
                    assert r.status == 200
