"""SGLang's sessions through the standalone router, over HTTP, in front of ``kvmesh mock`` engines
(which hold sessions as SGLang 0.5.23 does, and refuse a request naming one they do not hold:
kvmesh.mock.sglang_sessions).

A session opened through the router lives on one engine; every request naming it goes there, and
its close reaches it (kvmesh.router.asgi.sglang_sessions)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.asgi.test_agent_features import BS, mock_fleet, synced_replicas, until
from tests.router.asgi.test_responses_api import WORKER, engine_added
from tests.router.asgi.test_tokens_api import nothing_runs
from tests.router.servers import serve

TURN = {"sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


async def call(http: aiohttp.ClientSession, url: str, path: str, body: Any) -> tuple[int, Any, str | None]:
    async with http.post(url + path, json=body) as r:
        raw = await r.read()
        doc = await r.json(content_type=None) if raw else None
        return r.status, doc, r.headers.get(WORKER)


async def turn(http: aiohttp.ClientSession, url: str, session: str, text: str) -> tuple[int, Any, str | None]:
    return await call(http, url, "/generate", {"text": text, "session_params": {"id": session}, **TURN})


async def test_a_sessions_requests_all_go_to_the_engine_that_opened_it(http: aiohttp.ClientSession) -> None:
    """Three sessions on three engines, opened in turn; each one's turns go to its engine (any other
    would refuse them), whatever their prompts, and its blocks stay held there."""
    async with mock_fleet(3) as (front, mocks, app):
        by_url = {m.base_url: m for m in mocks}
        homes = {}
        for _ in range(3):
            status, session, home = await call(
                http, front.url, "/open_session", {"capacity_of_str_len": 4096}
            )
            assert status == 200 and isinstance(session, str), session
            assert session in by_url[home].engine.retention.sessions
            homes[session] = home
        assert sorted(homes.values()) == sorted(by_url)  # (spread: one each)
        for step in range(3):
            for session, home in homes.items():
                text = f"Step {step} of the episode, a prompt no engine has seen before. " * 3
                status, answer, worker = await turn(http, front.url, session, text)
                assert status == 200, answer
                assert worker == home
        # A session id the client chose, and one still open: the engine holding it refuses it.
        chosen = {"capacity_of_str_len": 4096, "session_id": "episode-7"}
        status, session, home = await call(http, front.url, "/open_session", chosen)
        assert (status, session) == (200, "episode-7")
        status, error, again = await call(http, front.url, "/open_session", chosen)
        assert status == 400 and again == home, error
        await nothing_runs(mocks, app)


async def test_a_closed_session_is_forgotten_and_its_engine_lets_it_go(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        status, session, home = await call(http, front.url, "/open_session", {"capacity_of_str_len": 64})
        assert status == 200
        holder = next(m for m in mocks if m.base_url == home)
        assert (await turn(http, front.url, session, "One turn."))[0] == 200
        status, body, _ = await call(http, front.url, "/close_session", {"session_id": session})
        assert (status, body) == (200, None)
        assert session not in holder.engine.retention.sessions
        status, error, _ = await turn(http, front.url, session, "Another turn.")
        assert status == 400 and error["error"]["param"] == "session_params.id", error
        # Opened at an engine directly, unknown to the router: its close reaches every engine.
        async with http.post(mocks[1].base_url + "/open_session", json={"capacity_of_str_len": 8}) as r:
            direct = await r.json()
        assert direct in mocks[1].engine.retention.sessions
        status, _, _ = await call(http, front.url, "/close_session", {"session_id": direct})
        assert status == 200
        assert direct not in mocks[1].engine.retention.sessions
        await nothing_runs(mocks, app)


async def test_a_session_whose_engine_is_down_is_a_503_naming_it(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(1) as (front, mocks, app):
        async with engine_added(http, front.url, "gone"):
            await until(lambda: "gone" in app.mesh.registry.routable)
            opened = None
            while opened is None:  # (taken in turn: the next open lands on the new engine)
                status, session, home = await call(
                    http, front.url, "/open_session", {"capacity_of_str_len": 8}
                )
                assert status == 200
                opened = session if home == "gone" else None
        await until(lambda: "gone" not in app.mesh.registry.routable)
        status, error, _ = await turn(http, front.url, opened, "Still there?")
        assert (status, error["error"]["param"]) == (503, "session_params.id"), error
        status, error, _ = await call(http, front.url, "/close_session", {"session_id": opened})
        assert status == 503, error
        status, session, home = await call(http, front.url, "/open_session", {"capacity_of_str_len": 8})
        assert status == 200 and home == mocks[0].base_url  # (the fleet opens the rest)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/open_session", {}, "capacity_of_str_len"),
        ("/open_session", {"capacity_of_str_len": "big"}, "capacity_of_str_len"),
        ("/open_session", {"capacity_of_str_len": 8, "session_id": 7}, "session_id"),
        ("/open_session", {"capacity_of_str_len": 8, "timeout": "soon"}, "timeout"),
        ("/open_session", {"capacity_of_str_len": 8, "streaming": "yes"}, "streaming"),
        ("/open_session", [1], "body"),
        ("/close_session", {}, "session_id"),
        ("/generate", {"text": "hi", "session_params": {"id": 3}}, "session_params.id"),
        ("/generate", {"text": "hi", "session_params": {"id": "never-opened"}}, "session_params.id"),
    ],
)
async def test_a_bad_session_request_is_a_400_naming_the_field(
    http: aiohttp.ClientSession, path: str, body: Any, field: str
) -> None:
    async with mock_fleet(1) as (front, mocks, _):
        status, error, _ = await call(http, front.url, path, body)
        assert (status, error["error"]["param"]) == (400, field), error
        assert not mocks[0].engine.retention.sessions


async def test_kvmeshs_own_session_control_is_refused_on_an_sglang_sessions_request(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(1) as (front, _, _):
        _, session, _ = await call(http, front.url, "/open_session", {"capacity_of_str_len": 8})
        body = {
            "text": "hi",
            "session_params": {"id": session},
            "nvext": {"session_control": {"session_id": "other", "action": "open"}},
        }
        status, error, _ = await call(http, front.url, "/generate", body)
        assert (status, error["error"]["param"]) == (400, "nvext.session_control"), error


async def test_inside_the_engines_a_session_is_followed_to_the_engine_that_opened_it(
    http: aiohttp.ClientSession,
) -> None:
    """Each engine's router is the fleet's front, and a load balancer sends a session's requests
    to any engine. One opened at the first engine is served there when its requests reach the
    second (whose engine would refuse them), and closed there when its close reaches the third."""
    async with start_mesh(3, RouterConfig(), MockConfig(block_size=BS, speedup=50.0)) as nodes:
        opener, other, third = nodes
        status, session, _ = await call(http, opener.url, "/open_session", {"capacity_of_str_len": 64})
        assert status == 200 and session in opener.engine.retention.sessions
        for entry in (other, opener, third, other):
            status, answer, worker = await turn(http, entry.url, session, "A turn of the episode.")
            assert status == 200, answer
            # (forwarded to the opener; at the opener itself, served by its engine untouched)
            assert worker == (opener.url if entry is not opener else None)
        # Its id asked for again at another engine: the opener, which holds it, refuses it.
        taken = {"capacity_of_str_len": 64, "session_id": session}
        status, error, _ = await call(http, other.url, "/open_session", taken)
        assert (status, error["error"]["param"]) == (400, "session_id"), error
        assert session not in other.engine.retention.sessions
        status, _, _ = await call(http, third.url, "/close_session", {"session_id": session})
        assert status == 200
        assert session not in opener.engine.retention.sessions
        # Closed everywhere: a request naming it is the engine's own refusal where it arrives.
        status, error, _ = await turn(http, other.url, session, "One more.")
        assert (status, error["error"]["param"]) == (400, "session_params.id"), error
        # A peer's question is answered to a peer alone: a client gets the engine's 404.
        async with http.get(opener.url + "/kvmesh/sglang_session", params={"id": session}) as r:
            assert r.status == 404


async def test_standalone_replicas_in_sync_follow_each_others_sessions(http: aiohttp.ClientSession) -> None:
    """Two standalone routers behind one address, in replica sync: a session opened through one is
    served through the other at the engine that opened it, and closed through the other too."""
    async with synced_replicas(http, 3, RouterConfig(router_replica_sync=True)) as (mocks, fronts, (a, b)):
        status, session, home = await call(http, fronts[0].url, "/open_session", {"capacity_of_str_len": 64})
        assert status == 200
        await until(lambda: b.sglang_session_homes.home(session) == home)
        for front in (fronts[1], fronts[0], fronts[1]):
            status, answer, worker = await turn(http, front.url, session, "A turn through either.")
            assert (status, worker) == (200, home), answer
        status, _, _ = await call(http, fronts[1].url, "/close_session", {"session_id": session})
        assert status == 200
        holder = next(m for m in mocks if m.base_url == home)
        assert session not in holder.engine.retention.sessions
        await until(lambda: a.sglang_session_homes.home(session) is None)


async def test_a_session_opened_for_a_client_that_left_is_closed() -> None:
    """A client that leaves while its engine opens the session never learns its id: the router
    closes it there at once, and does not keep it as anyone's."""
    closed: list[Any] = []

    async def models(_: Request) -> JSONResponse:  # (what the router's health check reads)
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def open_session(_: Request) -> JSONResponse:
        await asyncio.sleep(0.5)  # (an engine slow to answer)
        return JSONResponse("s-orphan")

    async def close_session(request: Request) -> Response:
        closed.append(await request.json())
        return Response(status_code=200)

    engine = Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/open_session", open_session, methods=["GET", "POST"]),
            Route("/close_session", close_session, methods=["GET", "POST"]),
        ]
    )
    async with serve(engine) as worker:
        settings = MeshSettings(
            workers=(WorkerSpec(worker.url, "w0", backend="sglang"),),
            router=RouterConfig(use_kv_events=False),
            health_interval=0.2,
        )
        app = build_router_app(settings)
        async with serve(app) as front, aiohttp.ClientSession() as http:
            async with http.get(front.url + "/health") as r:
                assert r.status == 200
            with contextlib.suppress(asyncio.TimeoutError):
                async with http.post(
                    front.url + "/open_session",
                    json={"capacity_of_str_len": 8},
                    timeout=aiohttp.ClientTimeout(total=0.1),
                ):
                    pass
            await until(lambda: closed == [{"session_id": "s-orphan"}])
            assert app.mesh.sglang_session_homes.home("s-orphan") is None
