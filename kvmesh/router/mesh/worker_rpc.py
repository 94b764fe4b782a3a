"""The router's client for the worker RPCs under ``/kvmesh/`` (DESIGN.md, "worker RPCs").

One typed method per RPC (``info``, ``kv_state``, ``models``, ``open_session``,
``close_session``, ``pin_prefix``) over one transport choice: the engine the middleware is embedded
in is called in-process through its own ASGI app (it is up by definition while this code runs, and
a loopback connection to itself would cost a socket per call); every other worker over HTTP with
kvmesh's own client. Payload shapes live here only, so the middleware, the registry and the
housekeeping never build them inline.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from kvmesh._types import WorkerId
from kvmesh.router.upstream.forwarder import ANSWER_LIMIT, ConnectFailed, Forwarder, Refused

ASGIApp = Any
ADMIN_TOKEN_HEADER = "x-kvmesh-admin-token"
KV_STATE_LIMIT = 512 << 20
"""The largest ``/kvmesh/kv_state`` read: every cached block's hash, some 25 bytes each in JSON,
so twenty million blocks. (The other RPCs' answers are small: ``ANSWER_LIMIT``.)"""
METRICS_LIMIT = 64 << 20
"""The largest engine ``/metrics`` page read (an engine's own counts of requests, per DP rank)."""


class WorkerRpc:
    """Calls a worker's ``/kvmesh/*`` routes (and ``/v1/models``), decoding their JSON answers."""

    def __init__(
        self,
        forwarder: Forwarder,
        *,
        timeout: float,
        state_timeout: float | None = None,
        token: str | None = None,
        local_token: str | None = None,
        local_id: WorkerId | None = None,
        local_app: ASGIApp | None = None,
    ) -> None:
        """``token`` goes to remote workers (the worker token); ``local_token`` to the embedding
        engine's own routes, in-process, never on the wire (default: ``token``)."""
        self.forwarder = forwarder
        self.timeout = timeout
        # kv_state answers can be large documents: they get their own (longer) bound.
        self.state_timeout = state_timeout if state_timeout is not None else timeout
        self.token = token
        self.local_token = local_token or token
        self.local_id = local_id if local_app is not None else None
        self.local_app = local_app
        self.framework: Any = None
        """The embedding server's framework app, once the middleware has seen it (its lifespan's
        scope, or a request's): what an in-process request carries as ``app`` (:func:`call_app`)."""
        self._headers = {ADMIN_TOKEN_HEADER: token} if token else None

    # ---------------------------------------------------------------- typed RPCs
    async def info(self, worker_id: WorkerId, url: str) -> Any:
        return await self.call(worker_id, url, "GET", "/kvmesh/info", None)

    async def models(self, worker_id: WorkerId, url: str) -> Any:
        return await self.call(worker_id, url, "GET", "/v1/models", None)

    async def kv_state(self, worker_id: WorkerId, url: str) -> Any:
        return await self.call(
            worker_id, url, "GET", "/kvmesh/kv_state", None, timeout=self.state_timeout, limit=KV_STATE_LIMIT
        )

    async def open_session(
        self, worker_id: WorkerId, url: str, session_id: str, timeout: float | None
    ) -> Any:
        payload: dict[str, Any] = {"action": "open_session", "session_id": session_id}
        if timeout is not None:
            payload["timeout"] = timeout
        return await self.call(worker_id, url, "POST", "/kvmesh/session_control", payload)

    async def close_session(self, worker_id: WorkerId, url: str, session_id: str) -> Any:
        payload = {"action": "close_session", "session_id": session_id}
        return await self.call(worker_id, url, "POST", "/kvmesh/session_control", payload)

    async def pin_prefix(
        self, worker_id: WorkerId, url: str, token_ids: list[int], ttl_seconds: float
    ) -> Any:
        payload = {"token_ids": token_ids, "ttl_seconds": ttl_seconds}
        return await self.call(worker_id, url, "POST", "/kvmesh/pin_prefix", payload)

    async def engine_get(
        self, worker_id: WorkerId, url: str, path: str, *, limit: int = ANSWER_LIMIT
    ) -> tuple[int, bytes]:
        """``GET path`` of the worker's engine (its own route, not a kvmesh RPC: no worker token):
        (status, body); in-process for the embedding engine. ConnectFailed when it cannot be read."""
        if worker_id == self.local_id:
            assert self.local_app is not None
            try:
                return await call_app(self.local_app, "GET", path, [], b"", framework=self.framework)
            except Exception as e:
                raise ConnectFailed("local", f"GET {path} raised {e!r}") from None
        return await self.forwarder.get(url + path, timeout=self.timeout, limit=limit)

    async def metrics_text(self, worker_id: WorkerId, url: str) -> bytes:
        """The worker's Prometheus ``/metrics`` page (the engine's own, not a kvmesh RPC)."""
        status, data = await self.engine_get(worker_id, url, "/metrics", limit=METRICS_LIMIT)
        if status != 200:
            raise ConnectFailed(url, f"GET /metrics: HTTP {status}")
        return data

    # ---------------------------------------------------------------- transport
    async def call(
        self,
        worker_id: WorkerId,
        url: str,
        method: str,
        path: str,
        payload: Any,
        *,
        timeout: float | None = None,
        limit: int = ANSWER_LIMIT,
    ) -> Any:
        """In-process for the embedding engine, HTTP for the others; ConnectFailed on any failure,
        an answer past ``limit`` bytes included (a GET's; a POST's answer is small)."""
        if worker_id == self.local_id:
            return await self._local(method, path, payload)
        bound = self.timeout if timeout is None else timeout
        if method == "GET":
            return await self.forwarder.get_json(
                url + path, timeout=bound, headers=self._headers, limit=limit
            )
        return await self.forwarder.post_json(url + path, payload, timeout=bound, headers=self._headers)

    async def _local(self, method: str, path: str, payload: Any) -> Any:
        """Call the embedding engine's own app in-process and decode its JSON answer."""
        app = self.local_app
        assert app is not None
        body = b"" if payload is None else msgspec.json.encode(payload)
        headers = [(b"content-type", b"application/json")] if payload is not None else []
        if self.local_token:
            headers.append((ADMIN_TOKEN_HEADER.encode(), self.local_token.encode()))
        try:
            status, data = await call_app(app, method, path, headers, body, framework=self.framework)
        except Exception as e:
            raise ConnectFailed("local", f"{method} {path} raised {e!r}") from None
        if status != 200:
            raise Refused("local", status, f"{method} {path}: {data[:200]!r}")
        try:
            return msgspec.json.decode(data)
        except msgspec.DecodeError:
            raise ConnectFailed("local", f"{method} {path}: not JSON") from None


async def call_app(
    app: ASGIApp,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    *,
    framework: Any = None,
) -> tuple[int, bytes]:
    """One whole request to an ASGI app in-process: (status, body). The caller never disconnects.

    ``framework``: the server's framework app (a FastAPI or Starlette instance), which the request
    carries as its scope's ``app``, as the framework's own requests do: it sets that on the way in,
    above kvmesh's middleware, and an engine's route handlers find their state through it (vLLM's
    read ``request.app.state``). A request made without it failed inside vLLM's handlers."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"kvmesh.local"), (b"content-length", str(len(body)).encode()), *headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
    if framework is not None:
        scope["app"] = framework
    sent = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # an in-process caller never disconnects
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)
