"""Follow one publisher rank's KV events from the NATS stream, with the ZMQ subscriber's contract.

``NatsEventSubscriber`` offers what :class:`~kvmesh.events.subscriber.EventSubscriber` offers the
router (``on_batch(seq, batch)`` once each, in order; ``on_reset(reason)``; ``resume_from``;
``expected_seq``; ``stats``), so the event feed treats both alike. The differences are below it:

* The stream is the replay. A subscription is a JetStream ordered consumer filtered on the rank's
  subject, starting at the first message the stream still holds; batches the router already has
  (sequence below the expected one) are skipped. A consumer that misses heartbeats (its NATS node
  died) or sees a delivery gap is re-created by the client from the last stream position.
* Epochs tell publisher processes apart. At start the subscriber reads the subject's newest
  message; older messages from another epoch are a previous process's and are skipped. A new
  epoch arriving live is a restart: ``on_reset``.
* A sequence above the expected one means the stream no longer holds the range (aged out, or the
  publisher dropped batches while NATS was away): ``on_reset``, and the owner cold-starts from
  ``kv_state`` and calls ``resume_from``.
* ``resume_from`` to a point already passed hands out the subscriber's own recent history; beyond
  it, the subscription restarts from the stream's beginning for that subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from kvmesh.errors import MalformedEventError
from kvmesh.events.nats_link import EPOCH_HEADER, SEQ_HEADER, NatsLink, import_nats
from kvmesh.events.subscriber import SubscriberStats
from kvmesh.events.wire import EventBatch, decode_batch

logger = logging.getLogger("kvmesh.events")


class NatsEventSubscriber:
    """One rank's KV-event stream from NATS JetStream, delivered in order, exactly once."""

    def __init__(
        self,
        link: NatsLink,
        subject: str,
        on_batch: Callable[[int, EventBatch], None],
        *,
        on_reset: Callable[[str], None] | None = None,
        name: str = "",
        history_batches: int = 64,
    ) -> None:
        self.link = link
        self.subject = subject
        self.endpoint = f"nats:{subject}"
        self.name = name or self.endpoint
        self.stats = SubscriberStats()
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._expected: int | None = None
        self._epoch: str | None = None
        # Messages up to this stream sequence with another epoch are an old process's.
        self._old_until = 0
        self._history: deque[tuple[int, EventBatch | None]] = deque(maxlen=history_batches)
        self._sub: Any = None
        self._generation = 0  # +1 per subscription: a replaced one's late messages are ignored
        self._sseq = 0  # the stream position of the last message read; 0: read the subject from its start
        self._stopping = False
        self._restart = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- EventSubscriber's API
    @property
    def replay_endpoint(self) -> str:
        """The stream itself: the quiet-stream probe's ``resume_from`` costs nothing here."""
        return self.endpoint

    @property
    def expected_seq(self) -> int | None:
        return self._expected

    def resume_from(self, last_seq: int) -> None:
        """The next batch delivered is ``last_seq + 1``."""
        previous = self._expected
        self._expected = last_seq + 1
        if previous is None or last_seq + 1 >= previous:
            return  # forward (or in step): what lies between is skipped as already known
        again = [(s, b) for s, b in self._history if last_seq < s < previous]
        if len(again) == previous - last_seq - 1:
            for s, b in again:
                self._deliver(s, b)
            return
        logger.info(
            "%s: resume from seq %d is older than the history; re-reading the stream", self.name, last_seq
        )
        self._sseq = 0
        self._generation += 1  # what the current subscription still delivers is ignored
        self._restart.set()

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._stopping = False
            self.link.on_up(self._on_link_up)
            self._task = asyncio.get_running_loop().create_task(self.run(), name=f"kvmesh-nats {self.name}")
        return self._task

    async def _on_link_up(self) -> None:
        # Reconnected: the server may have lost our consumer (a restart, a node gone); subscribe
        # again from the next stream position rather than wait for missed heartbeats.
        if self._sub is not None:
            self._generation += 1
            self._restart.set()

    async def stop(self) -> None:
        self.link.remove_listener(self._on_link_up)
        self._stopping = True
        self._restart.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._unsubscribe()

    async def run(self) -> None:
        """Subscribe whenever NATS is up; re-subscribe from the stream's start on request."""
        while not self._stopping:
            await self.link.wait_connected()
            self._restart.clear()
            try:
                await self._subscribe()
            except Exception as e:  # NATS went away mid-way, or the cluster is electing
                self.stats.reconnects += 1
                logger.warning("%s: cannot subscribe (%s); retrying", self.name, e)
                await asyncio.sleep(0.5)
                continue
            await self._restart.wait()
            await self._unsubscribe()

    # ---------------------------------------------------------------- subscription
    async def _subscribe(self) -> None:
        nats = import_nats()
        api = nats.js.api
        js = self.link.js
        try:
            last = await js.get_last_msg(self.link.options.stream, self.subject)
            headers = last.headers or {}
            if self._epoch is None:
                self._epoch = headers.get(EPOCH_HEADER)
            self._old_until = int(last.seq)
        except nats.js.errors.NotFoundError:
            self._old_until = 0
        if self._sseq > 0:  # continue after the last message read
            config = api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._sseq + 1
            )
        else:
            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL)
        self._generation += 1
        generation = self._generation

        async def on_message(msg: Any) -> None:
            if generation == self._generation:
                await self._on_message(msg)

        self._sub = await js.subscribe(
            self.subject,
            stream=self.link.options.stream,
            cb=on_message,
            ordered_consumer=True,
            idle_heartbeat=self.link.options.consumer_heartbeat,
            config=config,
            pending_msgs_limit=1_000_000,
        )

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_message(self, msg: Any) -> None:
        self.stats.received += 1
        self._sseq = max(self._sseq, int(msg.metadata.sequence.stream))
        headers = msg.headers or {}
        try:
            seq = int(headers[SEQ_HEADER])
        except (KeyError, ValueError):
            self._count_malformed(None, MalformedEventError(f"message without a valid {SEQ_HEADER} header"))
            return
        epoch = headers.get(EPOCH_HEADER)
        if epoch != self._epoch:
            if msg.metadata.sequence.stream <= self._old_until:
                self.stats.duplicates += 1  # a previous publisher process's, still in the stream
                return
            self._restarted(epoch, seq)
        self._accept(seq, msg.data)

    def _restarted(self, epoch: str | None, seq: int) -> None:
        previous = self._epoch
        self._epoch = epoch
        self._history.clear()
        if previous is None and self._expected is None:
            return  # the first publisher we see
        self.stats.restarts += 1
        self._expected = 0
        self._report_reset(f"publisher restarted (new epoch {epoch}, seq {seq})")

    def _accept(self, seq: int, payload: bytes) -> None:
        if self._expected is None:
            self._expected = 0
        if seq < self._expected:
            self.stats.duplicates += 1
            return
        if seq > self._expected:
            self.stats.gaps += 1
            self.stats.unrecoverable += 1
            first = self._expected
            self._expected = seq
            self._report_reset(f"gap: seqs {first}..{seq - 1} are not in the NATS stream; unrecoverable")
            if seq < (self._expected or 0):  # on_reset moved the stream past this batch
                return
        batch: EventBatch | None
        try:
            batch = decode_batch(payload)
        except MalformedEventError as e:
            self._count_malformed(seq, e)
            batch = None
        if seq != self._expected:  # on_reset resumed elsewhere
            return
        self._deliver(seq, batch)

    def _deliver(self, seq: int, batch: EventBatch | None) -> None:
        self._expected = seq + 1
        if self._history and self._history[-1][0] != seq - 1:
            self._history.clear()
        self._history.append((seq, batch))
        if batch is None:
            return
        self.stats.delivered += 1
        try:
            self._on_batch(seq, batch)
        except Exception:
            self.stats.callback_errors += 1
            logger.exception("%s: on_batch failed for seq %d", self.name, seq)

    def _report_reset(self, reason: str) -> None:
        logger.warning("%s: KV-event stream reset: %s", self.name, reason)
        if self._on_reset is not None:
            try:
                self._on_reset(reason)
            except Exception:
                self.stats.callback_errors += 1
                logger.exception("%s: on_reset failed", self.name)

    def _count_malformed(self, seq: int | None, error: MalformedEventError) -> None:
        self.stats.malformed += 1
        where = f"seq {seq}" if seq is not None else "unreadable seq"
        logger.warning("%s: dropping malformed KV-event batch (%s): %s", self.name, where, error)
