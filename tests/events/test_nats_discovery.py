"""WorkerAnnouncer against a bucket whose put swallows a cancellation, as nats-py's request does
on Python 3.11 when the acknowledgement lands as the cancellation arrives (``asyncio.wait_for``
then returns the result instead of raising)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvmesh.events.nats_discovery import WorkerAnnouncer
from kvmesh.events.nats_link import NatsOptions, subject_token

pytest.importorskip("nats")


class _Bucket:
    def __init__(self) -> None:
        self.puts: list[str] = []
        self.deleted: list[str] = []
        self.swallowed = 0
        self.in_put = asyncio.Event()

    async def put(self, key: str, value: bytes) -> None:
        self.puts.append(key)
        self.in_put.set()
        try:
            await asyncio.get_running_loop().create_future()  # an acknowledgement that never comes
        except asyncio.CancelledError:
            if self.swallowed:
                raise
            self.swallowed += 1  # the first cancellation lost, as wait_for loses it

    async def delete(self, key: str) -> None:
        self.deleted.append(key)

    async def get(self, key: str) -> Any:
        import nats.js.errors

        raise nats.js.errors.KeyNotFoundError


class _JetStream:
    def __init__(self, bucket: _Bucket) -> None:
        self.bucket = bucket

    async def key_value(self, name: str) -> _Bucket:
        return self.bucket


class _Link:
    connected = True

    def __init__(self, bucket: _Bucket) -> None:
        self.js = _JetStream(bucket)
        self.options = NatsOptions(("nats://127.0.0.1:4222",))

    async def wait_connected(self, timeout: float | None = None) -> bool:
        return True


async def test_stop_returns_and_deletes_the_entry_when_a_put_swallows_the_cancellation() -> None:
    bucket = _Bucket()
    link: Any = _Link(bucket)
    announcer = WorkerAnnouncer(link, "worker-a", "http://127.0.0.1:1", dict, interval=0.05)
    announcer.start()
    await asyncio.wait_for(bucket.in_put.wait(), 2.0)
    await asyncio.wait_for(announcer.stop(), 2.0)  # hung before: the loop went on renewing
    assert bucket.swallowed == 1
    assert bucket.puts == [subject_token("worker-a")]  # no renewal after the stop
    assert bucket.deleted == [subject_token("worker-a")]
