"""kvmesh/router/upstream/forwarder.py's HTTP/1.1 client against raw loopback servers that misbehave on cue.

Each server is an ``asyncio.start_server`` handler writing exact bytes, so a test controls framing,
timing and failures precisely; the router-level tests at the end put the client behind the
standalone router.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from kvmesh.router.upstream.connection import _HIGH_WATER
from kvmesh.router.upstream.forwarder import (
    ANSWER_LIMIT,
    ConnectFailed,
    Forwarder,
    MaybeDelivered,
    StreamBroken,
    UpstreamError,
)
from tests.router.engines import EngineState, engine_app
from tests.router.fleet import chat
from tests.router.servers import serve, wait_until

Handler = Callable[["Peer"], Awaitable[None]]


@dataclass
class Raw:
    url: str
    connections: int = 0
    sent: int = 0  # body bytes an endless answer wrote
    requests: list[tuple[bytes, dict[bytes, bytes], bytes]] = field(default_factory=list)


@dataclass
class Peer:
    """One accepted connection, as the handler sees it."""

    raw: Raw
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    index: int  # 0 for the server's first connection

    async def request(self) -> tuple[bytes, dict[bytes, bytes], bytes] | None:
        """The next request on this connection (None at EOF)."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        line, *lines = head[:-4].split(b"\r\n")
        headers = dict(h.split(b": ", 1) for h in lines)
        body = await self.reader.readexactly(int(headers.get(b"content-length", b"0")))
        got = (line, headers, body)
        self.raw.requests.append(got)
        return got

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[Raw]:
    raw = Raw("")

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = raw.connections
        raw.connections += 1
        try:
            await handler(Peer(raw, reader, writer, index))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    raw.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield raw
    finally:
        server.close()
        await server.wait_closed()


def ok(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    return head + b"".join(h + b"\r\n" for h in extra) + b"\r\n" + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def answer_all(peer: Peer) -> None:
    """Answer every request on the connection with its own body, keep-alive."""
    while (request := await peer.request()) is not None:
        await peer.send(ok(request[2], b"connection: keep-alive", b"keep-alive: timeout=5"))


@pytest.fixture
async def forwarder() -> AsyncIterator[Forwarder]:
    # (no warm connections: these tests count the connections the requests themselves open)
    f = Forwarder(connect_timeout=2.0, warm=False)
    yield f
    await f.close()


async def body_of(forwarder: Forwarder, url: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    response = await forwarder.open(url, "POST", "/v1/chat/completions", headers, body)
    assert response.status == 200
    data = await response.read()
    response.release()
    return data


async def test_content_length_answers_reuse_one_keep_alive_connection(forwarder: Forwarder) -> None:
    async with raw_server(answer_all) as raw:
        headers = [(b"authorization", b"Bearer k"), (b"x-kvmesh-hop", b"r1")]
        response = await forwarder.open(raw.url, "POST", "/v1/chat/completions?x=1", headers, b'{"a":1}')
        assert response.status == 200
        # hop-by-hop headers of the worker's connection stay behind
        assert response.headers == [(b"content-type", b"application/json")]
        assert response.content_type == "application/json"
        assert await response.read() == b'{"a":1}'
        response.release()
        assert await body_of(forwarder, raw.url, b"second", []) == b"second"
        assert raw.connections == 1
        line, sent, body = raw.requests[0]
        assert line == b"POST /v1/chat/completions?x=1 HTTP/1.1"
        assert sent == {
            b"host": raw.url[len("http://") :].encode(),
            b"authorization": b"Bearer k",
            b"x-kvmesh-hop": b"r1",
            b"content-length": b"7",
        }
        assert body == b'{"a":1}'


async def test_chunked_stream_arrives_chunk_by_chunk(forwarder: Forwarder) -> None:
    received_first = asyncio.Event()

    async def stream(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + chunk(b"data: one\n\n")
            )
            # The second event is written only once the client holds the first: nothing buffers.
            await asyncio.wait_for(received_first.wait(), 5)
            await peer.send(chunk(b"data: two\n\n"))
            await peer.send(b"0\r\n\r\n")

    async with raw_server(stream) as raw:
        response = await forwarder.open(raw.url, "POST", "/v1/chat/completions", [], b"{}")
        assert response.headers == [(b"content-type", b"text/event-stream")]
        chunks = response.chunks()
        assert await chunks.__anext__() == b"data: one\n\n"
        received_first.set()
        assert [c async for c in chunks] == [b"data: two\n\n"]
        response.release()
        received_first.clear()
        response = await forwarder.open(raw.url, "POST", "/v1/chat/completions", [], b"{}")
        first = await response.chunks().__anext__()
        received_first.set()
        assert first + await response.read() == b"data: one\n\ndata: two\n\n"
        response.release()
        assert raw.connections == 1


async def test_connection_refused_is_connect_failed(forwarder: Forwarder) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with pytest.raises(ConnectFailed, match="no response"):
            await forwarder.open(url, "POST", "/v1/completions", [], b"{}")


@pytest.mark.parametrize(
    "reply",
    [b"", b"HTTP/1.1 200 OK\r\ncontent-le", b"SSH-2.0-OpenSSH_9.6\r\n\r\n"],
    ids=["closed", "half-head", "not-http"],
)
async def test_failure_before_the_head_is_connect_failed(forwarder: Forwarder, reply: bytes) -> None:
    async def fail(peer: Peer) -> None:
        await peer.request()
        await peer.send(reply)

    async with raw_server(fail) as raw:
        with pytest.raises(ConnectFailed):
            await forwarder.open(raw.url, "POST", "/v1/completions", [], b"{}")
        assert raw.connections == 1  # a fresh connection is not retried: the caller fails over


async def test_a_post_the_worker_read_and_dropped_is_not_sent_twice(forwarder: Forwarder) -> None:
    """RFC 9112 section 9.3.1: the reused connection failed after the request was written, so the
    worker may be running it; the forwarder must not send it again (it used to)."""

    async def close_after_one(peer: Peer) -> None:
        request = await peer.request()
        assert request is not None
        await peer.send(ok(request[2]))
        if peer.index == 0:
            await peer.request()  # the reused connection's request is read, never answered
            return
        await answer_all(peer)

    async with raw_server(close_after_one) as raw:
        assert await body_of(forwarder, raw.url, b"1", []) == b"1"
        with pytest.raises(MaybeDelivered, match="after the request was sent"):
            await body_of(forwarder, raw.url, b"2", [])
        assert [r[2] for r in raw.requests] == [b"1", b"2"]


async def test_an_idle_connection_closed_before_reuse_is_replaced_transparently(forwarder: Forwarder) -> None:
    async def one_per_connection(peer: Peer) -> None:
        request = await peer.request()
        assert request is not None
        await peer.send(ok(request[2]))  # then close: the client sees EOF while the connection idles

    async with raw_server(one_per_connection) as raw:
        assert await body_of(forwarder, raw.url, b"1", []) == b"1"
        await asyncio.sleep(0.05)  # the EOF reaches the pooled connection
        assert await body_of(forwarder, raw.url, b"2", []) == b"2"
        assert raw.connections == 2
        assert [r[2] for r in raw.requests] == [b"1", b"2"]  # each sent once


async def test_an_old_idle_connection_is_not_reused() -> None:
    forwarder = Forwarder(connect_timeout=2.0, warm=False)
    forwarder._pool._max_idle_secs = 0.0  # every idle connection is past its age at once
    try:
        async with raw_server(answer_all) as raw:
            assert await body_of(forwarder, raw.url, b"1", []) == b"1"
            assert await body_of(forwarder, raw.url, b"2", []) == b"2"
            assert raw.connections == 2
    finally:
        await forwarder.close()


async def test_a_write_to_a_closed_connection_is_not_sent() -> None:
    from kvmesh.router.upstream.connection import Http1Connection, NotSent

    conn = Http1Connection()
    with pytest.raises(NotSent):
        await conn.request(b"POST / HTTP/1.1\r\n\r\n")


async def test_a_body_cut_short_is_stream_broken_after_the_bytes_that_came(forwarder: Forwarder) -> None:
    async def cut(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")

    async with raw_server(cut) as raw:
        response = await forwarder.open(raw.url, "POST", "/v1/completions", [], b"{}")
        got = b""
        with pytest.raises(StreamBroken, match="response broke off"):
            async for chunk in response.chunks():
                got += chunk
        assert got == b"0123456789"
        response.release()  # a broken connection is never pooled
        assert forwarder._pool.take_idle(forwarder._target(raw.url)[0]) is None


async def test_close_makes_the_worker_see_a_disconnect(forwarder: Forwarder) -> None:
    disconnected = asyncio.Event()

    async def endless(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        assert await peer.reader.read(1) == b""
        disconnected.set()

    async with raw_server(endless) as raw:
        response = await forwarder.open(raw.url, "POST", "/v1/completions", [], b"{}")
        assert await response.chunks().__anext__() == b"abc"
        response.close()
        await asyncio.wait_for(disconnected.wait(), 5)
        with pytest.raises(StreamBroken):
            await response.chunks().__anext__()


async def test_a_slow_reader_pauses_the_worker_instead_of_buffering(forwarder: Forwarder) -> None:
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB

    async def big(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload) + payload)

    async with raw_server(big) as raw:
        response = await forwarder.open(raw.url, "POST", "/v1/completions", [], b"{}")
        parts = []
        async for chunk in response.chunks():
            parts.append(chunk)
            await asyncio.sleep(0.02)  # a slow client
        assert b"".join(parts) == payload
        # Reading stops past the high-water mark, so no read hands back much more than that.
        assert max(map(len, parts)) <= _HIGH_WATER + 256 * 1024
        response.release()


async def test_rpc_helpers(forwarder: Forwarder) -> None:
    async def rpc(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            line = request[0]
            if line.startswith(b"GET /health"):
                await peer.send(b"HTTP/1.1 204 No Content\r\n\r\n")
            elif line.startswith(b"GET /missing"):
                await peer.send(b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found")
            elif line.startswith(b"GET /slow"):
                await asyncio.sleep(5)
            else:
                await peer.send(ok(b'{"echo":' + (request[2] or b"null") + b"}"))

    async with raw_server(rpc) as raw:
        assert await forwarder.status(raw.url + "/health") == 204
        assert await forwarder.get_json(raw.url + "/kvmesh/info", headers={"X-Token": "t"}) == {"echo": None}
        assert raw.requests[-1][1][b"x-token"] == b"t"
        assert await forwarder.post_json(raw.url + "/rpc", {"a": [1]}) == {"echo": {"a": [1]}}
        assert raw.requests[-1][1][b"content-type"] == b"application/json"
        with pytest.raises(ConnectFailed, match="HTTP 404: not found"):
            await forwarder.get_json(raw.url + "/missing")
        with pytest.raises(ConnectFailed, match=r"no answer within 0\.2s"):
            await forwarder.get_json(raw.url + "/slow", timeout=0.2)
        with pytest.raises(UpstreamError, match="CR or LF"):
            await forwarder.open(raw.url, "POST", "/v1/completions", [(b"x-a", b"1\r\nx-b: 2")], b"")


async def endless(peer: Peer) -> None:
    """Answer the first request with a chunked body that never ends; count what was sent."""
    if await peer.request() is None:
        return
    await peer.send(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    block = b" " * 65536
    while True:
        await peer.send(chunk(block))
        peer.raw.sent += len(block)


async def test_an_answer_past_its_limit_drops_the_connection(forwarder: Forwarder) -> None:
    """An address answering an RPC with an endless body (a wrong URL in the fleet, a broken engine)
    was read until the timeout: 1.6 GB of the router's memory in the 3 s of one health check."""
    async with raw_server(endless) as raw:
        with pytest.raises(ConnectFailed, match=f"response larger than {ANSWER_LIMIT} bytes"):
            await forwarder.get_json(raw.url + "/kvmesh/info", timeout=30)
        with pytest.raises(ConnectFailed, match="response larger than 100000 bytes"):
            await forwarder.get(raw.url + "/metrics", timeout=30, limit=100_000)
        with pytest.raises(ConnectFailed, match=f"response larger than {ANSWER_LIMIT} bytes"):
            await forwarder.status(raw.url + "/health", timeout=30)
        await wait_until(lambda: raw.connections == 3)
    # Each connection was dropped once its answer ran past the limit: the server sent about
    # that much (plus what the socket buffers held), not 30 s of loopback.
    assert raw.sent < 3 * (ANSWER_LIMIT + (16 << 20))


async def test_an_answer_within_its_limit_is_read_whole(forwarder: Forwarder) -> None:
    document = b'{"blocks": [' + b",".join(b"%d" % (10**18 + i) for i in range(50_000)) + b"]}"

    async def big(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(ok(document))

    async with raw_server(big) as raw:
        assert len(document) > 500_000
        doc = await forwarder.get_json(raw.url + "/kvmesh/kv_state", limit=len(document))
        assert len(doc["blocks"]) == 50_000
        with pytest.raises(ConnectFailed, match=f"response larger than {len(document) - 1} bytes"):
            await forwarder.get_json(raw.url + "/kvmesh/kv_state", limit=len(document) - 1)


# ---------------------------------------------------------------------------- behind the router
@contextlib.asynccontextmanager
async def router_for(*urls: str, health_interval: float = 5.0, **settings: object) -> AsyncIterator[str]:
    mesh = MeshSettings(
        workers=tuple(WorkerSpec(u, u) for u in urls),
        router=RouterConfig(router_mode="round-robin"),
        health_interval=health_interval,
        **settings,  # type: ignore[arg-type]
    )
    async with serve(build_router_app(mesh)) as front:
        yield front.url


async def _load(http: aiohttp.ClientSession, front: str) -> int:
    async with http.get(front + "/kvmesh/workers") as r:
        return sum(row["active_requests"] for row in (await r.json())["workers"])


async def test_router_fails_over_when_a_worker_refuses_connections(http: aiohttp.ClientSession) -> None:
    alive, gone = EngineState("alive"), EngineState("gone")
    async with serve(engine_app(alive)) as a, contextlib.AsyncExitStack() as stack:
        b = await stack.enter_async_context(serve(engine_app(gone)))
        async with router_for(a.url, b.url) as front:
            for _ in range(500):  # (both found up first: a worker never seen up is not "down")
                async with http.get(front + "/kvmesh/workers") as r:
                    if {row["state"] for row in (await r.json())["workers"]} == {"up"}:
                        break
                await asyncio.sleep(0.01)
            await stack.aclose()  # the second worker's port now refuses connections
            for i in range(4):
                async with http.post(front + "/v1/chat/completions", json=chat(f"q{i}")) as r:
                    assert r.status == 200
                    assert (await r.json())["choices"][0]["message"]["content"] == "alive"
            async with http.get(front + "/kvmesh/workers") as r:
                states = {row["url"]: row["state"] for row in (await r.json())["workers"]}
            assert states == {a.url: "up", b.url: "down"}


async def test_router_ends_a_stream_cleanly_when_the_worker_breaks_off(http: aiohttp.ClientSession) -> None:
    async def health_then_break(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            if request[0].startswith(b"GET"):
                await peer.send(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
                                if b"/kvmesh/" in request[0] or b"/v1/models" in request[0]
                                else b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")  # fmt: skip
                continue
            await peer.send(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + chunk(b'data: {"choices":[]}\n\n')
            )
            peer.writer.transport.abort()  # the worker dies mid-stream
            return

    async with raw_server(health_then_break) as raw, router_for(raw.url) as front:
        async with http.post(front + "/v1/chat/completions", json=chat("x", stream=True)) as r:
            assert r.status == 200
            text = (await r.read()).decode()
        assert text.startswith('data: {"choices":[]}\n\n')
        assert '"type":"UpstreamError"' in text and "response broke off" in text
        for _ in range(100):
            if await _load(http, front) == 0:
                break
            await asyncio.sleep(0.02)
        assert await _load(http, front) == 0


async def test_router_does_not_send_a_generation_twice_when_a_live_worker_drops_it(
    http: aiohttp.ClientSession,
) -> None:
    """The worker read the POST and closed the connection without a byte of answer, but still
    accepts connections: it may be running the request, so no second copy goes anywhere."""
    posts: list[bytes] = []

    async def drop_posts(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            if request[0].startswith(b"GET"):
                await peer.send(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
                                if b"/kvmesh/" in request[0] or b"/v1/models" in request[0]
                                else b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")  # fmt: skip
                continue
            posts.append(request[2])
            peer.writer.transport.abort()
            return

    other = EngineState("other")
    async with (
        raw_server(drop_posts) as raw,
        serve(engine_app(other)) as b,
        router_for(raw.url, b.url) as front,
    ):
        statuses = []
        for i in range(2):  # round robin: one of the two lands on the dropping worker
            async with http.post(front + "/v1/chat/completions", json=chat(f"q{i}")) as r:
                statuses.append(r.status)
                doc = await r.json()
                if r.status == 502:
                    assert "not re-sent" in doc["error"]["message"]
        assert sorted(statuses) == [200, 502]
        assert len(posts) == 1  # the dropped request reached a worker once, and only once
        assert len(other.received) == 1
        assert await _load(http, front) == 0


async def test_the_relay_hook_takes_chunks_only_while_the_reader_waits(forwarder: Forwarder) -> None:
    """The hook is offered a chunk only while the reader waits in ``read`` with nothing unread:
    a chunk behind one it declined in the same read, or one that comes while the reader is busy
    with the last, waits for the reader, so the chunks stay in order."""
    steps = [asyncio.Event() for _ in range(3)]

    async def stream(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await steps[0].wait()
        await peer.send(chunk(b"declined;") + chunk(b"second;"))  # one write, one read
        await steps[1].wait()
        await peer.send(chunk(b"third;"))
        await steps[2].wait()
        await peer.send(chunk(b"fourth;"))
        await asyncio.sleep(0.05)
        await peer.send(b"0\r\n\r\n")

    taken: list[bytes] = []

    def hook(data: bytes) -> bool:
        if data == b"declined;":
            return False
        taken.append(data)
        return True

    async with raw_server(stream) as raw:
        response = await forwarder.open(raw.url, "POST", "/v1/completions", [], b"{}")
        response.relay_directly(hook)
        chunks = response.chunks()
        reading = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.05)  # the reader waits with nothing unread
        steps[0].set()
        assert await reading == b"declined;second;"
        steps[1].set()  # the reader is busy with what it read: the next chunk waits for it
        await asyncio.sleep(0.05)
        assert taken == []
        assert await chunks.__anext__() == b"third;"
        reading = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.05)
        steps[2].set()  # the reader waits with nothing unread: the hook takes it
        with pytest.raises(StopAsyncIteration):
            await reading
        assert taken == [b"fourth;"]
        response.release()
