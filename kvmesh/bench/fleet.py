"""Simulated fleets as real processes on loopback: ``kvmesh mock`` engines plus one front router.

The routing-quality suite starts a fresh fleet for every contender, so each one meets empty caches
and the same engines. Every process is a separate ``python -m ...`` child (the engines, a
``kvmesh router`` or any other router command), as a user would run them; their output goes to
log files, and the tail of a log is shown when a process dies during start-up.

This module does not import :mod:`kvmesh.mock` (the two are siblings); it drives the engines the
way a user does, through their command line and HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from kvmesh.bench.report import percentile
from kvmesh.router.mesh.metrics import OVERHEAD_PHASES

SOURCE_ROOT = str(Path(__file__).resolve().parents[2])
"""The directory this kvmesh is imported from (a checkout, or the site-packages it is installed in)."""


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a ``python -m kvmesh ...`` child process (plus ``extra``): it imports the
    kvmesh this process runs. ``-m`` puts the working directory first on ``sys.path``, so a second
    checkout's benchmark started from the first checkout's directory ran the first one's engines
    and routers, and an A/B of the two compared a tree with itself. (Python 3.10 does not know
    ``PYTHONSAFEPATH``: there, start a checkout's benchmarks from its own directory.)"""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "PYTHONPATH": SOURCE_ROOT + (os.pathsep + path if path else ""),
        **(extra or {}),
    }


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up once, before any fork: the child between fork and exec should
    only call it, not load a library. None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def spawn_child(argv: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **popen)`` for a process that must not outlive this one: on Linux
    the kernel sends it SIGTERM when this process dies, however it dies. A benchmark killed with
    SIGKILL, or with SIGTERM (which runs no ``finally``), otherwise leaves its engines and routers
    serving on loopback, holding ports and CPU that the next run then measures against.

    The signal follows the thread that starts the child: start children from a thread that lives as
    long as they do (every caller here starts them from its event loop's thread). Elsewhere than
    Linux the children are only stopped by their callers' ``finally``."""
    prctl = _prctl()
    if prctl is None:
        return subprocess.Popen(list(argv), **popen)
    parent = os.getpid()

    def die_with_parent() -> None:  # runs in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took hold
            os._exit(1)

    return subprocess.Popen(list(argv), preexec_fn=die_with_parent, **popen)


FrontCommand = Callable[[Sequence[str], int], list[str]]
"""(engine URLs, port) -> the argv of a router process that serves on 127.0.0.1:port."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open while choosing, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Fleet:
    """A running fleet: where to send traffic, and the engines behind it."""

    front_url: str
    engine_urls: list[str]
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What one engine's /metrics says after a run."""

    requests: int
    modelled_seconds: float
    busy_seconds: float
    ttft_seconds_sum: float = 0.0
    """The engine's own time to first token, summed over its requests (arrival to first token, as
    the engine measures it): beside the client's, it splits a request's TTFT into the engine's
    part, which is where it was placed, and the front's own time in the path."""
    ttft_count: int = 0
    queue_seconds_sum: float = 0.0
    """Of the engine's own time to first token, the part its requests waited before a step took
    them in (``vllm:request_queue_time_seconds``): behind the step in progress when they arrived,
    or for memory."""
    queue_count: int = 0


def kvmesh_router(*flags: str) -> FrontCommand:
    """A standalone ``kvmesh router`` in front of the engines, with these extra flags."""

    def argv(engines: Sequence[str], port: int) -> list[str]:
        return [
            sys.executable, "-m", "kvmesh", "router", "--port", str(port), "--log-level", "warning",
            "--workers", ",".join(engines), "--tokenizer", "builtin", "--health-interval", "0.25", *flags,
        ]  # fmt: skip

    return argv


def sglang_router(policy: str = "cache_aware", *flags: str) -> FrontCommand:
    """sglang-router (the ``sglang-router`` package) in front of the engines. Its Prometheus
    exporter gets a free loopback port of its own: at its default (29000) a second sglang-router on
    the machine, such as another benchmark's, fails to start."""

    def argv(engines: Sequence[str], port: int) -> list[str]:
        (metrics_port,) = free_ports(1)
        return [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *engines, "--policy", policy, "--log-level", "warn",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *flags,
        ]  # fmt: skip

    return argv


@contextlib.asynccontextmanager
async def start_fleet(
    n: int,
    engine_args: Sequence[str],
    front: FrontCommand | None,
    *,
    startup_timeout: float = 60.0,
    keep_logs: Path | None = None,
    per_engine_args: Sequence[Sequence[str]] = (),
    request_logs: bool = False,
) -> AsyncIterator[Fleet]:
    """``n`` ``kvmesh mock`` engines (KV events on) and a front router; yields when all serve.
    ``front`` None: the engines alone, nothing in front of them to take CPU from them
    (``front_url`` then names no server; :func:`add_front` can still add one).

    Engine ``i`` also gets ``per_engine_args[i % len(per_engine_args)]`` after ``engine_args``
    (the later of a flag given twice wins): a mixed fleet, such as engines of two speeds. With
    ``request_logs`` every engine writes ``--request-log`` into the fleet's log directory
    (:func:`engine_requests` reads them back)."""
    ports = free_ports(3 * n + 1)
    engine_urls = [f"http://127.0.0.1:{p}" for p in ports[:n]]
    front_url = f"http://127.0.0.1:{ports[-1]}"
    tmp = None if keep_logs is not None else tempfile.TemporaryDirectory(prefix="kvmesh-fleet-")
    logs = keep_logs if keep_logs is not None else Path(tmp.name)  # type: ignore[union-attr]
    logs.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(front_url, engine_urls, logs)
    try:
        for i in range(n):
            argv = [
                sys.executable, "-m", "kvmesh", "mock", "--port", str(ports[i]), "--log-level", "error",
                "--kv-events-endpoint", f"tcp://127.0.0.1:{ports[n + i]}",
                "--kv-replay-endpoint", f"tcp://127.0.0.1:{ports[2 * n + i]}", *engine_args,
            ]  # fmt: skip
            if per_engine_args:
                argv += per_engine_args[i % len(per_engine_args)]
            if request_logs:
                path = request_log_path(logs, i)
                path.unlink(missing_ok=True)  # the engine appends: a kept log dir holds an earlier fleet's
                argv += ["--request-log", str(path)]
            fleet.procs.append(_spawn(argv, logs / f"engine-{i}.log"))
        await _wait_until(fleet, [u + "/health" for u in engine_urls], startup_timeout)
        if front is not None:
            fleet.front_url = await _start_front(fleet, front, ports[-1], "front.log", startup_timeout)
        yield fleet
    finally:
        stop_processes(fleet.procs)
        if tmp is not None:
            tmp.cleanup()


async def add_front(fleet: Fleet, front: FrontCommand, *, startup_timeout: float = 60.0) -> str:
    """Another front router before a running fleet's engines, for fronts compared on the same
    engines in one run: started, waited for as :func:`start_fleet` waits for its own, and stopped
    with the fleet. Returns its URL."""
    (port,) = free_ports(1)
    return await _start_front(fleet, front, port, f"front-{len(fleet.procs)}.log", startup_timeout)


_PORT_TAKEN = b"address already in use"
"""In a front's log, lower-cased: uvicorn's words, and sglang-router's ('Address already...')."""
_FRONT_ATTEMPTS = 3


async def _start_front(fleet: Fleet, front: FrontCommand, port: int, log_name: str, timeout: float) -> str:
    """Start ``front`` on ``port`` and wait until it serves; its URL. A port is chosen free and
    bound by the front a moment later; meanwhile the machine may hand it out (as the source port
    of some connection): a front that dies saying its address is in use is started again on
    another port, up to three times. (A run of the suite died on it, in sglang-router.)"""
    attempt = 0
    while True:
        attempt += 1
        log = fleet.logs / log_name
        proc = _spawn(front(fleet.engine_urls, port), log)
        fleet.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        try:
            await _wait_front(replace(fleet, front_url=url), timeout)
            return url
        except RuntimeError:
            if (
                proc.poll() is None
                or attempt == _FRONT_ATTEMPTS
                or _PORT_TAKEN not in log.read_bytes().lower()
            ):
                raise
            fleet.procs.remove(proc)
            (port,) = free_ports(1)


def stop_processes(procs: Sequence[subprocess.Popen[Any]], timeout: float = 10.0) -> None:
    """Terminate ``procs``, the last started first (a front before the engines it forwards to),
    then wait for each, killing whichever has not exited within ``timeout`` seconds."""
    for proc in reversed(procs):
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = child_env({"PYTHONUNBUFFERED": "1"})
    with log.open("wb") as out:
        return spawn_child(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _check_alive(fleet: Fleet) -> None:
    for proc in fleet.procs:
        if proc.poll() is not None:
            name = " ".join(str(a) for a in proc.args[2:5])  # type: ignore[index]
            tails = "\n".join(_tail(p) for p in sorted(fleet.logs.glob("*.log")))
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up; logs:\n{tails}")


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return f"--- {path.name}\n" + "\n".join(text)


async def _wait_until(fleet: Fleet, urls: list[str], timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        for url in urls:
            while True:
                _check_alive(fleet)
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with http.get(url) as r:
                        if r.status == 200:
                            break
                if loop.time() > deadline:
                    raise TimeoutError(f"{url} did not answer within {timeout}s")
                await asyncio.sleep(0.1)


async def _wait_front(fleet: Fleet, timeout: float) -> None:
    """Until the front router serves and knows every engine.

    A kvmesh router lists its workers' states at /kvmesh/workers; another router is ready when it
    answers /v1/models, and then after its own worker registration settles (a short grace).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    n = len(fleet.engine_urls)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            _check_alive(fleet)
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                async with http.get(fleet.front_url + "/kvmesh/workers") as r:
                    if r.status == 200:
                        doc = await r.json()
                        if sum(w.get("state") == "up" for w in doc["workers"]) == n:
                            return
                    elif r.status == 404:
                        async with http.get(fleet.front_url + "/v1/models") as m:
                            if m.status == 200:
                                await asyncio.sleep(1.0)
                                return
            if loop.time() > deadline:
                raise TimeoutError(f"the front router at {fleet.front_url} was not ready within {timeout}s")
            await asyncio.sleep(0.1)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$")
_PHASE = re.compile(r'phase="([^"]*)"')


def parse_metrics(text: str, label: str | None = None) -> dict[str, float]:
    """Sum of every sample of each metric in a Prometheus text exposition (labels folded); with
    ``label`` (such as ``phase="total"``), of the samples whose labels include it only."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m and (label is None or label in (m.group(2) or "")):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


ROUTING_PHASES = OVERHEAD_PHASES
"""The phases of ``kvmesh_router_overhead_seconds``: ``total`` runs from a request's arrival to its
decision; the four before it are parts of it, except that a prompt routed before it was tokenized
(``ParsedRequest.deferred``: on its first block, or on its conversation's earlier turn) is tokenized
and hashed after it was sent, and counts in those two only. ``forward`` runs from the decision to
the request written to its worker, ``relay_first`` from the arrival of a streamed answer's first
token from the worker to its hand-off to the client: with ``total``, the front's own part of a
time to first token, but for the HTTP server's reading of the request before ``total`` starts."""


def routing_phases(text: str) -> dict[str, float]:
    """Mean seconds a request of each phase of ``kvmesh_router_overhead_seconds`` in a kvmesh
    router's Prometheus exposition (:data:`ROUTING_PHASES`), the phases no request went through
    left out: empty for a front that reports none."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or not m.group(1).startswith("kvmesh_router_overhead_seconds_"):
            continue
        phase = _PHASE.search(m.group(2) or "")
        if phase is None:
            continue
        kind, name = m.group(1).rpartition("_")[2], phase.group(1)
        if kind == "sum":
            sums[name] = sums.get(name, 0.0) + float(m.group(3))
        elif kind == "count":
            counts[name] = counts.get(name, 0.0) + float(m.group(3))
    return {p: sums[p] / counts[p] for p in ROUTING_PHASES if counts.get(p) and p in sums}


async def front_routing_phases(url: str) -> dict[str, float]:
    """:func:`routing_phases` of the front at ``url``; empty for a front that does not report them
    (sglang-router has no such histogram) or does not answer."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.get(url + "/metrics") as r,
        ):
            return routing_phases(await r.text()) if r.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process (all its threads) has used so far, from Linux's /proc;
    None where there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # the name in parentheses may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_wait_seconds(pid: int) -> float | None:
    """Time the threads of a process alive now have spent ready to run and waiting for a CPU, from
    Linux's per-thread scheduler statistics (``/proc/<pid>/task/*/schedstat``, run-queue delay):
    on a machine the front shares with the engines and the client, a thread that wakes one of them
    by writing to it is often put off its CPU for the time that process runs, and a single-threaded
    front does nothing else meanwhile. None where there is no such process or no statistics."""
    total = 0
    read = False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended since the listing (or a kernel without the statistics)
        read = True
    return total / 1e9 if read else None


def front_cpu_seconds(fleet: Fleet) -> float | None:
    """:func:`process_cpu_seconds` of the fleet's front router (the process started last). Read
    before and after a run, the difference is the CPU the front took from the machine it shares
    with the engines: a compiled router and a Python one differ there more than in their routing."""
    return process_cpu_seconds(fleet.procs[-1].pid) if fleet.procs else None


def front_wait_seconds(fleet: Fleet) -> float | None:
    """:func:`process_wait_seconds` of the fleet's front router, read like :func:`front_cpu_seconds`."""
    return process_wait_seconds(fleet.procs[-1].pid) if fleet.procs else None


def request_log_path(logs: Path, index: int) -> Path:
    """Where engine ``index`` of a fleet started with ``request_logs`` writes its request log."""
    return logs / f"engine-{index}.requests.jsonl"


def engine_requests(fleet: Fleet) -> list[dict[str, Any]]:
    """The requests every engine of ``fleet`` logged as ended (``kvmesh mock --request-log``),
    each with its engine's index as ``engine``; [] for a fleet started without the logs. Read
    after the traffic has ended: an engine writes a request's line when it ends."""
    out: list[dict[str, Any]] = []
    for i in range(len(fleet.engine_urls)):
        path = request_log_path(fleet.logs, i)
        if not path.exists():
            continue
        with path.open(encoding="utf-8") as f:
            out.extend({**json.loads(line), "engine": i} for line in f if line.strip())
    return out


def engine_ttft_p50(requests: Sequence[dict[str, Any]]) -> float | None:
    """The median of the engines' own TTFTs (arrival to first token, seconds) over ``requests``
    from :func:`engine_requests`, as the client's p50 is taken; None when none had a first token.
    Beside the client's p50 it tells whether a median lost is lost where the requests were placed
    or in front of the engines."""
    return percentile(
        [r["first_token"] - r["arrival"] for r in requests if r.get("first_token") is not None], 50
    )


async def engine_stats(urls: Sequence[str]) -> list[EngineStats]:
    """Each engine's finished requests, its modelled vs real busy step time, its own TTFTs and
    queue waits (from /metrics)."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for url in urls:
            async with http.get(url + "/metrics") as r:
                m = parse_metrics(await r.text())
            out.append(
                EngineStats(
                    int(m.get("vllm:request_success_total", 0)),
                    m.get("kvmesh_mock_modelled_step_seconds", 0.0),
                    m.get("kvmesh_mock_busy_step_seconds", 0.0),
                    m.get("vllm:time_to_first_token_seconds_sum", 0.0),
                    int(m.get("vllm:time_to_first_token_seconds_count", 0)),
                    m.get("vllm:request_queue_time_seconds_sum", 0.0),
                    int(m.get("vllm:request_queue_time_seconds_count", 0)),
                )
            )
    return out
