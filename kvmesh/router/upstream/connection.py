"""Keep-alive HTTP/1.1 client connections on asyncio protocols, pooled per worker origin.

:class:`Http1Connection` carries one request at a time: :meth:`~Http1Connection.request` writes
it and waits for the response head, :meth:`~Http1Connection.read` hands back whatever body bytes
arrived since the last call (so an SSE stream goes on chunk by chunk) and pauses reading from the
socket while too much is waiting, so a slow client slows the worker down instead of filling memory.
A reader can also set :attr:`~Http1Connection.relay_hook` to be handed each body chunk straight
from the socket callback while it waits in :meth:`~Http1Connection.read`, which saves waking it.
:class:`ConnectionPool` keeps idle connections per origin, newest first, and drops the ones the
server closed while they sat idle.

Failures surface as ``OSError`` (connect, reset, closed early), ``asyncio.TimeoutError`` (connect)
or :class:`~kvmesh.router.upstream.http1.ProtocolError`; translating them is the caller's job.
:class:`NotSent` (an ``OSError``) says more: the connection was found closed before a single byte of
the request was handed to it, so the request provably never reached the server.

An idle connection is reused only while younger than ``max_idle_secs`` (2 s by default, below the
5 s keep-alive timeout of uvicorn, vLLM and SGLang): a server closing an idle connection just as a
request is written to it is the one case where a request may be lost without knowing whether the
server read it, and an old idle connection is where that race lives. The pool counts the
connections carrying a request per origin (:meth:`ConnectionPool.lend`), so that
:mod:`~kvmesh.router.upstream.warm` can keep as many ready as a worker's recent bursts took.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from kvmesh.router.upstream.http1 import ProtocolError, ResponseParser

# Pause reading from a worker once this much body waits for a slow client; resume below half.
_HIGH_WATER = 256 * 1024


class ConnectionClosed(ConnectionResetError):
    """The worker closed or reset the connection before the response was complete."""


class NotSent(ConnectionClosed):
    """The connection was already closed when a request was to be written: nothing was sent."""


@dataclass(frozen=True, slots=True)
class Origin:
    """The server part of a URL: what to connect to and what to say in ``Host``."""

    host: str
    port: int
    tls: bool
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if tls else 80)
        return cls(host, port, tls, parts.netloc.rpartition("@")[2].encode("idna"))


class Http1Connection(asyncio.Protocol):
    """One client connection; one request in flight at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.requests = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self._parser = ResponseParser(self)
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._paused = False
        self._on_lost: list[Http1Connection] | None = None  # the idle list holding this connection
        self.idle_since = 0.0  # loop time when it went back to the pool
        self._body_since = 0.0
        self.read_since = 0.0
        """``time.perf_counter()`` when the first of the bytes the last :meth:`read` handed out arrived."""
        self.relay_hook: Callable[[bytes], bool] | None = None
        """Offered each body chunk as it arrives while a reader waits in :meth:`read` (so with
        nothing unread); True means it has passed the chunk on and :meth:`read` will not see it.
        It must not raise."""

    # ---------------------------------------------------------------- caller side
    @property
    def usable(self) -> bool:
        """Open, idle and not told to close: can carry another request."""
        return (
            self._error is None
            and self.keep_alive
            and self._parser.idle
            and self.transport is not None
            and not self.transport.is_closing()
        )

    async def request(
        self, data: bytes, *, head_request: bool = False, on_sent: Callable[[], object] | None = None
    ) -> None:
        """Write a whole request and wait for its response head (``status``, ``headers``).
        ``on_sent`` runs once the request is handed to the transport, before anything else can."""
        transport = self.transport
        if self._error is not None or transport is None or transport.is_closing():
            raise NotSent(f"connection already closed: {self._error!r}")
        self._parser.expect(head_request=head_request)
        self.relay_hook = None
        self.requests += 1
        self.keep_alive = True
        self._complete = False
        self._body.clear()
        self._buffered = 0
        head = self._head = asyncio.get_running_loop().create_future()
        transport.write(data)
        if on_sent is not None:
            on_sent()
        try:
            await head
        finally:
            self._head = None

    async def read(self) -> bytes:
        """The body bytes received since the last call; ``b""`` once the response is complete."""
        while True:
            body = self._body
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                self.read_since = self._body_since
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                return data
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    @property
    def closed(self) -> bool:
        """Closed, failed, or never connected: it carries nothing any more."""
        return self._error is not None or self.transport is None or self.transport.is_closing()

    @property
    def complete(self) -> bool:
        """The whole response has been received (it may still be waiting in :meth:`read`)."""
        return self._complete

    @property
    def drained(self) -> bool:
        """The whole response has been received and handed out: :meth:`read` has nothing more."""
        return self._complete and not self._body

    def close(self) -> None:
        """Drop the connection now (the worker sees a disconnect); pending reads fail."""
        self._fail(ConnectionClosed("connection closed by the router"))
        if self.transport is not None:
            self.transport.abort()

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed(data)
        except ProtocolError as e:
            self._fail(e)
            assert self.transport is not None
            self.transport.abort()

    def eof_received(self) -> bool:
        try:
            self._parser.feed_eof()
        except ProtocolError:
            self._fail(ConnectionClosed("the worker closed the connection mid-response"))
        self.keep_alive = False
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(
            ConnectionClosed(f"connection lost: {exc!r}") if exc else ConnectionClosed("connection closed")
        )
        idle = self._on_lost
        if idle is not None:
            self._on_lost = None
            if self in idle:
                idle.remove(self)

    # ---------------------------------------------------------------- ResponseSink
    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self.keep_alive = keep_alive
        head = self._head
        if head is not None and not head.done():
            head.set_result(None)

    def on_body(self, data: bytes) -> None:
        hook = self.relay_hook
        if hook is not None:
            # Only while the reader waits: anything it read before is done with (the chunks
            # stay in order), and anything that came since woke it and is still unread.
            waiter = self._waiter
            if waiter is not None and not waiter.done() and hook(data):
                return
        if not self._body:
            self._body_since = time.perf_counter()
        self._body.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_end(self) -> None:
        self._complete = True
        self._wake()

    # ---------------------------------------------------------------- internals
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is not None:
            return
        self._error = error
        self.keep_alive = False
        for future in (self._head, self._waiter):
            if future is not None and not future.done():
                future.set_exception(error)


class ConnectionPool:
    """Idle keep-alive connections per origin; new ones are opened on demand."""

    def __init__(
        self, *, connect_timeout: float, max_idle_per_origin: int = 256, max_idle_secs: float = 2.0
    ) -> None:
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle_per_origin
        self._max_idle_secs = max_idle_secs
        self._idle: dict[Origin, list[Http1Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._lent: dict[Origin, weakref.WeakSet[Http1Connection]] = {}
        """Connections carrying a request now (:meth:`lend`), until given back or closed."""
        self._peaks: dict[Origin, tuple[int, float]] = {}
        """Per origin: the most connections lent at once lately, and the loop time it was last reached."""

    @property
    def max_idle_secs(self) -> float:
        """How long an idle connection is kept for reuse."""
        return self._max_idle_secs

    def take_idle(self, origin: Origin) -> Http1Connection | None:
        """The most recently used idle connection that is still usable and young enough, if any
        (the older ones are closed: newest first, so every one left is older still)."""
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest = asyncio.get_running_loop().time() - self._max_idle_secs
        while idle:
            conn = idle.pop()
            conn._on_lost = None
            if conn.usable and conn.idle_since >= oldest:
                return conn
            conn.close()
            if conn.idle_since < oldest:
                for stale in idle:
                    stale._on_lost = None
                    stale.close()
                idle.clear()
        return None

    async def connect(self, origin: Origin) -> Http1Connection:
        """A fresh connection (TCP_NODELAY is set by the event loop for TCP transports)."""
        loop = asyncio.get_running_loop()
        ssl_context: ssl.SSLContext | None = None
        if origin.tls:
            ssl_context = self._ssl = self._ssl or ssl.create_default_context()
        _, conn = await asyncio.wait_for(
            loop.create_connection(Http1Connection, origin.host, origin.port, ssl=ssl_context),
            self._connect_timeout,
        )
        return conn

    def lend(self, origin: Origin, conn: Http1Connection) -> None:
        """``conn`` carries a request now: counted towards how many an origin needs at once."""
        lent = self._lent.get(origin)
        if lent is None:
            lent = self._lent[origin] = weakref.WeakSet()
        lent.add(conn)
        busy = self.busy(origin)
        if busy >= self._peaks.get(origin, (0, 0.0))[0]:
            self._peaks[origin] = (busy, asyncio.get_running_loop().time())

    def busy(self, origin: Origin) -> int:
        """Connections to ``origin`` carrying a request now."""
        lent = self._lent.get(origin)
        if not lent:
            return 0
        for conn in [c for c in lent if c.closed]:
            lent.discard(conn)
        return len(lent)

    def warm_targets(self, now: float, remember_secs: float, margin_secs: float) -> list[tuple[Origin, int]]:
        """Per origin, how many connections to open now so that as many are ready as were busy at
        once in the last ``remember_secs``: that peak, less the ones busy now and the idle ones that
        will still be young enough to reuse ``margin_secs`` from now. Idle connections past their
        age are closed on the way (nothing reuses them)."""
        out = []
        young = now - self._max_idle_secs + margin_secs
        for origin, (peak, at) in list(self._peaks.items()):
            busy = self.busy(origin)
            if now - at > remember_secs:  # the peak is old: what is busy now is the new one
                if not busy:
                    del self._peaks[origin]
                    continue
                peak = busy
                self._peaks[origin] = (busy, now)
            idle = self._idle.get(origin, [])
            for conn in [c for c in idle if c.idle_since < now - self._max_idle_secs or not c.usable]:
                idle.remove(conn)
                conn._on_lost = None
                conn.close()
            ready = sum(1 for c in idle if c.idle_since >= young)
            missing = min(peak, self._max_idle) - busy - ready
            if missing > 0:
                out.append((origin, missing))
        return out

    def forget_peak(self, origin: Origin) -> None:
        """Keep no connections warm for ``origin`` until it carries requests again."""
        self._peaks.pop(origin, None)

    def park(self, origin: Origin, conn: Http1Connection) -> None:
        """Keep a fresh connection that has carried no request yet as idle (a warm one)."""
        conn.keep_alive = True  # (HTTP/1.1 keeps a connection open unless told otherwise)
        conn._complete = True  # (no response outstanding)
        self.give_back(origin, conn)

    def give_back(self, origin: Origin, conn: Http1Connection) -> None:
        """Keep a connection whose response was read to the end; close it if it cannot be reused."""
        lent = self._lent.get(origin)
        if lent is not None:
            lent.discard(conn)
        idle = self._idle.setdefault(origin, [])
        if conn.usable and conn.complete and len(idle) < self._max_idle:
            conn._on_lost = idle
            conn.idle_since = asyncio.get_running_loop().time()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn._on_lost = None
                conn.close()
        self._idle.clear()
