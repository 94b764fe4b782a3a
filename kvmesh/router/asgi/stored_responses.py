"""A stored Responses API answer, asked for again: ``GET /v1/responses/{id}`` (and anything below
it, such as vLLM's ``POST /v1/responses/{id}/cancel``), sent to the engine that stored it; and
:func:`find_home`, which finds that engine for a response this router did not relay.

An engine keeps the responses it served in its own memory, so only that engine can answer for one.
The router knows where each response it relayed was served (``Mesh.response_homes``). A response it
does not know (relayed by another replica: in a mesh every engine's middleware is one, and a client
behind a load balancer reaches any of them; or before this router started) is looked for: every
routable worker is asked for it at once (``GET /v1/responses/{id}``, as its engine answers it), and
the first that has it is remembered. The asks carry the hop headers, so a peer's middleware answers
from its own engine and asks no one in turn. Responses nobody holds (an engine with its store off)
are looked for again once a moment has passed (requests naming an id while it is looked for wait for
that search, and one nobody held is not looked for again for two seconds: ``Mesh.holder_search``).

Such a request goes to its engine, and its answer comes back unchanged. Where nobody holds the
id, an engine's middleware hands the request to its own engine, as it always did, and the
standalone router answers 404 naming ``response_id``. A worker that cannot be reached is a 502. A
worker that breaks off mid-answer has its connection closed, and so does the client's.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any
from urllib.parse import quote

from kvmesh._http import route_path
from kvmesh.router.asgi import peer_auth
from kvmesh.router.asgi.any_worker import first_holder
from kvmesh.router.asgi.forwarding import relay_unchanged
from kvmesh.router.asgi.json_io import read_body_or_refuse, send_error
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.mesh.worker_rpc import call_app
from kvmesh.router.request.responses_api import RESPONSES_PATH
from kvmesh.router.upstream.forwarder import UpstreamError, end_to_end_headers

_BELOW = RESPONSES_PATH + "/"
RENDER_PATH = RESPONSES_PATH + "/render"
_ASK_TIMEOUT = 2.0
"""Seconds a worker has to say whether it holds a response."""


def handles(path: str) -> bool:
    """Whether ``path`` names a stored response (or something below one); vLLM's
    ``/v1/responses/render`` names none (it renders a request, on any engine)."""
    return path.startswith(_BELOW) and len(path) > len(_BELOW) and path != RENDER_PATH


async def serve(mesh: Mesh, app: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
    path = route_path(scope)
    response_id = path[len(_BELOW) :].split("/", 1)[0]
    await mesh.ensure_started()
    headers = scope["headers"]
    if peer_auth.has_internal(headers):
        hop = peer_auth.read_hop(headers, mesh.settings.mesh_secret)
        scope = {**scope, "headers": peer_auth.strip_internal(headers)}
        if hop is not None and mesh.local_app is not None:  # a peer's ask: this engine answers
            await app(scope, receive, send)
            return
    if not mesh.registry.ready.is_set():
        await mesh.wait_ready()
    home = await find_home(mesh, response_id, scope)
    worker = mesh.registry.get(home) if home is not None else None
    if worker is None or home == mesh.settings.self_worker_id:
        if mesh.local_app is not None:  # this engine's own store answers
            await app(scope, receive, send)
            return
        await send_error(
            send, 404, f"response {response_id!r} was not served through this router", "response_id"
        )
        return
    settings = mesh.settings
    body = await read_body_or_refuse(
        scope, receive, send, settings.max_body_bytes, settings.body_read_timeout
    )
    if body is None:
        return  # (refused, or the client left)
    headers = peer_auth.strip_internal(end_to_end_headers(scope["headers"]))
    headers += peer_auth.hop_headers(mesh.settings.mesh_secret, mesh.replica, mesh.next_request_id())
    path = quote(path)  # (route_path is decoded: what follows the id is the client's, spaces and all)
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    try:
        upstream = await mesh.forwarder.open(worker.url, scope["method"], path, headers, body)
    except UpstreamError as e:
        await send_error(send, 502, f"the worker holding response {response_id!r} did not answer: {e}", None)
        return
    await relay_unchanged(upstream, send)


async def find_home(mesh: Mesh, response_id: str, scope: dict[str, Any]) -> str | None:
    """The worker holding stored response ``response_id``: known, or found by asking every routable
    worker at once (see the module docstring); None when none has it. The client's
    ``authorization`` (in its request's ``scope``) goes with the asks (an engine's store is behind
    its API key), so a search, and the memory of a miss, is per id and credential
    (``Mesh.holder_search``)."""
    home = mesh.response_homes.home(response_id)
    if home is not None:
        return home
    registry = mesh.registry
    workers = [w for w in (registry.get(i) for i in sorted(registry.routable)) if w is not None]
    if not workers:
        return None  # (nobody to ask: no miss to remember)
    auth = [(k, v) for k, v in scope["headers"] if k == b"authorization"]
    credential = hashlib.blake2b(b"\n".join(v for _, v in auth), digest_size=16).digest()
    return await mesh.holder_search.find(
        "response", (response_id, credential), lambda: _ask(mesh, workers, response_id, auth)
    )


async def _ask(
    mesh: Mesh, workers: list[Any], response_id: str, auth: list[tuple[bytes, bytes]]
) -> str | None:
    path = _BELOW + quote(response_id, safe="")
    asks = peer_auth.hop_header_map(mesh.settings.mesh_secret, mesh.replica, mesh.next_request_id())
    asks.update((k.decode(), v.decode("latin-1")) for k, v in auth)

    async def holds(worker: Any) -> bool:
        if worker.worker_id == mesh.settings.self_worker_id and mesh.local_app is not None:
            asked = call_app(mesh.local_app, "GET", path, auth, b"", framework=mesh.rpc.framework)
            status, _ = await asyncio.wait_for(asked, _ASK_TIMEOUT)
        else:
            status, _ = await mesh.forwarder.get(worker.url + path, timeout=_ASK_TIMEOUT, headers=asks)
        return status == 200

    return await first_holder(workers, holds, mesh.response_homes, response_id)
