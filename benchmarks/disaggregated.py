"""Aggregated vs disaggregated serving on the same simulated hardware and the same traffic.

Two fleets of four ``kvmesh mock`` processes behind one ``kvmesh router`` process each:

* aggregated:     4 engines, each prefills and decodes;
* disaggregated:  2 prefill engines (``--role prefill``) + 2 decode engines (``--role decode``);
                  the router runs each request in two stages and the decode engine pulls the
                  prompt's KV with a simulated transfer (``--transfer-ms-per-block``).

The same seeded multi-turn agentic workload runs against each, at ``--speedup`` (engine time
dominates). The table shows TTFT and ITL: disaggregation trades the extra hop and the transfer for
decode steps that no long prefill interrupts, so it shows up in ITL first, and in TTFT when
prefills are long and the decode pool is busy.

    .venv/bin/python benchmarks/disaggregated.py [--sessions 16] [--turns 4] [--concurrency 12]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from kvmesh.bench import report
from kvmesh.bench.fleet import child_env, spawn_child, stop_processes
from kvmesh.bench.runner import LoadSpec, Progress, run_workload
from kvmesh.bench.workloads import WorkloadSpec, build
from kvmesh.commands.argtypes import non_negative_float, output_path, positive_float, positive_int


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def _wait_up(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        for url in urls:
            while True:
                for p in procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"a process exited during start-up: {p.args}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(url + "/health") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not come up")
                await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def fleet(roles: list[str], mock_args: list[str]) -> AsyncIterator[str]:
    """Mock engines with these roles and a standalone router in front; yields the router's URL."""
    n = len(roles)
    ports = _free_ports(3 * n + 1)
    urls = [f"http://127.0.0.1:{p}" for p in ports[:n]]
    procs: list[subprocess.Popen[bytes]] = []
    py = [sys.executable, "-m", "kvmesh"]
    try:
        for i, role in enumerate(roles):
            cmd = [
                *py, "mock", "--port", str(ports[i]), "--log-level", "error", "--role", role,
                "--kv-events-endpoint", f"tcp://127.0.0.1:{ports[n + i]}",
                "--kv-replay-endpoint", f"tcp://127.0.0.1:{ports[2 * n + i]}", *mock_args,
            ]  # fmt: skip
            procs.append(
                spawn_child(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        await _wait_up(urls, procs)
        decode = [u for u, r in zip(urls, roles, strict=True) if r != "prefill"]
        prefill = [u for u, r in zip(urls, roles, strict=True) if r == "prefill"]
        router_url = f"http://127.0.0.1:{ports[-1]}"
        cmd = [
            *py,
            "router",
            "--port",
            str(ports[-1]),
            "--workers",
            ",".join(decode),
            "--health-interval",
            "0.5",
        ]
        if prefill:
            cmd += ["--prefill-workers", ",".join(prefill)]
        env = child_env({"KVMESH_TOKENIZER": "builtin"})
        procs.append(spawn_child(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        await _wait_up([router_url], procs)
        await asyncio.sleep(1.0)  # every worker discovered and its event stream followed
        yield router_url
    finally:
        stop_processes(procs, 5)


async def main(args: argparse.Namespace) -> int:
    spec = WorkloadSpec(
        name="agentic",
        sessions=args.sessions,
        turns=args.turns,
        groups=4,
        prefix_words=args.prefix_words,
        question_words=200,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    mock_args = [
        "--block-size", "16", "--num-blocks", str(args.num_blocks), "--speedup", str(args.speedup),
        "--max-num-batched-tokens", "8192", "--transfer-ms-per-block", str(args.transfer_ms_per_block),
    ]  # fmt: skip
    runs = []
    for name, roles in (
        ("aggregated 4", ["aggregated"] * 4),
        ("2P + 2D", ["prefill", "prefill", "decode", "decode"]),
    ):
        print(f"disaggregated benchmark: {name}: starting ...", file=sys.stderr, flush=True)
        async with fleet(roles, mock_args) as url:
            sessions = build(spec)
            total = sum(s.total_requests for s in sessions)
            progress = Progress(total, f"{name:>12}")
            load = LoadSpec(urls=(url,), concurrency=args.concurrency, seed=args.seed)
            runs.append(await run_workload(name, sessions, load, progress=progress))
            progress.close()
    summaries = [report.summarize(r) for r in runs]
    print(
        f"\nagentic: {args.sessions} conversations x {args.turns} turns, {args.concurrency} in flight, "
        f"4 simulated engines at --speedup {args.speedup}, transfer {args.transfer_ms_per_block} ms/block"
    )
    print(report.format_table(summaries))
    agg, dis = summaries
    for label, key in (("TTFT p50", ("ttft_s", "p50")), ("ITL p50", ("itl_s", "p50"))):
        a, d = agg[key[0]][key[1]], dis[key[0]][key[1]]
        if a and d:
            print(f"{label}: disaggregated / aggregated = {d / a:.2f}")
    if args.plot:  # ('' is none, as in routing_quality.py)
        print(f"plot written to {report.write_plot(runs, summaries, Path(args.plot))}")
    return 0 if all(s["errors"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=positive_int, default=16, help="conversations [%(default)s]")
    ap.add_argument("--turns", type=positive_int, default=4, help="turns per conversation [%(default)s]")
    ap.add_argument("--concurrency", type=positive_int, default=12, help="requests in flight [%(default)s]")
    ap.add_argument(
        "--prefix-words", type=positive_int, default=1500, help="shared system prompt, words [%(default)s]"
    )
    ap.add_argument(
        "--max-tokens", type=positive_int, default=96, help="output tokens per turn [%(default)s]"
    )
    ap.add_argument(
        "--num-blocks", type=positive_int, default=4096, help="KV blocks per engine [%(default)s]"
    )
    ap.add_argument("--speedup", type=positive_float, default=1.0, help="engine time divisor [%(default)s]")
    ap.add_argument("--transfer-ms-per-block", type=non_negative_float, default=0.1, help="[%(default)s]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--plot",
        type=output_path,
        default=None,
        help="write a PNG of the comparison here ('' or unset: none)",
    )
    raise SystemExit(asyncio.run(main(ap.parse_args())))
