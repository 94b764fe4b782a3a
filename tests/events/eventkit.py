"""Helpers for the KV-event tests: free ports, batches with checkable contents, a collecting
subscriber callback, a lossy relay and a ZMQ socket-hygiene check.

The KV-event tests of other directories (the engine tiers, the mock, the router) use them too:
pyproject.toml puts this directory on pytest's ``pythonpath``. It imports only the standard
library, zmq and kvmesh, which is all the engine environments hold besides pytest."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import zmq

from kvmesh.events.wire import BlockStored, EventBatch

_HANDED_OUT: set[int] = set()


def free_tcp_port() -> int:
    """A loopback port free now and not handed out before in this process. (The OS may give a port
    it has just released again: two calls in a row gave a PUB socket and its replay socket one
    port, and a CI run failed binding the second.)"""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def ipv6_loopback() -> bool:
    """Whether this host has an IPv6 loopback (``::1``) to bind."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def free_tcp6_port() -> int:
    """A free port on the IPv6 loopback."""
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


def free_tcp_port_runs(runs: int, length: int) -> list[int]:
    """The first ports of ``runs`` runs of ``length`` consecutive loopback ports, all free when
    asked and none shared between runs: a data-parallel engine's rank ``r`` publishes on its base
    port plus ``r``, which a port free on its own says nothing about (a CI run failed binding one)."""
    held: list[socket.socket] = []
    starts: list[int] = []
    try:
        while len(starts) < runs:
            start = free_tcp_port()
            run: list[socket.socket] = []
            try:
                for port in range(start, start + length):
                    s = socket.socket()
                    run.append(s)
                    s.bind(("127.0.0.1", port))
            except (OSError, OverflowError):  # taken, or past the last port: try another start
                for s in run:
                    s.close()
                continue
            held.extend(run)  # (held until every run is found: the next one cannot overlap it)
            starts.append(start)
        return starts
    finally:
        for s in held:
            s.close()


def ipc_endpoint(directory: Path, name: str) -> str:
    path = directory / f"{name}.sock"
    assert len(str(path)) < 100, "ipc paths are limited to ~107 bytes"
    return f"ipc://{path}"


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


def drop_5_percent(last_seq: int) -> Callable[[int], bool]:
    """Selects every message whose seq % 20 == 7, except ``last_seq`` (nothing after it would
    reveal the gap)."""
    return lambda seq: seq % 20 == 7 and seq != last_seq


Frames = list[bytes]


class LossyRelay:
    """SUB -> PUB relay of a KV-event stream, on a thread, that drops the messages whose sequence
    number ``drop`` selects. It binds ``downstream`` (``tcp://127.0.0.1:*`` takes a free port) and
    names the bound address in ``endpoint``. ``transform`` (optional) turns each message that is
    not dropped into the messages to send instead: none, itself twice, a garbled copy, an earlier
    one held back (reordering); it may be swapped while the relay runs, like ``drop``."""

    def __init__(
        self,
        upstream: str,
        downstream: str,
        *,
        drop: Callable[[int], bool],
        transform: Callable[[int, Frames], list[Frames]] | None = None,
    ) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind(downstream)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.drop = drop
        self.transform = transform
        self.dropped: list[int] = []
        self.highest_seen = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sub.poll(20):
                    continue
                frames = self._sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big")
                self.highest_seen = seq
                if self.drop(seq):
                    self.dropped.append(seq)
                    continue
                transform = self.transform
                for out in transform(seq, frames) if transform is not None else [frames]:
                    self._pub.send_multipart(out)
        finally:
            self._sub.close(linger=0)
            self._pub.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _open_sockets() -> set[zmq.Socket[bytes]]:
    return {s for s in list(zmq.Context.instance()._sockets) if not s.closed}  # type: ignore[attr-defined]


@contextmanager
def no_sockets_left_open() -> Iterator[None]:
    """Fail if the block leaves a socket of the process-wide ZMQ context open."""
    before = _open_sockets()
    yield
    leaked = _open_sockets() - before
    assert not leaked, f"sockets left open: {leaked}"
