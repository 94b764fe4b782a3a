"""Notice a client that goes away while the engine works for it, so its request can be aborted.

Starlette's StreamingResponse only notices a disconnect on the next write, and a plain endpoint
not at all; a request that is still queued (nothing to write yet) would keep its place and,
once running, its KV blocks. Here the work races a listener for ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from starlette.types import Receive, Scope, Send

from kvmesh._http import wait_disconnect


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` (the request body must already be read); cancel it if the client disconnects
    first. True if the work completed, False if the client went away."""
    task = asyncio.ensure_future(work)

    listener = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await task
    if task.cancelled():
        return False
    exc = task.exception()
    if isinstance(exc, OSError):  # the server reported the disconnect on write
        return False
    if exc is not None:
        raise exc
    return True


class EngineStreamResponse:
    """Server-sent events from ``chunks`` (or another stream: ``content_type``); calls
    ``on_disconnect`` if the client leaves early."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        on_disconnect: Callable[[], object],
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
        content_type: bytes = b"text/event-stream; charset=utf-8",
    ) -> None:
        self.chunks = chunks
        self.on_disconnect = on_disconnect
        self.headers = [
            (b"content-type", content_type),
            (b"cache-control", b"no-cache"),
            *(headers or ()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_all() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            completed = await until_disconnect(receive, send_all())
        finally:
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        if not completed:
            self.on_disconnect()
