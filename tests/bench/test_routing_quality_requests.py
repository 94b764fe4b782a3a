"""`benchmarks/routing_quality.py --requests`: every request's result, as the suite ran it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_quality.py"


def _chat_fits(engines: str, turns: str, *outputs: str) -> subprocess.CompletedProcess[str]:
    """Four chat sessions scaled to ``engines``, round-robin and kvmesh, writing ``outputs``."""
    return subprocess.run(
        [
            sys.executable, str(SCRIPT), "--workloads", "chat-fits", "--engines", engines,
            "--set", "sessions=4", "--set", turns, "--contenders", "round-robin,kvmesh",
            "--plot", "", "--no-progress", *outputs,
        ],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def test_every_request_of_every_run_is_written_with_where_it_went(tmp_path: Path) -> None:
    out, summaries = tmp_path / "requests.jsonl", tmp_path / "summary.json"
    out.write_text("a stale line from an earlier run\n")
    done = _chat_fits("1", "turns=2", "--requests", str(out), "--json", str(summaries))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ((case, per),) = json.loads(summaries.read_text()).items()
    assert {r["router"] for r in rows} == {"round-robin", "kvmesh"}
    for router, runs in per.items():
        mine = [r for r in rows if r["router"] == router]
        assert len(mine) == runs[0]["requests"] == 2  # a session of two turns on one engine
        assert all(r["case"] == case and r["round"] == 1 and r["error"] is None for r in mine)
        first, second = sorted(mine, key=lambda r: r["turn"])
        assert (first["turn"], second["turn"]) == (1, 2) and first["session"] == second["session"]
        assert second["start_s"] > first["start_s"] and first["ttft_ms"] > 0
        # the engine reported the second turn's history as cached, and the front which engine it was
        assert first["cached_tokens"] == 0 < second["cached_tokens"] < second["prompt_tokens"]
        assert first["worker"] == second["worker"] and first["worker"].startswith("http://127.0.0.1:")
        assert first["engine"] == second["engine"] == 0  # its index in the fleet: the only engine


def test_every_decision_of_a_kvmesh_front_is_written_beside_the_request_it_placed(tmp_path: Path) -> None:
    out, decisions = tmp_path / "requests.jsonl", tmp_path / "decisions.jsonl"
    done = _chat_fits("2", "turns=3", "--requests", str(out), "--decisions", str(decisions))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {decisions}" in done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    decided = [json.loads(line) for line in decisions.read_text().splitlines()]
    for router in ("round-robin", "kvmesh"):
        # one decision a request, joined to it: the worker it chose is the one the front named
        mine = {(r["session"], r["turn"]): r for r in rows if r["router"] == router}
        theirs = [d for d in decided if d["router"] == router]
        assert sorted((d["session"], d["turn"]) for d in theirs) == sorted(mine)
        for d in theirs:
            row = mine[(d["session"], d["turn"])]
            assert d["start_s"] == row["start_s"]  # (with the session and turn, names one request)
            assert d["worker_id"] == row["worker"] and d["case"] == row["case"] and d["round"] == 1
            assert d["at_s"] >= row["start_s"] - 0.005
            if router == "round-robin":  # (no candidates weighed: nothing moved)
                assert (d["reason"], d["candidates"], d["moved"]) == ("round-robin", [], False)
                continue
            assert len(d["candidates"]) == 2 and sum(c["chosen"] for c in d["candidates"]) == 1
            assert all(c["predicted_ttft_ms"] > 0 for c in d["candidates"])  # the latency cost's terms
            held = max(c["overlap_blocks"] for c in d["candidates"])
            assert d["moved"] == (d["overlap_blocks"] < held)  # (it left the worker holding most)
            if d["turn"] > 1:  # a later turn's history is cached somewhere, and the decision saw it
                assert held > 0


def _two_rounds(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], list[dict], dict]:
    tmp_path.mkdir()
    out, summaries = tmp_path / "requests.jsonl", tmp_path / "summary.json"
    done = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--workloads", "chat-fits", "--engines", "1",
            "--set", "sessions=2", "--set", "turns=2", "--contenders", "round-robin,kvmesh",
            "--rounds", "2", "--seed", "5", *flags,
            "--plot", "", "--no-progress", "--requests", str(out), "--json", str(summaries),
        ],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    per = next(iter(json.loads(summaries.read_text()).values())) if summaries.exists() else {}
    return done, rows, per


def _prompts(rows: list[dict], router: str, rnd: int) -> list[int]:
    return sorted(r["prompt_tokens"] for r in rows if r["router"] == router and r["round"] == rnd)


def test_every_round_sends_the_same_traffic_unless_each_round_gets_its_own_seed(tmp_path: Path) -> None:
    same, rows, per = _two_rounds(tmp_path / "same")
    assert same.returncode == 0, same.stderr[-2000:]
    assert "seed 5; rounds 2" in same.stdout
    assert [run["seed"] for run in per["kvmesh"]] == [5, 5]
    assert {r["seed"] for r in rows} == {5}
    assert _prompts(rows, "kvmesh", 1) == _prompts(rows, "kvmesh", 2)

    drawn, rows, per = _two_rounds(tmp_path / "drawn", "--seed-per-round")
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    assert "seeds 5-6, one a round; rounds 2" in drawn.stdout
    for router in ("round-robin", "kvmesh"):
        assert [run["seed"] for run in per[router]] == [5, 6]
        assert {r["seed"] for r in rows if r["router"] == router and r["round"] == 2} == {6}
    # a round's traffic is the same for both contenders, and another round's is new
    assert _prompts(rows, "kvmesh", 1) == _prompts(rows, "round-robin", 1)
    assert _prompts(rows, "kvmesh", 2) == _prompts(rows, "round-robin", 2)
    assert _prompts(rows, "kvmesh", 1) != _prompts(rows, "kvmesh", 2)


def test_an_output_in_a_directory_that_does_not_exist_is_refused_before_anything_runs(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    for flag, name in (
        ("--json", "s.json"),
        ("--requests", "r.jsonl"),
        ("--decisions", "d.jsonl"),
        ("--plot", "p.png"),
    ):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--workloads", "chat-fits", flag, str(missing / name)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2, (flag, done.stdout[-500:])
        assert f"argument {flag}: directory {missing} does not exist" in done.stderr
        assert "machine:" not in done.stdout  # no fleet was started
    assert not missing.exists()


def test_a_seed_per_round_with_a_single_round_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--workloads", "chat-fits", "--seed-per-round"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-500:]
    assert "--seed-per-round: needs --rounds 2 or more (got 1)" in done.stderr
    assert "machine:" not in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
        (["--rounds", "-2"], "argument --rounds: must be at least 1, got -2"),
        (["--engines", "0"], "argument --engines: must be at least 1, got 0"),
        (["--engines", "-1"], "argument --engines: must be at least 1, got -1"),
        (["--workloads", "bogus"], "--workloads: unknown bogus; choose from agent-long"),
        (["--workloads", "siblings,"], "--workloads: an empty name in 'siblings,'"),
        (["--workloads", ""], "--workloads: an empty name in ''"),
        (["--set", "rate=5", "--set", "concurrency=4"], "--set rate and --set concurrency"),
    ],
)
def test_a_value_the_suite_cannot_run_is_refused_before_anything_runs(args: list[str], message: str) -> None:
    # (each of these ran something else, silently, or failed with a traceback after the runs)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--plot", "", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-500:]
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-800:]
    assert "machine:" not in done.stdout


def test_an_output_path_that_is_a_directory_is_refused_before_anything_runs(tmp_path: Path) -> None:
    for flag in ("--json", "--requests", "--decisions", "--plot"):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--workloads", "chat-fits", flag, str(tmp_path)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2, (flag, done.stdout[-500:])
        assert f"argument {flag}: {tmp_path} is a directory, not a file" in done.stderr
        assert "machine:" not in done.stdout


def test_block_size_runs_the_engines_in_blocks_of_that_size(tmp_path: Path) -> None:
    out = tmp_path / "requests.jsonl"
    done = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--workloads", "chat-fits", "--engines", "1", "--block-size", "48",
            "--set", "sessions=2", "--set", "turns=3", "--contenders", "kvmesh",
            "--plot", "", "--no-progress", "--requests", str(out),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # the suite's 32k-token cache, in blocks of 48 tokens
    assert "--block-size 48 --num-blocks 682 " in done.stdout
    assert "### chat-fits x1 (sessions=2, turns=3, block_size=48)" in done.stdout  # the case says what it ran
    cached = [json.loads(line)["cached_tokens"] for line in out.read_text().splitlines()]
    # an engine reports whole blocks cached: of 48 tokens here, where blocks of 16 would show
    assert any(cached) and all(c % 48 == 0 for c in cached)
