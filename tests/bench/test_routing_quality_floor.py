"""`benchmarks/routing_quality.py --contenders floor,...`: each session alone on one engine, the
least TTFT the case allows, held beside the routers."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.bench.fleet import ROUTING_PHASES

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_quality.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--plot", "", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_floor_runs_the_same_sessions_one_at_a_time_on_one_engine(tmp_path: Path) -> None:
    out, summaries = tmp_path / "requests.jsonl", tmp_path / "summary.json"
    done = _run(
        "--workloads", "chat-fits", "--engines", "2", "--set", "sessions=3", "--set", "turns=3",
        "--contenders", "round-robin,dynamo,kvmesh,floor", "--requests", str(out), "--json", str(summaries),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ((_, per),) = json.loads(summaries.read_text()).items()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    floor = sorted((r for r in rows if r["router"] == "floor"), key=lambda r: r["start_s"])
    routed = [r for r in rows if r["router"] == "round-robin"]
    # the same requests as the routers sent, all on one engine, where the routers had two
    assert sorted((r["session"], r["turn"]) for r in floor) == sorted(
        (r["session"], r["turn"]) for r in routed
    )
    assert per["floor"][0]["per_engine"] == [len(routed)] and len(per["round-robin"][0]["per_engine"]) == 2
    # one session at a time: its turns run back to back, and nothing of another session between
    assert [r["session"] for r in floor] == [
        s for s in dict.fromkeys(r["session"] for r in floor) for _ in range(3)
    ]
    # every later turn finds its whole history on that engine: at least the full 16-token blocks of
    # the turn before's prompt
    for before, turn in itertools.pairwise(floor):
        if turn["turn"] > 1:
            assert turn["cached_tokens"] >= before["prompt_tokens"] // 16 * 16
    # the verdicts hold it against round-robin; it is no router, so no router's hits are held to it
    verdict = done.stdout[done.stdout.index("### the default router") :]
    # (its first table: with a baseline in the run, the pooled "how sure" table follows it)
    header, row = [line for line in verdict.splitlines() if line.startswith("|") and "---" not in line][:2]
    cells = dict(
        zip((c.strip() for c in header.split("|")), (c.strip() for c in row.split("|")), strict=True)
    )
    floor_p50 = per["floor"][0]["ttft_s"]["p50"] / per["round-robin"][0]["ttft_s"]["p50"]
    assert cells["floor / round-robin"] == f"{floor_p50:.2f}"
    # hits against the baselines, as the other columns: a best that counted kvmesh itself could
    # never leave it above 0 (and the floor, no router, is held to nobody)
    kv_minus_dynamo = per["kvmesh"][0]["prefix_hit_ratio"] - per["dynamo"][0]["prefix_hit_ratio"]
    assert cells["hits - best(sglang, dynamo)"] == f"{kv_minus_dynamo:.3f}"
    # where a kvmesh front's own time went: every phase of the latency cost's front, the same total
    # as the case table's routing column; a round-robin front decides, writes and relays, no more
    phases = per["kvmesh"][0]["front_routing_phases_s"]
    assert set(phases) == set(ROUTING_PHASES)
    assert phases["total"] == per["kvmesh"][0]["front_routing_mean_s"]
    assert phases["scheduling"] + phases["find_matches"] < phases["total"]
    assert set(per["round-robin"][0]["front_routing_phases_s"]) == {
        "scheduling",
        "total",
        "forward",
        "relay_first",
    }
    lines = done.stdout[done.stdout.index("where a kvmesh front's own time goes") :].splitlines()
    rows = {r.split("|")[1].strip(): r for r in lines if r.startswith("| ") and "---" not in r}
    assert f"| {1000 * phases['tokenize']:.2f} " in rows["kvmesh"]
    assert rows["round-robin"].split("|")[2].strip() == "-"  # it tokenizes nothing
    assert f"| {1000 * phases['relay_first']:.2f} " in rows["kvmesh"]
    # each request's time to first token split at the engine's arrival and first token: every
    # answered request found in its engine's log, on one clock (the request reached the engine
    # after it was sent, and the client after the engine's first token)
    for name, runs in per.items():
        split = runs[0]["front_split"]
        assert split["matched"] == 1.0, name
        assert split["to_engine_ms"]["p50"] > 0.0 and split["from_engine_ms"]["p50"] > 0.0
        total = sum(split[part]["mean"] for part in ("to_engine_ms", "engine_ms", "from_engine_ms"))
        assert total == pytest.approx(1000 * runs[0]["ttft_s"]["mean"])
    after = done.stdout[done.stdout.index("the time to first token in three parts") :].split("\n\n")[1]
    rows = {r.split("|")[1].strip(): r.split("|")[1:-1] for r in after.splitlines() if "---" not in r}
    assert rows["router"][1].strip() == "to the engine p50 ms"
    kv_split = per["kvmesh"][0]["front_split"]
    assert rows["kvmesh"][1].strip() == f"{kv_split['to_engine_ms']['p50']:.1f}"
    assert rows["kvmesh"][4].strip() == f"{kv_split['from_engine_ms']['p50']:.1f}"


def test_the_floor_runs_only_when_named_and_an_unknown_contender_is_refused() -> None:
    refused = _run("--workloads", "chat-fits", "--contenders", "kvmesh,oracle")
    assert refused.returncode == 2
    assert "--contenders: unknown oracle" in refused.stderr and "floor" in refused.stderr
    empty = _run("--workloads", "chat-fits", "--contenders", ",")
    assert empty.returncode == 2 and "--contenders: unknown empty list" in empty.stderr


def test_a_case_of_bursts_reports_each_burst_s_first_request_and_its_siblings_apart(tmp_path: Path) -> None:
    summaries, out = tmp_path / "summary.json", tmp_path / "requests.jsonl"
    done = _run(
        "--workloads", "siblings", "--engines", "2", "--set", "sessions=4", "--set", "turns=2",
        "--contenders", "round-robin,floor", "--json", str(summaries), "--requests", str(out),
        "--plot", str(tmp_path / "plot.png"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ((label, per),) = json.loads(summaries.read_text()).items()
    requests = [json.loads(line) for line in out.read_text().splitlines()]
    for name in ("round-robin", "floor"):
        sent = [r for r in requests if r["router"] == name]
        steps = {(r["session"], r["turn"]) for r in sent}
        assert len(steps) == 2 * 2 and len(sent) == 4 * len(steps)
        assert per[name][0]["bursts"]["count"] == len(steps)  # every step of every session is a burst
    table = done.stdout[done.stdout.index(f"{label}, by place in a burst") :]
    lines = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert lines[0].split("|")[1].strip() == "router"
    floor = next(line for line in lines if line.split("|")[1].strip() == "floor").split("|")[1:-1]
    first_p50 = per["floor"][0]["bursts"]["first_ttft_s"]["p50"] * 1000
    assert floor[1].strip() == f"{first_p50:.1f}"
    # the siblings that found under half their prompt cached, as each request's usage reported it
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    column = header.index("siblings under half cached %")
    for name in ("round-robin", "floor"):
        bursts: dict[tuple[str, int], list[dict]] = {}
        for r in requests:
            if r["router"] == name and r["ttft_ms"] is not None:  # (what the summary counts)
                bursts.setdefault((r["session"], r["turn"]), []).append(r)
        siblings = [
            r for b in bursts.values() for r in sorted(b, key=lambda r: (r["start_s"], r["ttft_ms"]))[1:]
        ]
        share = sum(2 * r["cached_tokens"] < r["prompt_tokens"] for r in siblings) / len(siblings)
        assert per[name][0]["bursts"]["siblings_uncached"]["share"] == pytest.approx(share)
        row = next(line for line in lines if line.split("|")[1].strip() == name).split("|")[1:-1]
        assert row[column].strip() == f"{100 * share:.1f}"
        # where the siblings reached their engines, from the engines' own logs: every burst found
        arrivals = per[name][0]["bursts"]["arrivals"]
        assert arrivals["bursts"] == per[name][0]["bursts"]["count"]
        gap = arrivals["siblings_after_first_ms"]["p50"]
        assert 0.0 <= gap < 1000.0 and 0.0 <= arrivals["joined_share"] <= 1.0
        gap_column = header.index("siblings at the engine after the first p50 ms")
        assert row[gap_column].strip() == f"{gap:.1f}"
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_case_without_bursts_has_no_burst_table(tmp_path: Path) -> None:
    done = _run("--workloads", "chat-fits", "--engines", "2", "--set", "sessions=2", "--set", "turns=2",
                "--contenders", "round-robin")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "by place in a burst" not in done.stdout
