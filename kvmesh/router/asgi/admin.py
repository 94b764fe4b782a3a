"""The router's admin endpoints, as Starlette routes over the fleet runtime::

    GET    /kvmesh/workers        -> every worker's state, load and indexed blocks
    POST   /kvmesh/workers        {"url": ..., "id": ..., spec fields} -> 201 + the worker's row
    DELETE /kvmesh/workers/{id}   -> 200 {"removed": id}
    GET    /kvmesh/router         -> this replica: name, epoch, replica-sync endpoint and peers
    GET    /kvmesh/decisions?limit=N -> the last N decisions (default 20, at most 64), newest first,
                                  with every candidate's cost terms
    GET    /busy_threshold        -> {"thresholds": [{"model", thresholds...} per served model]}
    POST   /busy_threshold        {"model": m, threshold: value, ...} -> {"model": m, thresholds...}
                                  ({"model": m} alone reads them; without "model": kvmesh's older
                                  form, the thresholds alone)

The ``/busy_threshold`` bodies are the reference router's. A kvmesh fleet routes one model family
(one tokenizer, one block size), so its thresholds are shared by the models it serves: the answer
names the model it was asked about, and a model the fleet does not serve is a 404.

A POST to ``/kvmesh/workers`` takes the fields of a ``[[workers]]`` table (``url`` required; ``id``
defaults to the URL; ``block_size``, ``kv_events_endpoints`` ... override the worker's
``/kvmesh/info``). The worker is discovered before the answer: 409 when its id or URL is taken or
its block size differs from the fleet's, 400 naming the field for a bad spec. One that does not
answer yet is kept (state ``down``) and admitted by the health checks when it does. A DELETE drops
the worker's index blocks, load and event subscriptions. Changes are per replica, not persisted.

One token rule (docs/ARCHITECTURE.md): with an admin token configured, *every* route here wants
``x-kvmesh-admin-token: <token>`` or ``Authorization: Bearer <token>`` (401 otherwise), reads
included: the worker list names every engine's address and the replica answer its sync socket.
Without a token they are open, as the reference router's are.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from kvmesh._http import MethodNotAllowed, error_body, token_matches
from kvmesh.errors import ConfigError
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import DECISION_HISTORY
from kvmesh.router.mesh.registry import WorkerConflict
from kvmesh.router.mesh.runtime import DECISIONS_PATH, ROUTER_PATH, Mesh
from kvmesh.router.mesh.settings import WorkerSpecError, worker_from_mapping

WORKERS_PATH = "/kvmesh/workers"
BUSY_PATH = "/busy_threshold"
_WORKER_PREFIX = WORKERS_PATH + "/"
_BODY_LIMIT = 64 * 1024
_THRESHOLD_FIELDS = (
    "active_decode_blocks_threshold",
    "active_prefill_tokens_threshold",
    "active_prefill_tokens_threshold_frac",
)
_encode = msgspec.json.encode


def handles(path: str) -> bool:
    """True for the paths the admin app answers (any method: a wrong one gets its 405 there)."""
    return path in (WORKERS_PATH, ROUTER_PATH, DECISIONS_PATH, BUSY_PATH) or path.startswith(_WORKER_PREFIX)


def _json(doc: Any, status: int = 200) -> Response:
    return Response(_encode(doc), status, media_type="application/json")


def _error(status: int, message: str, field: str | None = None) -> Response:
    return _json(error_body(message, status, field), status)


class _BadBody(Exception):
    def __init__(self, message: str, field: str | None = "body") -> None:
        super().__init__(message)
        self.field = field


async def _json_body(request: Request) -> Any:
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > _BODY_LIMIT:
            raise _BadBody(f"body larger than {_BODY_LIMIT} bytes")
        chunks.append(chunk)
    try:
        return msgspec.json.decode(b"".join(chunks))
    except msgspec.DecodeError as e:  # (its message says where: "Number out of range at byte 36")
        raise _BadBody(f"body must be a JSON object: {e}") from None
    except (UnicodeDecodeError, RecursionError):
        raise _BadBody("body must be a JSON object") from None


def build_admin_app(mesh: Mesh) -> Router:
    """The admin routes over ``mesh``; every one behind the admin token when one is set."""

    def guarded(endpoint: Any, *, peers_too: bool = False) -> Any:
        """``peers_too``: the worker token (what replicas present to each other) opens it as well."""

        async def checked(request: Request) -> Response:
            headers = request.scope["headers"]
            settings = mesh.settings
            allowed = token_matches(settings.admin_token, headers) or (
                peers_too and bool(settings.worker_token) and token_matches(settings.worker_token, headers)
            )
            if not allowed:
                return _error(401, "admin token missing or wrong")
            await mesh.ensure_started()
            await mesh.wait_ready()
            try:
                return await endpoint(request)  # type: ignore[no-any-return]
            except _BadBody as e:
                return _error(400, str(e), e.field)

        return checked

    async def list_workers(request: Request) -> Response:
        registry = mesh.registry
        rows = registry.snapshot()
        for row in rows:  # cache_control pins: what each worker took or refused
            row["cache_control_pins"] = mesh.pin_stats.get(row["worker_id"])
        return _json(
            {
                "replica": mesh.replica,
                "router_mode": mesh.config.router_mode,
                "block_size": registry.block_size,
                "workers": rows,
            }
        )

    async def add_worker(request: Request) -> Response:
        doc = await _json_body(request)
        if not isinstance(doc, dict):
            return _error(400, "body must be a JSON object with at least 'url'", "body")
        try:
            spec = worker_from_mapping(doc)
        except WorkerSpecError as e:
            return _error(400, str(e), e.field)
        try:
            await mesh.registry.add(spec)
        except WorkerConflict as e:
            return _error(409, str(e))
        row = next(r for r in mesh.registry.snapshot() if r["worker_id"] == spec.worker_id)
        return _json(row, 201)

    async def remove_worker(request: Request) -> Response:
        worker_id = request.path_params["worker_id"]
        registry = mesh.registry
        if registry.get(worker_id) is None:
            return _error(404, f"unknown worker id {worker_id!r}")
        if registry.is_local(worker_id):
            return _error(409, f"worker {worker_id!r} is this engine itself")
        await registry.remove(worker_id)
        return _json({"removed": worker_id})

    async def describe_router(request: Request) -> Response:
        return _json(mesh.describe())

    async def list_decisions(request: Request) -> Response:
        raw = request.query_params.get("limit", "20")
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if not 1 <= limit <= DECISION_HISTORY:
            raise _BadBody(f"limit must be an integer from 1 to {DECISION_HISTORY}, got {raw!r}", "limit")
        return _json(mesh.describe_decisions(limit))

    async def get_thresholds(request: Request) -> Response:
        current = _thresholds(mesh)
        return _json({"thresholds": [{"model": m, **current} for m in mesh.registry.models]})

    async def set_thresholds(request: Request) -> Response:
        doc = await _json_body(request)
        model = doc.pop("model", None) if isinstance(doc, dict) else None
        if model is None:
            changes = _parse_thresholds(doc)
            mesh.router.set_busy_thresholds(**changes)
            return _json(_thresholds(mesh))
        if not isinstance(model, str):
            return _error(400, "model must be a string", "model")
        if model not in mesh.registry.models:
            return _error(404, f"model {model!r} is not served by this fleet", "model")
        # null or absent thresholds read the current ones, as the reference's endpoint does
        changes = _parse_thresholds({k: v for k, v in doc.items() if v is not None}, allow_empty=True)
        if changes:
            mesh.router.set_busy_thresholds(**changes)
        return _json({"model": model, **_thresholds(mesh)})

    worker = _WORKER_PREFIX + "{worker_id:path}"
    return Router(
        routes=[
            Route(WORKERS_PATH, guarded(list_workers), methods=["GET"]),
            Route(WORKERS_PATH, guarded(add_worker), methods=["POST"]),
            Route(worker, guarded(remove_worker), methods=["DELETE"]),
            Route(ROUTER_PATH, guarded(describe_router, peers_too=True), methods=["GET"]),
            Route(DECISIONS_PATH, guarded(list_decisions), methods=["GET"]),
            Route(BUSY_PATH, guarded(get_thresholds), methods=["GET"]),
            Route(BUSY_PATH, guarded(set_thresholds), methods=["POST"]),
            # (after the routes above, so only another method reaches these: Starlette's own
            # answers, a 405 and a 404, are plain text, and every other answer here is JSON)
            Route(WORKERS_PATH, MethodNotAllowed("GET, POST")),
            Route(worker, MethodNotAllowed("DELETE")),
            Route(ROUTER_PATH, MethodNotAllowed("GET")),
            Route(DECISIONS_PATH, MethodNotAllowed("GET")),
            Route(BUSY_PATH, MethodNotAllowed("GET, POST")),
        ],
        default=_not_found,
        redirect_slashes=False,  # (no slash-less twin to send a client to: the paths are exact)
    )


async def _not_found(scope: Any, receive: Any, send: Any) -> None:
    # (a worker id with a line break in it matches no route: no such id can be registered)
    await _error(404, f"no admin endpoint at {scope['path']!r}")(scope, receive, send)


def _thresholds(mesh: Mesh) -> dict[str, Any]:
    t = mesh.router.busy_thresholds()
    return {name: getattr(t, name) for name in _THRESHOLD_FIELDS}


def _parse_thresholds(doc: Any, *, allow_empty: bool = False) -> dict[str, Any]:
    if not isinstance(doc, dict) or not (doc or allow_empty):
        raise _BadBody(f"body must be a JSON object with some of: {', '.join(_THRESHOLD_FIELDS)}")
    changes: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in _THRESHOLD_FIELDS:
            raise _BadBody(f"unknown threshold {key!r}", key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
        ):
            raise _BadBody(f"{key} must be a non-negative number or null", key)
        if key == "active_prefill_tokens_threshold" and value is not None:
            if isinstance(value, float) and not value.is_integer():  # (as the flag refuses it)
                raise _BadBody(f"{key} must be an integer or null", key)
            value = int(value)
        changes[key] = value
    try:  # the flags' own ranges, with messages naming the flag
        RouterConfig().with_overrides(**changes)
    except ConfigError as e:
        raise _BadBody(str(e), next(iter(changes))) from None
    return changes
