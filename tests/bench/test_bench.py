"""kvmesh bench: deterministic workloads, the runner against a real loopback engine, the report."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmesh.bench import report
from kvmesh.bench.runner import (
    LoadSpec,
    Progress,
    RequestResult,
    RunResult,
    on_schedule,
    run_workload,
    think_times,
)
from kvmesh.bench.workloads import WORKLOADS, Answer, WorkloadSpec, build, knob_matters, preset
from kvmesh.mock.testing import run_mock
from kvmesh.router.upstream.forwarder import ANSWER_LIMIT


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_deterministic(name: str) -> None:
    a = build(WorkloadSpec(name, sessions=4, seed=3))
    b = build(WorkloadSpec(name, sessions=4, seed=3))
    c = build(WorkloadSpec(name, sessions=4, seed=4))
    assert [s.next_step(None) for s in a] == [s.next_step(None) for s in b]
    assert [s.messages for s in a] != [s.messages for s in c]


def test_agentic_conversations_share_system_prompt_and_grow_turn_by_turn() -> None:
    sessions = build(WorkloadSpec("agentic", sessions=4, turns=3, groups=2))
    first = [s.next_step(None) for s in sessions]
    assert first[0][0]["messages"][0] == first[2][0]["messages"][0]  # same agent type
    assert first[0][0]["messages"][0] != first[1][0]["messages"][0]
    assert first[0][0]["tools"] == first[2][0]["tools"]
    second = sessions[0].next_step([Answer("the model said this", True)])
    assert second is not None
    messages = second[0]["messages"]
    assert messages[: len(first[0][0]["messages"])] == first[0][0]["messages"]  # a pure extension
    assert messages[-2] == {"role": "assistant", "content": "the model said this"}
    assert sessions[0].next_step([Answer("", False)]) is None  # a failed turn ends the conversation


def test_best_of_n_sends_bursts_of_identical_siblings() -> None:
    (session,) = build(WorkloadSpec("best-of-n", sessions=1, burst=5))
    burst = session.next_step(None)
    assert burst is not None and len(burst) == 5 and all(b == burst[0] for b in burst)


def test_percentiles_and_table() -> None:
    assert report.percentile([], 50) is None
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    results = [
        RequestResult("s", 1, "u", 0.0, ttft=0.1, latency=0.5, chunk_gaps=[0.01, 0.02], output_chunks=3,
                      prompt_tokens=100, cached_tokens=50, completion_tokens=3, worker_id="w1"),
        RequestResult("s", 2, "u", 0.5, ttft=0.3, latency=0.7, prompt_tokens=100, cached_tokens=0,
                      completion_tokens=3, worker_id="w2"),
        RequestResult("s", 3, "u", 0.9, error="HTTP 503: busy"),
    ]  # fmt: skip
    summary = report.summarize(RunResult("x", results, 2.0, 1))
    assert summary["ok"] == 2 and summary["errors"] == 1
    assert summary["prefix_hit_ratio"] == 0.25
    assert summary["per_worker"] == {"w1": 1, "w2": 1}
    assert summary["throughput_rps"] == 1.0
    assert summary["ttft_s"]["mean"] == pytest.approx(0.2)  # the failed request has no TTFT
    table = report.format_table([summary])
    assert "TTFT p50 (ms)" in table and "200.0" in table and "25.0%" in table


def test_a_burst_is_split_into_its_first_sent_request_and_its_siblings() -> None:
    def req(
        session: str,
        step: int,
        start: float,
        ttft: float | None,
        error: str | None = None,
        cached: int | None = 90,
    ) -> RequestResult:
        prompt = None if cached is None else 100
        return RequestResult(
            session, step, "u", start, ttft=ttft, prompt_tokens=prompt, cached_tokens=cached, error=error
        )

    results = [
        # a burst of three sent out of list order: the first sent is the one at 1.00 s; of its
        # siblings, the one at 1.001 s found under half its prompt cached
        req("a", 1, 1.002, 0.060), req("a", 1, 1.000, 0.030, cached=0), req("a", 1, 1.001, 0.070, cached=49),
        # a burst whose second sibling failed: it counts with the sibling that answered, whose
        # usage did not say what was cached
        req("b", 1, 2.000, 0.040), req("b", 1, 2.001, 0.090, cached=None), req("b", 1, 2.002, None, "HTTP 500"),
        req("a", 2, 3.000, 0.500),  # a step sent alone is no burst
    ]  # fmt: skip
    summary = report.summarize(RunResult("x", results, 4.0, 1))
    bursts = summary["bursts"]
    assert bursts["count"] == 2
    assert bursts["first_ttft_s"]["p50"] == pytest.approx(0.035)
    assert bursts["first_ttft_s"]["mean"] == pytest.approx(0.035)
    assert bursts["siblings_ttft_s"]["p50"] == pytest.approx(0.070)
    assert bursts["siblings_ttft_s"]["mean"] == pytest.approx((0.060 + 0.070 + 0.090) / 3)
    assert bursts["siblings_uncached"]["share"] == pytest.approx(1 / 2)  # of the two that said
    assert bursts["siblings_uncached"]["ttft_p50_s"] == pytest.approx(0.070)
    table = report.format_table([summary])
    assert "burst: first TTFT p50 (ms)" in table and "35.0" in table and "70.0" in table
    assert "burst: siblings under half cached" in table and "50.0%" in table
    lone = report.summarize(RunResult("y", [req("a", 1, 0.0, 0.1), req("a", 2, 1.0, 0.1)], 2.0, 1))
    assert lone["bursts"] is None and "burst:" not in report.format_table([lone])


async def test_runner_against_a_mock_engine(tmp_path: Path) -> None:
    async with run_mock(block_size=16, num_blocks=2048, speedup=50.0) as mock:
        sessions = build(WorkloadSpec("agentic", sessions=4, turns=3, prefix_words=200, max_tokens=8))
        run = await run_workload("agentic", sessions, LoadSpec(urls=(mock.base_url,), concurrency=2))
    assert len(run.results) == 12 and all(r.ok for r in run.results), [r.error for r in run.results]
    assert all(r.ttft is not None and r.ttft > 0 for r in run.results)
    summary = report.summarize(run)
    # later turns and later conversations of the same agent hit the mock's prefix cache
    assert summary["prefix_hit_ratio"] > 0.5
    path = report.write_plot([run], [summary], tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _address_space_of(limit_bytes: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return limit


async def test_a_concurrency_far_above_the_sessions_runs_them_all_at_once(tmp_path: Path) -> None:
    """A closed loop runs as many sessions at once as it has, however large ``--concurrency`` is.
    It made a user for each unit of it: ``--concurrency 99999999`` took a gigabyte in eight seconds
    before it sent a request, and twenty in ten minutes. (The command runs in an address space of
    4 GiB, so the old way ends in a MemoryError here rather than in the machine's memory.)"""
    out = tmp_path / "bench.json"
    async with run_mock(block_size=16, speedup=50.0) as mock:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh", "bench", "--url", mock.base_url, "--workload", "agentic",
            "--sessions", "3", "--turns", "2", "--concurrency", "100000000", "--max-tokens", "4",
            "--json", str(out), "--no-progress",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_address_space_of(4 << 30),
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    results = json.loads(out.read_text())["runs"][0]
    assert results["summary"]["ok"] == 6


async def test_bench_command_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    async with run_mock(block_size=16, speedup=50.0) as mock:
        address = mock.base_url.removeprefix("http://")  # host:port, as kvmesh router --workers takes it
        proc = await __import__("asyncio").create_subprocess_exec(
            sys.executable, "-m", "kvmesh", "bench", "--url", address, "--workload", "shared-prefix",
            "--sessions", "6", "--concurrency", "3", "--max-tokens", "4", "--json", str(out), "--no-nvext",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode()
    assert "TTFT p99 (ms)" in stdout.decode()
    doc = json.loads(out.read_text())
    assert doc["runs"][0]["summary"]["ok"] == 6


async def test_bench_says_why_its_requests_failed() -> None:
    async with run_mock(block_size=16, speedup=50.0) as mock:
        proc = await __import__("asyncio").create_subprocess_exec(
            sys.executable, "-m", "kvmesh", "bench", "--url", mock.base_url, "--workload", "siblings",
            "--model", "not-served-here", "--sessions", "1", "--burst", "2", "--turns", "1", "--no-progress",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await proc.communicate()
    assert proc.returncode == 1
    assert "0/2" in stdout.decode()
    # the reason, not only the count: the engine's 404 for a model it does not serve
    assert "kvmesh bench: 2 request(s) failed: HTTP 404" in stderr.decode(), stderr.decode()


def test_a_knob_matters_where_the_builder_reads_it() -> None:
    assert knob_matters("siblings", "burst") and knob_matters("best-of-n", "burst")
    assert not knob_matters("agent-long", "burst")
    assert knob_matters("hot-prefix", "hot_share") and not knob_matters("chat-fits", "hot_share")
    assert knob_matters("mixed", "long_share") and not knob_matters("agent-long", "long_share")
    assert all(knob_matters(name, "sessions") and knob_matters(name, "max_tokens") for name in WORKLOADS)


def _bench_cli(*flags: str) -> subprocess.CompletedProcess[str]:
    """``kvmesh bench`` against a port where nothing listens."""
    argv = [sys.executable, "-m", "kvmesh", "bench", "--url", "http://127.0.0.1:9", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workload", "agent-long", "--burst", "3"], "--burst has no effect on workload 'agent-long'"),
        (
            ["--workload", "shared-prefix", "--think-time", "2", "--rate", "4", "--ramp", "1"],
            "--think-time, --ramp have no effect on workload 'shared-prefix'",
        ),
    ],
)
def test_bench_refuses_a_flag_that_would_change_nothing(flags: list[str], message: str) -> None:
    done = _bench_cli(*flags)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sessions", "0"], "argument --sessions: must be at least 1, got 0"),
        (
            ["--workload", "hot-prefix", "--hot-share", "1.5"],
            "argument --hot-share: must be in [0, 1], got 1.5",
        ),
        (["--concurrency", "0"], "argument --concurrency: must be at least 1, got 0"),
        (["--rate", "-1"], "argument --rate: must be greater than 0, got -1"),
        (["--rate", "inf"], "argument --rate: must be finite, got inf"),
        (["--workload", "chat-fits", "--think-time", "-1"], "argument --think-time: must be a finite number"),
        (["--ramp", "inf"], "argument --ramp: must be a finite number"),
        # an output it could not write is refused before the run, not after it
        (["--json", "/no/such/dir/out.json"], "argument --json: directory /no/such/dir does not exist"),
        (["--plot", "/"], "argument --plot: / is a directory, not a file"),
        # (an empty list was a traceback; the others failed each request, or the question for the model)
        (["--url", ","], "argument --url: must name at least one server, e.g. http://127.0.0.1:8000"),
        (["--url", "ftp://x:1"], "argument --url: URL 'ftp://x:1' must look like http://host:port"),
        (
            ["--url", "http://127.0.0.1:70000"],
            "argument --url: URL 'http://127.0.0.1:70000' has an invalid port",
        ),
        # (a bad name had every request refused by the server; CR or LF in a value was a traceback)
        (["--header", "a b:c"], "argument --header: 'a b' is not a header name (letters, digits and"),
        (["--header", ":v"], "argument --header: '' is not a header name"),
        (["--header", "x:a\rb"], "argument --header: the value of x must be printable ASCII"),
        (["--header", "Content-Length:5"], "argument --header: Content-Length frames the request"),
        (["--header", "novalue"], "argument --header: 'novalue' must look like NAME:VALUE"),
    ],
)
def test_bench_refuses_a_value_out_of_range(flags: list[str], message: str) -> None:
    done = _bench_cli(*flags)
    assert done.returncode == 2
    assert message in done.stderr


def test_bench_against_a_server_that_is_not_there_says_so() -> None:
    done = _bench_cli("--no-progress")
    assert done.returncode == 1
    assert "kvmesh bench: cannot read http://127.0.0.1:9/v1/models" in done.stderr
    assert "Traceback" not in done.stderr


async def test_the_headers_given_reach_the_server_on_every_request() -> None:
    from tests.router.engines import EngineState, engine_app
    from tests.router.servers import serve

    state = EngineState("e0")
    async with serve(engine_app(state)) as engine:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh", "bench", "--url", engine.url, "--workload", "best-of-n",
            "--sessions", "2", "--burst", "2", "--no-progress", "--header", "X-Team: routing",
            "--header", "x-empty:",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert len(state.headers) == 4
    assert all(h.get("x-team") == "routing" and h.get("x-empty") == "" for h in state.headers)


def test_a_server_that_is_not_there_is_said_before_the_workload_is_made() -> None:
    """The workload was made first: with 100,000 sessions a wrong ``--url`` was said after 68 s
    and 650 MB, and a million take ten times that. (The command runs in an address space of 2 GiB,
    so the old way ends in a MemoryError here rather than in the machine's memory.)"""
    argv = [sys.executable, "-m", "kvmesh", "bench", "--url", "http://127.0.0.1:9", "--workload", "chat-fits"]
    argv += ["--sessions", "1000000", "--no-progress"]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, preexec_fn=_address_space_of(2 << 30)
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "kvmesh bench: cannot read http://127.0.0.1:9/v1/models" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["bench", "--workload", "best-of-n", "--sessions", "2", "--no-progress", "--url"], 1),
        (["events", "relay", "tcp://127.0.0.1:5557", "--nats", "nats://127.0.0.1:1", "--register"], 2),
    ],
    ids=["bench --url", "events relay --register"],
)
async def test_a_server_answering_without_end_is_read_up_to_a_limit(argv: list[str], status: int) -> None:
    """A URL that answers ``/v1/models`` or ``/kvmesh/info`` with an endless body (a wrong URL) was
    read until the client's timeout, 30 s for ``kvmesh bench``: gigabytes over loopback."""
    from tests.router.upstream.test_forwarder import endless, raw_server

    async with raw_server(endless) as server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh", *argv, server.url,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    text = stderr.decode()
    assert proc.returncode == status, text[-2000:]
    assert f"cannot read {server.url}/" in text and f"answer larger than {ANSWER_LIMIT} bytes" in text, text
    assert "Traceback" not in text
    assert server.sent < ANSWER_LIMIT + (16 << 20)


def test_a_long_preparation_shows_its_progress_and_a_short_one_leaves_no_line() -> None:
    shown = io.StringIO()
    bar = Progress(4, "chat-fits: preparing", shown, enabled=True, unit="sessions")
    for _ in range(4):
        bar.update()
    bar.close()
    assert (
        shown.getvalue()
        .rstrip("\n")
        .split("\r")[-1]
        .startswith("chat-fits: preparing [##############################] 4/4 sessions, ")
    )
    assert "errors" not in shown.getvalue()  # (making a session cannot fail)
    quiet = io.StringIO()
    bar = Progress(4, "chat-fits: preparing", quiet, enabled=True, unit="sessions", delay=3600)
    for _ in range(4):
        bar.update()
    bar.close()
    assert quiet.getvalue() == ""
    counted = io.StringIO()
    bar = Progress(2, "chat-fits", counted, enabled=True)
    bar.update(True)
    bar.update(False)
    bar.close()
    assert "2/2 requests, 1 errors" in counted.getvalue()


def test_every_workload_knob_has_a_flag_and_a_value_type() -> None:
    # one table feeds kvmesh bench's flags and routing_quality.py --set: a WorkloadSpec field
    # added without a row would be neither settable nor checked
    from dataclasses import fields

    from kvmesh.commands.bench import WORKLOAD_KNOBS

    assert set(WORKLOAD_KNOBS) == {f.name for f in fields(WorkloadSpec)} - {"name", "seed"}


def test_every_workload_has_a_preset_that_builds() -> None:
    for name in WORKLOADS:
        sessions = build(preset(name).spec)
        assert sessions and all(s.total_requests > 0 for s in sessions), name


def test_parallel_tool_calls_share_the_conversation_and_continue_with_the_first_success() -> None:
    best_of_n, parallel = build(WorkloadSpec("siblings", sessions=2, turns=2, burst=3, prefix_words=20))
    same = best_of_n.next_step(None)
    assert same is not None and len(same) == 3 and all(b == same[0] for b in same)
    first = parallel.next_step(None)
    assert first is not None and len(first) == 3
    tails = [b["messages"][-1]["content"] for b in first]
    assert len(set(tails)) == 3  # one different call per sibling
    assert all(b["messages"][:-1] == first[0]["messages"][:-1] for b in first)  # one shared prefix
    second = parallel.next_step([Answer("", False), Answer("answer one", True), Answer("x", True)])
    assert second is not None
    assert second[0]["messages"][1:3] == [
        {"role": "user", "content": tails[1]},
        {"role": "assistant", "content": "answer one"},
    ]


def test_hot_prefix_puts_the_hot_share_on_one_prefix() -> None:
    sessions = build(WorkloadSpec("hot-prefix", sessions=400, groups=5, prefix_words=10, hot_share=0.8))
    systems = [s.messages[0]["content"] for s in sessions]
    top = max(set(systems), key=systems.count)
    assert 0.74 < systems.count(top) / len(systems) < 0.86
    assert len(set(systems)) == 5


def test_mixed_interleaves_long_agents_and_short_chats() -> None:
    sessions = build(
        WorkloadSpec("mixed", sessions=16, long_share=0.25, prefix_words=1500, question_words=160)
    )
    kinds = [s.kind for s in sessions]
    assert kinds.count("agent-long") == 4 and kinds.count("chat") == 12
    assert kinds[:4] != ["agent-long"] * 4  # shuffled, not blocked
    agent = next(s for s in sessions if s.kind == "agent-long")
    chat = next(s for s in sessions if s.kind == "chat")
    assert len(agent.messages[0]["content"]) > 5 * len(chat.messages[0]["content"])
    assert agent.think_scale < chat.think_scale


async def test_rate_driven_starts_keep_to_their_timeline_when_each_one_is_late() -> None:
    # A clock of its own: every sleep overshoots by 1 ms, as the event loop's timer can, and every
    # start takes 0.5 ms. Starts land at their due times (a late one at most one overshoot after);
    # the delays do not add up over the run.
    now = 0.0
    started: list[float] = []

    async def sleep(seconds: float) -> None:
        nonlocal now
        now += seconds + 0.001

    def clock() -> float:
        return now

    gaps = [0.05, 0.0002, 0.03, 0.0001, 0.04] * 20
    async for _ in on_schedule(gaps, clock=clock, sleep=sleep):
        started.append(now)
        now += 0.0005
    due = list(itertools.accumulate([0.0, *gaps[:-1]]))
    assert len(started) == len(gaps)
    assert all(d - 1e-9 <= t <= d + 0.0015 + 1e-9 for t, d in zip(started, due, strict=True))


def test_think_times_are_seeded_per_session() -> None:
    a = list(itertools.islice(think_times(0, "chat-1", 2.0), 2000))
    assert a == list(itertools.islice(think_times(0, "chat-1", 2.0), 2000))  # every run pauses alike
    assert a != list(itertools.islice(think_times(0, "chat-2", 2.0), 2000))
    assert a != list(itertools.islice(think_times(1, "chat-1", 2.0), 2000))
    assert 1.8 < sum(a) / len(a) < 2.2 and min(a) >= 0
    assert set(itertools.islice(think_times(0, "chat-1", 0.0), 10)) == {0.0}
