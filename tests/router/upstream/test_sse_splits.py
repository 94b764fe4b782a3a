"""The proxied SSE stream through ResponseTap, cut at every byte: the same events, echo and usage.

A worker (or TCP) may split an event anywhere; the tap must count every event once, read usage
once, and put the nvext echo right before ``data: [DONE]`` whatever the cut.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from kvmesh.router.asgi.tap import ResponseTap

HEAD = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
CHUNK = {
    "id": "c1",
    "object": "chat.completion.chunk",
    "model": "m",
    "choices": [{"delta": {"content": "a"}}],
}
USAGE = {
    "id": "c1",
    "choices": [],
    "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}},
}
STREAM = (
    b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (CHUNK, CHUNK, USAGE))
    + b"data: [DONE]\n\n"
)
ECHO_EVENT = b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[],"nvext":{"worker_id":"w"}}\n\n'


class Recorder:
    """The tap's observer, counting what it is told."""

    def __init__(self) -> None:
        self.firsts = 0
        self.counted: list[int] = []
        self.cached: list[int] = []
        self.ended: list[bool] = []

    def first_event(self, streamed: bool = True) -> None:
        self.firsts += 1

    def events(self, n: int) -> None:
        self.counted.append(n)

    def usage(self, usage: dict[str, Any]) -> None:
        self.cached.append(usage["prompt_tokens_details"]["cached_tokens"])

    def echo(self) -> dict[str, Any] | None:
        return {"worker_id": "w"}

    def end(self, complete: bool) -> None:
        self.ended.append(complete)


def cuts() -> list[tuple[int, ...]]:
    """Every single cut, plus cuts at every third byte (many small reads)."""
    return [(i,) for i in range(1, len(STREAM))] + [tuple(range(3, len(STREAM), 3))]


@pytest.mark.parametrize("positions", cuts())
async def test_a_stream_cut_anywhere_is_seen_whole(positions: tuple[int, ...]) -> None:
    observer = Recorder()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    tap = ResponseTap(send, observer)
    await tap(HEAD)
    bounds = [0, *positions, len(STREAM)]
    for a, b in itertools.pairwise(bounds):
        await tap({"type": "http.response.body", "body": STREAM[a:b], "more_body": True})
    await tap({"type": "http.response.body", "body": b"", "more_body": False})

    out = b"".join(m["body"] for m in sent[1:])
    done_at = STREAM.index(b"data: [DONE]")
    assert out == STREAM[:done_at] + ECHO_EVENT + STREAM[done_at:]
    assert sum(observer.counted) == 3 and observer.firsts == 1
    assert observer.cached == [4]
    assert observer.ended == [True]
    assert all(m["body"] or not m["more_body"] for m in sent[1:])  # no empty messages mid-stream
