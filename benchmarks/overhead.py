"""Routing overhead on loopback: what the router adds on top of going straight to the engine.

One run measures, against a trivial upstream (a raw ASGI app answering a small chat completion):

* direct:                  client -> upstream
* router, round-robin:     client -> ``kvmesh router`` -> upstream  (the proxy path alone)
* router, kv:              the same with tokenize + hash + KV routing (approximate index, no events)
* embedded pass-through:   client -> upstream wrapped in KvMeshMiddleware that routes to itself,
                           compared with the same upstream without the middleware

at concurrency 1 (latency) and 32 (latency and requests per second). Each server is its own
process (uvicorn, as deployed); the client is this process (aiohttp, keep-alive). Added latency is
the router's median / p99 minus the direct path's, measured in the same run.

    .venv/bin/python benchmarks/overhead.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, percentile, table

BODY = b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"Say hello to the benchmark, briefly please."}]}'
ANSWER = (
    b'{"id":"cmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,'
    b'"completion_tokens":1,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":0}}}'
)
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The trivial engine: read the body, answer a fixed small completion."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


def _serve(kind: str, port: int) -> None:
    import logging

    import uvicorn

    app: Any = upstream_app
    if kind == "embedded":
        from kvmesh.router import KvMeshMiddleware
        from kvmesh.router.config import RouterConfig
        from kvmesh.router.settings import MeshSettings

        url = f"http://127.0.0.1:{port}"
        settings = MeshSettings(self_url=url, router=RouterConfig(use_kv_events=False))
        app = KvMeshMiddleware(upstream_app, settings=settings)
    logging.getLogger("kvmesh").setLevel(logging.ERROR)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _process(args: list[str], port: int) -> Iterator[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
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
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


def _server(kind: str) -> contextlib.AbstractContextManager[str]:
    port = _free_port()
    return _process([sys.executable, __file__, "--serve", kind, "--port", str(port)], port)


def _router(upstream: str, mode: str) -> contextlib.AbstractContextManager[str]:
    port = _free_port()
    kvmesh = [sys.executable, "-m", "kvmesh", "router", "--workers", upstream, "--port", str(port)]
    extra = ["--router-mode", mode, "--log-level", "error"]
    if mode == "kv":
        extra.append("--no-router-kv-events")
    return _process([*kvmesh, *extra], port)


async def _measure(url: str, n: int, concurrency: int) -> tuple[list[float], float]:
    import aiohttp

    latencies: list[float] = []
    target = url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one() -> None:
            t = time.perf_counter()
            async with http.post(target, data=BODY, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}")
            latencies.append(time.perf_counter() - t)

        for _ in range(min(200, n)):  # warm-up: connections, caches, JIT-less but branchy code
            await one()
        latencies.clear()
        per_worker = n // concurrency

        async def worker() -> None:
            for _ in range(per_worker):
                await one()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return latencies, len(latencies) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per configuration")
    parser.add_argument("--serve", choices=("upstream", "embedded"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve, args.port)
        return

    print(f"routing overhead on loopback; {machine()}")
    print(f"{args.requests} small non-streaming chat completions per row, after 200 warm-up requests\n")
    results: dict[tuple[str, int], tuple[list[float], float]] = {}
    with (
        _server("upstream") as upstream,
        _router(upstream, "round-robin") as rr,
        _router(upstream, "kv") as kv,
    ):
        for concurrency in (1, 32):
            for name, url in (("direct", upstream), ("router round-robin", rr), ("router kv", kv)):
                results[(name, concurrency)] = asyncio.run(_measure(url, args.requests, concurrency))
    with _server("upstream") as plain, _server("embedded") as embedded:
        for concurrency in (1, 32):
            for name, url in (("engine alone", plain), ("engine + middleware (local)", embedded)):
                results[(name, concurrency)] = asyncio.run(_measure(url, args.requests, concurrency))

    rows = []
    baseline = {
        "router round-robin": "direct",
        "router kv": "direct",
        "engine + middleware (local)": "engine alone",
    }
    for (name, concurrency), (lat, rps) in results.items():
        med = statistics.median(lat) * 1000
        p99 = percentile(lat, 99) * 1000
        base = baseline.get(name)
        if base is not None:
            base_lat = results[(base, concurrency)][0]
            added_med = f"{med - statistics.median(base_lat) * 1000:+.3f}"
            added_p99 = f"{p99 - percentile(base_lat, 99) * 1000:+.3f}"
            ratio = f"{rps / results[(base, concurrency)][1]:.2f}"
        else:
            added_med = added_p99 = ratio = "(baseline)"
        rows.append(
            [name, str(concurrency), f"{med:.3f}", f"{p99:.3f}", added_med, added_p99, f"{rps:,.0f}", ratio]
        )
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
            ],
            rows,
        )
    )
    goal = statistics.median(results[("router round-robin", 1)][0]) - statistics.median(
        results[("direct", 1)][0]
    )
    goal_kv = statistics.median(results[("router kv", 1)][0]) - statistics.median(results[("direct", 1)][0])
    print(
        f"\ngoal: median added latency <= 0.5 ms at concurrency 1 -> round-robin {goal * 1000:.3f} ms, "
        f"kv {goal_kv * 1000:.3f} ms"
    )


if __name__ == "__main__":
    main()
