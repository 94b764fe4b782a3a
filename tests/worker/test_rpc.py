"""kvmesh.worker.rpc: the /kvmesh/* routes any backend serves - validation, answers, errors, token.

The backend here is a small custom engine built the way a real one would be: its pins and sessions
are kvmesh's own retention ledger over a reference count per block (half sync, half async
methods, since the routes accept both). It is served by uvicorn on a free loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from kvmesh.worker.retention import Retention
from kvmesh.worker.rpc import MAX_BODY_BYTES, MAX_TTL_SECONDS, worker_rpc_routes
from tests.router.servers import serve as serve_app

pytestmark = pytest.mark.e2e

BLOCK = 4  # tokens per block of the test engine


class CustomEngine:
    """Caches every full block of every prompt it is shown; block i of a prompt is its i-th token
    tuple. Pins and sessions go through :class:`Retention` with the "reject" policy."""

    def __init__(self, budget_blocks: int = 3) -> None:
        self.refs: Counter[tuple[int, ...]] = Counter()
        self.retention: Retention[tuple[int, ...]] = Retention(
            budget_blocks,
            acquire=self.refs.update,
            release=self.refs.subtract,
            on_over_budget="reject",
            total_blocks=16,
            budget_setting="--budget",
        )
        self.now = 0.0
        self.in_use = False
        self.calls: list[str] = []

    def _blocks(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        full = len(token_ids) // BLOCK * BLOCK
        return [tuple(token_ids[: i + BLOCK]) for i in range(0, full, BLOCK)]

    def info(self) -> dict[str, Any]:
        self.calls.append("info")
        return {"backend": "custom", "block_size": BLOCK}

    async def kv_state(self) -> dict[str, Any]:
        self.calls.append("kv_state")
        return {"block_size": BLOCK, "ranks": []}

    def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int:
        self.calls.append("pin_prefix")
        return self.retention.pin(self._blocks(token_ids), ttl_seconds, self.now)

    async def open_session(self, session_id: str, timeout: float) -> bool:
        self.calls.append("open_session")
        return self.retention.open_session(session_id, timeout, self.now)

    def close_session(self, session_id: str) -> bool:
        self.calls.append("close_session")
        return self.retention.close_session(session_id)

    async def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return not self.in_use


@contextlib.asynccontextmanager
async def serve(engine: CustomEngine, admin_token: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(routes=worker_rpc_routes(engine, admin_token=admin_token))
    async with serve_app(app) as server, httpx.AsyncClient(base_url=server.url, timeout=5) as http:
        yield http


@pytest.fixture
async def engine_http() -> AsyncIterator[tuple[CustomEngine, httpx.AsyncClient]]:
    engine = CustomEngine()
    async with serve(engine) as http:
        yield engine, http


async def test_answers_of_each_route(engine_http: tuple[CustomEngine, httpx.AsyncClient]) -> None:
    engine, http = engine_http
    assert (await http.get("/kvmesh/info")).json() == {"backend": "custom", "block_size": BLOCK}
    assert (await http.get("/kvmesh/kv_state")).json() == {"block_size": BLOCK, "ranks": []}
    r = await http.post("/kvmesh/pin_prefix", json={"token_ids": list(range(9)), "ttl_seconds": 30})
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "blocks_pinned": 2, "ttl_seconds": 30.0}
    assert engine.retention.num_retained == 2 and +engine.refs == Counter(engine._blocks(range(8)))
    opened = await http.post("/kvmesh/session_control", json={"action": "open_session", "session_id": "s"})
    assert opened.json() == {
        "status": "ok",
        "session_id": "s",
        "action": "open_session",
        "created": True,
        "timeout": 300.0,  # the default
    }
    closed = await http.post("/kvmesh/session_control", json={"action": "close_session", "session_id": "s"})
    assert closed.json() == {"status": "ok", "session_id": "s", "action": "close_session", "closed": True}
    assert (await http.post("/kvmesh/reset_prefix_cache")).json() == {"status": "ok"}


async def test_backend_errors_keep_their_status_and_field(
    engine_http: tuple[CustomEngine, httpx.AsyncClient],
) -> None:
    engine, http = engine_http
    await http.post("/kvmesh/pin_prefix", json={"token_ids": list(range(8)), "ttl_seconds": 30})
    over = await http.post("/kvmesh/pin_prefix", json={"token_ids": list(range(100, 108)), "ttl_seconds": 30})
    assert over.status_code == 409
    assert over.json() == {
        "error": {
            "message": "pin budget exceeded: pinning 2 more blocks would retain 4 of 16 blocks; "
            "the limit is 3 (--budget)",
            "type": "ConflictError",
            "param": "token_ids",
            "code": 409,
        }
    }
    engine.in_use = True
    busy = await http.post("/kvmesh/reset_prefix_cache")
    assert busy.status_code == 409
    assert busy.json()["error"]["message"] == "cannot reset the prefix cache while blocks are in use"


PIN = "/kvmesh/pin_prefix"
SESSION = "/kvmesh/session_control"


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (PIN, b"{not json", "body", "the request body is not valid JSON"),
        (PIN, [1, 2], "body", "the request body must be a JSON object"),
        (
            PIN,
            {"ttl_seconds": 1},
            "token_ids",
            "'token_ids' must be a non-empty list of token ids in [0, 2**32)",
        ),
        (PIN, {"token_ids": [], "ttl_seconds": 1}, "token_ids", None),
        (PIN, {"token_ids": [1, -2], "ttl_seconds": 1}, "token_ids", None),
        (PIN, {"token_ids": [1, True], "ttl_seconds": 1}, "token_ids", None),
        (PIN, {"token_ids": [1, 2.0], "ttl_seconds": 1}, "token_ids", None),
        (PIN, {"token_ids": [1, 2**32], "ttl_seconds": 1}, "token_ids", None),
        (PIN, {"token_ids": [1]}, "ttl_seconds", "'ttl_seconds' is required"),
        (
            PIN,
            {"token_ids": [1], "ttl_seconds": 0},
            "ttl_seconds",
            "'ttl_seconds' must be a positive number of seconds, got 0",
        ),
        (
            PIN,
            {"token_ids": [1], "ttl_seconds": "5"},
            "ttl_seconds",
            "'ttl_seconds' must be a positive number of seconds, got '5'",
        ),
        (PIN, {"token_ids": [1], "ttl_seconds": True}, "ttl_seconds", None),
        (PIN, b'{"token_ids": [1], "ttl_seconds": NaN}', "ttl_seconds", None),
        (
            PIN,
            {"token_ids": [1], "ttl_seconds": MAX_TTL_SECONDS + 1},
            "ttl_seconds",
            "'ttl_seconds' must be at most 604800 seconds, got 604801.0",
        ),
        (SESSION, {"action": "open_session"}, "session_id", "'session_id' must be a non-empty string"),
        (SESSION, {"action": "open_session", "session_id": ""}, "session_id", None),
        (
            SESSION,
            {"action": "open_session", "session_id": "a\r\nx-evil: 1"},
            "session_id",
            "'session_id' must be printable ASCII, not beginning or ending with a space: turns name it "
            "in the X-Session-ID header",
        ),
        (SESSION, {"action": "close_session", "session_id": "caf\u00e9"}, "session_id", None),
        # nesting past the JSON parser's depth (a RecursionError, and a 500, before)
        (PIN, b"[" * 3000, "body", "the request body is not valid JSON"),
        (SESSION, {"action": "open_session", "session_id": "s", "timeout": -1}, "timeout", None),
        (
            SESSION,
            {"action": "pause", "session_id": "s"},
            "action",
            "'action' must be 'open_session' or 'close_session', got 'pause'",
        ),
    ],
)
async def test_invalid_requests_get_400_naming_the_field_and_never_reach_the_backend(
    engine_http: tuple[CustomEngine, httpx.AsyncClient],
    path: str,
    body: object,
    param: str,
    message: str | None,
) -> None:
    engine, http = engine_http
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    if message is not None:
        assert error["message"] == message
    assert engine.calls == []


async def test_a_body_past_the_limit_is_a_413_and_never_reaches_the_backend(
    engine_http: tuple[CustomEngine, httpx.AsyncClient],
) -> None:
    engine, http = engine_http
    ids = b"1," * (MAX_BODY_BYTES // 2)
    content = b'{"token_ids": [' + ids + b'1], "ttl_seconds": 5}'
    for stream in (False, True):  # (declared by content-length, and counted as it is read)
        body: Any = content
        if stream:

            async def chunks() -> AsyncIterator[bytes]:
                for i in range(0, len(content), 1 << 20):
                    yield content[i : i + (1 << 20)]

            body = chunks()
        r = await http.post(PIN, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413, stream
        assert r.json()["error"]["param"] == "body"
    assert engine.calls == []


async def test_a_declared_oversize_body_is_refused_before_it_is_sent(
    engine_http: tuple[CustomEngine, httpx.AsyncClient],
) -> None:
    # (the head alone, over a raw socket: an answer can only come from the content-length check,
    # since the body it declares never arrives)
    engine, http = engine_http
    reader, writer = await asyncio.open_connection(http.base_url.host, http.base_url.port)
    try:
        writer.write(
            f"POST {PIN} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 413 ")
    assert engine.calls == []


async def test_the_admin_token_guards_every_route() -> None:
    engine = CustomEngine()
    async with serve(engine, admin_token="s3cret") as http:

        async def statuses(headers: dict[str, str]) -> list[int]:
            return [
                (await http.get("/kvmesh/info", headers=headers)).status_code,
                (await http.get("/kvmesh/kv_state", headers=headers)).status_code,
                (
                    await http.post(PIN, json={"token_ids": [1], "ttl_seconds": 1}, headers=headers)
                ).status_code,
                (
                    await http.post(
                        SESSION, json={"action": "close_session", "session_id": "x"}, headers=headers
                    )
                ).status_code,
                (await http.post("/kvmesh/reset_prefix_cache", headers=headers)).status_code,
            ]

        assert await statuses({}) == [401] * 5
        assert await statuses({"authorization": "Bearer wrong"}) == [401] * 5
        assert await statuses({"authorization": "Basic s3cret"}) == [401] * 5
        assert await statuses({"x-kvmesh-admin-token": "s3cre"}) == [401] * 5
        assert engine.calls == []
        refused = await http.get("/kvmesh/info")
        assert refused.json()["error"] == {
            "message": "missing or wrong kvmesh admin token",
            "type": "AuthenticationError",
            "param": None,
            "code": 401,
        }
        assert await statuses({"authorization": "Bearer s3cret"}) == [200] * 5
        assert await statuses({"authorization": "bearer  s3cret"}) == [200] * 5
        assert await statuses({"x-kvmesh-admin-token": "s3cret"}) == [200] * 5


async def test_another_method_gets_an_openai_405_naming_the_one_served(
    engine_http: tuple[CustomEngine, httpx.AsyncClient],
) -> None:
    """Starlette's own 405 is plain text; the worker routes answer JSON, with ``allow``."""
    engine, http = engine_http
    for method, path, allowed in (
        ("POST", "/kvmesh/info", "GET"),
        ("PUT", "/kvmesh/kv_state", "GET"),
        ("GET", PIN, "POST"),
        ("DELETE", SESSION, "POST"),
        ("GET", "/kvmesh/reset_prefix_cache", "POST"),
    ):
        r = await http.request(method, path)
        assert (r.status_code, r.headers["allow"]) == (405, allowed), path
        assert r.json()["error"]["message"] == f"{method} is not served at {path}; use {allowed}"
    assert engine.calls == []
    assert (await http.get("/kvmesh/info")).status_code == 200  # (the routes themselves still answer)
