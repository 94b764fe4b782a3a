"""Helpers for the engine-tier tests (tests/engines/), and the scenarios every engine's publisher
goes through. Like conftest.py, this imports only the standard library, zmq, msgspec, kvmesh and
``tests/events/eventkit.py``: the engine environments hold little else."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import msgspec
import zmq

from kvmesh.events.publisher import BatchPublisher
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import decode_batch, pack_seq
from tests.events.eventkit import Collector, LossyRelay, drop_5_percent

REPO = Path(__file__).resolve().parents[2]
# How long a scenario waits for the batches of a healthy link; a lossy one gets longer.
WAIT_S = 20.0


class EnginePublisher(Protocol):
    """An engine's own ZMQ event publisher, publishing its own batch objects."""

    def publish(self, batch: Any) -> None: ...


AsBuiltins = Callable[[Any], Any]
"""A batch as plain data, the ground on which the engine's objects and kvmesh's are compared."""


def import_engine_module(name: str) -> ModuleType:
    """Import an engine module, failing (never skipping) when it is missing. Engines warn about
    their own dependencies at import time (torch deprecations); that noise is not under test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


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


REPLAY_STARTS = (0, 3, 6, 8, 2**40)
"""Replay requests that start before, inside, right after and far past a buffer of seqs 3..7."""


def replay_answers_of_both(
    engine: EnginePublisher, engine_replay: str, ours: BatchPublisher, batches: Sequence[Any]
) -> list[tuple[list[list[bytes]], list[list[bytes]]]]:
    """Publish 8 engine batches through the engine's publisher and kvmesh's ``BatchPublisher``
    (each keeping the last 5); return both replay sockets' answers, (theirs, ours), to each of
    :data:`REPLAY_STARTS`. kvmesh's answer from 0 must be the buffered seqs 3..7."""
    assert len(batches) == 8
    assert ours.replay_endpoint is not None
    encoder = msgspec.msgpack.Encoder()
    for batch in batches:
        engine.publish(batch)
        ours.publish(decode_batch(encoder.encode(batch)))
    asyncio.run(wait_sent(engine_replay, 7))
    asyncio.run(wait_sent(ours.replay_endpoint, 7))
    pairs = [
        (replay_answers(engine_replay, start), replay_answers(ours.replay_endpoint, start))
        for start in REPLAY_STARTS
    ]
    assert [int.from_bytes(f[2], "big") for f in pairs[0][1][:-1]] == [3, 4, 5, 6, 7]
    return pairs


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


# --- an engine's publisher -> kvmesh's subscriber ------------------------------------------------


async def late_subscriber_recovers(
    engine: EnginePublisher, endpoint: str, replay: str, batches: Sequence[Any], as_builtins: AsBuiltins
) -> None:
    """A subscriber that starts after half the batches went out gets that half from the engine's
    replay socket and the rest live: every batch once, in order, as the engine made it."""
    got = Collector()
    half = len(batches) // 2
    for batch in batches[:half]:
        engine.publish(batch)
    await wait_sent(replay, half - 1)
    sub = EventSubscriber(endpoint, got.on_batch, replay_endpoint=replay, on_reset=got.on_reset)
    sub.start()
    try:
        await asyncio.sleep(0.1)
        for i, batch in enumerate(batches[half:]):
            engine.publish(batch)
            if i % 100 == 0:
                await asyncio.sleep(0.001)
        await got.wait_for(len(batches), timeout=WAIT_S)
        await asyncio.sleep(0.05)
    finally:
        await sub.stop()
    assert got.seqs == list(range(len(batches)))
    assert [as_builtins(b) for _, b in got.batches] == [as_builtins(b) for b in batches]
    assert got.resets == [] and sub.stats.replayed >= half


async def bound_subscriber_catches_up(
    engine: EnginePublisher, endpoint: str, replay: str, batches: Sequence[Any], as_builtins: AsBuiltins
) -> None:
    """The engine's PUB connects to a subscriber that binds ``endpoint``: the 100 batches sent
    before anyone listened are lost on the live path and come back through replay."""
    got = Collector()
    for batch in batches[:100]:
        engine.publish(batch)
    await wait_sent(replay, 99)
    sub = EventSubscriber(endpoint, got.on_batch, replay_endpoint=replay, bind=True, on_reset=got.on_reset)
    sub.start()
    try:
        for batch in batches[100:300]:
            engine.publish(batch)
            await asyncio.sleep(0.005)
        await got.wait_for(300, timeout=WAIT_S)
        await asyncio.sleep(0.05)
    finally:
        await sub.stop()
    assert got.seqs == list(range(300))
    assert [as_builtins(b) for _, b in got.batches] == [as_builtins(b) for b in batches[:300]]
    assert got.resets == [] and sub.stats.replayed >= 100


async def lossy_link_is_repaired(
    engine: EnginePublisher,
    endpoint: str,
    replay: str,
    relay_endpoint: str,
    batches: Sequence[Any],
    as_builtins: AsBuiltins,
) -> None:
    """A relay on ``relay_endpoint`` drops 5% of the live stream; the subscriber behind it gets
    the missing batches from the engine's replay socket."""
    got = Collector()
    n = len(batches)
    relay = LossyRelay(endpoint, relay_endpoint, drop=drop_5_percent(n - 1))
    sub = EventSubscriber(relay.endpoint, got.on_batch, replay_endpoint=replay, on_reset=got.on_reset)
    sub.start()
    try:
        await asyncio.sleep(0.3)
        for i, batch in enumerate(batches):
            engine.publish(batch)
            if i % 50 == 0:
                await asyncio.sleep(0.002)
        await got.wait_for(n, timeout=60)
        while relay.highest_seen < n - 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
    finally:
        await sub.stop()
        relay.close()
    assert relay.dropped == [s for s in range(n - 1) if s % 20 == 7]
    assert got.seqs == list(range(n))
    assert [as_builtins(b) for _, b in got.batches] == [as_builtins(b) for b in batches]
    assert got.resets == [] and sub.stats.replayed >= len(relay.dropped)


def tap_shows_batches(
    engine: EnginePublisher,
    endpoint: str,
    replay: str,
    batches: Sequence[Any],
    check_event: Callable[[dict[str, Any], Any], None],
) -> None:
    """``kvmesh events tap --json`` from seq 0 shows the engine's first 12 batches (5 of them from
    replay); ``check_event(shown, event)`` compares each shown event with the engine's own."""
    for batch in batches[:5]:
        engine.publish(batch)
    tap = run_tap(
        endpoint,
        "--replay-endpoint",
        replay,
        "--from-seq",
        "0",
        "--count",
        "12",
        "--json",
        "--timeout",
        "60",
    )
    deadline = time.monotonic() + 90
    rest = iter(batches[5:])
    while tap.poll() is None and time.monotonic() < deadline:
        engine.publish(next(rest))
        time.sleep(0.05)
    out, err = tap.communicate(timeout=30)
    assert tap.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["seq"] for line in lines] == list(range(12))
    for line, batch in zip(lines, batches, strict=False):
        assert line["dp_rank"] == 0 and line["ts"] == batch.ts
        assert [e["type"] for e in line["events"]] == [type(e).__name__ for e in batch.events]
        for shown, event in zip(line["events"], batch.events, strict=True):
            check_event(shown, event)


async def router_rows(front: str) -> dict[str, dict[str, Any]]:
    """A standalone router's ``GET /kvmesh/workers`` rows, by worker URL."""
    import httpx  # (in every engine environment, as the tier's HTTP client)

    async with httpx.AsyncClient() as client:
        rows = (await client.get(front + "/kvmesh/workers")).json()["workers"]
    return {row["url"]: row for row in rows}


async def until_up(front: str, url: str) -> None:
    """Wait until the router at ``front`` has the worker at ``url`` up."""
    for _ in range(250):
        if (await router_rows(front))[url]["state"] == "up":
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never came up: {await router_rows(front)}")


async def until_indexed(front: str, url: str, blocks: int) -> dict[str, Any]:
    """The worker's row once the router at ``front`` indexes ``blocks`` blocks of it (or after
    ten seconds, for the caller's assertion to show)."""
    for _ in range(500):
        row = (await router_rows(front))[url]
        if row["indexed_blocks"] == blocks:
            break
        await asyncio.sleep(0.02)
    return row
