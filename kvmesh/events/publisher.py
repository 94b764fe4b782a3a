"""Publish KV-event batches exactly as vLLM and SGLang do: a PUB socket plus a ROUTER replay socket.

``BatchPublisher`` is the transport: each batch gets the next sequence number (0, 1, 2, ...) and
goes out as ``[topic, seq (u64 big-endian), payload]``; the last ``buffer_batches`` payloads stay
in memory so that a subscriber that missed some can ask the replay socket for them. A DEALER sends
``[b"", start_seq (8 bytes big-endian)]`` and receives ``[b"", topic, seq, payload]`` for every
buffered batch from ``start_seq`` on, then the end marker ``[b"", b"", seq -1 (signed), b""]``.

``KvEventPublisher`` is the API for an engine: it collects ``stored`` / ``removed`` / ``cleared``
calls during a scheduler step and ``flush()`` publishes them as one batch.

Threading: ZMQ sockets are not thread-safe, so one sender thread owns both sockets. ``publish()``
encodes the batch in the caller (so an unencodable batch raises there and never burns a sequence
number, and later mutation of the caller's lists cannot change what is sent), assigns the sequence
number under a lock, appends to a queue and, if the sender is idle, wakes it through a pipe. It
never waits for the network.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from itertools import islice
from types import TracebackType
from typing import Protocol

import zmq

from kvmesh.errors import ConfigError
from kvmesh.events.endpoint import check_endpoint, needs_ipv6
from kvmesh.events.wire import (
    MAX_REPLAY_REQUEST_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHashT,
    Event,
    EventBatch,
    encode_batch,
    end_marker_frames,
    pack_seq,
)

logger = logging.getLogger("kvmesh.events")

_MAX_U64 = 2**64 - 1
_MIN_I64 = -(2**63)


def should_bind(endpoint: str) -> bool:
    """vLLM's rule, plus SGLang's ``0.0.0.0``: bind wildcard, ipc and inproc endpoints; connect
    to a concrete ``tcp://host:port``."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or "0.0.0.0" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


def _unbind(sock: zmq.Socket[bytes], address: str) -> None:
    # Closing alone releases a listening address some time later, in ZMQ's I/O thread; unbinding
    # first frees it at once, so a restarted publisher can bind the same address straight away.
    # It also discards the socket's queued messages, so only sockets with nothing worth
    # delivering at close (the replay ROUTER) are unbound.
    with contextlib.suppress(zmq.ZMQError):
        sock.unbind(address)


def _bound_address(sock: zmq.Socket[bytes], requested: str) -> str:
    """The address a bound socket really listens on (resolves a tcp port of 0)."""
    last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return last or requested


class BatchPublisher:
    """PUB socket + ROUTER replay socket, thread-safe, never blocks the caller."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        bind: bool | None = None,
        hwm: int = 100_000,
    ) -> None:
        if buffer_batches < 1:
            raise ConfigError(f"buffer_batches must be at least 1, got {buffer_batches}")
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._pending: list[tuple[int, bytes]] = []
        self._wake_sent = False  # a byte is in the pipe and the sender has not taken the batch yet
        self._closing = False
        self._close_timeout = 0.0

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        bind_pub = should_bind(endpoint) if bind is None else bind
        self._pub = _open_with_options(ctx, zmq.PUB, endpoint, bind_pub, sndhwm=hwm)
        self.endpoint = _bound_address(self._pub, endpoint) if bind_pub else endpoint
        """The PUB address; for a bound socket the one it really listens on (port 0 resolved)."""
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            try:
                # Room for a whole replay plus its end marker even when the peer reads slowly
                # (ZMQ only learns of reads every HWM/2 messages).
                self._replay = _open_with_options(
                    ctx,
                    zmq.ROUTER,
                    replay_endpoint,
                    True,
                    sndhwm=2 * (buffer_batches + 1),
                    max_frame=MAX_REPLAY_REQUEST_BYTES,
                )
            except ConfigError:
                self._pub.close(linger=0)
                raise
            self.replay_endpoint = _bound_address(self._replay, replay_endpoint)

        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # The sockets are handed to the sender thread here and never touched by this thread again
        # (thread start is a full memory barrier, which is what ZMQ asks for when moving a socket).
        self._thread = threading.Thread(target=self._run, name="kvmesh-event-publisher", daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int | None:
        """The last sequence number assigned, None before the first batch."""
        with self._lock:
            return self._next_seq - 1 if self._next_seq else None

    def publish(self, batch: EventBatch) -> int:
        """Queue ``batch`` for sending and return its sequence number."""
        payload = encode_batch(batch)
        with self._lock:
            if self._closing:
                raise RuntimeError("publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._pending.append((seq, payload))
            wake = not self._wake_sent
            self._wake_sent = True
        if wake:
            with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the sender
                os.write(self._wake_w, b"\0")
        return seq

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (waiting up to ``timeout`` for peers to take it), then close."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._close_timeout = timeout
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")
        self._thread.join(timeout + 1.0)
        if self._thread.is_alive():  # pragma: no cover - the sender never blocks; defensive only
            logger.warning("KV-event publisher thread did not stop within %.1f s", timeout + 1.0)
            return
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> BatchPublisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    self._send_pending()
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                with self._lock:
                    done = self._closing and not self._pending
                if done:
                    break
        except Exception:  # pragma: no cover - a bug here must not take the engine down with it
            logger.exception("KV-event publisher thread failed")
        finally:
            # Not unbound first: unbinding drops what is still queued for connected subscribers,
            # and the linger below exists to deliver it. The address is released a moment later.
            self._pub.close(linger=int(self._close_timeout * 1000))
            if self._replay is not None:
                assert self.replay_endpoint is not None
                _unbind(self._replay, self.replay_endpoint)
                self._replay.close(linger=0)

    def _send_pending(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        with self._lock:
            pending, self._pending = self._pending, []
            self._wake_sent = False
        for seq, payload in pending:
            seq_frame = pack_seq(seq)
            # A PUB socket drops (never blocks) when a subscriber's queue is full; the replay
            # buffer is what lets that subscriber recover.
            self._pub.send_multipart((self._topic, seq_frame, payload))
            self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            try:
                self._replay_from(client, int.from_bytes(start, "big"))
            except zmq.ZMQError as e:  # one client's trouble must not stop the publisher
                logger.warning("replay to a subscriber failed: %s", e)

    def _replay_from(self, client: bytes, start_seq: int) -> None:
        assert self._replay is not None
        # Buffered sequence numbers are consecutive, so the start position is arithmetic.
        skip = max(0, start_seq - self._buffer[0][0]) if self._buffer else 0
        for seq, payload in islice(self._buffer, min(skip, len(self._buffer)), None):
            self._replay.send_multipart((client, b"", self._topic, pack_seq(seq), payload))
        self._replay.send_multipart((client, b"", *end_marker_frames()))


def _open_with_options(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    endpoint: str,
    bind: bool,
    *,
    sndhwm: int,
    max_frame: int = -1,
) -> zmq.Socket[bytes]:
    check_endpoint(endpoint, bind=bind)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, sndhwm)  # before bind/connect: they apply to later connections
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)  # (-1: none; a PUB reads nothing)
    sock.setsockopt(zmq.IPV6, needs_ipv6(endpoint, bind=bind))
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        verb = "bind" if bind else "connect"
        raise ConfigError(f"cannot {verb} KV-event socket to {endpoint!r}: {e}") from None
    return sock


class BatchSink(Protocol):
    """Where a KvEventPublisher's batches go: a ZMQ :class:`BatchPublisher` or the NATS one."""

    endpoint: str
    replay_endpoint: str | None

    @property
    def last_seq(self) -> int | None: ...

    def publish(self, batch: EventBatch) -> int: ...

    def close(self, timeout: float = 1.0) -> None: ...


class KvEventPublisher:
    """What a custom engine calls: record cache changes during a step, ``flush()`` once per step.

    Mirrors vLLM 0.33.0's events field for field (``lora_id`` null, ``medium`` and ``lora_name``
    always present), so vLLM's and SGLang's own decoders, Dynamo and kvmesh all read the output.
    Batches go to a ZMQ PUB socket at ``endpoint``, or to ``sink`` (e.g. a
    :class:`~kvmesh.events.nats_publisher.NatsBatchPublisher` for the NATS event plane).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        replay_endpoint: str | None = None,
        block_size: int,
        data_parallel_rank: int | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        bind: bool | None = None,
        sink: BatchSink | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be at least 1, got {block_size}")
        if (endpoint is None) == (sink is None):
            raise ConfigError("give a KV-event publisher either a ZMQ endpoint or a sink, not both")
        if sink is not None and replay_endpoint is not None:
            raise ConfigError("a replay endpoint belongs to a ZMQ publisher, not to a sink")
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._publisher: BatchSink
        if sink is not None:
            self._publisher = sink
        else:
            assert endpoint is not None
            self._publisher = BatchPublisher(
                endpoint,
                replay_endpoint=replay_endpoint,
                topic=topic,
                buffer_batches=buffer_batches,
                bind=bind,
            )

    @property
    def endpoint(self) -> str:
        return self._publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._publisher.replay_endpoint

    @property
    def last_seq(self) -> int | None:
        return self._publisher.last_seq

    def stored(
        self,
        block_hashes: Sequence[EngineHashT],
        token_ids: Sequence[int],
        *,
        parent_block_hash: EngineHashT | None = None,
        lora_name: str | None = None,
        medium: str = "GPU",
    ) -> None:
        """Record that ``block_hashes`` (a chain, parent first) now hold ``token_ids``."""
        hashes = _checked_hashes(block_hashes)
        if parent_block_hash is not None:
            _check_hash(parent_block_hash)
        if len(token_ids) != len(hashes) * self.block_size:
            raise ValueError(
                f"stored(): {len(hashes)} blocks of {self.block_size} tokens need "
                f"{len(hashes) * self.block_size} token ids, got {len(token_ids)}"
            )
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent_block_hash,
            token_ids=list(token_ids),
            block_size=self.block_size,
            lora_id=None,
            medium=medium,
            lora_name=lora_name,
        )
        with self._lock:
            self._events.append(event)

    def removed(self, block_hashes: Sequence[EngineHashT], *, medium: str = "GPU") -> None:
        """Record that ``block_hashes`` were evicted from ``medium``."""
        event = BlockRemoved(block_hashes=_checked_hashes(block_hashes), medium=medium)
        with self._lock:
            self._events.append(event)

    def cleared(self) -> None:
        """Record that the whole cache was dropped (e.g. a reset of the prefix cache)."""
        with self._lock:
            self._events.append(AllBlocksCleared())

    def flush(self) -> int | None:
        """Publish what was recorded since the last flush as one batch; return its sequence number,
        or None when nothing was recorded."""
        with self._lock:
            if not self._events:
                return None
            events, self._events = self._events, []
            # Inside the lock so that batches leave in the order their events were recorded.
            return self._publisher.publish(EventBatch(time.time(), events, self.data_parallel_rank))

    def close(self, timeout: float = 1.0) -> None:
        """Flush what is left, then close the sockets."""
        self.flush()
        self._publisher.close(timeout)

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _check_hash(h: EngineHashT) -> None:
    if isinstance(h, bytes):
        return
    if isinstance(h, bool) or not isinstance(h, int):
        raise TypeError(f"a block hash must be an int or bytes, got {type(h).__name__}")
    if not _MIN_I64 <= h <= _MAX_U64:
        raise ValueError(f"block hash {h} does not fit in 64 bits (signed or unsigned)")


def _checked_hashes(block_hashes: Sequence[EngineHashT]) -> list[EngineHashT]:
    hashes = list(block_hashes)
    if not hashes:
        raise ValueError("at least one block hash is required")
    for h in hashes:
        _check_hash(h)
    return hashes
