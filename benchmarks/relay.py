"""The streaming relay's CPU on loopback: what a front spends on each streamed token, beside sglang-router.

An answer streams one SSE event per token from the engine, and every event passes through the
front: read from the engine's connection, looked at (the first token, the usage, the router's
learning), written to the client. At a fleet's decode rate that is tens of thousands of events a
second, so the front's CPU per event decides how many cores it needs.

One upstream (a raw ASGI app, no engine) streams ``--events`` chat-completion events ``--gap-ms``
apart, as a decoding engine sends its tokens, then a usage event and ``[DONE]``. The same client
load goes, in the same run and interleaved round by round:

* direct:                          client -> upstream (the upstream's own CPU, for scale)
* kvmesh round-robin:              client -> ``kvmesh router --router-mode round-robin`` -> upstream
* kvmesh kv:                       the default router (approximate index: the upstream has no events)
* kvmesh kv, no usage asked:       the client leaves out ``stream_options.include_usage``, so the
                                   front counts each event's text to keep its load right
* kvmesh kv, through send:         the default router with ``KVMESH_DIRECT_RELAY=0``: every token
                                   goes to the client through the ASGI ``send`` (the default writes
                                   it from the engine connection's callback, ``direct_relay``)
* sglang-router cache_aware:       ``python -m sglang_router.launch_router`` (the ``bench`` extra)

"CPU us/event" is the CPU time (user + system, from /proc) of the process the client talks to,
per streamed event; "vs sglang-router" divides it by sglang-router's in the same round. TTFT and
ITL are the client's medians.

    .venv/bin/python benchmarks/relay.py [--events 64] [--gap-ms 5] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, spread, table
from overhead import Endpoint, free_port, request_read, serve_process

from kvmesh.bench.fleet import process_cpu_seconds, sglang_router
from kvmesh.bench.runner import Progress, on_schedule
from kvmesh.commands.argtypes import non_negative_float, positive_int

_PROMPT = '"messages":[{"role":"user","content":"Say hello to the benchmark, briefly please."}]'
BODY_USAGE = ('{"model":"m","stream":true,"stream_options":{"include_usage":true},' + _PROMPT + "}").encode()
BODY_PLAIN = ('{"model":"m","stream":true,' + _PROMPT + "}").encode()
_CHUNK = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"content":"tok%d"},"finish_reason":null}]}\n\n'
)
_USAGE = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    '"usage":{"prompt_tokens":12,"completion_tokens":%d,"total_tokens":%d,'
    '"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n'
)


def streaming_upstream(events: int, gap_s: float) -> Any:
    """A raw ASGI app that streams ``events`` chat-completion events ``gap_s`` apart, then the
    usage event and ``[DONE]``; any other path answers a model list (the fronts' discovery)."""
    chunks = [(_CHUNK % i).encode() for i in range(events)]
    frames = [*chunks, (_USAGE % (events, events + 12)).encode()]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not await request_read(scope, receive, send):
            return
        if scope["path"] != "/v1/chat/completions":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": b'{"object":"list","data":[{"id":"m","object":"model"}]}',
                }
            )
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        # Paced on one timeline (uvloop rounds a timer to the nearest millisecond): a
        # sub-millisecond gap sends events in small bunches whose mean spacing is the gap asked for.
        async for i in on_schedule([gap_s] * len(frames)):
            await send({"type": "http.response.body", "body": frames[i], "more_body": i < len(chunks)})

    return app


def _serve_upstream(port: int, events: int, gap_ms: float) -> None:
    import uvicorn

    app = streaming_upstream(events, gap_ms / 1000)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def _upstream(events: int, gap_ms: float) -> contextlib.AbstractContextManager[Endpoint]:
    port = free_port()
    argv = [
        sys.executable,
        __file__,
        "--serve",
        "--port",
        str(port),
        "--events",
        str(events),
        "--gap-ms",
        str(gap_ms),
    ]
    return serve_process(argv, port)


def _kvmesh(
    upstream: Endpoint, *flags: str, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[Endpoint]:
    port = free_port()
    argv = [sys.executable, "-m", "kvmesh", "router", "--workers", upstream.url, "--port", str(port),
            "--log-level", "error", "--tokenizer", "builtin", *flags]  # fmt: skip
    return serve_process(argv, port, env)


def _sglang_router(upstream: Endpoint) -> contextlib.AbstractContextManager[Endpoint]:
    port = free_port()
    argv = sglang_router("cache_aware")([upstream.url], port)  # the suite's own command line
    return serve_process(argv, port)


@dataclass(frozen=True)
class Sample:
    """One measurement of one path."""

    cpu_per_event: float | None
    ttft: float
    itl: float
    rps: float


async def measure(
    target: Endpoint,
    body: bytes,
    requests: int,
    concurrency: int,
    events: int,
    progress: Progress | None = None,
) -> Sample:
    """``requests`` streamed answers through ``target``, ``concurrency`` at a time, after a warm-up;
    each timed answer ticks ``progress``."""
    import aiohttp

    ttfts: list[float] = []
    itls: list[float] = []
    url = target.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one() -> None:
            t0 = time.perf_counter()
            first = last = 0.0
            seen = 0
            async with http.post(url, data=body, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"delta"' in line:
                        last = time.perf_counter()
                        if not seen:
                            first = last
                        seen += 1
            if seen != events:
                raise RuntimeError(f"{url}: {seen} token events relayed, expected {events}")
            ttfts.append(first - t0)
            itls.append((last - first) / (seen - 1) if seen > 1 else 0.0)

        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up: connections and caches
        ttfts.clear()
        itls.clear()

        async def client(n: int) -> None:
            for _ in range(n):
                await one()
                if progress is not None:
                    progress.update(True)

        shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
        cpu0 = process_cpu_seconds(target.pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(n) for n in shares if n))
        elapsed = time.perf_counter() - t0
        cpu1 = process_cpu_seconds(target.pid)
    cpu = (cpu1 - cpu0) / (requests * events) if cpu0 is not None and cpu1 is not None else None
    return Sample(cpu, statistics.median(ttfts), statistics.median(itls), requests / elapsed)


PEER = "sglang-router cache_aware"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--events", type=positive_int, default=64, help="token events in each streamed answer"
    )
    parser.add_argument(
        "--gap-ms",
        type=non_negative_float,
        default=5.0,
        help="the upstream's time between two events (ms; paced on a schedule, so under 1 ms, the "
        "event loop's timer step, it is the mean spacing)",
    )
    parser.add_argument("--requests", type=positive_int, default=320, help="timed answers per measurement")
    parser.add_argument("--concurrency", type=positive_int, default=32, help="answers streaming at once")
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved repetitions of every path"
    )
    parser.add_argument(
        "--no-sglang", action="store_true", help="leave sglang-router out even when installed"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve_upstream(args.port, args.events, args.gap_ms)
        return
    if args.requests < args.concurrency:
        parser.error(f"--requests must be at least --concurrency ({args.concurrency}), got {args.requests}")
    installed = importlib.util.find_spec("sglang_router") is not None
    has_peer = installed and not args.no_sglang

    print(f"streaming relay on loopback; {machine()}")
    print(
        f"{args.requests} streamed answers of {args.events} events {args.gap_ms:g} ms apart per measurement, "
        f"{args.concurrency} at a time; {args.rounds} round(s): median [min, max] over rounds"
    )
    if not installed:
        print("sglang-router is not installed (pip install -e '.[bench]'): no peer row")
    print()
    samples: dict[str, list[Sample]] = {}
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(_upstream(args.events, args.gap_ms))
        rr = stack.enter_context(_kvmesh(upstream, "--router-mode", "round-robin"))
        kv = stack.enter_context(_kvmesh(upstream, "--no-router-kv-events"))
        kv_send = stack.enter_context(
            _kvmesh(upstream, "--no-router-kv-events", env={"KVMESH_DIRECT_RELAY": "0"})
        )
        paths = [
            ("direct", upstream, BODY_USAGE),
            ("kvmesh round-robin", rr, BODY_USAGE),
            ("kvmesh kv", kv, BODY_USAGE),
            ("kvmesh kv, through send", kv_send, BODY_USAGE),
            ("kvmesh kv, no usage asked", kv, BODY_PLAIN),
        ]
        if has_peer:
            paths.append((PEER, stack.enter_context(_sglang_router(upstream)), BODY_USAGE))
        total = args.rounds * len(paths) * args.requests
        progress = Progress(total, "relay", enabled=None if not args.no_progress else False)
        for _ in range(args.rounds):
            for name, target, body in paths:
                sample = asyncio.run(
                    measure(target, body, args.requests, args.concurrency, args.events, progress)
                )
                samples.setdefault(name, []).append(sample)
        if progress.enabled:
            print(file=sys.stderr)

    rows = []
    for name, runs in samples.items():
        cpu = [s.cpu_per_event * 1e6 for s in runs if s.cpu_per_event is not None]
        peer = samples.get(PEER)
        if peer is not None and name != PEER and len(cpu) == len(runs):
            ratios = [s.cpu_per_event / p.cpu_per_event for s, p in zip(runs, peer, strict=True)  # type: ignore[operator]
                      if p.cpu_per_event]  # fmt: skip
            vs = spread(ratios, ".2f") if ratios else "n/a"
        else:
            vs = "(peer)" if name == PEER else "n/a"
        rows.append([
            name,
            spread(cpu, ".1f") if cpu else "n/a",
            vs,
            spread([s.ttft * 1000 for s in runs], ".2f"),
            spread([s.itl * 1000 for s in runs], ".2f"),
            spread([s.rps for s in runs], ".1f"),
        ])  # fmt: skip
    print(
        table(
            ["path", "CPU us/event", "CPU vs sglang-router (x)", "TTFT p50 ms", "ITL p50 ms", "answers/s"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
