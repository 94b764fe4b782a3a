"""Follow one publisher's KV-event stream and hand each batch to ``on_batch`` in order, exactly once.

Delivery rests on the sequence numbers. The subscriber knows the next sequence it expects; a live
batch above it is a gap (messages dropped by ZMQ at a high-water mark, by a slow-joining
connection, by a late start or a reconnect). The batch is held back and the missing range is asked
from the publisher's replay socket; live batches keep arriving into the hold-back buffer meanwhile.
When the replay's end marker arrives, the held batches are applied. A range the replay can no
longer supply (the publisher's buffer moved on), a live sequence that goes backwards (the
publisher restarted and counts from 0 again) and a gap without a replay socket cannot be repaired:
``on_reset(reason)`` tells the owner, who drops that worker's state and may cold-start from a
snapshot, then calls ``resume_from(last_seq)``; the stream continues from where it stands.

Bad input never stops the loop: messages with the wrong number of frames, undecodable msgpack
or wrongly typed fields are logged (logger ``kvmesh.events``) and counted. A malformed batch whose
sequence number is readable still advances the stream, so the next good batch applies directly.
Socket errors close everything and reconnect after an exponential back-off.

Everything runs in one task on one event loop; ``resume_from`` and ``stop`` are called from that
loop's thread. The loop watches the sockets' ZMQ descriptors itself (:mod:`kvmesh.events.readiness`)
and the reads never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvmesh.errors import ConfigError, MalformedEventError
from kvmesh.events.endpoint import check_endpoint, needs_ipv6
from kvmesh.events.readiness import SocketWatch, drain, readable, recv_frames
from kvmesh.events.wire import (
    MAX_SEQ,
    REPLAY_END_SEQ,
    EventBatch,
    decode_batch,
    pack_seq,
    unpack_frames,
    unpack_seq,
)

logger = logging.getLogger("kvmesh.events")

_DRAIN_LIMIT = 512  # messages read per wake-up before checking the other sockets again


@dataclass
class SubscriberStats:
    received: int = 0
    """Messages read from the live socket, good or bad."""
    delivered: int = 0
    """Batches handed to ``on_batch``."""
    malformed: int = 0
    """Messages or payloads that did not decode (live or replayed); each is logged."""
    gaps: int = 0
    """Times a live batch arrived with a sequence above the expected one."""
    replayed: int = 0
    """Batches delivered from the replay socket."""
    replays: int = 0
    """Replays answered to their end marker (a router's probe of a quiet stream that finds nothing
    missed is one)."""
    unrecoverable: int = 0
    """Ranges that could not be replayed; each was reported through ``on_reset``."""
    reconnects: int = 0
    """Times the sockets were reopened after an error."""
    restarts: int = 0
    """Times the publisher's sequence went backwards (it restarted); reported through ``on_reset``."""
    duplicates: int = 0
    """Batches skipped because they had already been delivered."""
    replay_timeouts: int = 0
    """Replay requests that got no answer in time (retried, then given up as unrecoverable)."""
    callback_errors: int = 0
    """Exceptions raised by ``on_batch`` (logged; the stream goes on)."""


@dataclass
class _Replay:
    sock: zmq.Socket[bytes]
    start: int
    attempt: int
    deadline: float


class EventSubscriber:
    """SUB socket (+ a DEALER per replay) following one worker's KV-event stream.

    ``on_batch(seq, batch)`` gets every batch once, in sequence order. ``on_reset(reason)`` says
    the stream could not be repaired (the owner should drop that worker's state, may cold-start
    from a snapshot and call ``resume_from``). ``bind=True`` binds ``endpoint`` for publishers that
    connect. ``from_beginning``: when the first batch seen is not seq 0, replay from 0 (True) or
    start with that batch (False, a live tap). A replay that gets no answer for ``replay_timeout``
    seconds is retried up to ``replay_attempts`` times, then given up as unrecoverable; socket
    errors reopen the sockets after ``backoff_initial`` seconds, doubling up to ``backoff_max``.
    The last ``history_batches`` delivered batches are kept for a ``resume_from`` to a point
    already passed (a few seconds of steps; a batch holds a step's new token ids, so not more).
    """

    def __init__(
        self,
        endpoint: str,
        on_batch: Callable[[int, EventBatch], None],
        *,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        bind: bool = False,
        on_reset: Callable[[str], None] | None = None,
        name: str = "",
        from_beginning: bool = True,
        replay_timeout: float = 2.0,
        replay_attempts: int = 3,
        max_held_batches: int = 100_000,
        history_batches: int = 64,
        backoff_initial: float = 0.05,
        backoff_max: float = 5.0,
    ) -> None:
        self.endpoint = check_endpoint(endpoint, bind=bind)
        self.replay_endpoint = replay_endpoint
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint, bind=False, what="KV-event replay endpoint")
        self.topic = topic
        self.bind = bind
        self.name = name or endpoint
        self.stats = SubscriberStats()
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._from_beginning = from_beginning
        self._replay_timeout = replay_timeout
        self._replay_attempts = replay_attempts
        self._max_held = max_held_batches
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max

        self._expected: int | None = None  # None: nothing seen and no resume point, so start at 0
        self._last_live: int | None = None  # last sequence read from the live socket
        self._last_live_payload = b""  # its payload, to tell a duplicate from a restart
        # Batches above the expected sequence, waiting for a replay to fill the gap below them.
        # Live order is sequence order, so the dict's insertion order is ascending.
        self._held: dict[int, EventBatch | None] = {}
        # The last batches delivered, consecutive: resume_from() to a point already passed (a
        # snapshot older than the stream) hands them out again without asking the publisher.
        self._history: deque[tuple[int, EventBatch | None]] = deque(maxlen=history_batches)
        self._replay: _Replay | None = None
        # The replay socket of the last replay that ended cleanly (its end marker read, so nothing
        # of it is still on the way): the next replay asks through it. A router probes each quiet
        # stream at every health check with a replay that answers nothing (mesh/event_feed.py):
        # a new connection each time cost both ends more than the question.
        self._parked: zmq.Socket[bytes] | None = None
        # Set by resume_from() and reconnects: catch up (apply held batches or replay) before the
        # next poll, without waiting for a live batch to reveal the gap.
        self._kick = False
        self._stopping = False
        self._healthy = False  # live traffic arrived since the last socket error
        self._task: asyncio.Task[None] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sub: zmq.Socket[bytes] | None = None
        # what the pump waits on: the sockets' descriptors, and _wake()
        self._watch: SocketWatch | None = None

    # --- public API ---------------------------------------------------------------------------

    @property
    def expected_seq(self) -> int | None:
        """The next sequence number to be delivered (None until the first batch or resume)."""
        return self._expected

    def resume_from(self, last_seq: int) -> None:
        """Continue after ``last_seq`` (e.g. the sequence of a kv_state snapshot): the next batch
        delivered is ``last_seq + 1``. With a replay endpoint, what the publisher still buffers is
        asked for at once; ``resume_from(-1)`` starts from the very beginning. Batches after
        ``last_seq`` that were delivered already are delivered again, from the subscriber's own
        history of the last ``history_batches`` when it still covers them (or from the replay)."""
        if not -1 <= last_seq < MAX_SEQ:  # (past it, the replay request could not be written)
            raise ValueError(f"last_seq must be from -1 to {MAX_SEQ - 1}, got {last_seq}")
        previous = self._expected
        self._expected = last_seq + 1
        self._drop_replay()
        held = {s: b for s, b in self._held.items() if s > last_seq}
        if previous is not None and last_seq + 1 < previous:
            again = [(s, b) for s, b in self._history if last_seq < s < previous]
            if len(again) == previous - last_seq - 1:  # the whole range, so no gap opens
                held = {**dict(again), **held}
        self._held = held
        self._kick = True
        self._wake()

    def start(self) -> asyncio.Task[None]:
        """Run in a background task on the current event loop."""
        if self._task is None or self._task.done():
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self.run(), name=f"kvmesh-events {self.name}")
        return self._task

    async def stop(self) -> None:
        """Stop and close the sockets. The stream position is kept: ``start()`` again resumes."""
        self._stopping = True
        self._wake()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        """Follow the stream until ``stop()``. Raises ConfigError if the first attempt to open the
        sockets fails (a bad endpoint); later failures are retried with back-off."""
        self._stopping = False
        # Plain sockets of the process-wide context (so inproc:// reaches a publisher in this
        # process); only the waiting is asynchronous, and reads never block: they follow the
        # socket's word that a message is there.
        self._ctx = zmq.Context.instance()
        self._watch = SocketWatch()
        backoff = self._backoff_initial
        opened_once = False
        try:
            while not self._stopping:
                try:
                    self._open()
                except zmq.ZMQError as e:
                    self._close()
                    if not opened_once:
                        verb = "bind" if self.bind else "connect"
                        raise ConfigError(
                            f"cannot {verb} to KV-event endpoint {self.endpoint!r}: {e}"
                        ) from None
                    await self._back_off(backoff, e)
                    backoff = min(backoff * 2, self._backoff_max)
                    continue
                opened_once = True
                try:
                    await self._pump()
                except Exception as e:  # whatever went wrong, reopen rather than die
                    if self._stopping:
                        break
                    if not isinstance(e, (zmq.ZMQError, OSError)):
                        logger.exception("%s: unexpected error in the KV-event loop", self.name)
                    self._close()
                    if self._healthy:  # it worked since the last failure: start the back-off over
                        backoff, self._healthy = self._backoff_initial, False
                    await self._back_off(backoff, e)
                    backoff = min(backoff * 2, self._backoff_max)
        finally:
            self._close()

    # --- sockets ------------------------------------------------------------------------------

    def _open(self) -> None:
        assert self._ctx is not None
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.IPV6, needs_ipv6(self.endpoint, bind=self.bind))
        if self.bind:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        assert self._watch is not None
        self._watch.watch(sub)
        # After resume_from() or a reconnect, catch up at once instead of waiting for the next
        # live batch to reveal the gap (an idle engine may not publish for a long time).
        if self._expected is not None:
            self._kick = True

    def _close(self) -> None:
        self._drop_replay()
        if self._parked is not None:
            self._parked.close(linger=0)
            self._parked = None
        if self._sub is not None and self.bind:
            # Frees the address at once (closing alone releases it later, in ZMQ's I/O thread).
            with contextlib.suppress(zmq.ZMQError):
                self._sub.unbind(self._sub.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint)
        if self._sub is not None:
            if self._watch is not None:
                self._watch.unwatch(self._sub)
            self._sub.close(linger=0)
        self._sub = None

    async def _back_off(self, delay: float, error: BaseException) -> None:
        self.stats.reconnects += 1
        logger.warning("%s: KV-event socket error (%s); reconnecting in %.2f s", self.name, error, delay)
        await asyncio.sleep(delay)

    def _wake(self) -> None:
        if self._watch is not None:
            self._watch.wake()

    # --- the loop -----------------------------------------------------------------------------

    async def _pump(self) -> None:
        """Read the sockets and dispatch until stopped (or a socket error escapes)."""
        loop = asyncio.get_running_loop()
        watch = self._watch
        assert watch is not None
        while not self._stopping:
            if self._kick:
                self._kick = False
                self._catch_up()
            assert self._sub is not None
            watch.clear()  # before asking the sockets (see kvmesh.events.readiness)
            more = False  # a socket may hold more than was read: ask again after a turn of the loop
            if self._replay is not None:
                more = self._drain_replay(self._replay)
            received = self.stats.received
            more = drain(self._sub, recv_frames, self._on_live_message, _DRAIN_LIMIT) or more
            if self.stats.received != received:
                self._healthy = True
            if self._replay is not None and loop.time() >= self._replay.deadline:
                self._replay_timed_out()
            if more or self._kick or self._stopping:
                await asyncio.sleep(0)
                continue
            await watch.wait(None if self._replay is None else self._replay.deadline - loop.time())

    # --- live stream --------------------------------------------------------------------------

    def _on_live_message(self, frames: list[bytes]) -> None:
        self.stats.received += 1
        try:
            _, seq, payload = unpack_frames(frames)
            if seq == REPLAY_END_SEQ:
                raise MalformedEventError("a live message carries the replay end marker as its sequence")
        except MalformedEventError as e:
            self._count_malformed(None, e)
            return
        if seq == self._last_live and payload == self._last_live_payload:
            # The same message twice (a relay or a network retry duplicated it): a publisher that
            # restarted would not repeat the last batch byte for byte under the same sequence.
            self.stats.duplicates += 1
            return
        batch = self._decode(seq, payload)
        if self._last_live is not None and seq <= self._last_live:
            self._publisher_restarted(seq)
        self._last_live = seq
        self._last_live_payload = payload
        if batch is None and self.replay_endpoint is not None:
            # Perhaps garbled on the way: treated as lost, so the next batch (or the quiet-stream
            # probe) reveals the gap and the replay fetches the publisher's copy. A copy that is
            # malformed there too is skipped like any other (_on_replay_message).
            return
        if self._replay is not None:
            self._hold(seq, batch)
            return
        self._accept(seq, batch)

    def _publisher_restarted(self, seq: int) -> None:
        previous = self._last_live
        self.stats.restarts += 1
        self._drop_replay()
        self._held.clear()
        self._history.clear()
        self._expected = 0
        self._report_reset(f"publisher restarted: sequence went back from {previous} to {seq}")

    def _accept(self, seq: int, batch: EventBatch | None) -> None:
        """Apply a batch that is not held back behind a replay."""
        if self._expected is None:
            self._expected = 0 if self._from_beginning else seq
        if seq < self._expected:
            self.stats.duplicates += 1
            return
        if seq > self._expected:
            self.stats.gaps += 1
            if self.replay_endpoint is not None:
                self._hold(seq, batch)
                self._start_replay(self._expected, attempt=1)
                return
            self._skip_to(
                seq, f"gap: expected seq {self._expected}, got {seq}; unrecoverable without a replay endpoint"
            )
            if seq != self._expected:  # on_reset moved the stream elsewhere
                self._hold(seq, batch)
                self._kick = True
                return
        self._deliver(seq, batch)

    def _hold(self, seq: int, batch: EventBatch | None) -> None:
        self._held[seq] = batch
        if len(self._held) > self._max_held and self._replay is not None:
            # The replay cannot keep up; give it up rather than hold without bound.
            first = next(iter(self._held))
            self._drop_replay()
            self._skip_to(
                first, f"gap: more than {self._max_held} batches held while replaying; unrecoverable"
            )
            self._apply_held()

    def _catch_up(self) -> None:
        if self._held:
            self._apply_held()
        elif self.replay_endpoint is not None and self._replay is None and self._expected is not None:
            self._start_replay(self._expected, attempt=1)

    def _apply_held(self) -> None:
        """Apply held batches in order until none are left or one needs a replay."""
        while self._held and self._replay is None:
            seq = next(iter(self._held))
            batch = self._held.pop(seq)
            self._accept(seq, batch)
            if self._kick:  # on_reset moved the stream; the next loop turn continues
                return

    def _deliver(self, seq: int, batch: EventBatch | None) -> None:
        self._expected = seq + 1
        history = self._history
        if history and history[-1][0] != seq - 1:
            history.clear()  # keep it consecutive
        history.append((seq, batch))
        if batch is None:  # malformed, already counted and logged: skip it, keep the order
            return
        self.stats.delivered += 1
        try:
            self._on_batch(seq, batch)
        except Exception:
            self.stats.callback_errors += 1
            logger.exception("%s: on_batch failed for seq %d", self.name, seq)

    def _skip_to(self, seq: int, reason: str) -> None:
        self.stats.unrecoverable += 1
        self._expected = seq
        self._report_reset(reason)

    def _report_reset(self, reason: str) -> None:
        logger.warning("%s: KV-event stream reset: %s", self.name, reason)
        if self._on_reset is not None:
            try:
                self._on_reset(reason)
            except Exception:
                self.stats.callback_errors += 1
                logger.exception("%s: on_reset failed", self.name)

    # --- replay -------------------------------------------------------------------------------

    def _start_replay(self, start: int, *, attempt: int) -> None:
        assert self._ctx is not None and self.replay_endpoint is not None
        sock, self._parked = self._parked, None
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # a whole replay buffer may come back at once
            sock.setsockopt(zmq.IPV6, needs_ipv6(self.replay_endpoint, bind=False))
            sock.connect(self.replay_endpoint)
        # A connected DEALER queues the request until the connection is up; it does not block.
        sock.send_multipart([b"", pack_seq(start)], zmq.NOBLOCK)
        deadline = asyncio.get_running_loop().time() + self._replay_timeout
        self._replay = _Replay(sock, start, attempt, deadline)
        assert self._watch is not None
        self._watch.watch(sock)
        logger.info("%s: requesting replay from seq %d (attempt %d)", self.name, start, attempt)

    def _drop_replay(self, *, ended: bool = False) -> None:
        """Stop following the replay in progress. Its socket is kept for the next one when the
        replay ``ended`` (its end marker read); dropped midway, answers may still be on their
        way to it, so it is closed with them."""
        replay, self._replay = self._replay, None
        if replay is None:
            return
        if self._watch is not None:
            self._watch.unwatch(replay.sock)
        if ended and self._parked is None:
            self._parked = replay.sock
        else:
            replay.sock.close(linger=0)

    def _drain_replay(self, replay: _Replay) -> bool:
        """Read the replay's answers (as :func:`~kvmesh.events.readiness.drain`); True when it
        stopped at the limit with more there."""
        # Handling one answer may end this replay (end marker, reset) and close its socket.
        for _ in range(_DRAIN_LIMIT):
            if self._replay is not replay or not readable(replay.sock):
                return False
            self._on_replay_message(replay, recv_frames(replay.sock))
        return True

    def _on_replay_message(self, replay: _Replay, frames: list[bytes]) -> None:
        replay.deadline = asyncio.get_running_loop().time() + self._replay_timeout
        try:
            if len(frames) != 4 or frames[0] != b"":
                raise MalformedEventError(
                    f"replay answer must be [b'', topic, seq, payload], got {len(frames)} frames"
                )
            seq = unpack_seq(frames[2])
        except MalformedEventError as e:
            self._count_malformed(None, e)
            return
        if seq == REPLAY_END_SEQ:
            self._finish_replay()
            return
        batch = self._decode(seq, frames[3])
        assert self._expected is not None
        if seq < self._expected:
            self.stats.duplicates += 1
            return
        if seq > self._expected:
            first_missing = self._expected
            self._skip_to(
                seq,
                f"gap: seqs {first_missing}..{seq - 1} are no longer in the publisher's replay buffer; unrecoverable",
            )
            if seq != self._expected or self._replay is not replay:
                return
        if batch is not None:
            self.stats.replayed += 1
        self._deliver(seq, batch)

    def _finish_replay(self) -> None:
        self.stats.replays += 1
        self._drop_replay(ended=True)
        if self._held and self._expected is not None:
            first = next(iter(self._held))
            if first > self._expected:
                # The publisher answered, but without these: they are gone.
                self._skip_to(
                    first,
                    f"gap: seqs {self._expected}..{first - 1} are not in the publisher's replay buffer; unrecoverable",
                )
        self._apply_held()

    def _replay_timed_out(self) -> None:
        replay = self._replay
        assert replay is not None and self._expected is not None
        self.stats.replay_timeouts += 1
        self._drop_replay()
        if replay.attempt < self._replay_attempts:
            logger.warning(
                "%s: no answer from replay endpoint %s within %.1f s; retrying",
                self.name,
                self.replay_endpoint,
                self._replay_timeout,
            )
            self._start_replay(self._expected, attempt=replay.attempt + 1)
            return
        first = next(iter(self._held), self._expected)
        self._skip_to(
            first,
            f"gap: replay from seq {self._expected} got no answer after {replay.attempt} attempts; unrecoverable",
        )
        self._apply_held()

    # --- helpers ------------------------------------------------------------------------------

    def _decode(self, seq: int, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except MalformedEventError as e:
            self._count_malformed(seq, e)
            return None

    def _count_malformed(self, seq: int | None, error: MalformedEventError) -> None:
        self.stats.malformed += 1
        where = f"seq {seq}" if seq is not None else "unreadable seq"
        logger.warning("%s: dropping malformed KV-event batch (%s): %s", self.name, where, error)
