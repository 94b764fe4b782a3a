"""kvmesh/bench/arrivals.py: a burst's requests found in the engines' request logs."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.bench.arrivals import burst_arrivals, front_split
from kvmesh.bench.runner import RequestResult, RunResult

T0 = 500.0  # the run's start on the engines' clock


def sent(session: str, step: int, start: float, prompt: int, error: str | None = None) -> RequestResult:
    return RequestResult(session, step, "http://front", start, ttft=0.05, prompt_tokens=prompt, error=error)


def logged(at: float, prompt: int, engine: int, step: int | None) -> dict[str, Any]:
    return {"arrival": T0 + at, "prompt_tokens": prompt, "engine": engine, "step": step}


def test_siblings_are_measured_from_the_first_arrival_of_their_burst() -> None:
    run = RunResult(
        "x",
        [
            # three identical prompts: whichever record each is matched to, the burst reads the same
            sent("a", 1, 0.0000, 100),
            sent("a", 1, 0.0002, 100),
            sent("a", 1, 0.0004, 100),
            sent("b", 1, 1.0000, 50),
            sent("b", 1, 1.0001, 60),
            sent("c", 1, 2.0000, 70),  # a step sent alone is no burst
            sent("d", 1, 3.0000, 80),  # a burst with a request the engines never logged
            sent("d", 1, 3.0001, 81),
        ],
        4.0,
        4,
        T0,
    )
    log = [
        logged(-0.5, 100, 0, 1),  # another client's request of the same length, before ours were sent
        logged(0.0010, 100, 0, 5),
        logged(0.0015, 100, 0, 5),  # in the first's step on its engine
        logged(0.0040, 100, 1, 5),  # the same step number on another engine: not its step
        logged(1.0005, 50, 1, 12),
        logged(1.0025, 60, 1, 13),  # on the first's engine, in the next step
        logged(2.0003, 70, 2, 20),
        logged(3.0004, 80, 3, 30),
    ]
    arrivals = burst_arrivals(run, log)
    assert arrivals is not None
    assert arrivals["bursts"] == 2
    # gaps 0.5 and 3.0 ms in a's burst, 2.0 in b's
    assert arrivals["siblings_after_first_ms"]["p50"] == pytest.approx(2.0)
    assert arrivals["siblings_after_first_ms"]["mean"] == pytest.approx((0.5 + 3.0 + 2.0) / 3)
    assert arrivals["joined_share"] == pytest.approx(1 / 3)


def test_a_request_is_matched_only_within_its_window_after_it_was_sent() -> None:
    run = RunResult("x", [sent("a", 1, 0.0, 100), sent("a", 1, 0.0001, 100)], 1.0, 1, T0)
    late = [logged(0.0010, 100, 0, 1), logged(0.0010 + 5.0, 100, 0, 2)]
    assert burst_arrivals(run, late) is None  # the second request's record came 5 s later: not it
    assert burst_arrivals(run, []) is None  # no logs
    failed = RunResult("x", [sent("a", 1, 0.0, 100), sent("a", 1, 0.0001, 100, error="HTTP 500")], 1.0, 1, T0)
    assert burst_arrivals(failed, [logged(0.001, 100, 0, 1), logged(0.002, 100, 0, 1)]) is None


def answered(session: str, start: float, ttft: float, prompt: int) -> RequestResult:
    return RequestResult(session, 1, "http://front", start, ttft=ttft, prompt_tokens=prompt)


def handled(at: float, first_token: float, prompt: int) -> dict[str, Any]:
    return {"arrival": T0 + at, "first_token": T0 + first_token, "prompt_tokens": prompt, "engine": 0}


def test_the_time_to_first_token_splits_at_the_engines_arrival_and_first_token() -> None:
    run = RunResult(
        "x",
        [
            answered("a", 0.000, 0.060, 100),  # 2 ms to the engine, 55 there, 3 back
            answered("b", 1.000, 0.050, 100),  # 4 ms to the engine, 45 there, 1 back
            answered("c", 2.000, 0.080, 200),  # 10 ms to the engine, 60 there, 10 back
            answered("d", 3.000, 0.040, 300),  # never logged by an engine: not counted
            sent("e", 1, 4.000, 400, error="HTTP 503"),  # failed: not a request that was answered
        ],
        5.0,
        5,
        T0,
    )
    log = [
        handled(0.002, 0.057, 100),
        handled(1.004, 1.049, 100),
        handled(2.010, 2.070, 200),
        handled(4.001, 4.020, 400),
    ]
    split = front_split(run, log)
    assert split is not None
    assert split["to_engine_ms"]["p50"] == pytest.approx(4.0)
    assert split["to_engine_ms"]["mean"] == pytest.approx((2.0 + 4.0 + 10.0) / 3)
    assert split["engine_ms"]["p50"] == pytest.approx(55.0)
    assert split["from_engine_ms"]["p50"] == pytest.approx(3.0)
    assert split["from_engine_ms"]["p90"] == pytest.approx(3.0 + 0.8 * (10.0 - 3.0))
    assert split["matched"] == pytest.approx(3 / 4)


def test_no_split_without_engine_logs_or_first_tokens() -> None:
    run = RunResult("x", [answered("a", 0.0, 0.05, 100)], 1.0, 1, T0)
    assert front_split(run, []) is None
    unfinished = [{"arrival": T0 + 0.001, "first_token": None, "prompt_tokens": 100, "engine": 0}]
    assert front_split(run, unfinished) is None
