"""Aborts of requests by id, sent to whichever engine runs them: vLLM's token API
(``POST /inference/v1/abort_requests``, and ``--tokens-only``'s ``/abort_requests``) and SGLang's
``POST /abort_request``.

An engine stops a request only where it runs, and answers 200 for ids it does not know. Once the
router has moved a request to a peer, an abort sent to the engine the client called would stop
nothing, and the request would run on for nobody. So the abort goes to every worker whose server
has that API at once (the ids are few, and a worker that does not run them ignores them): the local
engine through its own app, peers over HTTP with the hop headers, so that a peer's middleware hands
the abort to its own engine and asks no one in turn. The client's ``authorization`` goes along
(vLLM guards ``/inference`` with its API key, SGLang its admin routes with its own).

SGLang's ``abort_all`` goes to every SGLang worker too: behind kvmesh a request may run on any of
them, so "every request of the server" is every request of the fleet.

The body is checked first (vLLM's: ``request_ids``, a list of strings or one string; SGLang's:
``rid`` a string, ``abort_all`` a boolean), else a 400 naming the field. The answer is the engine's
(200, no body) when a worker took the abort; when none did, the answer of the first that refused it,
or a 502 when no worker could be reached. With no worker serving the API, an engine's middleware
hands the abort to its own engine, and the standalone router answers 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh._http import replay_body, route_path
from kvmesh.errors import RequestError
from kvmesh.router.asgi import peer_auth
from kvmesh.router.asgi.json_io import read_body, send_error
from kvmesh.router.mesh.registry import WorkerInfo
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.mesh.worker_rpc import call_app
from kvmesh.router.request import generate_api, tokens_api
from kvmesh.router.request.parse import decode_body

_ABORT_TIMEOUT = 3.0
"""Seconds a worker has to take an abort."""


@dataclass(frozen=True)
class AbortApi:
    """One engine API's abort: its paths, the generation path whose requests it stops (the router
    takes the abort where it routes that path), how its body is read (to what a worker is sent),
    which workers serve it, and the API's name for the answers."""

    paths: frozenset[str]
    stops: str
    read: Callable[[Any], dict[str, Any]]
    serves: Callable[[WorkerInfo], bool]
    name: str


APIS = (
    AbortApi(
        tokens_api.ABORT_PATHS,
        tokens_api.TOKENS_PATH,
        lambda body: {"request_ids": tokens_api.abort_ids(body)},
        lambda info: info.tokens_api,
        tokens_api.TOKENS_PATH,
    ),
    AbortApi(
        frozenset((generate_api.ABORT_PATH,)),
        generate_api.GENERATE_PATH,
        generate_api.abort_body,
        lambda info: info.backend in generate_api.SERVED_BY,
        "SGLang's API",
    ),
)


def abort_api(path: str, method: str, routed: frozenset[str]) -> AbortApi | None:
    """The API whose abort a request is, when the router routes that API's generation path
    (``routed``); None for any other request."""
    if method != "POST":
        return None
    return next((api for api in APIS if path in api.paths and api.stops in routed), None)


async def serve(mesh: Mesh, api: AbortApi, app: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
    await mesh.ensure_started()
    headers = scope["headers"]
    if peer_auth.has_internal(headers):
        hop = peer_auth.read_hop(headers, mesh.settings.mesh_secret)
        scope = {**scope, "headers": peer_auth.strip_internal(headers)}
        if hop is not None and mesh.local_app is not None:  # a peer's fan-out: this engine's part
            await app(scope, receive, send)
            return
    settings = mesh.settings
    try:
        raw = await read_body(scope, receive, settings.max_body_bytes, settings.body_read_timeout)
        if raw is None:
            return  # the client left
        payload = api.read(decode_body(raw))
    except RequestError as e:
        await send_error(send, e.status, str(e), e.field)
        return
    if not mesh.registry.ready.is_set():
        await mesh.wait_ready()
    registry = mesh.registry
    serving = registry.described(registry.routable, api.serves)
    workers = [w for w in (registry.get(i) for i in sorted(serving)) if w is not None]
    if not workers:
        if mesh.local_app is not None:
            await app(scope, replay_body(raw, receive), send)
            return
        await send_error(send, 404, f"no worker serves {api.name}, so none runs these requests", "path")
        return
    path = route_path(scope)
    auth = [(k, v) for k, v in scope["headers"] if k == b"authorization"]
    asks = peer_auth.hop_header_map(settings.mesh_secret, mesh.replica, mesh.next_request_id())
    asks.update((k.decode(), v.decode("latin-1")) for k, v in auth)

    async def abort(worker: Any) -> tuple[int, bytes]:
        if worker.worker_id == mesh.settings.self_worker_id and mesh.local_app is not None:
            local = [(b"content-type", b"application/json"), *auth]
            asked = call_app(mesh.local_app, "POST", path, local, raw, framework=mesh.rpc.framework)
            return await asyncio.wait_for(asked, _ABORT_TIMEOUT)
        return await mesh.forwarder.post(worker.url + path, payload, timeout=_ABORT_TIMEOUT, headers=asks)

    answers = await asyncio.gather(*(abort(w) for w in workers), return_exceptions=True)
    refused: tuple[int, bytes] | None = None
    for answer in answers:
        if isinstance(answer, BaseException):
            continue
        if answer[0] == 200:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        refused = refused or answer
    if refused is not None:
        status, body = refused
        kind = b"application/json" if body.startswith(b"{") else b"text/plain; charset=utf-8"
        start_headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": start_headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    await send_error(send, 502, f"no worker serving {api.name} could be reached to abort these requests")
