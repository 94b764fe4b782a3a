"""Publish KV-event batches to the NATS event plane, with the ZMQ publisher's contract.

``NatsBatchPublisher`` is a drop-in for :class:`~kvmesh.events.publisher.BatchPublisher` (the
``sink`` of a :class:`~kvmesh.events.publisher.KvEventPublisher`): ``publish(batch)`` encodes in
the caller, assigns the next sequence number and returns at once. A thread of its own runs an
event loop with the NATS connection and stores each batch in the JetStream stream under
``<prefix>.events.<name>.<rank>``, in order, one acknowledged publish at a time, headers carrying
the sequence number and this process's epoch. There is no replay socket: the stream is the replay.

While NATS is unreachable batches wait in memory (at most ``buffer_batches``; beyond that the
oldest are dropped, which a router sees as a gap and repairs from ``kv_state``). A publish that
times out during a cluster failover is sent again; ``Nats-Msg-Id`` (epoch + seq) makes the stream
drop the copy if the first attempt was stored after all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from types import TracebackType

from kvmesh.errors import ConfigError
from kvmesh.events.nats_link import (
    EPOCH_HEADER,
    NATS_ENDPOINT_PREFIX,
    SEQ_HEADER,
    NatsLink,
    NatsOptions,
    import_nats,
)
from kvmesh.events.wire import EventBatch, encode_batch

logger = logging.getLogger("kvmesh.events")


class NatsBatchPublisher:
    """A batch sink on NATS JetStream; thread-safe, never blocks the caller."""

    def __init__(
        self, options: NatsOptions, name: str, *, rank: int = 0, buffer_batches: int = 10_000
    ) -> None:
        import_nats()  # fail here, with the install hint, not in the thread
        if buffer_batches < 1:
            raise ConfigError(f"buffer_batches must be at least 1, got {buffer_batches}")
        self.options = options
        self.subject = options.events_subject(name, rank)
        self.endpoint = NATS_ENDPOINT_PREFIX + self.subject
        """What ``/kvmesh/info`` lists in ``kv_events_endpoints`` for this rank."""
        self.replay_endpoint: str | None = None
        self.epoch = os.urandom(6).hex()
        self.dropped = 0
        """Batches dropped because NATS stayed away longer than the buffer lasts."""
        self.stored = 0
        """Batches the stream acknowledged."""
        self._lock = threading.Lock()
        self._next_seq = 0
        self._pending: deque[tuple[int, bytes]] = deque()
        self._max_pending = buffer_batches
        self._closing = False
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kvmesh-nats-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def last_seq(self) -> int | None:
        with self._lock:
            return self._next_seq - 1 if self._next_seq else None

    @property
    def backlog(self) -> int:
        """Batches assigned a sequence number but not yet acknowledged by the stream."""
        with self._lock:
            return len(self._pending)

    def publish(self, batch: EventBatch) -> int:
        """Queue ``batch``; return its sequence number."""
        payload = encode_batch(batch)
        with self._lock:
            if self._closing:
                raise RuntimeError("publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._queue(seq, payload)
        return seq

    def publish_payload(self, seq: int, payload: bytes) -> None:
        """Queue an already encoded batch under the caller's sequence number (a relay keeps the
        upstream publisher's numbers)."""
        with self._lock:
            if self._closing:
                raise RuntimeError("publisher is closed")
            self._next_seq = seq + 1
            self._queue(seq, payload)

    def new_epoch(self) -> None:
        """The upstream restarted and counts from 0 again (a relay calls this)."""
        with self._lock:
            self.epoch = os.urandom(6).hex()

    def _queue(self, seq: int, payload: bytes) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append((seq, payload))
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def close(self, timeout: float = 1.0) -> None:
        """Store what is queued (waiting up to ``timeout`` seconds), then disconnect."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._wake is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._wake.set)
        self._thread.join(timeout + 3.0)

    def __enter__(self) -> NatsBatchPublisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---------------------------------------------------------------- sender thread
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except Exception:  # pragma: no cover - a bug here must not take the engine down
            logger.exception("NATS KV-event publisher thread failed")
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        self._ready.set()
        link = NatsLink(self.options, name=f"kvmesh-publisher {self.subject}")
        link.start()
        close_deadline: float | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                with self._lock:
                    closing, empty = self._closing, not self._pending
                if closing and close_deadline is None:
                    close_deadline = loop.time() + 1.0
                if closing and (empty or loop.time() > (close_deadline or 0.0)):
                    break
                if empty or not link.connected:
                    self._wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 0.05 if link.connected else 0.2)
                    continue
                await self._send_some(link)
        finally:
            await link.close()

    async def _send_some(self, link: NatsLink) -> None:
        nats = import_nats()
        while True:
            with self._lock:
                if not self._pending:
                    return
                seq, payload = self._pending[0]
                epoch = self.epoch
            headers = {SEQ_HEADER: str(seq), EPOCH_HEADER: epoch, "Nats-Msg-Id": f"{epoch}-{seq}"}
            try:
                await link.js.publish(self.subject, payload, headers=headers, timeout=2.0)
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as e:
                logger.debug("NATS publish of seq %d failed (%s); retrying", seq, e)
                await asyncio.sleep(0.05)
                return
            with self._lock:
                if self._pending and self._pending[0][0] == seq:
                    self._pending.popleft()
            self.stored += 1
