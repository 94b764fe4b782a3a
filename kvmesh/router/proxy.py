"""Forward one HTTP request to a worker and hand back its response as it arrives.

One aiohttp ``ClientSession`` per app (connection pooling, keep-alive to every worker). aiohttp's
errors never leave this module: a failure before the response head arrived becomes
:class:`ConnectFailed` (the caller may retry on another worker: nothing reached the client yet),
a failure while reading the body becomes :class:`StreamBroken` (the client already has bytes;
only a clean error is possible). Bodies are read chunk by chunk as the socket delivers them and
never decompressed, so an SSE stream reaches the client event by event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp

from kvmesh.errors import WorkerError

# Headers that describe one connection, not the message (RFC 9110 section 7.6.1), plus the ones
# the client library recomputes for the new connection.
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


class UpstreamError(WorkerError):
    """A worker could not serve a forwarded request."""

    def __init__(self, worker_url: str, message: str) -> None:
        super().__init__(f"{worker_url}: {message}")
        self.worker_url = worker_url


class ConnectFailed(UpstreamError):
    """Nothing came back before the connection failed: safe to retry on another worker."""


class StreamBroken(UpstreamError):
    """The worker's response broke off after it started."""


class UpstreamResponse:
    """A worker's response head, with the body still on the wire."""

    __slots__ = ("_iter", "_response", "headers", "status", "worker_url")

    def __init__(self, worker_url: str, response: aiohttp.ClientResponse) -> None:
        self.worker_url = worker_url
        self._response = response
        self._iter: AsyncIterator[bytes] | None = None
        self.status = response.status
        self.headers: list[tuple[bytes, bytes]] = [
            (k.lower(), v) for k, v in response.raw_headers if k.lower() not in HOP_BY_HOP
        ]

    @property
    def content_type(self) -> str:
        return self._response.headers.get("content-type", "")

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (one iterator per response: a second call continues it);
        raises StreamBroken if the worker breaks off."""
        if self._iter is None:
            self._iter = self._chunks()
        return self._iter

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise StreamBroken(self.worker_url, f"response broke off: {e!r}") from None

    async def read(self, limit: int) -> bytes:
        """The whole body (for small JSON answers); StreamBroken past ``limit`` bytes or on failure."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise StreamBroken(self.worker_url, f"response larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection (the worker sees a disconnect and can abort the request)."""
        self._response.close()

    def release(self) -> None:
        """Give a fully read connection back to the pool."""
        self._response.release()


class Forwarder:
    """The app's HTTP client towards workers: one pooled session, created on first use."""

    def __init__(self, *, connect_timeout: float = 3.0, pool_size: int = 1024) -> None:
        self._connect_timeout = connect_timeout
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=self._pool_size, limit_per_host=0, ttl_dns_cache=300)
            session = self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout, sock_read=None),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return session

    async def open(
        self,
        worker_url: str,
        method: str,
        path: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send the request and wait for the response head (not the body)."""
        try:
            response = await self._client().request(
                method, worker_url + path, headers=list(headers), data=body, allow_redirects=False
            )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise ConnectFailed(worker_url, f"no response: {e!r}") from None
        return UpstreamResponse(worker_url, response)

    async def status(self, url: str, *, timeout: float = 3.0) -> int:
        """The HTTP status of a GET (a liveness probe); ConnectFailed when nothing answers."""
        try:
            async with self._client().get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise ConnectFailed(url, f"no response: {e!r}") from None

    async def get_json(self, url: str, *, timeout: float = 3.0, headers: dict[str, str] | None = None) -> Any:
        """GET a small JSON document (worker RPCs); ConnectFailed on any failure."""
        return await self._json("GET", url, None, timeout, headers)

    async def post_json(
        self, url: str, payload: Any, *, timeout: float = 3.0, headers: dict[str, str] | None = None
    ) -> Any:
        return await self._json("POST", url, payload, timeout, headers)

    async def _json(
        self, method: str, url: str, payload: Any, timeout: float, headers: dict[str, str] | None
    ) -> Any:
        try:
            async with self._client().request(
                method, url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                if response.status != 200:
                    body = (await response.read())[:200].decode("utf-8", "replace")
                    raise ConnectFailed(url, f"HTTP {response.status}: {body}")
                return await response.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
            raise ConnectFailed(url, f"request failed: {e!r}") from None

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
