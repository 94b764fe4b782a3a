"""The spread of observed around predicted waits for memory, which widens the band of costs the
router cannot tell apart (``LatencyCost.pick_saving_work``)."""

from __future__ import annotations

import random

import pytest

from kvmesh.router.core.wait_spread import CLIP, PRIOR, SHRINK, WaitSpread


def test_before_any_wait_is_seen_the_prior_spread_is_used() -> None:
    spread = WaitSpread()
    assert spread.relative == PRIOR
    assert spread.width_ms(800.0) == pytest.approx(800.0 * PRIOR)
    assert spread.width_ms(0.0) == 0.0


def test_it_learns_how_far_the_waits_come_from_their_predictions() -> None:
    """Waits that come in within +-30% of the prediction (uniformly: a relative mean square of
    0.03) teach that spread, at every size, the prior weighing as ``SHRINK`` requests."""
    rng = random.Random(0)
    spread = WaitSpread()
    n = 300
    for _ in range(n):
        predicted = rng.uniform(200.0, 2000.0)
        spread.observe(predicted, predicted * (1.0 + rng.uniform(-0.3, 0.3)))
    expected = ((n * 0.03 + SHRINK * PRIOR**2) / (n + SHRINK)) ** 0.5
    assert spread.relative == pytest.approx(expected, rel=0.1)
    assert spread.relative < 0.3  # below the largest error it saw
    assert spread.width_ms(1000.0) == pytest.approx(1000.0 * spread.relative)


def test_exact_predictions_narrow_it_toward_nothing_as_the_prior_fades() -> None:
    spread = WaitSpread()
    widths = []
    for n in (SHRINK, 10 * SHRINK, 40 * SHRINK):
        while spread.describe()["requests"] < n:
            spread.observe(500.0, 500.0)
        widths.append(spread.relative)
    assert widths[0] == pytest.approx(PRIOR * 0.5**0.5)  # the prior weighs as much as the requests
    assert widths[0] > widths[1] > widths[2] > 0.0


def test_a_wait_far_longer_than_any_model_would_predict_counts_as_clipped() -> None:
    """A request that met a stalled step as well is not the memory model's error alone."""
    stalled, clipped = WaitSpread(), WaitSpread()
    for _ in range(50):
        stalled.observe(100.0, 100.0 * 50)
        clipped.observe(100.0, 100.0 * CLIP)
    assert stalled.relative == pytest.approx(clipped.relative)


def test_it_follows_the_traffic_after_the_fleet_changes() -> None:
    """Sums are halved as they grow: after a long stretch of poor predictions, a long stretch of
    good ones brings the spread down again."""
    spread = WaitSpread()
    for _ in range(1000):
        spread.observe(1000.0, 2000.0)
    poor = spread.relative
    for _ in range(2000):
        spread.observe(1000.0, 1000.0)
    assert poor > 0.9
    assert spread.relative < 0.2 * poor


@pytest.mark.parametrize("predicted", [0.0, -5.0])
def test_requests_predicted_no_wait_teach_nothing(predicted: float) -> None:
    spread = WaitSpread()
    spread.observe(predicted, 900.0)
    spread.observe(300.0, float("nan"))
    assert spread.describe() == {"requests": 0.0, "relative_spread": PRIOR}
