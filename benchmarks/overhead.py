"""Routing overhead on loopback: what the router adds on top of going straight to the engine.

One run measures, against a trivial upstream (a raw ASGI app answering a small chat completion):

* direct:                  client -> upstream
* router, round-robin:     client -> ``kvmesh router`` -> upstream  (the proxy path alone)
* router, kv:              the same with tokenize + hash + KV routing (approximate index, no events)
* embedded pass-through:   client -> upstream wrapped in KvMeshMiddleware that routes to itself,
                           compared with the same upstream without the middleware

at concurrency 1 (latency) and 32 (latency and requests per second). Each server is its own
process (uvicorn, as deployed); the client is this process (aiohttp, keep-alive). Added latency is
the router's median / p99 minus the direct path's, measured in the same round; ``--rounds``
repeats every measurement, interleaved, and the table shows the median over rounds with the
range in brackets (the machine may be shared: a single round is noisy). "server CPU" is the CPU
time (user + system, from /proc) the process the client talks to spent per request: the most
noise-resistant measure of the router's own cost.

    .venv/bin/python benchmarks/overhead.py [--requests 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, percentile, spread, table

from kvmesh.bench.fleet import child_env, process_cpu_seconds, spawn_child, stop_processes
from kvmesh.commands.argtypes import positive_int

BODY = b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"Say hello to the benchmark, briefly please."}]}'
ANSWER = (
    b'{"id":"cmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,'
    b'"completion_tokens":1,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":0}}}'
)
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def request_read(scope: dict[str, Any], receive: Any, send: Any) -> bool:
    """For a raw ASGI upstream: serve the lifespan protocol to its end (False), or read an HTTP
    request's whole body (True: answer it)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return False
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    return True


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The trivial engine: read the body, answer a fixed small completion."""
    if not await request_read(scope, receive, send):
        return
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


def _serve(kind: str, port: int) -> None:
    import logging

    import uvicorn

    app: Any = upstream_app
    if kind == "embedded":
        from kvmesh.router import KvMeshMiddleware
        from kvmesh.router.core.config import RouterConfig
        from kvmesh.router.mesh.settings import MeshSettings

        url = f"http://127.0.0.1:{port}"
        settings = MeshSettings(self_url=url, router=RouterConfig(use_kv_events=False))
        app = KvMeshMiddleware(upstream_app, settings=settings)
    logging.getLogger("kvmesh").setLevel(logging.ERROR)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Endpoint:
    url: str
    pid: int


@contextlib.contextmanager
def serve_process(args: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[Endpoint]:
    """Start ``args`` (a server on 127.0.0.1:``port``, with ``env`` added to its environment);
    yield once it accepts connections."""
    env = child_env({"PYTHONUNBUFFERED": "1", **(env or {})})
    proc = spawn_child(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{args} exited: {proc.stderr.read().decode() if proc.stderr else ''}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args} did not start")
            time.sleep(0.05)
        yield Endpoint(f"http://127.0.0.1:{port}", proc.pid)
    finally:
        stop_processes([proc], 5)


def _server(kind: str) -> contextlib.AbstractContextManager[Endpoint]:
    port = free_port()
    return serve_process([sys.executable, __file__, "--serve", kind, "--port", str(port)], port)


def _router(upstream: Endpoint, mode: str) -> contextlib.AbstractContextManager[Endpoint]:
    port = free_port()
    kvmesh = [sys.executable, "-m", "kvmesh", "router", "--workers", upstream.url, "--port", str(port)]
    extra = ["--router-mode", mode, "--log-level", "error"]
    if mode == "kv":
        extra.append("--no-router-kv-events")
    return serve_process([*kvmesh, *extra], port)


@dataclass(frozen=True)
class Sample:
    """One measurement of one path at one concurrency."""

    median: float
    p99: float
    rps: float
    cpu_per_request: float | None


async def _measure(target: Endpoint, n: int, concurrency: int) -> Sample:
    import aiohttp

    latencies: list[float] = []
    url = target.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one() -> None:
            t = time.perf_counter()
            async with http.post(url, data=BODY, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}")
            latencies.append(time.perf_counter() - t)

        for _ in range(min(200, n)):  # warm-up: connections, caches, JIT-less but branchy code
            await one()
        latencies.clear()
        # every request asked for is timed: the first n % concurrency clients send one more
        shares = [n // concurrency + (i < n % concurrency) for i in range(concurrency)]

        async def worker(share: int) -> None:
            for _ in range(share):
                await one()

        cpu0 = process_cpu_seconds(target.pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(share) for share in shares))
        elapsed = time.perf_counter() - t0
        cpu1 = process_cpu_seconds(target.pid)
    cpu = (cpu1 - cpu0) / len(latencies) if cpu0 is not None and cpu1 is not None else None
    return Sample(statistics.median(latencies), percentile(latencies, 99), len(latencies) / elapsed, cpu)


def _http_parser() -> str:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


BASELINE = {
    "router round-robin": "direct",
    "router kv": "direct",
    "engine + middleware (local)": "engine alone",
}


CONCURRENCIES = (1, 32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per measurement")
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved repetitions of every measurement"
    )
    parser.add_argument("--serve", choices=("upstream", "embedded"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requests < max(CONCURRENCIES):  # each client sends its share: at least one request
        parser.error(
            f"--requests must be at least {max(CONCURRENCIES)} (one per client at concurrency "
            f"{max(CONCURRENCIES)}), got {args.requests}"
        )
    if args.serve:
        _serve(args.serve, args.port)
        return

    print(f"routing overhead on loopback; {machine()}; uvicorn HTTP parser: {_http_parser()}")
    print(
        f"{args.requests} small non-streaming chat completions per measurement, after 200 warm-up "
        f"requests; {args.rounds} round(s): median [min, max] over rounds\n"
    )
    samples: dict[tuple[str, int], list[Sample]] = {}

    def run(paths: list[tuple[str, Endpoint]]) -> None:
        for _ in range(args.rounds):
            for concurrency in CONCURRENCIES:
                for name, target in paths:
                    sample = asyncio.run(_measure(target, args.requests, concurrency))
                    samples.setdefault((name, concurrency), []).append(sample)

    with (
        _server("upstream") as upstream,
        _router(upstream, "round-robin") as rr,
        _router(upstream, "kv") as kv,
    ):
        run([("direct", upstream), ("router round-robin", rr), ("router kv", kv)])
    with _server("upstream") as plain, _server("embedded") as embedded:
        run([("engine alone", plain), ("engine + middleware (local)", embedded)])

    rows = []
    for (name, concurrency), runs in samples.items():
        base = BASELINE.get(name)
        cpu = [s.cpu_per_request * 1e6 for s in runs if s.cpu_per_request is not None]
        row = [
            name,
            str(concurrency),
            spread([s.median * 1000 for s in runs], ".3f"),
            spread([s.p99 * 1000 for s in runs], ".3f"),
        ]
        if base is not None:
            base_runs = samples[(base, concurrency)]
            pairs = list(zip(runs, base_runs, strict=True))
            row += [
                spread([(s.median - b.median) * 1000 for s, b in pairs], "+.3f"),
                spread([(s.p99 - b.p99) * 1000 for s, b in pairs], "+.3f"),
            ]
        else:
            row += ["(baseline)", "(baseline)"]
        row.append(spread([s.rps for s in runs], ",.0f"))
        if base is not None:
            row.append(spread([s.rps / b.rps for s, b in pairs], ".2f"))
        else:
            row.append("(baseline)")
        row.append(spread(cpu, ".0f") if cpu else "n/a")
        rows.append(row)
    print(
        table(
            [
                "path",
                "conc.",
                "median ms",
                "p99 ms",
                "added median ms",
                "added p99 ms",
                "req/s",
                "req/s vs baseline",
                "server CPU us/req",
            ],
            rows,
        )
    )

    def added(name: str) -> float:
        pairs = zip(samples[(name, 1)], samples[("direct", 1)], strict=True)
        return statistics.median([(s.median - b.median) * 1000 for s, b in pairs])

    print(
        f"\ngoal: median added latency <= 0.5 ms at concurrency 1 -> "
        f"round-robin {added('router round-robin'):.3f} ms, kv {added('router kv'):.3f} ms"
    )


if __name__ == "__main__":
    main()
