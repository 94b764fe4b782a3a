"""Runtime worker admin API: POST /kvmesh/workers adds a worker, DELETE /kvmesh/workers/{id} removes it."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from kvmesh import _native
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.engines import EngineState, engine_app
from tests.router.servers import serve

TOKEN = {"x-kvmesh-admin-token": "s3cret"}


async def _rows(http: aiohttp.ClientSession, front: str) -> dict[str, dict[str, Any]]:
    async with http.get(front + "/kvmesh/workers", headers=TOKEN) as r:
        return {row["worker_id"]: row for row in (await r.json())["workers"]}


async def _add(
    http: aiohttp.ClientSession, front: str, body: Any, headers: dict[str, str] | None = TOKEN
) -> tuple[int, Any]:
    async with http.post(front + "/kvmesh/workers", json=body, headers=headers) as r:
        return r.status, await r.json()


async def _delete(
    http: aiohttp.ClientSession, front: str, worker_id: str, headers: dict[str, str] | None = TOKEN
) -> tuple[int, Any]:
    async with http.delete(front + "/kvmesh/workers/" + worker_id, headers=headers) as r:
        return r.status, await r.json()


async def test_a_worker_added_at_runtime_is_discovered_followed_and_removed() -> None:
    async with (
        run_mock(block_size=16, speedup=50.0) as m0,
        run_mock(block_size=16, speedup=50.0, seed=1) as m1,
        aiohttp.ClientSession() as http,
    ):
        settings = MeshSettings(workers=(WorkerSpec(m0.base_url, "m0"),), admin_token="s3cret")
        async with serve(build_router_app(settings)) as front:
            status, row = await _add(http, front.url, {"url": m1.base_url, "id": "m1"})
            assert status == 201, row
            # discovered through its /kvmesh/info, like a configured worker
            described = (row["worker_id"], row["state"], row["backend"], row["block_size"])
            assert described == ("m1", "up", "mock", 16)
            body = {
                "model": m1.config.model,
                "messages": [{"role": "user", "content": "runtime worker " * 30}],
                "max_tokens": 2,
                "nvext": {"backend_instance_id": "m1"},
            }
            async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                assert r.headers["x-kvmesh-worker-id"] == "m1"
            for _ in range(200):  # its KV events reach the index
                if (await _rows(http, front.url))["m1"]["indexed_blocks"] > 0:
                    break
                await asyncio.sleep(0.02)
            assert (await _rows(http, front.url))["m1"]["indexed_blocks"] > 0
            async with http.get(front.url + "/metrics") as r:
                series = [line for line in (await r.text()).splitlines() if 'worker="m1"' in line]
            assert {s.split("{")[0] for s in series} >= {
                "kvmesh_cached_tokens_predicted_total",
                "kvmesh_cached_tokens_reported_total",
                "kvmesh_worker_active_decode_blocks",
            }

            assert await _delete(http, front.url, "m1") == (200, {"removed": "m1"})
            assert list(await _rows(http, front.url)) == ["m0"]
            async with http.get(front.url + "/metrics") as r:
                lines = (await r.text()).splitlines()
            gauges = [line for line in lines if line.startswith("kvmesh_worker_")]
            assert gauges and not [g for g in gauges if 'worker="m1"' in g]  # its load went with it
            # and every series of its own: a fleet whose engines come and go under new ids had
            # each router export them for ever
            assert not [line for line in lines if 'worker="m1"' in line]
            async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "nvext.backend_instance_id"
            assert (await _delete(http, front.url, "m1"))[0] == 404


async def test_admin_api_refusals() -> None:
    odd = EngineState("odd", block_size=32)
    async with (
        serve(engine_app(EngineState("e0"))) as e0,
        serve(engine_app(EngineState("e1"))) as e1,
        serve(engine_app(odd)) as bad,
        aiohttp.ClientSession() as http,
    ):
        settings = MeshSettings(
            workers=(WorkerSpec(e0.url, "e0"),),
            router=RouterConfig(use_kv_events=False),
            admin_token="s3cret",
        )
        async with serve(build_router_app(settings)) as front:
            # the token guards both verbs
            assert (await _add(http, front.url, {"url": e1.url}, headers=None))[0] == 401
            wrong = {"authorization": "Bearer nope"}
            assert (await _add(http, front.url, {"url": e1.url}, headers=wrong))[0] == 401
            assert (await _delete(http, front.url, "e0", headers=None))[0] == 401
            # one rule for every admin route, reads included
            for path in ("/kvmesh/workers", "/kvmesh/router", "/busy_threshold"):
                async with http.get(front.url + path) as r:
                    assert (r.status, (await r.json())["error"]["type"]) == (401, "AuthenticationError")
                async with http.get(front.url + path, headers={"Authorization": "bearer s3cret"}) as r:
                    assert r.status == 200, path
                    if path == "/kvmesh/router":  # which code decides: compiled or Python, and why
                        assert (await r.json())["compiled"] == _native.summary()
            # a bad spec names its field
            for body, field in (
                ({"url": e1.url, "block_size": -1}, "block_size"),
                ({"url": 5}, "url"),
                ({"url": "ftp://x:1"}, "url"),
                ({"url": e1.url, "colour": "red"}, "colour"),
                ({"url": e1.url, "kv_events_endpoints": 3}, "kv_events_endpoints"),
                # (answers name their worker in a header: CR or LF there broke every one of them)
                ({"url": e1.url, "id": "e1\r\nx-evil: 1"}, "id"),
                ({"url": e1.url, "id": " e1"}, "id"),
                # (a space broke the request line to the worker, which was kept "down" for it)
                ({"url": e1.url + "/a b", "id": "spaced"}, "url"),
                ({"url": e1.url.replace("//", "//user:pw@"), "id": "creds"}, "url"),
                ({"url": "http://[::1", "id": "bracket"}, "url"),  # (the URL parser raised: a 500)
                ([e1.url], "body"),
            ):
                status, answer = await _add(http, front.url, body)
                assert (status, answer["error"]["param"]) == (400, field), answer
            status, answer = await _add(http, front.url, {"url": e1.url, "block_size": -1})
            assert answer["error"]["message"] == "block_size must be a positive integer, got -1"
            # conflicts
            status, answer = await _add(http, front.url, {"url": e1.url, "id": "e0"})
            assert (status, answer["error"]["message"]) == (409, "worker id 'e0' is already registered")
            status, answer = await _add(http, front.url, {"url": e0.url, "id": "again"})
            assert status == 409
            assert answer["error"]["message"] == f"worker {e0.url} is already registered as 'e0'"
            status, answer = await _add(http, front.url, {"url": bad.url, "id": "odd"})
            assert status == 409
            assert answer["error"]["message"] == (
                "block size 32 differs from the fleet's 16; KV hashes would never match"
            )
            status, answer = await _add(http, front.url, {"url": e1.url, "block_size": 64})
            assert status == 409
            assert list(await _rows(http, front.url)) == ["e0"]  # nothing was kept
            assert odd.received == []
            # a host in another script is IDNA-encoded, and is the id when none is given
            status, row = await _add(http, front.url, {"url": "http://b\u00fccher.invalid:9"})
            idna = "http://xn--bcher-kva.invalid:9"
            assert (status, row["worker_id"], row["url"]) == (201, idna, idna)
            assert (await _delete(http, front.url, row["worker_id"]))[0] == 200
            # a worker that does not answer yet is kept, down, and admitted later
            status, row = await _add(http, front.url, {"url": "http://127.0.0.1:9", "id": "later"})
            assert (status, row["state"]) == (201, "down")
            assert (await _delete(http, front.url, "later"))[0] == 200
            # a good one serves at once
            status, row = await _add(http, front.url, {"url": e1.url, "id": "e1"})
            assert (status, row["state"]) == (201, "up")
            hello = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(
                front.url + "/v1/chat/completions", json=hello, headers={"x-worker-instance-id": "e1"}
            ) as r:
                assert r.status == 200
                assert r.headers["x-kvmesh-worker-id"] == "e1"


async def test_a_wrong_method_or_path_gets_an_openai_error_naming_what_is_served() -> None:
    """Starlette's own 405 and 404 are plain text; the admin API answers JSON like every other
    refusal, and a 405 names the methods in ``allow``."""
    async with (
        serve(engine_app(EngineState("e0"))) as e0,
        serve(build_router_app(MeshSettings(workers=(WorkerSpec(e0.url, "e0"),)))) as front,
        aiohttp.ClientSession() as http,
    ):
        for method, path, allowed in (
            ("PUT", "/kvmesh/workers", "GET, POST"),
            ("POST", "/kvmesh/router", "GET"),
            ("DELETE", "/kvmesh/decisions", "GET"),
            ("PATCH", "/busy_threshold", "GET, POST"),
            ("GET", "/kvmesh/workers/e0", "DELETE"),
        ):
            async with http.request(method, front.url + path) as r:
                assert (r.status, r.headers["allow"]) == (405, allowed), path
                error = (await r.json())["error"]
                assert error["message"] == f"{method} is not served at {path}; use {allowed}"
        async with http.delete(front.url + "/kvmesh/workers/%0A0") as r:  # (no route matches a line break)
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "NotFoundError"
        async with http.get(front.url + "/kvmesh/workers") as r:  # (the routes themselves still answer)
            assert [row["worker_id"] for row in (await r.json())["workers"]] == ["e0"]
