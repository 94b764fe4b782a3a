"""KV-event wire codec and transport: kvmesh vs baselines, same run.

    .venv/bin/python benchmarks/wire.py [--repeat 3000] [--e2e-batches 20000]

Decode: kvmesh's typed ``decode_batch`` against the obvious hand-written consumer (untyped
``msgspec.msgpack.decode`` and a walk over the dicts, pulling out the fields a router needs), on
two vLLM-shaped payloads: one scheduler step that stored 16 blocks of 16 tokens, and a big step
(32 stores of 16 blocks plus 8 evictions). If vLLM is importable, its own typed decoder is timed
too, for reference.

End to end: batches/s from ``BatchPublisher`` to ``EventSubscriber`` over loopback tcp (sequence
checks, in-order delivery, replay machinery idle), against a bare pyzmq PUB -> SUB + decode loop
(no sequence checking, nothing recoverable) as the floor.

Paced: a router hears each engine step's batch on its own, so what a batch costs it is mostly
the wake-up around it. A publisher in another process sends one batch every ``--paced-gap-ms``;
the subscriber's process CPU per batch is measured for ``EventSubscriber`` and for the plainest
asyncio consumer pyzmq offers (``await sock.recv_multipart()`` on a ``zmq.asyncio`` socket, then
``decode_batch``), each on its own event loop in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, median, table, time_calls

from kvmesh.bench.fleet import spawn_child
from kvmesh.commands.argtypes import non_negative_float, positive_int
from kvmesh.events.publisher import BatchPublisher
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch

BLOCK = 16


def stored(first_hash: int, blocks: int) -> BlockStored:
    return BlockStored(
        block_hashes=[(first_hash + i) * 0x9E3779B97F4A7C15 % 2**64 for i in range(blocks)],
        parent_block_hash=first_hash * 31 % 2**64,
        token_ids=[(7 * i + first_hash) % 151_000 for i in range(blocks * BLOCK)],
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


WORKLOADS: dict[str, EventBatch] = {
    "1 store x 16 blocks": EventBatch(1.8e9, [stored(1, 16)], 0),
    "32 stores x 16 blocks + 8 removals": EventBatch(
        1.8e9,
        [stored(k * 1000, 16) for k in range(32)]
        + [BlockRemoved(block_hashes=[k * 7 + i for i in range(4)], medium="GPU") for k in range(8)],
        0,
    ),
}


def blocks_in(batch: EventBatch) -> int:
    return sum(len(e.block_hashes) for e in batch.events if isinstance(e, (BlockStored, BlockRemoved)))


def untyped_walk(payload: bytes) -> list[tuple[Any, ...]]:
    """The baseline consumer: decode to builtins, then pick the fields out of each dict."""
    _ts, events, _rank = msgspec.msgpack.decode(payload)
    out = []
    for e in events:
        kind = e["type"]
        if kind == "BlockStored":
            out.append(
                (
                    kind,
                    e["block_hashes"],
                    e.get("parent_block_hash"),
                    e["token_ids"],
                    e.get("medium"),
                    e.get("lora_name"),
                )
            )
        elif kind == "BlockRemoved":
            out.append((kind, e["block_hashes"], e.get("medium")))
        else:
            out.append((kind,))
    return out


def decode_candidates() -> dict[str, Callable[[bytes], object]]:
    candidates: dict[str, Callable[[bytes], object]] = {
        "baseline: untyped decode + dict walk": untyped_walk,
        "kvmesh decode_batch": decode_batch,
    }
    try:
        from vllm.distributed.kv_events import KVEventBatch
    except ImportError:
        print("vLLM not importable: its decoder is left out (not needed for the comparison)", file=sys.stderr)
    else:
        candidates["vLLM's own typed decoder (reference)"] = msgspec.msgpack.Decoder(KVEventBatch).decode
    return candidates


DECODE_ROUNDS = 10


def bench_decode(repeat: int) -> str:
    rows = []
    candidates = decode_candidates()
    for workload, batch in WORKLOADS.items():
        payload = encode_batch(batch)
        blocks = blocks_in(batch)
        results: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(DECODE_ROUNDS):  # interleaved rounds: machine noise hits every candidate alike
            for name, fn in candidates.items():
                results[name] += time_calls(
                    lambda fn=fn, p=payload: fn(p), repeat=repeat // DECODE_ROUNDS, warmup=5
                )
        baseline = median(results["baseline: untyped decode + dict walk"])
        for name, samples in results.items():
            t = median(samples)
            rows.append(
                [
                    workload,
                    f"{len(payload):,} B",
                    name,
                    f"{1 / t:,.0f}",
                    f"{blocks / t:,.0f}",
                    f"{baseline / t:.2f}x",
                ]
            )
    return table(["payload", "size", "decoder", "batches/s", "blocks/s", "speed vs baseline"], rows)


async def kvmesh_end_to_end(n: int, batch: EventBatch) -> float:
    done = asyncio.Event()
    count = 0

    def on_batch(seq: int, _batch: EventBatch) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    with BatchPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True) as pub:
        sub = EventSubscriber(pub.endpoint, on_batch, replay_endpoint=pub.replay_endpoint)
        sub.start()
        await asyncio.sleep(0.3)  # connected before the clock starts
        start = time.perf_counter()
        for i in range(n):
            pub.publish(batch)
            if i % 1000 == 0:
                await asyncio.sleep(0)
        await asyncio.wait_for(done.wait(), 120)
        elapsed = time.perf_counter() - start
        await sub.stop()
        assert sub.stats.delivered == n
    return elapsed


def raw_end_to_end(n: int, batch: EventBatch) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)

    def receive() -> None:
        for _ in range(n):
            _, _, payload = sub.recv_multipart()
            decode_batch(payload)

    receiver = threading.Thread(target=receive)
    receiver.start()
    start = time.perf_counter()
    for i in range(n):
        pub.send_multipart((b"", i.to_bytes(8, "big"), encode_batch(batch)))
    receiver.join()
    elapsed = time.perf_counter() - start
    sub.close(linger=0)
    pub.close(linger=0)
    return elapsed


def bench_end_to_end(n: int) -> str:
    batch = WORKLOADS["1 store x 16 blocks"]
    raw = raw_end_to_end(n, batch)
    ours = asyncio.run(kvmesh_end_to_end(n, batch))
    rows = [
        ["baseline: bare PUB -> SUB + decode_batch (no seq checks)", f"{n / raw:,.0f}", "1.00x"],
        ["kvmesh BatchPublisher -> EventSubscriber", f"{n / ours:,.0f}", f"{raw / ours:.2f}x"],
    ]
    return table(
        ["path (loopback tcp, 1 store x 16 blocks per batch)", "batches/s", "speed vs baseline"], rows
    )


# The publisher's process: this file's own end-to-end payload, one batch every gap.
_PACED_PUBLISHER = """
import sys, time
sys.path.insert(0, sys.argv[4])
from wire import WORKLOADS
from kvmesh.events.publisher import BatchPublisher
n, gap = int(sys.argv[2]), float(sys.argv[3]) / 1000
batch = WORKLOADS["1 store x 16 blocks"]
with BatchPublisher(sys.argv[1], bind=True) as pub:
    time.sleep(1.0)  # the subscriber has connected
    for _ in range(n):
        pub.publish(batch)
        time.sleep(gap)
    time.sleep(0.5)
"""


def _free_endpoint() -> str:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    probe = ctx.socket(zmq.PUB)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    return f"tcp://127.0.0.1:{port}"


Stop = Callable[[], Awaitable[None]]


async def _paced(n: int, gap_ms: float, consume: Callable[[str, Callable[[], None]], Stop]) -> float:
    """CPU seconds this process spent per batch, from the 200th batch to the last. ``consume``
    starts a consumer that calls its second argument per batch, and returns what stops it."""
    endpoint = _free_endpoint()
    count, since = 0, 0.0
    done = asyncio.Event()

    def got() -> None:
        nonlocal count, since
        count += 1
        if count == 200:
            since = time.process_time()
        if count == n:
            done.set()

    stop = consume(endpoint, got)
    here = str(Path(__file__).resolve().parent)
    publisher = spawn_child([sys.executable, "-c", _PACED_PUBLISHER, endpoint, str(n), str(gap_ms), here])
    try:
        await asyncio.wait_for(done.wait(), 60 + n * gap_ms / 1000 * 3)
        return (time.process_time() - since) / (n - 200)
    finally:
        publisher.wait()
        await stop()


def _kvmesh_consumer(endpoint: str, got: Callable[[], None]) -> Stop:
    sub = EventSubscriber(endpoint, lambda _seq, _batch: got())
    sub.start()
    return sub.stop


def _bare_consumer(endpoint: str, got: Callable[[], None]) -> Stop:
    async def run() -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        try:
            while True:
                _, _, payload = await sock.recv_multipart()
                decode_batch(payload)
                got()
        finally:
            sock.close(linger=0)

    task = asyncio.get_running_loop().create_task(run())

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return stop


def bench_paced(n: int, gap_ms: float) -> str:
    bare = asyncio.run(_paced(n, gap_ms, _bare_consumer))
    ours = asyncio.run(_paced(n, gap_ms, _kvmesh_consumer))
    rows = [
        ["baseline: zmq.asyncio SUB, await recv_multipart + decode_batch", f"{bare * 1e6:.0f}", "1.00x"],
        ["kvmesh EventSubscriber", f"{ours * 1e6:.0f}", f"{ours / bare:.2f}x"],
    ]
    return table(
        [
            f"consumer (one batch every {gap_ms:g} ms, publisher in another process)",
            "CPU us/batch",
            "vs baseline",
        ],
        rows,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=3000, help="timed decodes per decoder and payload"
    )
    parser.add_argument(
        "--e2e-batches", type=positive_int, default=20000, help="batches sent in the end-to-end runs"
    )
    parser.add_argument(
        "--paced-batches", type=positive_int, default=3000, help="batches sent in the paced runs"
    )
    parser.add_argument(
        "--paced-gap-ms",
        type=non_negative_float,
        default=0.7,
        help="gap between two batches in the paced runs (ms)",
    )
    args = parser.parse_args()
    if args.repeat < DECODE_ROUNDS:
        parser.error(
            f"--repeat must be at least {DECODE_ROUNDS} (one decode in each of {DECODE_ROUNDS} rounds), "
            f"got {args.repeat}"
        )
    print(f"machine: {machine()}\n")
    print(bench_decode(args.repeat))
    print()
    print(bench_end_to_end(args.e2e_batches))
    print()
    print(bench_paced(args.paced_batches, args.paced_gap_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
