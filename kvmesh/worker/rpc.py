"""The worker-side RPCs a kvmesh router calls, as Starlette routes under ``/kvmesh/``.

Any engine can serve them by implementing :class:`WorkerBackend` (methods may be sync or async)::

    GET  /kvmesh/info             -> backend, model, block size, dp size, event endpoints, ...
    GET  /kvmesh/kv_state         -> {"block_size", "ranks": [{"dp_rank", "last_seq", "events"}]}
    POST /kvmesh/pin_prefix       {"token_ids": [...], "ttl_seconds": s} -> {"status", "blocks_pinned"}
    POST /kvmesh/session_control  {"action": "open_session"|"close_session", "session_id", "timeout"}
    POST /kvmesh/reset_prefix_cache -> {"status": "ok"} (409 while blocks are in use)

With an admin token configured, every route wants ``Authorization: Bearer <token>`` or
``x-kvmesh-admin-token: <token>`` and answers 401 otherwise.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh._http import HEADER_SAFE_RULE, MethodNotAllowed, error_body, header_safe, token_matches
from kvmesh.errors import RequestError
from kvmesh.hashing import MAX_TOKEN_ID

T = TypeVar("T")
DEFAULT_SESSION_TIMEOUT = 300.0
MAX_TTL_SECONDS = 7 * 24 * 3600.0
MAX_BODY_BYTES = 32 << 20
"""The largest RPC body read: a pin of a prompt at the longest contexts served, with room to spare."""
_TOO_LARGE = f"the request body is larger than {MAX_BODY_BYTES} bytes"
ADMIN_HEADER = "x-kvmesh-admin-token"


class WorkerBackend(Protocol):
    def info(self) -> dict[str, Any] | Awaitable[dict[str, Any]]: ...
    def kv_state(self) -> dict[str, Any] | Awaitable[dict[str, Any]]: ...
    def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int | Awaitable[int]: ...
    def open_session(self, session_id: str, timeout: float) -> bool | Awaitable[bool]: ...
    def close_session(self, session_id: str) -> bool | Awaitable[bool]: ...
    def reset_prefix_cache(self) -> bool | Awaitable[bool]: ...


def error_response(message: str, status: int, field: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, field), status)


def worker_token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The token an engine demands on its ``/kvmesh/*`` RPCs: ``KVMESH_WORKER_TOKEN`` (what the
    routers present to workers), else ``KVMESH_ADMIN_TOKEN`` (older deployments guarded both with
    one token), else none. A router never presents its admin token, so an engine embedding a router
    should set ``KVMESH_WORKER_TOKEN`` to keep the two credentials apart (docs/security.md)."""
    env = os.environ if environ is None else environ
    return env.get("KVMESH_WORKER_TOKEN") or env.get("KVMESH_ADMIN_TOKEN") or None


def admin_token_ok(request: Request, token: str | None) -> bool:
    """True when no token is configured or the request carries the right one."""
    return token_matches(token, request.scope["headers"])


async def _call(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        return await value  # type: ignore[no-any-return]
    return value


async def json_object(request: Request) -> dict[str, Any]:
    """The request's body, a JSON object bounded in size (a RequestError naming ``body`` else)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(_TOO_LARGE, status=413, field="body")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(_TOO_LARGE, status=413, field="body")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):  # (RecursionError: nesting past the parser's depth, a 500 before)
        raise RequestError("the request body is not valid JSON", field="body") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    return body


def _positive_number(body: dict[str, Any], name: str, default: float | None = None) -> float:
    value = body.get(name, default)
    if value is None:
        raise RequestError(f"'{name}' is required", field=name)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise RequestError(f"'{name}' must be a positive number of seconds, got {value!r}", field=name)
    if value > MAX_TTL_SECONDS:
        raise RequestError(f"'{name}' must be at most {MAX_TTL_SECONDS:g} seconds, got {value!r}", field=name)
    return float(value)


def worker_rpc_routes(backend: WorkerBackend, *, admin_token: str | None = None) -> list[Route]:
    """The ``/kvmesh/*`` routes over ``backend``, guarded by ``admin_token`` when set."""

    def guarded(
        handler: Callable[[Request], Awaitable[dict[str, Any]]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if not admin_token_ok(request, admin_token):
                return error_response("missing or wrong kvmesh admin token", 401)
            try:
                return JSONResponse(await handler(request))
            except RequestError as e:
                return error_response(str(e), e.status, e.field)

        return endpoint

    async def info(request: Request) -> dict[str, Any]:
        return await _call(backend.info())

    async def kv_state(request: Request) -> dict[str, Any]:
        return await _call(backend.kv_state())

    async def pin_prefix(request: Request) -> dict[str, Any]:
        body = await json_object(request)
        token_ids = body.get("token_ids")
        if (
            not isinstance(token_ids, list)
            or not token_ids
            or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in token_ids)
        ):
            # (a block hash takes a token id as 32 bits: 2**53 + 1 was a 500 from the mock's hashing)
            raise RequestError(
                "'token_ids' must be a non-empty list of token ids in [0, 2**32)", field="token_ids"
            )
        ttl = _positive_number(body, "ttl_seconds")
        pinned = await _call(backend.pin_prefix(token_ids, ttl))
        return {"status": "ok", "blocks_pinned": pinned, "ttl_seconds": ttl}

    async def session_control(request: Request) -> dict[str, Any]:
        body = await json_object(request)
        action = body.get("action")
        session_id = body.get("session_id")
        if not isinstance(session_id, str) or not session_id:
            raise RequestError("'session_id' must be a non-empty string", field="session_id")
        if not header_safe(session_id):  # (a turn names its session in the X-Session-ID header)
            raise RequestError(
                f"'session_id' must be {HEADER_SAFE_RULE}: turns name it in the X-Session-ID header",
                field="session_id",
            )
        if action == "open_session":
            timeout = _positive_number(body, "timeout", DEFAULT_SESSION_TIMEOUT)
            created = await _call(backend.open_session(session_id, timeout))
            return {
                "status": "ok",
                "session_id": session_id,
                "action": action,
                "created": created,
                "timeout": timeout,
            }
        if action == "close_session":
            closed = await _call(backend.close_session(session_id))
            return {"status": "ok", "session_id": session_id, "action": action, "closed": closed}
        raise RequestError(
            f"'action' must be 'open_session' or 'close_session', got {action!r}", field="action"
        )

    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        if not await _call(backend.reset_prefix_cache()):
            raise RequestError("cannot reset the prefix cache while blocks are in use", status=409)
        return {"status": "ok"}

    served = [
        ("/kvmesh/info", info, "GET"),
        ("/kvmesh/kv_state", kv_state, "GET"),
        ("/kvmesh/pin_prefix", pin_prefix, "POST"),
        ("/kvmesh/session_control", session_control, "POST"),
        ("/kvmesh/reset_prefix_cache", reset_prefix_cache, "POST"),
    ]
    return [Route(path, guarded(endpoint), methods=[method]) for path, endpoint, method in served] + [
        # (after them, so only another method reaches these: an OpenAI 405, not the app's own)
        Route(path, MethodNotAllowed(method))
        for path, _, method in served
    ]
