"""How many simulated requests per second one mock engine process serves (step-loop overhead).

    .venv/bin/python benchmarks/mock_engine.py [--speedup 10] [--concurrency 16,64] [--osl 32]

Three rows per concurrency, same workload (chat requests of about 1000 prompt tokens, three
quarters of them a system prompt shared within 8 groups, ``--osl`` output tokens, a closed loop
of ``concurrency`` clients):

* ``model (virtual time)`` - the same scheduler and block pool stepped in simulated time with no
  sleeping and no I/O: the throughput the fitted step model allows. This is the baseline.
* ``engine (in-process)`` - the real asyncio step loop, requests submitted directly.
* ``HTTP (kvmesh mock)`` - a separate ``kvmesh mock`` process publishing KV events, driven over
  loopback with streaming chat completions by an aiohttp client in this process.

``ratio`` is measured req/s over the model's; below 1 the Python step loop (or, for HTTP, the
server and the client sharing this machine's cores) is the bottleneck. ``step stretch`` is the
wall time the engine's steps really took over the time the model asked for (1.00 = faithful).
``mock CPU`` is the engine process's CPU time per request (for HTTP: parsing, tokenizing,
scheduling, streaming every token as its own SSE event, publishing KV events).
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
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, table

from kvmesh.bench.fleet import spawn_child, stop_processes
from kvmesh.commands.argtypes import non_negative_int, positive_int, positive_ints
from kvmesh.errors import ConfigError
from kvmesh.mock.block_pool import BlockPool
from kvmesh.mock.config import MockConfig
from kvmesh.mock.engine import GenerationParams, MockEngine
from kvmesh.mock.request import EngineRequest
from kvmesh.mock.sampler import OutputSampler, sampler_key
from kvmesh.mock.scheduler import Scheduler
from kvmesh.mock.timing import step_seconds
from kvmesh.router.request.tokenizer import BuiltinTokenizer

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
]


def workload(n: int, groups: int = 8) -> list[list[dict[str, str]]]:
    """Chat conversations: a ~750-token system prompt per group, a ~250-token unique question."""
    systems = [" ".join(f"{WORDS[(g * 7 + i) % len(WORDS)]}{g}" for i in range(250)) for g in range(groups)]
    out = []
    for i in range(n):
        question = " ".join(f"{WORDS[(i * 13 + j) % len(WORDS)]}{i}" for j in range(80))
        out.append(
            [{"role": "system", "content": systems[i % groups]}, {"role": "user", "content": question}]
        )
    return out


def simulate(cfg: MockConfig, prompts: list[list[int]], osl: int, concurrency: int) -> tuple[float, float]:
    """(requests per second, median TTFT ms) of the step model in virtual time, closed loop."""
    pool = BlockPool(cfg.num_blocks, cfg.block_size)
    sched = Scheduler(pool, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens)
    now = 0.0
    issued = done = 0
    arrivals: dict[str, float] = {}
    ttfts: list[float] = []
    while done < len(prompts):
        while issued < len(prompts) and issued - done < concurrency:
            prompt = prompts[issued]
            req = EngineRequest(
                request_id=str(issued),
                prompt_len=len(prompt),
                token_ids=list(prompt),
                max_tokens=osl,
                sampler=OutputSampler(sampler_key(0, prompt), natural_stop=False),
                salt=1,
                block_size=cfg.block_size,
                arrival=now,
            )
            sched.add_request(req)
            arrivals[req.request_id] = now
            issued += 1
        out = sched.schedule()
        pool.take_events()
        now += step_seconds(out.num_prefill_tokens, out.num_emitting, pool.usage, cfg.speedup)
        result = sched.update(out)
        for req, _ in result.tokens:
            if req.num_output_tokens == 1:
                ttfts.append((now - arrivals[req.request_id]) * 1e3)
        done += len(result.finished)
    return len(prompts) / now, statistics.median(ttfts)


async def run_engine(
    cfg: MockConfig, prompts: list[list[int]], osl: int, concurrency: int
) -> dict[str, float]:
    engine = MockEngine(cfg)
    await engine.start()
    queue = list(reversed(prompts))
    ttfts: list[float] = []

    async def client() -> None:
        while queue:
            prompt = queue.pop()
            t0 = time.perf_counter()
            stream = engine.submit(GenerationParams(prompt_token_ids=prompt, max_tokens=osl))
            first = True
            async for _ in stream.deltas():
                if first:
                    ttfts.append((time.perf_counter() - t0) * 1e3)
                    first = False

    cpu0, t0, steps0 = time.process_time(), time.perf_counter(), engine.steps
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = engine.steps - steps0
    await engine.stop()
    return {
        "rps": len(prompts) / wall,
        "cpu_ms": cpu / len(prompts) * 1e3,
        "ttft": statistics.median(ttfts),
        "step_cpu_us": cpu / steps * 1e6,
        "steps_per_s": steps / wall,
        "stretch": engine.busy_seconds / engine.modelled_seconds,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def mock_process(cfg: MockConfig):  # type: ignore[no-untyped-def]
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvmesh",
        "mock",
        "--port",
        str(port),
        "--speedup",
        str(cfg.speedup),
        "--block-size",
        str(cfg.block_size),
        "--num-blocks",
        str(cfg.num_blocks),
        "--max-num-seqs",
        str(cfg.max_num_seqs),
        "--max-num-batched-tokens",
        str(cfg.max_num_batched_tokens),
        # port 0: the engine's ZMQ sockets pick free ports themselves (no race with the HTTP port)
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-replay-endpoint",
        "tcp://127.0.0.1:0",
    ]
    proc = spawn_child(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvmesh mock did not start") from None
                time.sleep(0.05)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        stop_processes([proc], 5)


async def run_http(
    base_url: str, pid: int, conversations: list[list[dict[str, str]]], osl: int, concurrency: int
) -> dict[str, float]:
    queue = list(reversed(conversations))
    ttfts: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url, connector=connector) as session:

        async def client() -> None:
            while queue:
                body = {"model": "kvmesh-mock", "messages": queue.pop(), "max_tokens": osl, "stream": True}
                t0 = time.perf_counter()
                first = True
                async with session.post("/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        if first and line.startswith(b'data: {"id"') and b'"content":""' not in line:
                            ttfts.append((time.perf_counter() - t0) * 1e3)
                            first = False

        async def step_seconds() -> tuple[float, float]:
            async with session.get("/metrics") as r:
                text = await r.text()
            values = {
                line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("kvmesh_mock_") and "_step_seconds" in line
            }
            return values["kvmesh_mock_busy_step_seconds"], values["kvmesh_mock_modelled_step_seconds"]

        # one request first, so connection set-up and imports stay out of the numbers
        async with session.post("/v1/completions", json={"prompt": "warm", "max_tokens": 1}) as r:
            await r.read()
        busy0, modelled0 = await step_seconds()
        mock0, cpu0, t0 = _proc_cpu_seconds(pid), time.process_time(), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        mock_cpu, client_cpu = _proc_cpu_seconds(pid) - mock0, time.process_time() - cpu0
        busy, modelled = await step_seconds()
    n = len(conversations)
    return {
        "rps": n / wall,
        "cpu_ms": mock_cpu / n * 1e3,
        "client_cpu_ms": client_cpu / n * 1e3,
        "ttft": statistics.median(ttfts),
        "stretch": (busy - busy0) / (modelled - modelled0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument(
        "--concurrency", type=positive_ints, default="16,64", help="comma-separated client counts"
    )
    parser.add_argument("--osl", type=positive_int, default=32, help="output tokens per request")
    parser.add_argument(
        "--requests",
        type=non_negative_int,
        default=0,
        help="requests per run [0: 8 x concurrency, at least 200]",
    )
    parser.add_argument("--skip-http", action="store_true", help="only the in-process rows")
    args = parser.parse_args()

    try:
        cfg = MockConfig(speedup=args.speedup).validate()
    except ConfigError as exc:  # it names the flag (--speedup)
        parser.error(str(exc))
    tok = BuiltinTokenizer()
    print(f"machine: {machine()}")
    print(
        f"workload: chat, 8 shared system prompts, OSL {args.osl}, --speedup {args.speedup:g}, "
        f"block size {cfg.block_size}, {cfg.num_blocks} blocks, max_num_seqs {cfg.max_num_seqs}"
    )
    headers = [
        "mode",
        "clients",
        "requests",
        "req/s",
        "ratio",
        "p50 TTFT ms",
        "step stretch",
        "mock CPU ms/req",
        "notes",
    ]
    rows = []
    for conc in args.concurrency:
        n = args.requests or max(200, 8 * conc)
        conversations = workload(n)
        prompts = [tok.apply_chat_template(c) for c in conversations]
        isl = statistics.mean(len(p) for p in prompts)
        ideal_rps, ideal_ttft = simulate(cfg, prompts, args.osl, conc)
        rows.append(
            [
                "model (virtual time)",
                str(conc),
                str(n),
                f"{ideal_rps:.0f}",
                "1.00",
                f"{ideal_ttft:.1f}",
                "1.00",
                "-",
                f"mean ISL {isl:.0f}",
            ]
        )
        eng = asyncio.run(run_engine(cfg, prompts, args.osl, conc))
        rows.append(
            [
                "engine (in-process)",
                str(conc),
                str(n),
                f"{eng['rps']:.0f}",
                f"{eng['rps'] / ideal_rps:.2f}",
                f"{eng['ttft']:.1f}",
                f"{eng['stretch']:.2f}",
                f"{eng['cpu_ms']:.2f}",
                f"{eng['steps_per_s']:.0f} steps/s, {eng['step_cpu_us']:.0f} us CPU/step",
            ]
        )
        if not args.skip_http:
            with mock_process(cfg) as (proc, url):
                http = asyncio.run(run_http(url, proc.pid, conversations, args.osl, conc))
            rows.append(
                [
                    "HTTP (kvmesh mock)",
                    str(conc),
                    str(n),
                    f"{http['rps']:.0f}",
                    f"{http['rps'] / ideal_rps:.2f}",
                    f"{http['ttft']:.1f}",
                    f"{http['stretch']:.2f}",
                    f"{http['cpu_ms']:.2f}",
                    f"client CPU {http['client_cpu_ms']:.2f} ms/req",
                ]
            )
    print(table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
