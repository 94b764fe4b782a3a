"""``kvmesh demo``: a simulated 4-engine mesh, the agentic workload with KV routing (kvmesh's default
latency cost), then with Dynamo's cost, then round-robin.

Each simulated engine embeds ``KvMeshMiddleware`` exactly as a real engine would
(``vllm serve --middleware kvmesh.adapters.vllm.KvMeshMiddleware``): it knows its own URL and its three
peers, follows every peer's KV events, and serves or forwards each request it receives. The
client spreads conversations over the four engines' own ports, as a plain load balancer would.
Both runs start from a fresh fleet (empty caches) and send exactly the same conversations.

Each engine is its own ``kvmesh mock --middleware kvmesh.router.KvMeshMiddleware`` process,
configured only through ``KVMESH_*`` variables, the way ``vllm serve`` embeds it (``--in-process``
runs them in this process instead, as the tests do). The engines' step times follow the reference
mocker's fitted model, so time to first token grows with the uncached prompt length the way it
does on a GPU, and cache hits show up as shorter TTFTs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.commands.argtypes import output_path, positive_float, positive_int
from kvmesh.commands.exits import refuse

MAX_ENGINES = 64
"""Engines a demo fleet may have. Each is a process of its own (about 50 MB) with three ports, and
the demo runs three fleets in turn. Unbounded, ``--engines 1000000`` ended in "Too many open
files" while choosing ports, and a few thousand would have started as many processes."""


def engine_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_ENGINES:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_ENGINES} (each engine is a process of its own), got {value}"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines", type=engine_count, default=4, help=f"simulated engines in the mesh, 1-{MAX_ENGINES} [4]"
    )
    parser.add_argument("--sessions", type=positive_int, default=24, help="agent conversations per run [24]")
    parser.add_argument("--turns", type=positive_int, default=10, help="turns per conversation [10]")
    parser.add_argument("--concurrency", type=positive_int, default=16, help="conversations in flight [16]")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="output tokens per turn [32]")
    parser.add_argument(
        "--speedup", type=positive_float, default=1.0, help="simulated engine speed-up ratio [1]"
    )
    parser.add_argument(
        "--num-blocks", type=positive_int, default=2048, help="KV blocks per simulated engine [2048]"
    )
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block [16]")
    parser.add_argument(
        "--plot", type=output_path, default="kvmesh-demo.png", help="where to write the comparison plot"
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        type=output_path,
        default=None,
        help="also write every request as JSON here",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (both runs send the same prompts)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the engines in this process instead of one process each",
    )


@dataclass(frozen=True)
class MeshNode:
    url: str
    engine: Any  # kvmesh.mock.engine.MockEngine


def _free_socket() -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto says
    # TCP, and without it every small response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.asynccontextmanager
async def start_mesh(
    n: int,
    router: Any,
    mock: Any,
    *,
    health_interval: float = 0.25,
    startup_timeout: float = 20.0,
    mesh_secret: str | None = None,
    root_path: str = "",
    root_path_in_app: bool = False,
) -> AsyncIterator[list[MeshNode]]:
    """``n`` mock engines on loopback, each embedding KvMeshMiddleware configured with all ``n``
    and one mesh secret (a fresh random one unless given), so forwarded requests are proven.
    ``root_path``: served under it by uvicorn, which puts it before every path (SGLang's
    ``--fastapi-root-path``); with ``root_path_in_app``, set by the app on paths that may or may
    not carry it (FastAPI's ``root_path``, which ``vllm serve --root-path`` sets).

    ``router`` is a RouterConfig, ``mock`` a MockConfig (events endpoints are picked here). Yields
    once every engine's middleware sees every worker up.
    """
    import aiohttp
    import uvicorn
    from starlette.middleware import Middleware

    from kvmesh.mock.engine import MockEngine
    from kvmesh.mock.server import build_app
    from kvmesh.router.asgi.middleware import EVERY_PATH, KvMeshMiddleware
    from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec

    socks = [_free_socket() for _ in range(n)]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    specs = tuple(WorkerSpec(u, u) for u in urls)
    secret = mesh_secret or secrets.token_hex(16)
    servers: list[uvicorn.Server] = []
    tasks: list[asyncio.Task[None]] = []
    nodes: list[MeshNode] = []
    try:
        for i, sock in enumerate(socks):
            engine = MockEngine(
                mock.replace(
                    kv_events_endpoint="tcp://127.0.0.1:0", kv_replay_endpoint="tcp://127.0.0.1:0", seed=i
                )
            )
            settings = MeshSettings(
                workers=specs,
                router=router,
                self_url=urls[i],
                tokenizer="builtin",
                health_interval=health_interval,
                mesh_secret=secret,
            )
            # (the mock serves SGLang's /generate and vLLM's token API too: routed as theirs are)
            routing = Middleware(KvMeshMiddleware, settings=settings, generation_paths=EVERY_PATH)
            app = build_app(engine, middleware=[routing])
            if root_path_in_app:
                app = _under_root(app, root_path)
            server = uvicorn.Server(
                uvicorn.Config(
                    app,
                    log_level="warning",
                    access_log=False,
                    lifespan="on",
                    timeout_graceful_shutdown=1,
                    root_path="" if root_path_in_app else root_path,
                )
            )
            servers.append(server)
            tasks.append(asyncio.create_task(server.serve(sockets=[sock])))
            nodes.append(MeshNode(urls[i], engine))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + startup_timeout
        async with aiohttp.ClientSession() as http:
            for url in urls:
                while True:
                    if loop.time() > deadline:
                        raise TimeoutError(f"the simulated mesh did not come up within {startup_timeout}s")
                    for t in tasks:
                        if t.done():
                            t.result()
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        async with http.get(url + "/kvmesh/workers") as r:
                            doc = await r.json()
                        if sum(w["state"] == "up" for w in doc["workers"]) == n:
                            break
                    await asyncio.sleep(0.05)
        yield nodes
    finally:
        for server in servers:
            server.should_exit = True
        for t in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 5)
        for sock in socks:
            sock.close()


def _under_root(app: Any, root_path: str) -> Any:
    """``app`` with ``root_path`` set in each request's scope, as FastAPI sets its own."""

    async def under_root(scope: Any, receive: Any, send: Any) -> None:
        await app({**scope, "root_path": root_path}, receive, send)

    return under_root


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while choosing, so none is handed out twice)."""
    socks = [_free_socket() for _ in range(n)]
    ports = [int(s.getsockname()[1]) for s in socks]
    for sock in socks:
        sock.close()
    return ports


async def _wait_for_mesh(urls: list[str], check: Any, timeout: float) -> None:
    """Until every replica's /kvmesh/workers shows every worker up."""
    import aiohttp

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as http:
        for url in urls:
            while True:
                if loop.time() > deadline:
                    raise TimeoutError(f"the simulated mesh did not come up within {timeout}s")
                check()
                with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
                    async with http.get(url + "/kvmesh/workers") as r:
                        doc = await r.json()
                    if sum(w["state"] == "up" for w in doc["workers"]) == len(urls):
                        break
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def start_mesh_processes(
    n: int,
    router_mode: str,
    mock_args: list[str],
    *,
    startup_timeout: float = 30.0,
    extra_env: dict[str, str] | None = None,
) -> AsyncIterator[list[str]]:
    """``n`` ``kvmesh mock`` processes, each with ``--middleware kvmesh.router.KvMeshMiddleware``
    and configured only through KVMESH_* variables: exactly how ``vllm serve`` embeds it."""
    import subprocess

    from kvmesh.bench.fleet import child_env, spawn_child, stop_processes

    ports = _free_ports(3 * n)  # HTTP, events and replay for each engine
    urls = [f"http://127.0.0.1:{p}" for p in ports[:n]]
    secret = secrets.token_hex(16)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, url in enumerate(urls):
            env = child_env(
                {
                    "KVMESH_WORKERS": ",".join(urls),
                    "KVMESH_SELF_URL": url,
                    "KVMESH_TOKENIZER": "builtin",
                    "KVMESH_ROUTER_MODE": router_mode,
                    "KVMESH_HEALTH_INTERVAL": "0.25",
                    "KVMESH_MESH_SECRET": secret,
                    **(extra_env or {}),
                }
            )
            cmd = [
                sys.executable, "-m", "kvmesh", "mock", "--port", str(ports[i]), "--log-level", "error",
                "--kv-events-endpoint", f"tcp://127.0.0.1:{ports[n + i]}",
                "--kv-replay-endpoint", f"tcp://127.0.0.1:{ports[2 * n + i]}",
                "--middleware", "kvmesh.router.KvMeshMiddleware", *mock_args,
            ]  # fmt: skip
            procs.append(spawn_child(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

        def check() -> None:
            for proc in procs:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise RuntimeError(f"a simulated engine exited during start-up:\n{err}")

        await _wait_for_mesh(urls, check, startup_timeout)
        yield urls
    finally:
        stop_processes(procs, 5)


def _against(other_s: float, kv_s: float) -> str:
    """``other_s`` over ``kv_s`` as what a reader wants to know: how much faster or slower."""
    ratio = other_s / kv_s
    if ratio >= 1.0:
        return f"{ratio:.2f}x faster"
    return f"{1.0 / ratio:.2f}x slower"


def comparison_line(kv: dict[str, Any], other: dict[str, Any], label: str) -> str | None:
    """The demo's one-line verdict of KV routing against ``other``'s run (summaries of
    :func:`kvmesh.bench.report.summarize`), None when either has no TTFT."""
    ttft, theirs = kv["ttft_s"], other["ttft_s"]
    if not (ttft["p50"] and theirs["p50"] and ttft["p90"] and theirs["p90"]):
        return None
    return (
        f"KV routing (latency cost) vs {label}: TTFT p50 {_against(theirs['p50'], ttft['p50'])}, "
        f"p90 {_against(theirs['p90'], ttft['p90'])}, prefix hit ratio "
        f"{100 * (kv['prefix_hit_ratio'] or 0):.0f}% vs {100 * (other['prefix_hit_ratio'] or 0):.0f}%"
    )


async def _run_demo(args: argparse.Namespace) -> int:
    from kvmesh.bench import report
    from kvmesh.bench.runner import LoadSpec, Progress, RunResult, run_workload
    from kvmesh.bench.workloads import WorkloadSpec, build
    from kvmesh.errors import ConfigError
    from kvmesh.mock.config import MockConfig
    from kvmesh.router.core.config import RouterConfig

    try:  # (the engines check their flags too, but as processes of their own, after start-up began)
        mock = MockConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_batched_tokens=8192,
            speedup=args.speedup,
        ).validate()
    except ConfigError as e:
        return refuse("kvmesh demo", e)
    spec = WorkloadSpec(
        name="agentic",
        sessions=args.sessions,
        turns=args.turns,
        groups=4,
        prefix_words=400,
        question_words=200,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    mock_args = [
        "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks),
        "--speedup", str(args.speedup), "--max-num-batched-tokens", "8192",
    ]  # fmt: skip
    runs: list[RunResult] = []
    plans = (
        ("kv-routing", "kv", "latency"),
        ("dynamo-cost", "kv", "dynamo"),
        ("round-robin", "round-robin", None),
    )
    for name, mode, cost in plans:
        print(
            f"kvmesh demo: {name}: starting {args.engines} simulated engines ...", file=sys.stderr, flush=True
        )
        mesh: Any
        if args.in_process:
            config = RouterConfig(router_mode=mode, router_cost_model=cost or "latency")  # type: ignore[arg-type]
            mesh = start_mesh(args.engines, config, mock)
        else:
            env = {"KVMESH_ROUTER_COST_MODEL": cost} if cost else None
            mesh = start_mesh_processes(args.engines, mode, mock_args, extra_env=env)
        async with mesh as nodes:
            urls = tuple(n.url if isinstance(n, MeshNode) else n for n in nodes)
            sessions = build(spec)
            total = sum(s.total_requests for s in sessions)
            progress = Progress(total, f"{name:>11}", enabled=False if args.no_progress else None)
            load = LoadSpec(urls=urls, concurrency=args.concurrency, seed=args.seed)
            runs.append(await run_workload(name, sessions, load, progress=progress))
    summaries = [report.summarize(r) for r in runs]
    print()
    print(
        f"agentic workload: {args.sessions} conversations x {args.turns} turns, {args.concurrency} in flight, "
        f"{args.engines} simulated engines each embedding KvMeshMiddleware"
    )
    print(report.format_table(summaries))
    for summary in summaries:  # what failed, not only how many (as `kvmesh bench` says it)
        for kind, n in summary["error_kinds"].items():
            print(f"kvmesh demo: {summary['name']}: {n} request(s) failed: {kind}", file=sys.stderr)
    kv, dyn, rr = summaries
    for other, label in ((rr, "round-robin"), (dyn, "Dynamo's cost")):
        line = comparison_line(kv, other, label)
        if line:
            print(line)
    if args.json_path:
        import json

        Path(args.json_path).write_text(json.dumps(report.to_json(runs, summaries), indent=1))
        print(f"wrote {args.json_path}")
    if args.plot:
        try:
            path = report.write_plot(runs, summaries, args.plot)
        except ImportError as e:
            print(f"kvmesh demo: no plot: {e}", file=sys.stderr)
        else:
            print(f"plot written to {path.resolve()}")
    failed = sum(s["errors"] for s in summaries)
    return 0 if failed == 0 else 1


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("kvmesh").setLevel(logging.ERROR)  # peers coming up are not news in a demo
    return asyncio.run(_run_demo(args))
