"""Forward one HTTP request to a worker and hand back its response as it arrives.

The app's :class:`Forwarder` speaks HTTP/1.1 over pooled keep-alive connections
(:mod:`kvmesh.router.upstream.connection`): one buffer out per request, the response head parsed by
:mod:`kvmesh.router.upstream.http1`, body bytes handed on as the socket delivers them and never
decompressed, so an SSE stream reaches the client event by event. Socket and protocol errors never
leave this module: a failure before the response head arrived becomes :class:`ConnectFailed` (the
caller may retry on another worker: nothing reached the client yet), a failure while reading the
body becomes :class:`StreamBroken` (the client already has bytes; only a clean error is possible).

Sending twice (RFC 9112 section 9.3.1: a client may retry a non-idempotent request on its own only
when it knows the first attempt was never applied). A generation is a non-idempotent POST: it costs
engine time, and with sessions and pins it changes engine state. :meth:`Forwarder.open` therefore
sends a request again only when it provably never reached the worker: the connect failed, or the
reused keep-alive connection was already closed when the request was to be written
(:class:`~kvmesh.router.upstream.connection.NotSent`). Once a byte was handed to a connection, a
failure before the response head is :class:`MaybeDelivered`: the worker may be running it, so the
forwarder does not resend it, and the caller decides (the router fails over only to replace a
worker it finds dead). The small worker RPCs and probes (:meth:`get_json`, :meth:`post_json`) are
idempotent and keep the transparent retry on a fresh connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvmesh.errors import WorkerError
from kvmesh.router.upstream.connection import ConnectionPool, Http1Connection, NotSent, Origin
from kvmesh.router.upstream.http1 import ProtocolError, encode_request
from kvmesh.router.upstream.warm import keep_warm
from kvmesh.router.upstream.warm import stop as stop_warming

# Headers that describe one connection, not the message (RFC 9110 section 7.6.1), plus the ones
# the client recomputes for the new connection.
HOP_BY_HOP: frozenset[bytes] = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    )
)
_JSON_HEADERS = [(b"content-type", b"application/json")]
ANSWER_LIMIT = 4 << 20
"""The largest answer to a worker RPC or probe read whole, unless the call says otherwise (the
cache dump and the engine's /metrics do). Without a bound, an address answering /kvmesh/info with
an endless body (a wrong URL in the fleet, a broken engine) took the router to 1.6 GB in the 3 s of
one health check's timeout, and again at every check."""
_CONNECTION = b"connection"
_FAILURES = (OSError, asyncio.TimeoutError, ProtocolError)
# RFC 9110 section 9.2.2; the worker RPCs kvmesh POSTs (session_control, pin_prefix) set a state
# and are idempotent as well, so _exchange retries them like these.
_IDEMPOTENT = frozenset(("GET", "HEAD", "PUT", "DELETE", "OPTIONS"))


def end_to_end_headers(headers: list[tuple[bytes, bytes]], drop: bytes = b"") -> list[tuple[bytes, bytes]]:
    """Lower-case ``headers`` without the hop-by-hop ones: HOP_BY_HOP, every header the
    ``Connection`` header names (RFC 9110 section 7.6.1) and ``drop``."""
    out: list[tuple[bytes, bytes]] = []
    named: set[bytes] | None = None
    for name, value in headers:
        if name in HOP_BY_HOP or name == drop:
            if name == _CONNECTION:
                tokens = {token.strip().lower() for token in value.split(b",")}
                named = tokens if named is None else named | tokens
            continue
        out.append((name, value))
    if named:
        out = [(name, value) for name, value in out if name not in named]
    return out


class UpstreamError(WorkerError):
    """A worker could not serve a forwarded request."""

    def __init__(self, worker_url: str, message: str) -> None:
        super().__init__(f"{worker_url}: {message}")
        self.worker_url = worker_url


class ConnectFailed(UpstreamError):
    """Nothing came back before the connection failed: safe to retry on another worker."""


class Refused(ConnectFailed):
    """The worker answered a JSON call with an HTTP error status (``status``)."""

    def __init__(self, worker_url: str, status: int, message: str) -> None:
        super().__init__(worker_url, f"HTTP {status}: {message}")
        self.status = status


class MaybeDelivered(ConnectFailed):
    """The request was written, then the connection failed before the response head: the worker
    may have received it and may be running it. Never re-sent by the forwarder."""


class StreamBroken(UpstreamError):
    """The worker's response broke off after it started."""


class UpstreamResponse:
    """A worker's response head, with the body still on the wire.

    Iterate it (or :meth:`chunks`) for the body; then :meth:`release` a fully read response's
    connection to the pool, or :meth:`close` it to make the worker see a disconnect.
    """

    __slots__ = ("_conn", "_origin", "_pool", "_released", "headers", "status", "worker_url")

    def __init__(self, worker_url: str, conn: Http1Connection, pool: ConnectionPool, origin: Origin) -> None:
        self.worker_url = worker_url
        self._conn = conn
        self._pool = pool
        self._origin = origin
        self._released = False
        self.status = conn.status
        self.headers = end_to_end_headers(conn.headers)

    @property
    def content_type(self) -> str:
        for name, value in self.headers:
            if name == b"content-type":
                return value.decode("latin-1")
        return ""

    @property
    def drained(self) -> bool:
        """Every body byte has been handed out: iterating further yields nothing."""
        return self._conn.drained

    @property
    def received_at(self) -> float:
        """``time.perf_counter()`` when the first of the body bytes last handed out arrived."""
        return self._conn.read_since

    def chunks(self) -> UpstreamResponse:
        """Body bytes as they arrive (the response is its own iterator: a second call continues it);
        raises StreamBroken if the worker breaks off."""
        return self

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        try:
            data = await self._conn.read()
        except _FAILURES as e:
            raise StreamBroken(self.worker_url, f"response broke off: {e!r}") from None
        if not data:
            raise StopAsyncIteration
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body (for small JSON answers); StreamBroken past ``limit`` bytes or on failure."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self:
            size += len(chunk)
            if limit is not None and size > limit:
                raise StreamBroken(self.worker_url, f"response larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def relay_directly(self, hook: Callable[[bytes], bool] | None) -> None:
        """Offer the body's next chunks to ``hook`` as they arrive, while this response is being
        read and all of it read so far (see ``Http1Connection.relay_hook``; the connection's next
        request clears it); None stops it."""
        if not self._released:
            self._conn.relay_hook = hook

    def close(self) -> None:
        """Drop the connection (the worker sees a disconnect and can abort the request)."""
        if not self._released:  # once released, the connection may carry someone else's request
            self._conn.close()

    def release(self) -> None:
        """Give a fully read connection back to the pool (an unfinished one is closed)."""
        if not self._released:
            self._released = True
            self._pool.give_back(self._origin, self._conn)


class Forwarder:
    """The app's HTTP client towards workers: keep-alive connections, pooled per worker."""

    def __init__(self, *, connect_timeout: float = 3.0, pool_size: int = 256, warm: bool = True) -> None:
        """``warm``: keep connections ready for each worker's recent bursts (:mod:`.warm`), from
        the first request on."""
        self._pool = ConnectionPool(connect_timeout=connect_timeout, max_idle_per_origin=pool_size)
        self._targets: dict[str, tuple[Origin, bytes]] = {}
        self._warms = warm
        self._warm: asyncio.Task[None] | None = None

    async def open(
        self,
        worker_url: str,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        on_sent: Callable[[], object] | None = None,
    ) -> UpstreamResponse:
        """Send the request and wait for the response head (not the body).

        ``headers`` are lower-case (name, value) pairs without hop-by-hop ones (see HOP_BY_HOP).
        ``on_sent`` runs as soon as the request is written (see ``Http1Connection.request``).
        """
        origin, prefix = self._target(worker_url)
        try:
            data = encode_request(method.encode(), prefix + path.encode(), origin.host_header, headers, body)
        except ValueError as e:
            raise UpstreamError(worker_url, str(e)) from None
        return await self._send(
            worker_url,
            origin,
            data,
            method == "HEAD",
            idempotent=method in _IDEMPOTENT,
            on_sent=on_sent,
            counted=True,
        )

    async def _send(
        self,
        url: str,
        origin: Origin,
        data: bytes,
        head_request: bool,
        *,
        idempotent: bool,
        on_sent: Callable[[], object] | None = None,
        counted: bool = False,
    ) -> UpstreamResponse:
        """``counted``: the request counts towards the connections kept ready for its worker (a
        forwarded request does; a worker RPC or probe, one at a time, does not: counted, it kept
        a connection ready for every worker of an idle fleet, replaced every 1.5 s)."""
        pool = self._pool
        if counted and self._warm is None and self._warms:
            self._warm = asyncio.get_running_loop().create_task(keep_warm(pool))
        conn = pool.take_idle(origin)
        if conn is not None:
            if counted:
                pool.lend(origin, conn)
            try:
                await conn.request(data, head_request=head_request, on_sent=on_sent)
                return UpstreamResponse(url, conn, pool, origin)
            except NotSent:
                conn.close()  # closed before a byte was written: a fresh connection is safe
            except _FAILURES as e:
                # Written, then the connection failed before the head: the worker may have read
                # it (or closed the idle connection just before). Only an idempotent request may
                # go again; for the others it is the caller's call (module docstring).
                conn.close()
                if not idempotent:
                    raise MaybeDelivered(
                        url, f"connection failed after the request was sent: {e!r}"
                    ) from None
            except BaseException:
                conn.close()
                raise
        conn = None
        try:
            conn = await pool.connect(origin)
        except _FAILURES as e:
            raise ConnectFailed(url, f"no response: {e!r}") from None
        if counted:
            pool.lend(origin, conn)
        try:
            await conn.request(data, head_request=head_request, on_sent=on_sent)
        except _FAILURES as e:
            conn.close()
            if isinstance(e, NotSent) or idempotent:
                raise ConnectFailed(url, f"no response: {e!r}") from None
            raise MaybeDelivered(url, f"no response: {e!r}") from None
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(url, conn, pool, origin)

    async def reachable(self, url: str) -> bool:
        """Whether the worker accepts a connection now (a fresh one, closed at once): after a
        :class:`MaybeDelivered`, a worker that refuses is gone, and the request with it."""
        try:
            conn = await self._pool.connect(self._target(url)[0])
        except _FAILURES:
            return False
        conn.close()
        return True

    def _target(self, url: str) -> tuple[Origin, bytes]:
        """(origin, path prefix) of a worker URL; cached, the fleet's URLs are few."""
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            path = parts.path.rstrip("/")
            if parts.query:
                path += "?" + parts.query
            target = (Origin.parse(url), path.encode())
            if len(self._targets) < 4096:
                self._targets[url] = target
        return target

    async def status(self, url: str, *, timeout: float = 3.0) -> int:
        """The HTTP status of a GET (a liveness probe); ConnectFailed when nothing answers."""
        status, _ = await self._exchange("GET", url, None, timeout, None, ANSWER_LIMIT)
        return status

    async def get(
        self,
        url: str,
        *,
        timeout: float = 3.0,
        headers: dict[str, str] | None = None,
        limit: int = ANSWER_LIMIT,
    ) -> tuple[int, bytes]:
        """A whole GET: (status, body); ConnectFailed when nothing answers in time or the body
        runs past ``limit`` bytes."""
        return await self._exchange("GET", url, None, timeout, headers, limit)

    async def post(
        self, url: str, payload: Any, *, timeout: float = 3.0, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """A whole POST of a small JSON ``payload``: (status, body), whatever the status;
        ConnectFailed when nothing answers in time."""
        return await self._exchange("POST", url, payload, timeout, headers, ANSWER_LIMIT)

    async def get_json(
        self,
        url: str,
        *,
        timeout: float = 3.0,
        headers: dict[str, str] | None = None,
        limit: int = ANSWER_LIMIT,
    ) -> Any:
        """GET a JSON document (worker RPCs); ConnectFailed on any failure."""
        return await self._json("GET", url, None, timeout, headers, limit)

    async def post_json(
        self, url: str, payload: Any, *, timeout: float = 3.0, headers: dict[str, str] | None = None
    ) -> Any:
        return await self._json("POST", url, payload, timeout, headers, ANSWER_LIMIT)

    async def _json(
        self, method: str, url: str, payload: Any, timeout: float, headers: dict[str, str] | None, limit: int
    ) -> Any:
        status, body = await self._exchange(method, url, payload, timeout, headers, limit)
        if status != 200:
            raise Refused(url, status, body[:200].decode("utf-8", "replace"))
        try:
            return msgspec.json.decode(body)
        except msgspec.DecodeError as e:
            raise ConnectFailed(url, f"request failed: answer is not JSON: {e}") from None

    async def _exchange(
        self,
        method: str,
        url: str,
        payload: Any,
        timeout: float,
        headers: dict[str, str] | None,
        limit: int,
    ) -> tuple[int, bytes]:
        """One whole request/response (worker RPCs and probes), bounded by ``timeout`` and, in
        size, by ``limit``: the connection is dropped once the body runs past it."""
        origin, target = self._target(url)
        wire = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        body = b""
        if payload is not None:
            body = msgspec.json.encode(payload)
            wire += _JSON_HEADERS
        try:
            data = encode_request(method.encode(), target or b"/", origin.host_header, wire, body)
        except ValueError as e:
            raise ConnectFailed(url, f"request failed: {e}") from None
        return await self._whole(url, origin, data, method == "HEAD", True, timeout, limit)

    async def whole(
        self,
        worker_url: str,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        timeout: float,
        limit: int = ANSWER_LIMIT,
    ) -> tuple[int, bytes]:
        """A client's request sent on as it came (headers as for :meth:`open`), its answer read
        whole: (status, body). ConnectFailed when nothing answers within ``timeout`` or the body
        runs past ``limit``; MaybeDelivered as for :meth:`open`."""
        origin, prefix = self._target(worker_url)
        try:
            data = encode_request(method.encode(), prefix + path.encode(), origin.host_header, headers, body)
        except ValueError as e:
            raise ConnectFailed(worker_url, f"request failed: {e}") from None
        return await self._whole(
            worker_url, origin, data, method == "HEAD", method in _IDEMPOTENT, timeout, limit
        )

    async def _whole(
        self,
        url: str,
        origin: Origin,
        data: bytes,
        head_request: bool,
        idempotent: bool,
        timeout: float,
        limit: int,
    ) -> tuple[int, bytes]:
        """Send ``data`` (an encoded request) and read the whole answer, bounded by ``timeout``
        and, in size, by ``limit``: the connection is dropped once the body runs past it."""

        async def exchange() -> tuple[int, bytes]:
            response = await self._send(url, origin, data, head_request, idempotent=idempotent)
            try:
                body = await response.read(limit)
            except BaseException:
                response.close()
                raise
            response.release()
            return response.status, body

        try:
            return await asyncio.wait_for(exchange(), timeout)
        except asyncio.TimeoutError:
            raise ConnectFailed(url, f"request failed: no answer within {timeout:g}s") from None
        except StreamBroken as e:
            raise ConnectFailed(url, f"request failed: {e}") from None

    async def close(self) -> None:
        task, self._warm = self._warm, None
        await stop_warming(task)
        self._pool.close()
