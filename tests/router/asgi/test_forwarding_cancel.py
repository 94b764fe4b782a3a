"""A client that leaves while the request is being opened upstream: the open is abandoned and,
even when a cancellation is lost on the way (asyncio.wait_for before Python 3.12 drops one that
meets a completed connect), the upstream connection is closed, so the worker aborts the request
instead of running it for nobody."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from kvmesh.router.asgi.forwarding import Dispatch
from kvmesh.router.request.nvext import EMPTY


class _Upstream:
    closed = False
    drained = False

    def chunks(self) -> _Upstream:
        return self

    async def __anext__(self) -> bytes:
        await asyncio.sleep(0.01)
        return b"data: {}\n\n"

    def close(self) -> None:
        self.closed = True


class _SwallowsOneCancel:
    """A forwarder whose open loses the first cancellation, as a racing connect can."""

    def __init__(self) -> None:
        self.upstream = _Upstream()

    async def open(self, *args: Any) -> _Upstream:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # lost
        return self.upstream


async def test_a_response_that_got_through_after_the_client_left_is_closed() -> None:
    forwarder = _SwallowsOneCancel()
    mesh = SimpleNamespace(
        forwarder=forwarder,
        settings=SimpleNamespace(mesh_secret=None),
        replica="r1",
        registry=SimpleNamespace(get=lambda worker_id: None),
    )
    parsed = SimpleNamespace(endpoint="/v1/chat/completions", engine_body=lambda *_: b"{}", nvext=EMPTY)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}  # the client is gone already

    scope = {"headers": [], "query_string": b""}
    dispatch = Dispatch(
        mesh,  # type: ignore[arg-type]
        None,
        scope,
        receive,
        None,
        parsed,  # type: ignore[arg-type]
        SimpleNamespace(request_id="req-1"),  # type: ignore[arg-type]
        reroute=None,  # type: ignore[arg-type]
        error=None,  # type: ignore[arg-type]
        count=None,  # type: ignore[arg-type]
    )
    assert await dispatch._open_while_client_waits("http://w", "w", b"{}") is None
    assert forwarder.upstream.closed
