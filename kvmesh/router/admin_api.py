"""Runtime admin endpoints the middleware answers besides ``GET /kvmesh/workers``::

    POST   /kvmesh/workers        {"url": ..., "id": ..., spec fields} -> 201 + the worker's row
    DELETE /kvmesh/workers/{id}   -> 200 {"removed": id}
    GET    /kvmesh/router         -> this replica: name, epoch, replica-sync endpoint and peers

A POST takes the fields of a ``[[workers]]`` table (``url`` required; ``id`` defaults to the URL;
``block_size``, ``kv_events_endpoints`` ... override the worker's ``/kvmesh/info``). The worker is
discovered before the answer: 409 when its id or URL is taken or its block size differs from the
fleet's, 400 naming the field for a bad spec. One that does not answer yet is kept (state
``down``) and admitted by the health checks when it does. A DELETE drops the worker's index
blocks, load and event subscriptions. Changes are per replica and not persisted.

With an admin token configured every route here wants ``x-kvmesh-admin-token: <token>`` or
``Authorization: Bearer <token>`` (401 otherwise).
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec

from kvmesh.router.mesh import ROUTER_PATH, Mesh
from kvmesh.router.settings import WorkerSpecError, worker_from_mapping
from kvmesh.router.workers import WorkerConflict

WORKERS_PATH = "/kvmesh/workers"
_WORKER_PREFIX = WORKERS_PATH + "/"
_BODY_LIMIT = 64 * 1024
_ADMIN_HEADER = b"x-kvmesh-admin-token"


def handles(path: str, method: str) -> bool:
    """True for the requests :func:`handle` answers."""
    return (
        (path == WORKERS_PATH and method == "POST")
        or (path.startswith(_WORKER_PREFIX) and method == "DELETE")
        or (path == ROUTER_PATH and method == "GET")
    )


async def handle(mesh: Mesh, scope: dict[str, Any], receive: Any, send: Any) -> None:
    if not authorized(mesh.settings.admin_token, scope["headers"]):
        await _answer(send, 401, _error(401, "admin token missing or wrong", kind="unauthorized"))
        return
    path = scope["path"]
    if path == ROUTER_PATH:
        await _answer(send, 200, mesh.describe())
    elif path == WORKERS_PATH:
        await _add(mesh, receive, send)
    else:
        await _remove(mesh, path[len(_WORKER_PREFIX) :], send)


def authorized(token: str | None, headers: list[tuple[bytes, bytes]]) -> bool:
    if not token:
        return True
    expected = token.encode()
    for name, value in headers:
        if name == _ADMIN_HEADER and hmac.compare_digest(value, expected):
            return True
        if name == b"authorization" and hmac.compare_digest(value, b"Bearer " + expected):
            return True
    return False


async def _add(mesh: Mesh, receive: Any, send: Any) -> None:
    try:
        raw = await _read_body(receive)
    except _TooLarge:
        await _answer(send, 413, _error(413, f"request body larger than {_BODY_LIMIT} bytes"))
        return
    if raw is None:
        return
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        doc = None
    if not isinstance(doc, dict):
        await _answer(send, 400, _error(400, "body must be a JSON object with at least 'url'", "body"))
        return
    try:
        spec = worker_from_mapping(doc)
    except WorkerSpecError as e:
        await _answer(send, 400, _error(400, str(e), e.field))
        return
    registry = mesh.registry
    try:
        await registry.add(spec)
    except WorkerConflict as e:
        await _answer(send, 409, _error(409, str(e), kind="conflict"))
        return
    row = next(r for r in registry.snapshot() if r["worker_id"] == spec.worker_id)
    await _answer(send, 201, row)


async def _remove(mesh: Mesh, worker_id: str, send: Any) -> None:
    registry = mesh.registry
    if registry.get(worker_id) is None:
        await _answer(send, 404, _error(404, f"unknown worker id {worker_id!r}", kind="not_found"))
        return
    if registry.is_local(worker_id):
        await _answer(send, 409, _error(409, f"worker {worker_id!r} is this engine itself", kind="conflict"))
        return
    await registry.remove(worker_id)
    await _answer(send, 200, {"removed": worker_id})


class _TooLarge(Exception):
    pass


async def _read_body(receive: Any) -> bytes | None:
    """The body, None if the client left; _TooLarge past the limit."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _BODY_LIMIT:
            raise _TooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _error(status: int, message: str, field: str | None = None, kind: str | None = None) -> dict[str, Any]:
    kind = kind or ("invalid_request_error" if status < 500 else "service_unavailable")
    return {"error": {"message": message, "type": kind, "param": field, "code": status}}


async def _answer(send: Any, status: int, doc: Any) -> None:
    body = msgspec.json.encode(doc)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
