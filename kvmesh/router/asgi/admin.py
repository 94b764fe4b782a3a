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

from kvmesh.errors import RequestError
from kvmesh.router.asgi.json_io import read_body, send_error, send_json
from kvmesh.router.mesh.registry import WorkerConflict
from kvmesh.router.mesh.runtime import ROUTER_PATH, Mesh
from kvmesh.router.mesh.settings import WorkerSpecError, worker_from_mapping

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
        await send_error(send, 401, "admin token missing or wrong", kind="unauthorized")
        return
    path = scope["path"]
    if path == ROUTER_PATH:
        await send_json(send, 200, msgspec.json.encode(mesh.describe()))
    elif path == WORKERS_PATH:
        await _add(mesh, scope, receive, send)
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


async def _add(mesh: Mesh, scope: dict[str, Any], receive: Any, send: Any) -> None:
    try:
        raw = await read_body(scope, receive, _BODY_LIMIT)
    except RequestError as e:
        await send_error(send, e.status, str(e), e.field)
        return
    if raw is None:
        return
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        doc = None
    if not isinstance(doc, dict):
        await send_error(send, 400, "body must be a JSON object with at least 'url'", "body")
        return
    try:
        spec = worker_from_mapping(doc)
    except WorkerSpecError as e:
        await send_error(send, 400, str(e), e.field)
        return
    registry = mesh.registry
    try:
        await registry.add(spec)
    except WorkerConflict as e:
        await send_error(send, 409, str(e), kind="conflict")
        return
    row = next(r for r in registry.snapshot() if r["worker_id"] == spec.worker_id)
    await send_json(send, 201, msgspec.json.encode(row))


async def _remove(mesh: Mesh, worker_id: str, send: Any) -> None:
    registry = mesh.registry
    if registry.get(worker_id) is None:
        await send_error(send, 404, f"unknown worker id {worker_id!r}", kind="not_found")
        return
    if registry.is_local(worker_id):
        await send_error(send, 409, f"worker {worker_id!r} is this engine itself", kind="conflict")
        return
    await registry.remove(worker_id)
    await send_json(send, 200, msgspec.json.encode({"removed": worker_id}))
