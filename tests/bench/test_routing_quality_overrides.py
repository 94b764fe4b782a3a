"""`benchmarks/routing_quality.py --set/--num-blocks`: the suite's workloads at other sizes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_quality.py"


@pytest.fixture(scope="module")
def rq():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("routing_quality", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["routing_quality"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_a_change_reaches_the_sessions_sent_and_the_load(rq) -> None:  # type: ignore[no-untyped-def]
    base = rq.Case("agent-long", 4)
    changed = rq.Case("agent-long", 4, changes=(("question_words", 100), ("concurrency", 3)))
    sessions, load = rq.load_for(base, True, 0)
    small, small_load = rq.load_for(changed, True, 0)
    assert load.concurrency == 12 and small_load.concurrency == 3
    # the tool outputs a session appends are a fifth as long, the system prompt the same
    assert len(small[0].followups[0]) < len(sessions[0].followups[0]) / 3
    assert small[0].messages[0] == sessions[0].messages[0]
    assert "question_words=100" in changed.label and "concurrency=3" in changed.label


def test_a_rate_turns_a_closed_loop_open_and_scales_with_the_fleet(rq) -> None:  # type: ignore[no-untyped-def]
    case = rq.Case("chat-fits", 8, changes=(("rate", 5.0),))
    _, load = rq.load_for(case, True, 0)
    assert load.concurrency is None and load.rate == 10.0


def test_num_blocks_replaces_the_engines_cache(rq) -> None:  # type: ignore[no-untyped-def]
    args = rq.Case("siblings", 4, num_blocks=(512,)).engine_args
    assert args[args.index("--num-blocks") + 1] == "512"
    assert args.count("--num-blocks") == 1
    assert rq.Case("siblings", 4).engine_args == rq.ENGINE_ARGS
    assert rq.Case("siblings", 4, num_blocks=(512,)).per_engine_args == ()


def test_block_size_keeps_the_cache_in_tokens_unless_num_blocks_gives_it_in_blocks(rq) -> None:  # type: ignore[no-untyped-def]
    def flags(case) -> tuple[str, str]:  # type: ignore[no-untyped-def]
        args = case.engine_args
        return args[args.index("--block-size") + 1], args[args.index("--num-blocks") + 1]

    assert flags(rq.Case("siblings", 4, block_size=64)) == ("64", "512")  # 2,048 x 16 tokens
    assert flags(rq.Case("siblings", 4, short=True, block_size=32)) == ("32", "512")  # 1,024 x 16
    assert flags(rq.Case("siblings", 4, block_size=64, num_blocks=(300,))) == ("64", "300")
    assert rq.Case("siblings", 4, block_size=64).label == "siblings x4 (block_size=64)"
    assert flags(rq.Case("siblings", 4)) == ("16", "2048")


def test_several_num_blocks_give_each_engine_its_cache_beside_its_speed(rq) -> None:  # type: ignore[no-untyped-def]
    case = rq.Case("chat-fits", 4, num_blocks=(2048, 1024), speedups=(1.0, 1.0, 0.5))
    assert case.engine_args == rq.ENGINE_ARGS  # the suite's cache, which each engine's own replaces
    assert case.per_engine_args == (
        ("--speedup", "1", "--num-blocks", "2048"),
        ("--speedup", "1", "--num-blocks", "1024"),
        ("--speedup", "0.5", "--num-blocks", "2048"),
        ("--speedup", "1", "--num-blocks", "1024"),
    )
    assert case.label == "chat-fits x4 (num_blocks=2048,1024, speedups=1,1,0.5)"
    assert rq.parse_num_blocks("2048,1024") == (2048, 1024)


def test_engine_speedups_give_each_engine_its_speed_and_name_the_case(rq) -> None:  # type: ignore[no-untyped-def]
    case = rq.Case("chat-fits", 4, speedups=(1.0, 0.5))
    assert case.per_engine_args == (("--speedup", "1"), ("--speedup", "0.5")) * 2
    assert case.label == "chat-fits x4 (speedups=1,0.5)"
    assert rq.parse_speedups("2,1,0.25") == (2.0, 1.0, 0.25)
    assert rq.Case("chat-fits", 4).per_engine_args == ()


@pytest.mark.parametrize(
    ("flag", "names"),
    [
        (["--set", "prefix=3000"], "KNOB one of"),
        (["--set", "turns=two"], "--set turns needs an integer"),
        (["--set", "hot_share=1.5"], "--set hot_share must be in [0, 1]"),
        (["--set", "sessions=0"], "--set sessions must be at least 1"),
        (["--num-blocks", "-4"], "--num-blocks: '-4': give a positive integer"),
        (["--num-blocks", "2048,0"], "--num-blocks: '2048,0'"),
        (["--num-blocks", "2048,1.5"], "--num-blocks: '2048,1.5'"),
        (["--engine-speedups", "1,0"], "--engine-speedups: '1,0': give comma-separated positive numbers"),
        (["--engine-speedups", "1,,2"], "--engine-speedups: '1,,2'"),
        (["--engine-speedups", "inf"], "--engine-speedups: 'inf'"),
        (["--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
        # a knob none of the chosen workloads reads, and load knobs their load never uses
        (["--workloads", "agent-long,chat-fits", "--set", "burst=8"], "--set burst: no effect on the chosen"),
        (
            ["--workloads", "hot-prefix", "--set", "think_time=2", "--set", "ramp=1"],
            "--set think_time, ramp: no",
        ),
    ],
)
def test_a_bad_change_is_refused_before_any_fleet_starts(flag: list[str], names: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flag], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert names in done.stderr


def test_a_change_counts_when_any_chosen_workload_reads_it(rq) -> None:  # type: ignore[no-untyped-def]
    assert rq.changes_something(rq.Case("siblings", 4), "burst")
    assert not rq.changes_something(rq.Case("agent-long", 4), "burst")
    assert rq.changes_something(rq.Case("agent-long", 4), "think_time")  # multi-turn, closed loop
    assert not rq.changes_something(rq.Case("hot-prefix", 4), "ramp")  # an open loop has no ramp
    # a rate makes a closed loop open: then its ramp does nothing either
    assert not rq.changes_something(rq.Case("chat-fits", 4, changes=(("rate", 2.0),)), "ramp")
    assert rq.changes_something(rq.Case("hot-prefix", 4), "concurrency")


def _summary(p50: float, hits: float, engine: float | None = None) -> dict[str, object]:
    return {
        "ttft_s": {"p50": p50, "p99": 2 * p50, "mean": p50},
        "prefix_hit_ratio": hits,
        "engine_ttft_mean_s": engine,
    }


def test_verdicts_need_a_baseline_and_compare_round_by_round(rq) -> None:  # type: ignore[no-untyped-def]
    # kvmesh alone (a trace, a profile): nothing to hold it against, so no verdict row, and no
    # crash after a long run
    assert rq.verdicts({"case": {"kvmesh": [_summary(0.1, 0.9)]}}) == ""
    text = rq.verdicts(
        {
            "wl": {
                "kvmesh": [_summary(0.09, 0.90)],
                "dynamo": [_summary(0.1, 0.85)],
                "sglang": [_summary(0.12, 0.95)],
            }
        }
    )
    row = next(line for line in text.splitlines() if line.startswith("| wl "))
    assert "0.90" in row and "-0.050" in row  # p50 against the better baseline; hits against the best
    # the engines' own mean TTFT against the better baseline's, where the engines reported it
    engine = rq.verdicts(
        {"wl": {"kvmesh": [_summary(0.09, 0.9, 0.06)], "dynamo": [_summary(0.1, 0.9, 0.08)]}}
    )
    cells = [c.strip() for c in next(x for x in engine.splitlines() if x.startswith("| wl ")).split("|")]
    assert cells[5] == "0.75" and cells[4] == "0.90"  # engine 60/80 ms; client mean 90/100
    only_rr = rq.verdicts({"case": {"kvmesh": [_summary(0.05, 0.9)], "round-robin": [_summary(0.1, 0.5)]}})
    assert "0.50" in only_rr  # p50 against round-robin, with no sglang or Dynamo run


def test_the_tradeoff_places_each_router_by_its_hits_and_p50_over_rounds(rq) -> None:  # type: ignore[no-untyped-def]
    per = {
        "dynamo": [_summary(0.050, 0.74), _summary(0.048, 0.76), _summary(0.049, 0.75)],
        "sglang": [_summary(0.054, 0.90)],
        "failed": [{"ttft_s": {"p50": None}, "prefix_hit_ratio": None}],  # nothing answered
    }
    points = {name: rest for name, *rest in rq.tradeoff_points(per)}
    assert set(points) == {"dynamo", "sglang"}
    hits, p50, low, high = points["dynamo"]
    assert hits == pytest.approx(75.0) and p50 == pytest.approx(49.0)
    assert (low, high) == (pytest.approx(48.0), pytest.approx(50.0))
    assert points["sglang"] == [
        pytest.approx(90.0),
        pytest.approx(54.0),
        pytest.approx(54.0),
        pytest.approx(54.0),
    ]


def test_every_router_runs_by_default_and_the_floor_only_when_named(rq) -> None:  # type: ignore[no-untyped-def]
    available = rq.contenders()
    default = [c.name for c in rq.choose_contenders(available, None)]
    assert "floor" not in default and {"round-robin", "dynamo", "kvmesh"} <= set(default)
    assert [c.name for c in rq.choose_contenders(available, "floor,round-robin")] == ["round-robin", "floor"]
