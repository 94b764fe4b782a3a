"""kvmesh.bench.fleet: real ``kvmesh mock`` processes behind a front router, and what they report."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest

from kvmesh.bench.fleet import (
    SOURCE_ROOT,
    child_env,
    engine_requests,
    engine_stats,
    engine_ttft_p50,
    front_cpu_seconds,
    front_routing_phases,
    front_wait_seconds,
    kvmesh_router,
    parse_metrics,
    process_cpu_seconds,
    process_wait_seconds,
    routing_phases,
    start_fleet,
)
from kvmesh.bench.runner import LoadSpec, run_workload
from kvmesh.bench.workloads import WorkloadSpec, build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_a_fleet_serves_through_its_front_router_and_reports_its_profile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine_args = ["--speedup", "20", "--block-size", "16", "--num-blocks", "256", "--report-profile"]
    front = kvmesh_router("--router-mode", "round-robin")
    # a kept log directory still holds an earlier fleet's request log: it is not read as this one's
    (tmp_path / "engine-0.requests.jsonl").write_text('{"arrival": 0.0, "first_token": 9.0}\n')
    # engine 1 runs at its own speed: the later --speedup wins
    async with start_fleet(
        2,
        engine_args,
        front,
        per_engine_args=[(), ("--speedup", "10")],
        request_logs=True,
        keep_logs=tmp_path,
    ) as fleet:
        async with aiohttp.ClientSession() as http:
            infos = []
            for url in fleet.engine_urls:
                async with http.get(url + "/kvmesh/info") as r:
                    infos.append(await r.json())
        sessions = build(WorkloadSpec("chat-fits", sessions=2, turns=2, prefix_words=10, question_words=10,
                                      max_tokens=4))  # fmt: skip
        cpu_before, wait_before = front_cpu_seconds(fleet), front_wait_seconds(fleet)
        run = await run_workload("rr", sessions, LoadSpec(urls=(fleet.front_url,), concurrency=2))
        cpu_after, wait_after = front_cpu_seconds(fleet), front_wait_seconds(fleet)
        stats = await engine_stats(fleet.engine_urls)
        routing = (await front_routing_phases(fleet.front_url)).get("total")
        engine_routing = await front_routing_phases(fleet.engine_urls[0])  # an engine routes nothing
        logged = engine_requests(fleet)
    # the mock's step model divided by --speedup, as data a router can seed a timing model from
    assert infos[0]["timing_profile"] == {
        "prefill_ms": pytest.approx([4.209989e-07 / 20, 1.518344e-02 / 20, 16.50142 / 20]),
        "decode_ms": pytest.approx([-25.74 / 20, 54.01 / 20, 5.74 / 20]),
        "decode_min_ms": pytest.approx(1.0 / 20),
    }
    assert infos[1]["timing_profile"]["prefill_ms"] == pytest.approx(
        [4.209989e-07 / 10, 1.518344e-02 / 10, 16.50142 / 10]
    )
    assert all(r.ok for r in run.results) and len(run.results) == 4
    assert [s.requests for s in stats] == [2, 2]  # round-robin, counted by the engines themselves
    assert all(s.modelled_seconds > 0 for s in stats)
    # the engines' own TTFTs: one per request, each within what the client saw through the front
    assert [s.ttft_count for s in stats] == [2, 2]
    client = sum(r.ttft for r in run.results if r.ttft is not None)
    assert 0 < sum(s.ttft_seconds_sum for s in stats) < client
    # of those, the waits before a step took each in: one each, a part of the engine's own TTFT
    assert [s.queue_count for s in stats] == [2, 2]
    assert all(0 <= s.queue_seconds_sum < s.ttft_seconds_sum for s in stats)
    # the front's own time to each decision, a part of what it adds to the engines' TTFTs
    assert routing is not None and 0 < routing * 4 < client - sum(s.ttft_seconds_sum for s in stats)
    assert engine_routing == {}
    # the front's own CPU so far (its start-up imports alone take a good part of a second; /proc
    # counts in ticks of 10 ms, so four small requests may not move it), and none once it is gone
    assert cpu_before is not None and cpu_after is not None
    assert 0.05 < cpu_before <= cpu_after
    assert process_cpu_seconds(fleet.procs[-1].pid) is None
    # and its threads' waits for a CPU, read the same way (none once it is gone)
    assert wait_before is not None and wait_after is not None and 0 <= wait_before <= wait_after
    assert process_wait_seconds(fleet.procs[-1].pid) is None
    # each engine's --request-log: a line per request it served, its own TTFT in it
    assert sorted(r["engine"] for r in logged) == [0, 0, 1, 1]
    own = sorted(r["first_token"] - r["arrival"] for r in logged)
    assert sum(own) == pytest.approx(sum(s.ttft_seconds_sum for s in stats))
    p50 = engine_ttft_p50(logged)
    assert p50 is not None and own[0] <= p50 <= own[-1]
    assert engine_ttft_p50([]) is None


async def test_an_engine_that_cannot_start_fails_the_fleet_with_its_log() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)exited with 2 during start-up.*--num-blocks must be"):
        async with start_fleet(1, ["--num-blocks", "0"], kvmesh_router()):
            pass


async def test_a_front_whose_port_was_taken_meanwhile_starts_on_another() -> None:
    """A port is chosen free and bound by the front a moment later; here another process holds it
    by then (the first start only): the front dies saying so and is started on another port."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    router = kvmesh_router()
    asked: list[int] = []

    def front(engines: Sequence[str], port: int) -> list[str]:
        asked.append(port)
        return router(engines, taken if len(asked) == 1 else port)

    try:
        async with start_fleet(1, ["--speedup", "20", "--num-blocks", "64"], front) as fleet:
            assert len(asked) == 2 and fleet.front_url == f"http://127.0.0.1:{asked[1]}"
            async with aiohttp.ClientSession() as http, http.get(fleet.front_url + "/kvmesh/workers") as r:
                assert r.status == 200
            assert len(fleet.procs) == 2  # (the engine and the second front: the first is gone)
    finally:
        holder.close()


def test_parse_metrics_sums_labelled_samples() -> None:
    text = (
        "# HELP x y\n"
        'vllm:request_success_total{model_name="m",finished_reason="length"} 3.0\n'
        'vllm:request_success_total{model_name="m",finished_reason="stop"} 2.0\n'
        "kvmesh_mock_busy_step_seconds 1.5\n"
    )
    assert parse_metrics(text) == {"vllm:request_success_total": 5.0, "kvmesh_mock_busy_step_seconds": 1.5}


def test_routing_phases_reads_each_phase_s_mean_and_leaves_out_the_phases_nothing_went_through() -> None:
    text = (
        'kvmesh_router_overhead_seconds_bucket{phase="tokenize",le="0.001"} 2.0\n'
        'kvmesh_router_overhead_seconds_count{phase="tokenize"} 2.0\n'
        'kvmesh_router_overhead_seconds_sum{phase="tokenize"} 0.003\n'
        'kvmesh_router_overhead_seconds_created{phase="tokenize"} 1.7e9\n'
        'kvmesh_router_overhead_seconds_count{phase="find_matches"} 0.0\n'
        'kvmesh_router_overhead_seconds_sum{phase="find_matches"} 0.0\n'
        'kvmesh_router_overhead_seconds_count{phase="scheduling"} 4.0\n'
        'kvmesh_router_overhead_seconds_sum{phase="scheduling"} 0.001\n'
        'kvmesh_router_overhead_seconds_count{phase="total"} 4.0\n'
        'kvmesh_router_overhead_seconds_sum{phase="total"} 0.008\n'
        'kvmesh_kv_hit_rate_sum{phase="total"} 9.0\n'  # another histogram: not a phase of this one
    )
    assert routing_phases(text) == pytest.approx({"tokenize": 0.0015, "scheduling": 0.00025, "total": 0.002})
    assert list(routing_phases(text)) == ["tokenize", "scheduling", "total"]  # in the phases' order
    assert routing_phases("vllm:num_requests_running 1.0\n") == {}
    assert routing_phases('kvmesh_router_overhead_seconds_count{phase="total"} 0.0\n') == {}


async def test_a_fleet_without_a_front_is_its_engines_alone() -> None:
    async with start_fleet(1, ["--speedup", "20", "--num-blocks", "64"], None) as fleet:
        assert len(fleet.procs) == 1  # the engine, and no router process beside it
        async with aiohttp.ClientSession() as http:
            async with http.get(fleet.engine_urls[0] + "/health") as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(fleet.front_url + "/health"):
                    pass


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
async def test_the_fleet_runs_the_kvmesh_its_caller_imports_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # another checkout's directory (here, a kvmesh that only says where it is) as the working
    # directory: ``python -m kvmesh`` would put it first on sys.path, and the fleet's engines and
    # router would run it instead of the kvmesh this benchmark imports
    other = tmp_path / "kvmesh"
    other.mkdir()
    (other / "__init__.py").write_text("")
    (other / "__main__.py").write_text("raise SystemExit('the kvmesh of the working directory')\n")
    monkeypatch.chdir(tmp_path)
    fleet_of_one = start_fleet(1, ["--speedup", "20", "--num-blocks", "64"], kvmesh_router())
    async with fleet_of_one as fleet, aiohttp.ClientSession() as http:
        r = await http.get(fleet.front_url + "/kvmesh/router")
        assert r.status == 200  # the router came up, as did its engine
        r.release()
    assert child_env({"X": "1"})["PYTHONPATH"].split(os.pathsep)[0] == SOURCE_ROOT
    assert Path(SOURCE_ROOT, "kvmesh", "bench", "fleet.py").is_file()


_FLEET_THEN_WAIT = """
import asyncio, json, sys
from pathlib import Path
from kvmesh.bench.fleet import kvmesh_router, start_fleet

async def main():
    engines = ["--speedup", "20", "--num-blocks", "64"]
    async with start_fleet(2, engines, kvmesh_router(), keep_logs=Path(sys.argv[1])) as fleet:
        print(json.dumps([p.pid for p in fleet.procs]), flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


def _running(pid: int) -> bool:
    """True while ``pid`` runs: a zombie (dead, not yet reaped by whoever adopted it) does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_fleet_stops_when_the_process_that_started_it_is_killed(
    how: signal.Signals, tmp_path: Path
) -> None:
    # SIGKILL, and SIGTERM's default action, end the benchmark without its ``finally``: its engines
    # and router would go on serving on loopback, taking the CPU the next run measures with. (Nor
    # does its temporary log directory go: the logs go under the test's own, which pytest removes.)
    parent = subprocess.Popen(
        [sys.executable, "-c", _FLEET_THEN_WAIT, str(tmp_path)],
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 3 and all(_running(p) for p in pids)  # two engines and the front
        parent.send_signal(how)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if _running(p)] == []
        assert (tmp_path / "front.log").is_file()  # (its logs, so nothing was left elsewhere)
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


_SPINNERS = """
import hashlib, os, sys, threading, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one CPU, for this thread and its children
stop = threading.Event()
def spin():
    data = bytes(1 << 20)
    end = time.monotonic() + 0.6
    while time.monotonic() < end:
        hashlib.sha256(data).digest()  # (off the GIL: the threads contend for the CPU alone)
    stop.wait()  # alive, so that its counts are still there to read
threads = [threading.Thread(target=spin) for _ in range(int(sys.argv[1]))]
for t in threads:
    t.start()
time.sleep(0.8)
print("done", flush=True)
stop.wait()
"""


def _waits_of_spinners(threads: int) -> float | None:
    child = subprocess.Popen(
        [sys.executable, "-c", _SPINNERS, str(threads)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        return process_wait_seconds(child.pid)
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux's scheduler statistics")
def test_a_process_shows_the_time_its_threads_waited_for_a_cpu() -> None:
    # one thread busy on a CPU of its own does not wait for it; two on one CPU take turns, each
    # ready to run while the other has it (about 0.3 s each), whatever the CPU time they use
    # (other processes sharing that CPU add to both alike)
    alone = _waits_of_spinners(1)
    shared = _waits_of_spinners(2)
    assert alone is not None and shared is not None
    assert shared - alone > 0.2
    assert process_wait_seconds(2**22 + 7) is None  # no such process
