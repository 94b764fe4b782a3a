"""Helpers for the KV-event tests: free ports, batches with checkable contents, and a collecting
subscriber callback."""

from __future__ import annotations

import asyncio
import socket

from kvmesh.events.wire import BlockStored, EventBatch


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_batch(i: int, *, salt: int = 0) -> EventBatch:
    """Batch number ``i``; its contents name ``i`` (and ``salt``) so that a mix-up shows."""
    return EventBatch(
        ts=float(i),
        events=[
            BlockStored(
                block_hashes=[i, 10**9 + salt],
                parent_block_hash=i - 1 if i else None,
                token_ids=[i % 50_000] * 8,
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
        data_parallel_rank=salt,
    )


class Collector:
    """The subscriber's callbacks: records every delivered batch and every reset reason."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, EventBatch]] = []
        self.resets: list[str] = []

    def on_batch(self, seq: int, batch: EventBatch) -> None:
        self.batches.append((seq, batch))

    def on_reset(self, reason: str) -> None:
        self.resets.append(reason)

    @property
    def seqs(self) -> list[int]:
        return [s for s, _ in self.batches]

    async def wait_for(self, count: int, timeout: float = 15.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.batches) < count:
            if loop.time() > deadline:
                raise AssertionError(f"got {len(self.batches)} of {count} batches within {timeout} s")
            await asyncio.sleep(0.005)
