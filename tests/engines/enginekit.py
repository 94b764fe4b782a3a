"""Helpers for the engine-tier tests (tests/engines/). Like conftest.py, this imports only the
standard library, pytest, zmq and kvmesh: the engine environments hold nothing else."""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import zmq

from kvmesh.events.wire import EventBatch, pack_seq

REPO = Path(__file__).resolve().parents[2]


def import_engine_module(name: str) -> ModuleType:
    """Import an engine module, failing (never skipping) when it is missing. Engines warn about
    their own dependencies at import time (torch deprecations); that noise is not under test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Collector:
    """EventSubscriber callbacks that record what was delivered and every reset."""

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

    async def wait_for(self, count: int, timeout: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.batches) < count:
            if loop.time() > deadline:
                raise AssertionError(f"got {len(self.batches)} of {count} batches within {timeout} s")
            await asyncio.sleep(0.005)


def replay_answers(replay_endpoint: str, start: int, *, timeout_ms: int = 5000) -> list[list[bytes]]:
    """Every answer of a replay socket to ``start``, up to and including the end marker, read by a
    raw DEALER exactly as the engines document the protocol."""
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    try:
        dealer.send_multipart([b"", pack_seq(start)])
        answers = []
        while True:
            assert dealer.poll(timeout_ms), "the replay socket did not answer"
            frames = dealer.recv_multipart()
            answers.append(frames)
            if frames[2] == b"\xff" * 8:
                return answers
    finally:
        dealer.close(linger=0)


async def wait_sent(replay_endpoint: str, seq: int) -> None:
    """Wait until a publisher has put ``seq`` on the wire: its publish() only queues, and the
    replay socket, served by the same thread after sending, is the witness."""
    for _ in range(300):
        answers = replay_answers(replay_endpoint, seq)
        if answers[0][2] == pack_seq(seq):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"seq {seq} was never sent")


class LossyRelay:
    """SUB -> PUB relay on a thread that drops every message whose seq % 20 == 7 (5%), except the
    one numbered ``last_seq`` (nothing after it would reveal the gap)."""

    def __init__(self, upstream: str, downstream: str, *, last_seq: int) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind(downstream)
        self.endpoint = downstream
        self.last_seq = last_seq
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
                if seq % 20 == 7 and seq != self.last_seq:
                    self.dropped.append(seq)
                    continue
                self._pub.send_multipart(frames)
        finally:
            self._sub.close(linger=0)
            self._pub.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run_tap(*args: str, timeout: float = 60) -> subprocess.Popen[str]:
    """``kvmesh events tap`` in a subprocess of this same interpreter (the engine env) with this
    checkout importable, as the Makefile runs the engine tier."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "events", "tap", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
