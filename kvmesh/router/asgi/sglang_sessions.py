"""SGLang's sessions through the standalone router: ``/open_session``, ``/close_session``, and the
``/generate`` requests that continue one.

An SGLang session lives in the engine that opened it: its requests (``/generate`` with
``session_params.id``) append to the history that engine holds, and another engine answers them
with an error (the id does not exist there). RL frameworks and agent loops open one per episode or
conversation. Before, the standalone router answered 404 for both paths and refused a request
naming a session, so a session could be used only by going to an engine directly.

* ``/open_session`` (GET or POST, as SGLang takes it) goes to one routable worker whose server is
  SGLang's, taken in turn (a session holds its history on one engine for its whole life: spread
  evenly, not by the load of the moment). A session id already known goes to the worker holding
  it, which refuses it as taken. The engine's answer is the client's; when it is the session's id,
  the router remembers that worker as the session's home (``Mesh.sglang_session_homes``). A
  session opened for a client that left meanwhile is closed at once: no one knows its id.
* A ``/generate`` request naming a session the router knows goes to its home, counted there as
  any request is (:meth:`~.routed.RoutedRequest._home`); one naming an unknown session is the
  client's 400 naming ``session_params.id``, and one whose home is down a 503 (no other engine
  has its history).
* ``/close_session`` goes to the session's home, which is then forgotten. A session the router
  does not know (opened before it started, or at an engine directly) is closed on every SGLang
  worker, as SGLang's close of an id it does not hold does nothing.

A body is checked as SGLang's request types read it (a 400 naming the field, not the engine's 422).

Inside the engines, each engine's router is the fleet's front, and a load balancer may send a
session's requests to any of them. A session is opened by the engine that got ``/open_session``,
whose router learns it from the answer (:func:`serve_embedded`). Another engine's router that gets
a request naming a session it does not know asks its peers which opened it
(:func:`find_home`: ``GET /kvmesh/sglang_session?id=...``, answered only to a peer's hop headers)
and sends the request there, as it sends any request to a peer; a session no peer knows is left to
the engine the request reached (opened there directly, or unknown: its engine's own answer). A
close goes to the engine holding the session likewise, and so does an open asking for an id a peer
holds (which that engine refuses as taken): an id stays one engine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, quote

import msgspec

from kvmesh._http import replay_body, route_path, wait_disconnect
from kvmesh.errors import RequestError
from kvmesh.router.asgi import peer_auth
from kvmesh.router.asgi.any_worker import first_holder
from kvmesh.router.asgi.forwarding import WORKER_ID_HEADER
from kvmesh.router.asgi.json_io import read_body, read_body_or_refuse, send_error, send_json
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.generate_api import SERVED_BY, closed_session, opened_session
from kvmesh.router.request.parse import decode_body
from kvmesh.router.upstream.forwarder import UpstreamError, end_to_end_headers

OPEN_PATH = "/open_session"
CLOSE_PATH = "/close_session"
PATHS = (OPEN_PATH, CLOSE_PATH)
HOME_PATH = "/kvmesh/sglang_session"
"""Inside the engines: a peer asks whether this engine opened a session (``?id=``)."""
_TIMEOUT = 60.0
_ASK_TIMEOUT = 2.0
_ANSWER_LIMIT = 1 << 16


class SglangSessions:
    """An ASGI app serving :data:`PATHS` (see the module docstring)."""

    def __init__(self, mesh_of: Callable[[], Mesh]) -> None:
        self._mesh_of = mesh_of  # (the router's mesh exists only once the middleware is built)
        self._turn = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        mesh = self._mesh_of()
        await mesh.ensure_started()
        path = route_path(scope)
        settings = mesh.settings
        try:
            raw = await read_body(scope, receive, settings.max_body_bytes, settings.body_read_timeout)
            if raw is None:
                return  # the client left
            body = decode_body(raw)  # (a 400 naming ``body`` for what is no JSON object)
            if not mesh.registry.ready.is_set():
                await mesh.wait_ready()
            workers = sorted(
                mesh.registry.described(mesh.registry.routable, lambda info: info.backend in SERVED_BY)
            )
            if path == OPEN_PATH:
                left = asyncio.ensure_future(wait_disconnect(receive))
                try:
                    await self._open(mesh, scope, send, raw, opened_session(body), workers, left)
                finally:
                    left.cancel()
            else:
                await self._close(mesh, scope, send, raw, closed_session(body), workers)
        except RequestError as e:
            mesh.metrics.requests.labels(path, "rejected", str(e.status)).inc()
            await send_error(send, e.status, str(e), e.field)

    async def _open(
        self,
        mesh: Mesh,
        scope: dict[str, Any],
        send: Any,
        raw: bytes,
        session: str | None,
        workers: list[str],
        left: asyncio.Future[None],
    ) -> None:
        """``left`` is done once the client has gone: a session opened for no one is closed."""
        home = mesh.sglang_session_homes.home(session) if session is not None else None
        if home is not None:
            order = [home] if home in workers else []
        else:
            self._turn += 1
            start = self._turn % len(workers) if workers else 0
            order = workers[start:] + workers[:start]
        if home is not None and not order:
            raise RequestError(
                f"worker {home!r}, which holds session {session!r}, is down", field="session_id", status=503
            )
        if not order:
            raise RequestError("no worker serves SGLang's sessions (/open_session)", field="path", status=503)
        for worker_id in order:  # (the next one when a worker cannot be reached)
            answer = await _ask(mesh, worker_id, scope, raw)
            if answer is None:
                continue
            status, data = answer
            opened = _decoded(data) if status == 200 else None
            if left.done():  # (the client left while the engine opened it: no one will use it)
                if isinstance(opened, str) and opened:
                    closing = msgspec.json.encode({"session_id": opened})
                    await _ask(mesh, worker_id, scope, closing, "POST", CLOSE_PATH)
                mesh.metrics.requests.labels(OPEN_PATH, "disconnected", "499").inc()
                return
            if isinstance(opened, str) and opened:
                mesh.sglang_session_homes.remember(opened, worker_id)
            mesh.metrics.requests.labels(OPEN_PATH, "session", str(status)).inc()
            await send_json(send, status, data, [(WORKER_ID_HEADER, worker_id.encode())])
            return
        await send_error(send, 502, "no worker could be reached for /open_session", None)

    async def _close(
        self, mesh: Mesh, scope: dict[str, Any], send: Any, raw: bytes, session: str, workers: list[str]
    ) -> None:
        home = mesh.sglang_session_homes.home(session)
        if home is not None and home not in mesh.registry.routable:
            raise RequestError(
                f"worker {home!r}, which holds session {session!r}, is down", field="session_id", status=503
            )
        asked = [home] if home is not None else workers
        if not asked:
            raise RequestError(
                "no worker serves SGLang's sessions (/close_session)", field="path", status=503
            )
        answers = await asyncio.gather(*(_ask(mesh, worker_id, scope, raw) for worker_id in asked))
        reached = [(w, a) for w, a in zip(asked, answers, strict=True) if a is not None]
        if not reached:
            await send_error(send, 502, "no worker could be reached for /close_session", None)
            return
        failed = next(((w, a) for w, a in reached if a[0] != 200), None)
        status, data = failed[1] if failed is not None else reached[0][1]
        if status == 200:
            mesh.sglang_session_homes.forget(session)
        mesh.metrics.requests.labels(CLOSE_PATH, "session", str(status)).inc()
        await send({"type": "http.response.start", "status": status, "headers": _headers(data)})
        await send({"type": "http.response.body", "body": data, "more_body": False})


async def _ask(
    mesh: Mesh, worker_id: str, scope: dict[str, Any], raw: bytes, method: str = "", path: str = ""
) -> tuple[int, bytes] | None:
    """(status, body) of the client's request (or ``method`` ``path`` with its headers) asked of
    one worker; None when it gave none."""
    worker = mesh.registry.get(worker_id)
    if worker is None:
        return None
    headers = peer_auth.strip_internal(end_to_end_headers(scope["headers"]))
    try:
        return await mesh.forwarder.whole(
            worker.url,
            method or scope["method"],
            path or route_path(scope),
            headers,
            raw,
            timeout=_TIMEOUT,
            limit=_ANSWER_LIMIT,
        )
    except UpstreamError:
        return None


def _headers(data: bytes) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-length", str(len(data)).encode())]
    if data:
        headers.append((b"content-type", b"application/json"))
    return headers


def _decoded(data: bytes) -> Any:
    """An engine's answer decoded; None for what is no JSON."""
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None


# ---------------------------------------------------------------------------- inside the engines
def handles_embedded(path: str) -> bool:
    return path in PATHS or path == HOME_PATH


async def serve_embedded(mesh: Mesh, app: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A session's own paths inside an engine (the module docstring): an open served by this
    engine and learned; a close served where the session is; a peer's question answered."""
    path = route_path(scope)
    self_id = mesh.settings.self_worker_id
    hop = peer_auth.read_hop(scope["headers"], mesh.settings.mesh_secret)
    if path == HOME_PATH:
        if hop is None or scope["method"] != "GET":
            await app(scope, receive, send)  # (not a peer's: the engine's own 404)
            return
        session = _query_id(scope)
        if session is not None and mesh.sglang_session_homes.home(session) == self_id:
            await send_json(send, 200, msgspec.json.encode({"worker": self_id}))
        else:
            await send_error(send, 404, "no session of that id was opened here", "id")
        return
    scope = {**scope, "headers": peer_auth.strip_internal(scope["headers"])}
    settings = mesh.settings
    raw = await read_body_or_refuse(scope, receive, send, settings.max_body_bytes, settings.body_read_timeout)
    if raw is None:
        return
    try:
        doc = decode_body(raw)  # (what no engine should parse: not JSON, nested past a request's depth)
    except RequestError as e:
        await send_error(send, e.status, str(e), e.field)
        return
    named = doc.get("session_id")
    session = named if isinstance(named, str) else None  # (else the engine's own answer)
    # (an id asked for that a peer holds goes there, which refuses it as taken: an id stays one
    # engine's; a close goes where the session is)
    home = await find_home(mesh, session) if session is not None and hop is None else None
    if home is None or home == self_id:
        watch = _learning(mesh, send) if path == OPEN_PATH else _forgetting(mesh, session, send)
        await app(scope, replay_body(raw, receive), watch)
        return
    if home not in mesh.registry.routable:
        await send_error(
            send, 503, f"worker {home!r}, which holds session {session!r}, is down", "session_id"
        )
        return
    headers = [
        *scope["headers"],
        *peer_auth.hop_headers(settings.mesh_secret, mesh.replica, mesh.next_request_id()),
    ]
    answer = await _ask(mesh, home, {**scope, "headers": headers}, raw)
    if answer is None:
        await send_error(send, 502, f"worker {home!r}, which holds session {session!r}, did not answer", None)
        return
    status, data = answer
    if status == 200 and path == CLOSE_PATH and session is not None:
        mesh.sglang_session_homes.forget(session)
    await send({"type": "http.response.start", "status": status, "headers": _headers(data)})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def find_home(mesh: Mesh, session: str) -> str | None:
    """The worker that opened ``session``: known, or found by asking every other routable worker's
    router at once (one search per id at a time, a miss remembered for a moment:
    ``Mesh.holder_search``); None when none says so."""
    home = mesh.sglang_session_homes.home(session)
    if home is not None or mesh.local_app is None:
        return home
    registry = mesh.registry
    peers = [w for w in (registry.get(i) for i in sorted(registry.routable)) if w is not None]
    peers = [w for w in peers if w.worker_id != mesh.settings.self_worker_id]
    if not peers:
        return None  # (nobody to ask: no miss to remember)
    return await mesh.holder_search.find("sglang_session", session, lambda: _ask_peers(mesh, peers, session))


async def _ask_peers(mesh: Mesh, peers: list[Any], session: str) -> str | None:
    asks = peer_auth.hop_header_map(mesh.settings.mesh_secret, mesh.replica, mesh.next_request_id())
    target = f"{HOME_PATH}?id={quote(session, safe='')}"

    async def opened(worker: Any) -> bool:
        status, _ = await mesh.forwarder.get(worker.url + target, timeout=_ASK_TIMEOUT, headers=asks)
        return status == 200

    return await first_holder(peers, opened, mesh.sglang_session_homes, session)


def _learning(mesh: Mesh, send: Any) -> Any:
    """``send``, remembering this engine as the home of the session its answer opens."""
    status = 0
    body: list[bytes] = []

    async def watching(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and status == 200:
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                opened = _decoded(b"".join(body))
                if isinstance(opened, str) and opened and mesh.settings.self_worker_id is not None:
                    mesh.sglang_session_homes.remember(opened, mesh.settings.self_worker_id)
        await send(message)

    return watching


def _forgetting(mesh: Mesh, session: str | None, send: Any) -> Any:
    """``send``, forgetting ``session`` once the engine has closed it."""

    async def watching(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] == 200 and session is not None:
            mesh.sglang_session_homes.forget(session)
        await send(message)

    return watching


def _query_id(scope: dict[str, Any]) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("id")
    return values[0] if values else None


__all__ = [
    "CLOSE_PATH",
    "HOME_PATH",
    "OPEN_PATH",
    "PATHS",
    "SglangSessions",
    "find_home",
    "handles_embedded",
    "serve_embedded",
]
