"""Where in its decode pass a worker will be when a request reaches it: read off its last tokens,
with the lag between those and the engine's pass boundaries learned from what requests show."""

from __future__ import annotations

import math
import random

import pytest

from kvmesh.router.core.pass_lag import MIN_SEEN, PassLag

PASS_MS = 10.0


def _engine_wait(since_ms: float, lag_ms: float) -> float:
    """What a request waits for on an engine ``lag_ms`` further into its pass than ``since_ms``."""
    phase = (since_ms + lag_ms) / PASS_MS
    return PASS_MS * (1.0 - (phase - math.floor(phase)))


def _teach(lag: PassLag, true_lag_ms: float, n: int, rng: random.Random) -> None:
    for _ in range(n):
        since = rng.uniform(0.0, PASS_MS)
        # the curve's overhead is off by 3 ms, and every request has some noise of its own
        lag.observe(since, PASS_MS, 3.0 + _engine_wait(since, true_lag_ms) + rng.gauss(0.0, 0.5))


def test_before_it_has_learned_the_rest_of_the_pass_is_what_the_last_tokens_say() -> None:
    lag = PassLag()
    assert lag.rest(0.0, PASS_MS) == 1.0
    assert lag.rest(2.5, PASS_MS) == pytest.approx(0.75)
    assert lag.rest(-1.0, PASS_MS) == 1.0  # tokens stamped after the decision's clock: just streamed
    # a pass or more ago (a longer step, late tokens) or never: half a pass, the average
    for since in (PASS_MS, 25.0, math.inf, math.nan):
        assert lag.rest(since, PASS_MS) == 0.5


def test_it_learns_the_lag_and_a_request_that_would_just_miss_the_pass_end_waits_a_whole_one() -> None:
    lag = PassLag()
    rng = random.Random(3)
    _teach(lag, 2.0, MIN_SEEN - 1, rng)
    assert lag.lag_ms == 0.0  # too few requests yet
    _teach(lag, 2.0, 300, rng)
    assert lag.lag_ms == pytest.approx(2.0, abs=0.5)
    assert lag.describe() == {"lag_ms": lag.lag_ms, "requests": MIN_SEEN - 1 + 300}
    # 9 ms after the last tokens of a 10 ms pass: the request gets there after the next one began
    assert lag.rest(9.0, PASS_MS) > 0.8
    assert lag.rest(1.0, PASS_MS) == pytest.approx(0.7, abs=0.06)  # 1 ms + ~2 ms into 10: ~7 left


def test_it_follows_a_lag_that_changes_and_ignores_requests_it_cannot_place() -> None:
    lag = PassLag()
    rng = random.Random(4)
    _teach(lag, 3.0, 300, rng)
    assert lag.lag_ms == pytest.approx(3.0, abs=0.5)
    for since in (PASS_MS + 1.0, -0.5, math.inf):  # past a pass, or before the tokens: not counted
        lag.observe(since, PASS_MS, 100.0)
    lag.observe(1.0, PASS_MS, math.nan)
    lag.observe(1.0, PASS_MS, math.inf)
    assert lag.describe()["requests"] == 300
    _teach(lag, 0.5, 300, rng)
    assert lag.lag_ms == pytest.approx(0.5, abs=0.5)
