"""The standalone router's engine controls over HTTP (kvmesh.router.asgi.fleet_control): one call
pauses, resumes, puts to sleep or wakes every worker, and the answer is the fleet's.

Stock servers stand in for the engines here, answering as vLLM's and SGLang's do and recording what
they were asked; ``test_fleet_control_mock.py`` drives the same paths on ``kvmesh mock`` engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.router.asgi import fleet_control
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import Server, serve


@dataclass
class Stock:
    """A stock engine's control endpoints: what it was asked, and how it answers."""

    paused: bool = False
    weight_version: str = "v1"
    status: int = 200  # of every control's answer
    crash: bool = False  # drop every connection when asked, as a killed engine does
    server: Server | None = None
    asked: list[tuple[str, str, str, bytes, str | None]] = field(default_factory=list)
    adapters: set[str] = field(default_factory=set)
    """The LoRA adapters loaded at run time, listed in ``/v1/models`` as vLLM lists them."""


def _stock_app(stock: Stock) -> Starlette:
    async def control(request: Request) -> Response:
        body = await request.body()
        stock.asked.append(
            (request.method, request.url.path, request.url.query, body, request.headers.get("authorization"))
        )
        if stock.crash and stock.server is not None:
            stock.server.crash()
            await asyncio.sleep(5)
        if stock.status != 200:
            return JSONResponse(
                {"detail": [{"loc": ["query", "mode"], "msg": "bad"}]}, status_code=stock.status
            )
        path = request.url.path
        if path == "/is_paused":
            return JSONResponse({"is_paused": stock.paused})
        if path == "/weight_info":
            return JSONResponse({"weight_version": stock.weight_version})
        if path == "/release_memory_occupation":
            return JSONResponse(None)  # (SGLang's handler returns nothing)
        if path.endswith("load_lora_adapter"):
            name = json.loads(body)["lora_name"]
            if path.endswith("/unload_lora_adapter"):
                stock.adapters.discard(name)
            else:
                stock.adapters.add(name)
            return Response(f"Success: LoRA adapter '{name}' done.")  # (vLLM's: plain text)
        return JSONResponse({"status": "paused" if path == "/pause" else "ok"})

    async def models(request: Request) -> Response:
        adapters = [{"id": a, "object": "model", "parent": "m"} for a in sorted(stock.adapters)]
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}, *adapters]})

    paths = (*fleet_control.POSTS, *fleet_control.GETS, *fleet_control.EITHER, *fleet_control.PER_ENGINE)
    return Starlette(
        routes=[Route(p, control, methods=["GET", "POST"]) for p in paths] + [Route("/v1/models", models)]
    )


@contextlib.asynccontextmanager
async def _fleet(*stocks: Stock, admin_token: str | None = None) -> AsyncIterator[str]:
    """A standalone router in front of ``stocks`` (worker ids a, b, ...): its URL."""
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for stock in stocks:
            stock.server = await stack.enter_async_context(serve(_stock_app(stock)))
            urls.append(stock.server.url)
        workers = tuple(WorkerSpec(u, chr(ord("a") + i), backend="vllm") for i, u in enumerate(urls))
        settings = MeshSettings(
            workers=workers,
            router=RouterConfig(use_kv_events=False),
            health_interval=0.2,
            admin_token=admin_token,
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        yield front.url


async def _call(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, Any]:
    async with http.request(method, url, **kw) as r:
        return r.status, await r.json()


async def test_a_pause_reaches_every_worker_as_the_client_sent_it(http: aiohttp.ClientSession) -> None:
    a, b = Stock(), Stock()
    async with _fleet(a, b) as front:
        status, answer = await _call(
            http, "POST", front + "/pause?mode=keep&clear_cache=false", headers={"authorization": "Bearer k"}
        )
        assert status == 200, answer
        assert answer == {
            "status": "paused",
            "workers": {"a": {"status": "paused"}, "b": {"status": "paused"}},
        }
        asked = ("POST", "/pause", "mode=keep&clear_cache=false", b"", "Bearer k")
        assert a.asked == b.asked == [asked]
        # SGLang's pause carries its mode in a JSON body, which goes on as it came
        status, answer = await _call(http, "POST", front + "/pause_generation", json={"mode": "in_place"})
        assert status == 200 and answer["status"] == "ok", answer
        assert a.asked[-1][3] == b.asked[-1][3] == b'{"mode": "in_place"}'
        # SGLang takes GET as well as POST where it does, and may answer with nothing
        status, answer = await _call(http, "GET", front + "/release_memory_occupation")
        assert status == 200 and answer == {"workers": {"a": None, "b": None}}, answer
        assert a.asked[-1][:2] == ("GET", "/release_memory_occupation")


async def test_the_fleet_is_paused_only_when_every_worker_is(http: aiohttp.ClientSession) -> None:
    a, b = Stock(paused=True), Stock(paused=False, weight_version="v2")
    async with _fleet(a, b) as front:
        status, answer = await _call(http, "GET", front + "/is_paused")
        assert status == 200
        assert answer == {
            "is_paused": False,
            "workers": {"a": {"is_paused": True}, "b": {"is_paused": False}},
        }
        b.paused = True
        status, answer = await _call(http, "GET", front + "/is_paused")
        assert answer["is_paused"] is True
        # a field the workers disagree on has no one value for the fleet
        status, answer = await _call(http, "GET", front + "/weight_info")
        assert status == 200 and answer["weight_version"] is None
        assert answer["workers"] == {"a": {"weight_version": "v1"}, "b": {"weight_version": "v2"}}


async def test_a_refusal_every_worker_shares_is_the_clients_and_a_split_is_a_502(
    http: aiohttp.ClientSession,
) -> None:
    a, b = Stock(status=422), Stock(status=422)
    async with _fleet(a, b) as front:
        status, answer = await _call(http, "POST", front + "/pause?mode=sideways")
        assert status == 422 and answer["detail"][0]["loc"] == ["query", "mode"], answer
        b.status = 200
        status, answer = await _call(http, "POST", front + "/resume")
        assert status == 502, answer
        assert answer["succeeded"] == ["b"] and list(answer["failed"]) == ["a"]
        assert answer["failed"]["a"].startswith("HTTP 422") and answer["error"]["code"] == 502


async def test_weight_transfers_per_engine_and_bad_bodies_reach_no_engine(
    http: aiohttp.ClientSession,
) -> None:
    a = Stock()
    async with _fleet(a) as front:
        status, answer = await _call(
            http, "POST", front + "/init_weight_transfer_engine", json={"init_info": {}}
        )
        assert status == 404 and "/kvmesh/workers" in answer["error"]["message"], answer
        status, answer = await _call(http, "POST", front + "/pause_generation", data=b"[1, 2]")
        assert status == 400 and answer["error"]["param"] == "body", answer
        assert a.asked == []


async def test_the_admin_token_is_required_and_goes_no_further(http: aiohttp.ClientSession) -> None:
    a = Stock()
    async with _fleet(a, admin_token="t") as front:
        status, answer = await _call(http, "POST", front + "/sleep?level=1")
        assert status == 401 and a.asked == [], answer
        status, _ = await _call(http, "POST", front + "/sleep?level=1", headers={"x-kvmesh-admin-token": "t"})
        assert status == 200
        status, _ = await _call(http, "POST", front + "/wake_up", headers={"authorization": "Bearer t"})
        assert status == 200
        assert [(path, auth) for _, path, _, _, auth in a.asked] == [("/sleep", None), ("/wake_up", None)]


async def test_a_worker_that_breaks_off_is_named(http: aiohttp.ClientSession) -> None:
    a, b = Stock(), Stock(crash=True)
    async with _fleet(a, b) as front:
        status, answer = await _call(http, "POST", front + "/resume")
        assert status == 502, answer
        assert answer["succeeded"] == ["a"] and list(answer["failed"]) == ["b"], answer
        assert answer["failed"]["b"], answer


async def test_a_worker_down_is_not_asked_and_the_answer_names_it(http: aiohttp.ClientSession) -> None:
    """A loop must know which engines missed a pause: one that comes back later is not paused."""
    a, b = Stock(), Stock()
    async with _fleet(a, b) as front:
        assert b.server is not None
        b.server.crash()
        for _ in range(250):
            status, listed = await _call(http, "GET", front + "/kvmesh/workers")
            if {w["worker_id"]: w["state"] for w in listed["workers"]}.get("b") == "down":
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the router never saw b down")
        status, answer = await _call(http, "POST", front + "/pause")
        assert status == 200, answer
        assert list(answer["workers"]) == ["a"] and answer["not_asked"] == {"b": "down"}, answer
        assert [path for _, path, *_ in b.asked] == []
        status, answer = await _call(http, "POST", front + "/resume")
        assert answer["not_asked"] == {"b": "down"}, answer


async def test_a_lora_adapter_loaded_through_the_router_is_routed_to_at_once(
    http: aiohttp.ClientSession,
) -> None:
    """A run-time LoRA load goes to every worker, and the router reads their adapters again at
    once: the adapter's requests can go to them from the answer on (before, the router learnt of
    it at a later health check, and routed its requests as the base model's until then)."""
    a, b = Stock(), Stock()

    async def adapters(front: str) -> dict[str, list[str]]:
        _, listed = await _call(http, "GET", front + "/kvmesh/workers")
        return {w["worker_id"]: w["lora_adapters"] for w in listed["workers"]}

    async with _fleet(a, b) as front:
        for load, unload in (
            ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
            ("/load_lora_adapter", "/unload_lora_adapter"),  # (SGLang's)
        ):
            body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            status, answer = await _call(http, "POST", front + load, json=body)
            assert status == 200, answer
            assert set(answer["workers"]) == {"a", "b"} and "sql" in answer["workers"]["a"]
            assert a.adapters == b.adapters == {"sql"}
            assert await adapters(front) == {"a": ["sql"], "b": ["sql"]}
            status, answer = await _call(http, "POST", front + unload, json={"lora_name": "sql"})
            assert status == 200, answer
            assert await adapters(front) == {"a": [], "b": []}


async def test_the_profilers_and_a_weight_update_session_reach_every_worker(
    http: aiohttp.ClientSession,
) -> None:
    """One call profiles the whole fleet (vLLM's POST, SGLang's GET or POST), and SGLang's session
    around a load of in-place-quantized weights opens and closes on every engine."""
    a, b = Stock(), Stock()
    async with _fleet(a, b) as front:
        for method, path in (("POST", "/start_profile"), ("GET", "/stop_profile")):
            status, answer = await _call(http, method, front + path)
            assert status == 200 and set(answer["workers"]) == {"a", "b"}, answer
        for path, body in (("/begin_weight_update", {"selector": "all"}), ("/end_weight_update", {})):
            status, answer = await _call(http, "POST", front + path, json=body)
            assert status == 200, answer
        asked = [(m, p) for m, p, *_ in a.asked]
        assert asked == [
            ("POST", "/start_profile"),
            ("GET", "/stop_profile"),
            ("POST", "/begin_weight_update"),
            ("POST", "/end_weight_update"),
        ]
        assert [(m, p) for m, p, *_ in b.asked] == asked
        assert a.asked[2][3] == b'{"selector": "all"}'
