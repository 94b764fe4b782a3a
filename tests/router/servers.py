"""Real loopback servers for the middleware tests: uvicorn in the test's own event loop.

``serve(app)`` starts an ASGI app on a free 127.0.0.1 port; ``crash()`` on the handle aborts every
open connection and stops listening, the way a killed engine process disappears.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn


def bound_socket() -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto says
    # TCP, and without it every small response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Server:
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]
    sock: socket.socket

    def crash(self) -> None:
        """Drop every connection mid-flight and stop accepting new ones."""
        for connection in list(self.server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        for srv in getattr(self.server, "servers", []):
            srv.close()
        self.server.should_exit = True
        self.server.force_exit = True


@contextlib.asynccontextmanager
async def serve(app: Any, sock: socket.socket | None = None) -> AsyncIterator[Server]:
    sock = sock or bound_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="auto", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
    handle = Server(f"http://127.0.0.1:{port}", server, task, sock)
    try:
        yield handle
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
        sock.close()


class Loop:
    """An event loop on a thread, holding async context managers open until closed."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()

    def enter(self, cm: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(self.stack.enter_async_context(cm), self.loop).result(timeout)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.stack.aclose(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


async def read_completion_request(scope: dict[str, Any], receive: Any, send: Any) -> bool:
    """For a raw ASGI engine: True once a ``/v1/chat/completions`` request's body has been read;
    anything else gets a 404 (or nothing, outside HTTP) and False."""
    if scope["type"] != "http":
        return False
    if scope["path"] != "/v1/chat/completions":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return False
    while (await receive()).get("more_body"):
        pass
    return True


async def pinned_stream_bytes(http: Any, worker: str, model: str) -> bytes:
    """A streamed chat answer pinned to ``worker`` (``nvext.backend_instance_id``), through ``http``
    (an ``httpx.AsyncClient`` on a front), as the raw bytes the client received; the front must say
    it chose ``worker``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "nvext": {"backend_instance_id": worker},
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["x-kvmesh-worker-id"] == worker
        return b"".join([chunk async for chunk in r.aiter_raw()])


def sse_event(text: str) -> bytes:
    """One chat-completion chunk event carrying ``text``."""
    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class StreamingEngine:
    """A raw streaming engine: ``events`` token events ``gap`` seconds apart, then ``[DONE]``
    (``forever``: until the client leaves). It keeps the exact bytes it sent."""

    def __init__(self, *, events: int = 24, gap: float = 0.01, size: int = 8, forever: bool = False):
        self.events = events
        self.gap = gap
        self.size = size
        self.forever = forever
        self.sent = b""
        self.disconnected = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not await read_completion_request(scope, receive, send):
            return
        head = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
        await send(head)
        watcher = asyncio.ensure_future(receive())
        i = 0
        while self.forever or i < self.events:
            if watcher.done():  # http.disconnect: the router closed the connection
                self.disconnected.set()
                return
            body = sse_event(f"word{i} " + "x" * self.size)
            self.sent += body
            await send({"type": "http.response.body", "body": body, "more_body": True})
            i += 1
            if self.gap:
                await asyncio.sleep(self.gap)
        self.sent += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        watcher.cancel()
