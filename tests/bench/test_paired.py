"""The verdicts' intervals: a paired bootstrap over sessions (`kvmesh.bench.paired`), and the
routing-quality suite's table of them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.bench.paired import PairedRequest, _Router, paired_verdicts
from kvmesh.bench.report import percentile

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_quality.py"


def _traffic(seed: int, sessions: int = 30, turns: int = 4, rounds: int = 1) -> list[PairedRequest]:
    """Sessions of differing difficulty (a per-session scale) with per-turn noise."""
    rng = random.Random(seed)
    out = []
    for rnd in range(1, rounds + 1):
        for s in range(sessions):
            scale = rng.uniform(20.0, 200.0)
            for _ in range(turns):
                out.append(PairedRequest(rnd, f"s{s}", scale * rng.uniform(0.9, 1.1), 1000, 600))
    return out


def _scaled(reqs: list[PairedRequest], by: float, cached: int | None = None) -> list[PairedRequest]:
    return [
        PairedRequest(
            r.round,
            r.session,
            None if r.ttft is None else r.ttft * by,
            r.prompt_tokens,
            r.cached_tokens if cached is None else cached,
        )
        for r in reqs
    ]


def test_the_same_requests_are_even_in_every_draw() -> None:
    reqs = _traffic(1)
    got = paired_verdicts(reqs, {"sglang": list(reqs)}, draws=200)
    for name in ("p50", "p99", "mean"):
        iv = got[name]
        assert iv is not None and iv.value == iv.low == iv.high == pytest.approx(1.0)
    hits = got["hits"]
    assert hits is not None and hits.value == hits.low == hits.high == 0.0


def test_a_router_slower_on_every_request_is_slower_in_every_draw() -> None:
    # paired: the sessions' own spread (20-200 ms) cancels, so the ratio is exact in each draw
    base = _traffic(2)
    got = paired_verdicts(_scaled(base, 1.1, cached=500), {"dynamo": base}, draws=200)
    for name in ("p50", "p99", "mean"):
        iv = got[name]
        assert iv is not None and iv.low == pytest.approx(1.1) and iv.high == pytest.approx(1.1)
    hits = got["hits"]
    assert hits is not None and hits.value == pytest.approx(0.5 - 0.6) == pytest.approx(hits.high)


def test_noise_alone_gives_an_interval_around_even() -> None:
    base = _traffic(3)
    rng = random.Random(9)
    noisy = [
        PairedRequest(r.round, r.session, r.ttft * rng.uniform(0.8, 1.2), r.prompt_tokens, r.cached_tokens)
        for r in base
        if r.ttft is not None
    ]
    got = paired_verdicts(noisy, {"sglang": base}, draws=400)
    p50 = got["p50"]
    assert p50 is not None and p50.low < 1.0 < p50.high and p50.high - p50.low > 0.02
    assert p50.low <= p50.value <= p50.high


def test_the_best_baseline_is_the_bar() -> None:
    base = _traffic(4)
    got = paired_verdicts(base, {"slow": _scaled(base, 2.0), "fast": _scaled(base, 0.8)}, draws=50)
    assert got["p50"] is not None and got["p50"].value == pytest.approx(1.25)
    # hits: the higher of the baselines
    got = paired_verdicts(
        _scaled(base, 1.0, cached=700), {"a": _scaled(base, 1.0, cached=900), "b": base}, draws=50
    )
    assert got["hits"] is not None and got["hits"].value == pytest.approx(0.7 - 0.9)


def test_rounds_are_resampled_apart() -> None:
    """Session names repeat across rounds; each round's sessions are units of their own, and a
    draw takes as many of each round as it had."""
    base = [PairedRequest(rnd, f"s{s}", 10.0) for rnd in (1, 2) for s in range(10) for _ in range(3)]
    mine = [PairedRequest(r.round, r.session, 30.0 if r.round == 2 else 10.0) for r in base]
    got = paired_verdicts(mine, {"sglang": base}, draws=300)
    mean = got["mean"]
    # slower only in round 2: pooled, the mean is (10 + 30) / (10 + 10) in every draw that keeps
    # ten sessions of each round (one resampling the two rounds together would not)
    assert mean is not None and mean.value == pytest.approx(2.0)
    assert mean.low == pytest.approx(2.0) and mean.high == pytest.approx(2.0)


def test_the_weighted_quantile_is_the_percentile_of_the_repeated_requests() -> None:
    rng = random.Random(11)
    for _ in range(200):
        n_units = rng.randint(1, 6)
        reqs = [
            PairedRequest(1, f"u{rng.randrange(n_units)}", round(rng.uniform(1, 50), 1))
            for _ in range(rng.randint(1, 12))
        ]
        units = sorted({r.session for r in reqs})
        unit_of = {(1, u): i for i, u in enumerate(units)}
        weights = [rng.randint(0, 3) for _ in units]
        if not any(weights):
            weights[0] = 1
        repeated = [r.ttft for r in reqs for _ in range(weights[units.index(r.session)])]
        router = _Router(reqs, unit_of)
        for name, q in (("p50", 50), ("p99", 99)):
            if repeated:
                assert router.stat(name, weights) == pytest.approx(percentile(repeated, q))
            else:
                assert router.stat(name, weights) is None


def test_failed_requests_and_unreported_tokens() -> None:
    base = _traffic(6)
    mine = [PairedRequest(r.round, r.session, r.ttft) for r in base]  # no tokens reported
    mine.append(PairedRequest(1, "s0", None))  # a failed request is not timed
    got = paired_verdicts(mine, {"sglang": base}, draws=20)
    assert got["hits"] is None
    assert got["p50"] is not None and got["p50"].value == pytest.approx(1.0)


def test_refuses_what_it_cannot_answer() -> None:
    with pytest.raises(ValueError, match="baseline"):
        paired_verdicts(_traffic(7), {})
    with pytest.raises(ValueError, match="level"):
        paired_verdicts(_traffic(7), {"sglang": _traffic(7)}, level=1.0)
    with pytest.raises(ValueError, match="draws"):
        paired_verdicts(_traffic(7), {"sglang": _traffic(7)}, draws=0)


def test_the_suite_prints_and_plots_how_sure_each_verdict_is(tmp_path: Path) -> None:
    requests, plot = tmp_path / "requests.jsonl", tmp_path / "plot.png"
    done = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--workloads", "chat-fits", "--engines", "1",
            "--set", "sessions=12", "--set", "turns=2", "--contenders", "dynamo,kvmesh",
            "--plot", str(plot), "--no-progress", "--requests", str(requests),
        ],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    head, _, rest = done.stdout.partition("### how sure")
    assert "### the default router against the baselines" in head
    rows = [line for line in rest.splitlines() if line.startswith("| chat-fits")]
    assert len(rows) == 1, rest
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    sessions = {json.loads(line)["session"] for line in requests.read_text().splitlines()}
    assert cells[-1] == str(len(sessions)) and len(sessions) > 1
    for cell in cells[1:4]:  # ratio (low-high)
        value, interval = cell.split(" ")
        low, high = (float(x) for x in interval.strip("()").split("-"))
        assert low <= float(value) <= high
    # and the plot gains a row: the verdicts with their intervals
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_draws_the_intervals_below_the_cases(tmp_path: Path) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import routing_quality as rq
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from matplotlib import image

    def summary(p50: float) -> dict[str, object]:
        return {
            "ttft_s": {"p50": p50, "p90": 2 * p50, "p99": 3 * p50},
            "prefix_hit_ratio": 0.8,
            "per_engine": [3, 5],
        }

    results = {"chat-fits x4": {"sglang": [summary(0.05)], "kvmesh": [summary(0.04)]}}
    sure = rq.how_sure(
        {
            "chat-fits x4": {
                router: [
                    {"round": 1, "session": f"s{i}", "error": None, "ttft_ms": ms * (1 + i % 3),
                     "prompt_tokens": 100, "cached_tokens": 80}
                    for i in range(12)
                ]
                for router, ms in (("sglang", 50.0), ("kvmesh", 40.0))
            }
        },
        draws=50,
    )  # fmt: skip
    assert sure["chat-fits x4"].sessions == 12
    p50 = sure["chat-fits x4"].verdicts["p50"]
    assert p50 is not None and p50.value == pytest.approx(0.8)
    plain = image.imread(rq.write_plot(results, tmp_path / "plain.png"))
    with_sure = image.imread(rq.write_plot(results, tmp_path / "sure.png", sure))
    assert with_sure.shape[0] > plain.shape[0]  # a row more: the forest of intervals
    assert with_sure.shape[1] == plain.shape[1]
