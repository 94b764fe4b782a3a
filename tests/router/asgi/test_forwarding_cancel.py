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

    async def open(self, *args: Any, **kwargs: Any) -> _Upstream:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # lost
        return self.upstream


def _dispatch(forwarder: Any, receive: Any) -> Dispatch:
    mesh = SimpleNamespace(
        forwarder=forwarder,
        settings=SimpleNamespace(mesh_secret=None),
        replica="r1",
        registry=SimpleNamespace(get=lambda worker_id: None),
    )
    parsed = SimpleNamespace(endpoint="/v1/chat/completions", engine_body=lambda *_: b"{}", nvext=EMPTY)
    return Dispatch(
        mesh,  # type: ignore[arg-type]
        None,
        {"type": "http", "path": "/v1/chat/completions", "headers": [], "query_string": b""},
        receive,
        None,
        parsed,  # type: ignore[arg-type]
        SimpleNamespace(request_id="req-1"),  # type: ignore[arg-type]
        reroute=None,  # type: ignore[arg-type]
        error=None,  # type: ignore[arg-type]
        count=None,  # type: ignore[arg-type]
    )


async def test_a_response_that_got_through_after_the_client_left_is_closed() -> None:
    forwarder = _SwallowsOneCancel()

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}  # the client is gone already

    dispatch = _dispatch(forwarder, receive)
    assert await dispatch._open_while_client_waits("http://w", "w", b"{}") is None
    assert forwarder.upstream.closed
    assert _cancels_pending() == 0  # the cancellation it asked for is withdrawn: the task goes on


def _cancels_pending() -> int:
    task = asyncio.current_task()
    assert task is not None
    return int(getattr(task, "cancelling", lambda: 0)())  # Python 3.11+ counts them


class _Records:
    """A forwarder that notes when the request is written; the worker answers at once."""

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.upstream = _Upstream()

    async def open(self, *args: Any, **kwargs: Any) -> _Upstream:
        self.order.append("written")
        return self.upstream


async def test_the_request_is_written_before_work_already_scheduled_runs() -> None:
    # In a burst, the other requests' parsing and routing is what is already scheduled: a request
    # written from a task of its own waited behind all of it before the worker saw it.
    order: list[str] = []
    forwarder = _Records(order)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    dispatch = _dispatch(forwarder, receive)
    asyncio.get_running_loop().call_soon(order.append, "other work")
    opened = await dispatch._open_while_client_waits("http://w", "w", b"{}")
    assert opened is not None and opened[0] is forwarder.upstream and not forwarder.upstream.closed
    assert order[0] == "written"
    assert _cancels_pending() == 0


async def test_an_open_that_fails_after_the_client_left_is_not_failed_over() -> None:
    from kvmesh.router.upstream.forwarder import ConnectFailed

    class _FailsAfterLosingTheCancel:
        async def open(self, *args: Any, **kwargs: Any) -> Any:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass  # lost on the way
            raise ConnectFailed("http://w", "connection refused")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    dispatch = _dispatch(_FailsAfterLosingTheCancel(), receive)
    # nobody waits for the answer: no other worker is tried (the caller fails over on ConnectFailed)
    assert await dispatch._open_while_client_waits("http://w", "w", b"{}") is None
    assert _cancels_pending() == 0
