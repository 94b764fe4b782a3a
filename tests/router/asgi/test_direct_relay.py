"""A streamed answer relayed from the worker's socket callback (``direct_relay``) against the ASGI
``send``: the client gets the same bytes, the router hears the same tokens, and a client that
stops reading or leaves is handled as before.

The end-to-end tests serve a real router on uvicorn (httptools) on loopback, standalone in front
of a raw streaming engine or embedded in mock engines, and run once with the direct path on and
once with it off; the last ones drive the writer and its choice of ``send`` directly.
"""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.router.asgi import direct_relay
from kvmesh.router.asgi.direct_relay import DirectRelay
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.asgi.tap import ResponseTap
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.metrics import get_metrics
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import StreamingEngine, serve, sse_event, wait_until

EVENTS = 24


def _front(upstream_url: str) -> Any:
    # kv mode with no KV events (a raw upstream has none); the client asks for no usage, so the
    # router counts each event's text: what it heard shows in the output-length histogram.
    settings = MeshSettings(
        workers=(WorkerSpec(upstream_url, "u"),), router=RouterConfig(use_kv_events=False)
    )
    return build_router_app(settings)


BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def _paths() -> tuple[float, float]:
    relayed = get_metrics().relayed_chunks
    return relayed["direct"]._value.get(), relayed["send"]._value.get()


@pytest.fixture(params=[True, False], ids=["direct", "send"])
def direct(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(direct_relay, "ENABLED", request.param)
    return bool(request.param)


async def test_the_client_gets_the_engines_bytes_and_the_router_hears_every_token(direct: bool) -> None:
    upstream = StreamingEngine(events=EVENTS)
    osl = get_metrics().osl
    async with serve(upstream) as engine, serve(_front(engine.url)) as front, aiohttp.ClientSession() as http:
        heard_before = osl._sum.get()
        direct_before, send_before = _paths()
        async with http.post(front.url + "/v1/chat/completions", json=BODY) as r:
            assert r.status == 200
            received = await r.read()
        await wait_until(lambda: osl._sum.get() > heard_before)
        heard = osl._sum.get() - heard_before
        direct_after, send_after = _paths()
    assert received == upstream.sent
    # Every event's text, counted in the router's tokens (two builtin tokens or more each).
    assert heard >= 2 * EVENTS
    if direct:
        # The first event goes through send (the first token is timed there); most go direct.
        assert direct_after - direct_before >= EVENTS // 2
    else:
        assert direct_after == direct_before
        assert send_after - send_before >= EVENTS // 2


async def test_both_paths_hear_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    osl = get_metrics().osl
    heard = []
    for on in (True, False):
        monkeypatch.setattr(direct_relay, "ENABLED", on)
        upstream = StreamingEngine(events=EVENTS)
        async with (
            serve(upstream) as engine,
            serve(_front(engine.url)) as front,
            aiohttp.ClientSession() as http,
        ):
            before = osl._sum.get()
            async with http.post(front.url + "/v1/chat/completions", json=BODY) as r:
                await r.read()
            await wait_until(lambda b=before: osl._sum.get() > b)  # type: ignore[misc]
            heard.append(osl._sum.get() - before)
    assert heard[0] == heard[1]


async def test_a_client_that_stops_reading_gets_every_byte_in_order(direct: bool) -> None:
    # ~6 MB as fast as the engine can write it, to a client that reads nothing for a while
    # through a small receive buffer: the front's writes to it back up, whichever path each
    # chunk takes (half events and a paused client go through send), and every byte must still
    # arrive, in order.
    upstream = StreamingEngine(events=1500, gap=0.0, size=4000)
    async with serve(upstream) as engine, serve(_front(engine.url)) as front:
        port = int(front.url.rsplit(":", 1)[1])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 24)
        payload = json.dumps(BODY).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(payload), payload)
        )
        await asyncio.sleep(0.5)  # not reading
        raw = await asyncio.wait_for(reader.read(-1), 30)
        writer.close()
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert _unchunk(chunked) == upstream.sent


async def test_a_client_that_leaves_mid_stream_stops_the_engine(direct: bool) -> None:
    upstream = StreamingEngine(forever=True, gap=0.01)
    async with serve(upstream) as engine, serve(_front(engine.url)) as front, aiohttp.ClientSession() as http:
        direct_before, _ = _paths()
        async with http.post(front.url + "/v1/chat/completions", json=BODY) as r:
            for _ in range(10):
                await r.content.readuntil(b"\n\n")
            r.close()
        await asyncio.wait_for(upstream.disconnected.wait(), 5)
        direct_after, _ = _paths()
    assert (direct_after > direct_before) == direct


async def test_an_engine_embedding_the_middleware_relays_a_peers_answer(direct: bool) -> None:
    """Inside an engine's app the middleware is handed Starlette's outermost ``send`` wrapper,
    which passes messages on unchanged: the direct path looks through it."""
    mock = MockConfig(block_size=16, num_blocks=4096, speedup=1.0)
    async with start_mesh(2, RouterConfig(), mock) as nodes, aiohttp.ClientSession() as http:
        a, b = (node.url for node in nodes)
        direct_before, _ = _paths()
        body = {
            "model": mock.model,
            "messages": [{"role": "user", "content": "tell me about the sea"}],
            "max_tokens": 24,
            "stream": True,
            "nvext": {"backend_instance_id": b},  # served by b, relayed by a
        }
        async with http.post(a + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["x-kvmesh-worker-id"] == b
            received = await r.read()
        direct_after, _ = _paths()
    events = [e for e in received.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 24
    assert (direct_after - direct_before >= 12) == direct


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += data[:size]
        assert data[size : size + 2] == b"\r\n"
        data = data[size + 2 :]


async def test_only_uvicorns_own_send_is_written_around() -> None:
    async def send(message: dict[str, Any]) -> None:  # a middleware's wrapper, or another server
        pass

    tap = ResponseTap(send, _Quiet())
    assert DirectRelay.under(send, tap) is None

    class RequestResponseCycle:  # the name alone, from another module, is not uvicorn's
        async def send(self, message: dict[str, Any]) -> None:
            pass

    assert DirectRelay.under(RequestResponseCycle().send, tap) is None


class _Quiet:
    def __init__(self) -> None:
        self.counted = 0

    def first_event(self, streamed: bool = True) -> None: ...
    def events(self, n: int) -> None:
        self.counted += n

    def usage(self, usage: dict[str, Any]) -> None: ...
    def echo(self) -> dict[str, Any] | None:
        return None

    def end(self, complete: bool) -> None: ...


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


async def test_a_chunk_goes_direct_only_when_the_client_can_take_it_as_it_is() -> None:
    async def send(message: dict[str, Any]) -> None:
        pass

    observer = _Quiet()
    tap = ResponseTap(send, observer)
    await tap(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    await tap({"type": "http.response.body", "body": sse_event("first"), "more_body": True})
    transport = _Transport()
    cycle = SimpleNamespace(flow=SimpleNamespace(write_paused=False), transport=transport, disconnected=False)
    relay = DirectRelay(cycle, tap)
    event = sse_event("next")

    assert relay(event)
    assert transport.written == [b"%x\r\n%b\r\n" % (len(event), event)]  # uvicorn's chunk framing
    assert observer.counted == 2 and relay.written == 1

    cycle.flow.write_paused = True  # a slow client: send waits for it
    assert not relay(event)
    cycle.flow.write_paused, cycle.disconnected = False, True
    assert not relay(event)
    cycle.disconnected = False
    assert not relay(b"data: [DONE]\n\n")  # the echo goes in before it, in send
    assert not relay(event[:-3])  # half an event: the tap holds it back, in send
    assert transport.written == [b"%x\r\n%b\r\n" % (len(event), event)] and observer.counted == 2
