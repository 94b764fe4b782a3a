"""Serve a routed request where the router decided: the wrapped app in-process, or a peer over
kvmesh's HTTP/1.1 client, failing over to the next-best worker while nothing has reached the client.

What the engine receives is the engine's form of the request (``ParsedRequest.engine_body``) and,
for a turn of a session, its session in the engine's own way: the ``X-Session-ID`` header (vLLM's;
the TensorRT-LLM adapter and the mock read it too), added here so that every deployment (the
standalone router, any ASGI app, an embedded engine) tags the turn, in-process or forwarded.

A connection failure before the request reached the worker (connect refused, a pooled connection
found closed) marks the worker down and asks the router again without it. A failure after the
request was written but before the worker's first body byte is ambiguous: the worker may be
running it, and a generation must not run twice (upstream/forwarder.py). It is sent elsewhere only
when the worker then refuses a new connection (it died, and the request with it); a worker that
still answers gets the client a 502 and no second copy. After the first byte the client's response
has begun, so a break ends that response cleanly (an error event for SSE) instead. A client that leaves before the first byte
closes the upstream connection, which tells the worker to abort a prefill nobody waits for.

A worker that refuses the request for now (:func:`refused_for_now`: a 503, or a stream whose first
event is a 503 error, which is how a paused vLLM engine answers) ran none of it, and the client has
nothing yet: the router asks again without that worker, as for a connection failure, but leaves it
up (a paused engine answers its health checks). For a second after (``REFUSAL_HOLD_S``) the router
passes that worker over for new requests, unless no other worker may serve one. A request pinned to
the worker, or one with no other worker left, gets the refusal as the worker gave it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from kvmesh._http import error_body, replay_body, route_path, wait_disconnect
from kvmesh.errors import KvMeshError, RequestError
from kvmesh.router.asgi.accounting import RoutedAccount
from kvmesh.router.asgi.direct_relay import DirectRelay
from kvmesh.router.asgi.json_io import send_error
from kvmesh.router.asgi.peer_auth import HOP_HEADER, REQUEST_ID_HEADER, hop_headers, strip_internal
from kvmesh.router.asgi.tap import ResponseTap
from kvmesh.router.core.route_types import Decision
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.parse import ParsedRequest
from kvmesh.router.upstream.forwarder import (
    ConnectFailed,
    MaybeDelivered,
    StreamBroken,
    UpstreamResponse,
    end_to_end_headers,
)

ASGIApp = Any
Scope = dict[str, Any]
__all__ = [
    "HOP_HEADER",
    "REQUEST_ID_HEADER",
    "WORKER_ID_HEADER",
    "Dispatch",
    "refused_for_now",
    "replace_body",
]
WORKER_ID_HEADER = b"x-kvmesh-worker-id"
SESSION_HEADER = b"x-session-id"

Reroute = Callable[[frozenset[str]], Awaitable[Decision | None]]
"""Ask the router again, among these workers only; None when the request was answered meanwhile."""
ErrorReply = Callable[[int, str, float | None], Awaitable[None]]
Count = Callable[[str, int], None]
_Opened = TypeVar("_Opened")


def replace_body(scope: Scope, body: bytes) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**scope, "headers": headers}


def session_header(parsed: ParsedRequest, headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes] | None:
    """``X-Session-ID`` for a turn of a kvmesh session, unless the client named one itself."""
    session = parsed.nvext.session
    if session is None or any(k.lower() == SESSION_HEADER for k, _ in headers):
        return None
    try:
        return (SESSION_HEADER, session.session_id.encode("latin-1"))
    except UnicodeEncodeError:
        return None


def annotation_events(parsed: ParsedRequest, formatted: Callable[[list[int]], str]) -> bytes:
    """The ``nvext.annotations`` a streaming client asked for, as SSE events ahead of the answer
    (an ``event:`` line and the value as a comment line, as the reference sends them)."""
    out = b""
    for name in parsed.nvext.annotations:
        value: Any = parsed.tokens if name == "token_ids" else formatted(parsed.tokens)
        out += b"event: " + name.encode() + b"\n: " + msgspec.json.encode(value) + b"\n\n"
    return out


_STREAMED_ERROR = b'data: {"error"'


def refused_for_now(status: int, first: bytes | None) -> bool:
    """Whether a worker's answer refuses the request for now, having run none of it: a 503 (vLLM's
    engine while paused, whole requests), or a 200 stream whose first event is an error with code
    503 (vLLM's answer to a streamed request while paused: the refusal comes as the stream's first
    event). ``first``: the first body bytes, read before anything goes to the client."""
    if status == 503:
        return True
    if status != 200 or first is None or not first.startswith(_STREAMED_ERROR):
        return False
    event = first.split(b"\n", 1)[0][len(b"data: ") :]
    try:
        error = msgspec.json.decode(event).get("error")
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == 503


class Dispatch:
    """Serve one routed request on its decided worker, with failover (one instance per request)."""

    __slots__ = (
        "account",
        "app",
        "count",
        "error",
        "mesh",
        "parsed",
        "receive",
        "reroute",
        "scope",
        "send",
        "sent",
    )

    def __init__(
        self,
        mesh: Mesh,
        app: ASGIApp,
        scope: Scope,
        receive: Any,
        send: Any,
        parsed: ParsedRequest,
        account: RoutedAccount,
        *,
        reroute: Reroute,
        error: ErrorReply,
        count: Count,
    ) -> None:
        self.mesh = mesh
        self.app = app
        self.scope = scope
        self.receive = receive
        self.send = send
        self.parsed = parsed
        self.account = account
        self.reroute = reroute
        self.error = error
        self.count = count
        self.sent: Callable[[], object] | None = None
        """Runs as soon as the request is on its way to the worker (see ``RoutedRequest._sent``)."""

    async def run(self, decision: Decision, pinned: bool) -> None:
        mesh = self.mesh
        registry = mesh.registry
        account = self.account
        tried: set[str] = set()
        account.forwarding()
        while True:
            worker_id = decision.worker[0]
            try:
                body = self._engine_body(worker_id)
            except RequestError:  # a field this worker's engine has no parameter for
                account.decision = decision
                account.end(False)
                raise
            account.dispatched(decision, self.parsed.isl)
            if registry.is_local(worker_id):
                await self.serve_local(worker_id, body)
                return
            worker = registry.get(worker_id)
            assert worker is not None
            try:
                opened = await self._open_while_client_waits(worker.url, worker_id, body)
            except ConnectFailed as e:
                mesh.router.cancel(account.request_id, time.monotonic())
                if isinstance(e, MaybeDelivered) and await mesh.forwarder.reachable(worker.url):
                    # Alive, and it may be generating: a second copy elsewhere could run it twice.
                    mesh.metrics.not_resent.inc()
                    await self.error(502, f"the worker dropped the request and it was not re-sent: {e}", None)
                    return
                mesh.metrics.failovers.inc()
                tried.add(worker_id)
                await registry.mark_down(worker_id, str(e))
                allowed = registry.routable - tried
                if pinned or not allowed:
                    await self.error(502 if tried else 503, f"no worker could serve the request: {e}", 1.0)
                    return
                next_decision = await self.reroute(allowed)
                if next_decision is None:
                    return
                decision = next_decision
                continue
            if opened is None:  # the client left before the worker answered
                self.count("disconnected", 499)
                account.end(False)
                return
            upstream, first = opened
            if not pinned and refused_for_now(upstream.status, first):
                # (nothing ran there and nothing reached the client: another worker may serve it)
                allowed = registry.routable - tried - {worker_id}
                if allowed:
                    upstream.close()
                    mesh.router.cancel(account.request_id, time.monotonic())
                    mesh.metrics.refusals_rerouted.inc()
                    mesh.refused(worker_id)
                    tried.add(worker_id)
                    next_decision = await self.reroute(allowed)
                    if next_decision is None:
                        return
                    decision = next_decision
                    continue
            await self._relay(upstream, first)
            return

    def _engine_body(self, worker_id: str) -> bytes:
        w = self.mesh.registry.get(worker_id)
        info = w.info if w is not None else None
        polarity = info.priority_polarity if info is not None else "none"
        return self.parsed.engine_body(polarity, info.backend if info is not None else "")

    def _tap(self, worker_id: str) -> ResponseTap:
        account = self.account
        parsed = self.parsed
        return ResponseTap(
            self.send,
            account,
            extra_headers=[(WORKER_ID_HEADER, worker_id.encode())],
            content=account.content if account.wants_content else None,
            preamble=annotation_events(parsed, self.mesh.tokenizer.decode)
            if parsed.nvext.annotations
            else b"",
            text=account.streamed_text if account.counts_text else None,
            identified=functools.partial(self.mesh.response_homes.remember, worker_id=worker_id)
            if parsed.stores_response
            else None,
        )

    # ---------------------------------------------------------------- in-process
    async def serve_local(self, worker_id: str, body: bytes) -> None:
        scope = self.scope if body is self.parsed.raw_body else replace_body(self.scope, body)
        tag = session_header(self.parsed, scope["headers"])
        if tag is not None:
            scope = {**scope, "headers": [*scope["headers"], tag]}
        tap = self._tap(worker_id)
        self._written()
        try:
            await self.app(scope, replay_body(body, self.receive), tap)
        finally:
            self.count("local", tap.status)
            if not tap.complete:
                self.account.end(False)

    # ---------------------------------------------------------------- to a peer
    async def _open_while_client_waits(
        self, url: str, worker_id: str, body: bytes
    ) -> tuple[UpstreamResponse, bytes | None] | None:
        """``_open``, abandoned when the client disconnects first (None): closing the upstream
        connection tells the worker to abort, so a long prefill does not run for nobody."""
        return await open_while_client_waits(self.receive, lambda: self._open(url, body), _close_opened)

    async def _open(self, url: str, body: bytes) -> tuple[UpstreamResponse, bytes | None]:
        """Send upstream and wait for the first body bytes: until then a failure may fail over."""
        # The peer counts the load under our request id; the proof (with a mesh secret) tells it
        # the headers come from a replica, not a client (peer_auth).
        headers = strip_internal(end_to_end_headers(self.scope["headers"]))
        tag = session_header(self.parsed, headers)
        if tag is not None:
            headers.append(tag)
        headers += hop_headers(self.mesh.settings.mesh_secret, self.mesh.replica, self.account.request_id)
        path = route_path(self.scope)  # (the client's: /invocations stays /invocations, :mod:`.invocations`)
        if self.scope.get("query_string"):
            path += "?" + self.scope["query_string"].decode("latin-1")
        upstream = await self.mesh.forwarder.open(url, "POST", path, headers, body, on_sent=self._written)
        try:
            first = await upstream.chunks().__anext__()
        except StopAsyncIteration:
            return upstream, None
        except StreamBroken as e:
            upstream.close()  # the head came: the worker had the request
            raise MaybeDelivered(url, f"failed before the first byte: {e}") from None
        except BaseException:  # cancelled: the client left
            upstream.close()
            raise
        return upstream, first

    async def _relay(self, upstream: UpstreamResponse, first: bytes | None) -> None:
        tap = self._tap(self.account.worker_id)
        # A response that arrived whole (small JSON answers) goes out at once: a client leaving
        # now has nothing left to abort, so only a response still on the wire is watched.
        whole = upstream.drained
        gone: asyncio.Event | None = None
        watcher = None
        if not whole:
            gone = asyncio.Event()
            watcher = asyncio.get_running_loop().create_task(self._watch_client(upstream, gone))
        try:
            await tap({"type": "http.response.start", "status": upstream.status, "headers": upstream.headers})
            if whole:
                await tap({"type": "http.response.body", "body": first or b"", "more_body": False})
            else:
                if first is not None:
                    await self._relay_until_first_token(upstream, tap, first)
                    await self._relay_rest(upstream, tap)
                await tap({"type": "http.response.body", "body": b"", "more_body": False})
            upstream.release()
            self.count("forwarded", upstream.status)
        except StreamBroken as e:
            upstream.close()
            if gone is None or not gone.is_set():
                await self._broken(tap, str(e))
        finally:
            if watcher is not None:
                watcher.cancel()
            if not tap.complete:
                upstream.close()
                self.account.end(False)

    async def _relay_rest(self, upstream: UpstreamResponse, tap: ResponseTap) -> None:
        """Relay the body after its first token. Where the server allows it, the chunks the tap
        passes on unchanged go to the client straight from the worker's socket callback
        (:mod:`.direct_relay`), and this loop sees only the others."""
        direct = DirectRelay.under(self.send, tap)
        upstream.relay_directly(direct)
        sent = 0
        try:
            async for chunk in upstream.chunks():
                await tap({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += 1
        finally:
            upstream.relay_directly(None)
            relayed = self.mesh.metrics.relayed_chunks
            relayed["send"].inc(sent)
            if direct is not None:
                relayed["direct"].inc(direct.written)

    def _written(self) -> None:
        """The request is on its way to its worker (written, or handed to the local engine)."""
        self.account.written()
        if self.sent is not None:
            self.sent()

    async def _relay_until_first_token(
        self, upstream: UpstreamResponse, tap: ResponseTap, first: bytes
    ) -> None:
        """Relay from the response's first body bytes to the chunk carrying its first token, and
        time that chunk's way through the front (``relay_first``)."""
        chunk: bytes | None = first
        while chunk is not None:
            arrived = upstream.received_at
            await tap({"type": "http.response.body", "body": chunk, "more_body": True})
            if tap.first_sent_at:
                self.account.relayed_first(tap.first_sent_at - arrived)
                return
            chunk = await anext(upstream.chunks(), None)

    async def _watch_client(self, upstream: UpstreamResponse, gone: asyncio.Event) -> None:
        await wait_disconnect(self.receive)
        gone.set()
        upstream.close()  # the worker sees the disconnect and can abort the generation

    async def _broken(self, tap: ResponseTap, message: str) -> None:
        """The worker broke off mid-response: end the client's response cleanly."""
        self.count("forwarded", 502)
        if not tap.started:
            await send_error(self.send, 502, message)
            return
        event = b"data: " + msgspec.json.encode(error_body(message, 502)) + b"\n\n"
        with contextlib.suppress(Exception):
            await self.send({"type": "http.response.body", "body": event, "more_body": False})


async def open_while_client_waits(
    receive: Any, opening: Callable[[], Awaitable[_Opened]], close: Callable[[_Opened], object]
) -> _Opened | None:
    """Await ``opening()`` (a request sent to a worker, until its answer begins), abandoned when
    the client disconnects first: then None, and the connection to the worker is closed, which
    tells it to abort (a long prefill or pooling pass does not run for nobody).

    It runs in this task, so the request is written to the worker at once. In a task of its own
    it was written only after everything already scheduled, which in a burst is the other
    requests' parsing and routing. A watcher cancels this task when the client leaves."""
    me = asyncio.current_task()
    assert me is not None
    opening_now, left = True, False

    def client_left(watch: asyncio.Future[None]) -> None:
        nonlocal left
        if watch.cancelled():
            return
        watch.exception()  # retrieved: a receive that failed is a client gone as well
        # (a callback already scheduled can run after the open ended: then it is too late)
        if opening_now:
            left = True
            me.cancel()

    gone = asyncio.ensure_future(wait_disconnect(receive))
    gone.add_done_callback(client_left)
    try:
        opened = await opening()
    except (asyncio.CancelledError, KvMeshError):
        if not left:
            raise
        _uncancel(me)  # the client is gone: nothing to fail over for
        return None
    finally:
        opening_now = False
        gone.cancel()
    if left:
        # The cancellation was lost on the way (it can meet a connect that just completed,
        # asyncio.wait_for before Python 3.12) and the request got through: the worker must
        # see the disconnect, or it runs the request for nobody.
        _uncancel(me)
        close(opened)
        return None
    return opened


def _close_opened(opened: tuple[UpstreamResponse, bytes | None]) -> None:
    opened[0].close()


def _uncancel(task: asyncio.Task[Any]) -> None:
    """Withdraw a cancellation this module asked for and handled (Python 3.11+ counts them, and
    ``asyncio.timeout`` in the same task reads the count)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


async def relay_unchanged(
    upstream: UpstreamResponse, send: Callable[[dict[str, Any]], Awaitable[None]]
) -> None:
    """Hand a worker's answer to the client as it comes, head and body (an answer the router
    does not read: a stored response, a utility endpoint's). A worker that breaks off, or a client
    that leaves, closes the connection to the worker."""
    try:
        await send({"type": "http.response.start", "status": upstream.status, "headers": upstream.headers})
        async for chunk in upstream.chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        upstream.release()
    except BaseException:
        upstream.close()
        raise
