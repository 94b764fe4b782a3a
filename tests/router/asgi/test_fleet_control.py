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
    pause_reads: int = 0
    """``GET /is_paused`` asked (the router reads it after a pause or a resume, and at its health
    checks); kept out of ``asked``, which is what the clients' calls brought."""
    adapters: set[str] = field(default_factory=set)
    """The LoRA adapters loaded at run time, listed in ``/v1/models`` as vLLM lists them."""
    answers: dict[str, Any] = field(default_factory=dict)
    """A JSON answer of its own for a path."""


def _stock_app(stock: Stock) -> Starlette:
    async def control(request: Request) -> Response:
        body = await request.body()
        if request.method == "GET" and request.url.path == "/is_paused":
            stock.pause_reads += 1
            return JSONResponse({"is_paused": stock.paused})
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
        if path in stock.answers:
            return JSONResponse(stock.answers[path])
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

    paths = (
        *fleet_control.POSTS,
        *fleet_control.GETS,
        *fleet_control.EITHER,
        *fleet_control.OTHER_METHODS,
        *fleet_control.PER_ENGINE,
    )
    methods = ["GET", "POST", "PUT", "DELETE"]
    return Starlette(
        routes=[Route(p, control, methods=methods) for p in paths] + [Route("/v1/models", models)]
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
        assert a.pause_reads >= 1 and b.pause_reads >= 1  # (read before the answer: paused now)
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


async def test_sglangs_settings_and_cache_storage_controls_reach_every_worker_by_their_methods(
    http: aiohttp.ClientSession,
) -> None:
    """SGLang's run-time settings, expert recorder and hierarchical cache storage backend, and the
    RL loop's reads of both engines: each goes to every worker with the client's method, query
    and body (before, the router answered 404 or 405)."""
    a, b = Stock(), Stock()
    calls = [
        ("POST", "/freeze_gc", None),
        ("GET", "/set_trace_level?level=2", None),
        ("POST", "/configure_logging", {"log_requests": True}),
        ("PUT", "/set_internal_state", {"server_args": {"pp_max_micro_batch_size": 8}}),
        ("PUT", "/hicache/storage-backend", {"hicache_storage_backend": "file"}),
        ("GET", "/hicache/storage-backend", None),
        ("DELETE", "/hicache/storage-backend", None),
        ("POST", "/hicache/storage-backend/clear", None),
        ("GET", "/start_expert_distribution_record", None),
        ("POST", "/dump_expert_distribution_record", None),
        ("POST", "/weights_checker", {"action": "snapshot"}),
        ("GET", "/get_world_size?include_dp=false", None),
    ]
    async with _fleet(a, b) as front:
        for method, target, body in calls:
            status, answer = await _call(http, method, front + target, json=body)
            assert status == 200 and set(answer["workers"]) == {"a", "b"}, (target, answer)
        for stock in (a, b):
            assert [(m, p + ("?" + q if q else "")) for m, p, q, *_ in stock.asked] == [
                (method, target) for method, target, _ in calls
            ]
            assert stock.asked[3][3] == b'{"server_args": {"pp_max_micro_batch_size": 8}}'
        async with http.patch(front + "/hicache/storage-backend") as r:
            assert r.status == 405


async def test_a_weight_comparison_matches_only_when_every_engine_does(http: aiohttp.ClientSession) -> None:
    """vLLM's ``/weight_checker`` compare after a weight update: the fleet's ``match`` is true only
    when every engine's is, and each engine's mismatches are under its id."""
    same = {"match": True, "mismatches": []}
    a, b = Stock(answers={"/weight_checker": same}), Stock(answers={"/weight_checker": same})
    async with _fleet(a, b) as front:
        body = {"action": "compare", "baseline": {"w": "x"}}
        status, answer = await _call(http, "POST", front + "/weight_checker", json=body)
        assert (status, answer["match"]) == (200, True), answer
        b.answers["/weight_checker"] = {"match": False, "mismatches": ["lm_head.weight"]}
        status, answer = await _call(http, "POST", front + "/weight_checker", json=body)
        assert (status, answer["match"], answer["mismatches"]) == (200, False, None), answer
        assert answer["workers"]["b"]["mismatches"] == ["lm_head.weight"]


async def test_an_external_corpus_is_one_id_on_every_engine(http: aiohttp.ClientSession) -> None:
    """A corpus for SGLang's n-gram speculative decoding added without an id: the router gives it
    one, the same on every engine, so one removal removes it everywhere (each engine drew its own
    before). An id the client gives goes as it came; one that is not a string reaches no engine."""
    a, b = Stock(), Stock()
    async with _fleet(a, b) as front:
        status, answer = await _call(http, "POST", front + "/add_external_corpus", json={"documents": ["d"]})
        assert status == 200, answer
        sent = [json.loads(stock.asked[-1][3]) for stock in (a, b)]
        assert sent[0] == sent[1] and sent[0]["documents"] == ["d"], sent
        assert len(sent[0]["corpus_id"]) == 32, sent
        body = b'{"corpus_id": "docs-v2", "file_path": "/data/docs.jsonl"}'
        status, answer = await _call(http, "POST", front + "/add_external_corpus", data=body)
        assert status == 200 and a.asked[-1][3] == b.asked[-1][3] == body, answer
        status, answer = await _call(http, "POST", front + "/add_external_corpus", json={"corpus_id": 7})
        assert status == 400 and answer["error"]["param"] == "corpus_id", answer
        status, answer = await _call(http, "POST", front + "/add_external_corpus", data=b"[]")
        assert status == 400 and answer["error"]["param"] == "body", answer
        assert len(a.asked) == len(b.asked) == 2
        for method, path in (("POST", "/remove_external_corpus"), ("GET", "/list_external_corpora")):
            status, answer = await _call(
                http, method, front + path, json=sent[0] if method == "POST" else None
            )
            assert status == 200 and set(answer["workers"]) == {"a", "b"}, answer


async def test_one_engines_role_and_transfer_engine_are_not_the_fleets(http: aiohttp.ClientSession) -> None:
    a = Stock()
    async with _fleet(a) as front:
        for method, path in (
            ("POST", "/pd_role_switch"),
            ("POST", "/update_weights_from_ipc"),
            ("GET", "/remote_instance_transfer_engine_info"),
        ):
            status, answer = await _call(http, method, front + path)
            assert status == 404 and "/kvmesh/workers" in answer["error"]["message"], (path, answer)
        assert a.asked == []
