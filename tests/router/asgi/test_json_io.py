"""`read_body`: the request body as the routing path reads it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvmesh.errors import RequestError
from kvmesh.router.asgi.json_io import read_body

SCOPE: dict[str, Any] = {"headers": [(b"content-length", b"11")]}


def _receiver(chunks: list[bytes], tasks: list[asyncio.Task[Any] | None], stall: bool = False) -> Any:
    async def receive() -> dict[str, Any]:
        tasks.append(asyncio.current_task())
        if not chunks:
            await asyncio.sleep(3600)  # a client that stalls after what it sent
        body = chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": stall or bool(chunks)}

    return receive


@pytest.mark.skipif(not hasattr(asyncio, "timeout"), reason="Python 3.10 reads through wait_for")
async def test_the_body_is_read_in_the_request_task_with_a_timeout() -> None:
    # A task of its own per read starts only after everything already scheduled: in a burst of
    # requests each one's body waited behind the others' parsing and routing.
    tasks: list[asyncio.Task[Any] | None] = []
    body = await read_body(SCOPE, _receiver([b"hello ", b"world"], tasks), 1 << 20, timeout=5.0)
    assert body == b"hello world"
    assert tasks == [asyncio.current_task()] * 2


async def test_a_stalled_body_is_a_408_naming_the_body() -> None:
    with pytest.raises(RequestError) as e:
        await read_body(SCOPE, _receiver([b"hello "], [], stall=True), 1 << 20, timeout=0.05)
    assert e.value.status == 408 and e.value.field == "body"


async def test_a_body_past_the_limit_is_a_413() -> None:
    with pytest.raises(RequestError) as e:
        await read_body({"headers": []}, _receiver([b"x" * 10, b"y" * 10], []), 15, timeout=5.0)
    assert e.value.status == 413 and e.value.field == "body"
