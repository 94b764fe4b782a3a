"""A stored Responses API answer, asked for again: ``GET /v1/responses/{id}`` (and anything below
it, such as vLLM's ``POST /v1/responses/{id}/cancel``), sent to the engine that stored it.

An engine keeps the responses it served in its own memory, so only that engine can answer for one.
The router knows where each response it relayed was served (``Mesh.response_homes``). Such a
request goes there, and its answer comes back unchanged. Where the router does not know the id (a
response served before it started, or through another router), an engine's middleware hands the
request to its own engine, as it always did, and the standalone router answers 404 naming
``response_id``. A worker that cannot be reached is a 502. A worker that breaks off mid-answer has
its connection closed, and so does the client's.
"""

from __future__ import annotations

from typing import Any

from kvmesh._http import route_path
from kvmesh.errors import RequestError
from kvmesh.router.asgi.json_io import read_body, send_error
from kvmesh.router.asgi.peer_auth import strip_internal
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.responses_api import RESPONSES_PATH
from kvmesh.router.upstream.forwarder import UpstreamError, end_to_end_headers

_BELOW = RESPONSES_PATH + "/"


def handles(path: str) -> bool:
    """Whether ``path`` names a stored response (or something below one)."""
    return path.startswith(_BELOW) and len(path) > len(_BELOW)


async def serve(mesh: Mesh, app: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
    path = route_path(scope)
    response_id = path[len(_BELOW) :].split("/", 1)[0]
    await mesh.ensure_started()
    home = mesh.response_homes.home(response_id)
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
    try:
        body = await read_body(scope, receive, settings.max_body_bytes, settings.body_read_timeout)
    except RequestError as e:
        await send_error(send, e.status, str(e), e.field)
        return
    if body is None:
        return  # the client left
    headers = strip_internal(end_to_end_headers(scope["headers"]))
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    try:
        upstream = await mesh.forwarder.open(worker.url, scope["method"], path, headers, body)
    except UpstreamError as e:
        await send_error(send, 502, f"the worker holding response {response_id!r} did not answer: {e}", None)
        return
    try:
        await send({"type": "http.response.start", "status": upstream.status, "headers": upstream.headers})
        async for chunk in upstream.chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        upstream.release()
    except BaseException:  # (the worker broke off, or the client left: the connection goes)
        upstream.close()
        raise
