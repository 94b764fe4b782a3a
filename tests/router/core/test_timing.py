"""The online timing model: it recovers a known curve and the worker's fixed overhead, shrugs off an
outlier, follows a slowdown, and does not let short prompts' noise bend the slope."""

from __future__ import annotations

import random

import pytest

from kvmesh.router.core.timing import (
    MAD_TO_SD,
    MOCKER_PRIOR,
    SHRINK,
    Profile,
    TimingModel,
    WorkerTiming,
    features,
)

TRUE = Profile((2.0e-06, 0.04, 30.0), (0.0, 0.0, 8.0), 8.0, "truth")
"""A worker ~2.5x slower than the prior on long prompts, with an 8 ms decode pass."""
OVERHEAD = 12.0
"""ms between dispatch and first token that are not engine work (HTTP, request handling)."""


def _truth(
    x: float, decoding: bool, profile: Profile = TRUE, budget: int = 8192, overhead: float = OVERHEAD
) -> float:
    s2, s1, k = features(x, budget)
    a, b, c = profile.prefill_ms
    return overhead + a * s2 * 1e6 + b * s1 * 1e3 + c * k + (k if decoding else 1.0) * profile.decode(0.3)


def _feed(
    model: TimingModel, rng: random.Random, n: int, profile: Profile = TRUE, noise: float = 0.02
) -> None:
    for _ in range(n):
        x = rng.uniform(50, 16000)
        decoding = rng.random() < 0.5
        y = _truth(x, decoding, profile) * (1 + rng.gauss(0, noise))
        model.observe_itl(profile.decode(0.3) * (1 + rng.gauss(0, noise)), 0.3)
        model.observe_ttft(x, decoding, 0.3, y)


def test_features_split_work_into_step_sized_chunks() -> None:
    assert features(10000, 8192) == pytest.approx((8.192**2 + 1.808**2, 10.0, 2.0))
    assert features(0, 8192) == (0.0, 0.0, 1.0)


def test_features_asked_again_are_those_of_the_arguments_asked() -> None:
    """The last answer is kept for the next call with the same arguments, and only for it."""
    asks = [(10000, 8192), (10000, 8192), (10000, 4096), (10000.0, 4096), (9999, 4096), (0, 4096), (9999, 0)]
    first = [features(x, b) for x, b in asks]
    for (x, b), expected in zip(reversed(asks), reversed(first), strict=True):
        assert features(x, b) == expected
    assert first[2] == pytest.approx((2 * 4.096**2 + 1.808**2, 10.0, 3.0))
    assert first[6] == features(9999, 1)  # a budget below one step is one token a step


def test_the_fit_recovers_known_coefficients_from_the_mocker_prior() -> None:
    model = TimingModel(MOCKER_PRIOR, 8192)
    _feed(model, random.Random(1), 400)
    a, b, c = model.describe()["prefill_ms"]
    assert a == pytest.approx(2.0e-06, rel=0.15)
    assert b == pytest.approx(0.04, rel=0.15)
    assert c == pytest.approx(30.0, rel=0.2)
    assert model.describe()["overhead_ms"] == pytest.approx(OVERHEAD, abs=5.0)
    for x in (200, 3000, 12000):
        assert model.ttft_ms(x, True, 0.3) == pytest.approx(_truth(x, True), rel=0.1)
    assert model.describe()["ttft_rel_error"] < 0.1
    # the overhead is no engine work: what the request adds to the worker's queue leaves it out
    assert model.prefill_ms(3000) == pytest.approx(_truth(3000, False, overhead=0.0) - 8.0, rel=0.1)


def test_short_prompts_noise_does_not_bend_the_slope() -> None:
    """TTFTs of short prompts carry tens of ms of unmodelled waiting (the step in progress when the
    request came) that dwarf what their tokens cost. The fit must not read that as a slope: it
    keeps the seed's slope and puts the level into the constant terms."""
    model = TimingModel(MOCKER_PRIOR, 8192)
    rng = random.Random(5)
    true = Profile(MOCKER_PRIOR.prefill_ms, MOCKER_PRIOR.decode_ms, 1.0, "mocker")
    for _ in range(200):
        x = rng.uniform(50, 800)
        y = _truth(x, True, true, overhead=OVERHEAD) + rng.uniform(0, 60)  # waits for a step in flight
        model.observe_ttft(x, True, 0.3, y)
    _, b, _ = model.describe()["prefill_ms"]
    assert b == pytest.approx(MOCKER_PRIOR.prefill_ms[1], rel=0.5)  # the seed's slope, not 10x
    # while the level follows the data: ~12 ms overhead + ~30 ms mean wait above the engine's time
    level = model.ttft_ms(400, True, 0.3) - _truth(400, True, true, overhead=0.0)
    assert level == pytest.approx(OVERHEAD + 30.0, abs=10.0)


def test_one_outlier_barely_moves_the_fit() -> None:
    model = TimingModel(MOCKER_PRIOR, 8192)
    _feed(model, random.Random(2), 300)
    before = model.ttft_ms(4000, False, 0.3)
    changes, outliers = model.changes, model.outliers
    model.observe_ttft(200, False, 0.3, 60_000.0)  # a request that stalled for a minute
    after = model.ttft_ms(4000, False, 0.3)
    assert model.outliers == outliers + 1 and model.changes == changes  # one is no change
    assert after == pytest.approx(before, rel=0.05)
    unclipped = _truth(4000, False) + 60_000  # what an unclipped least-squares step would chase
    assert abs(after - before) < 0.01 * abs(unclipped - before)


def test_the_fit_follows_a_worker_that_slows_down() -> None:
    model = TimingModel(MOCKER_PRIOR, 8192)
    rng = random.Random(3)
    _feed(model, rng, 300)
    slow = Profile(tuple(3 * v for v in TRUE.prefill_ms), TRUE.decode_ms, 8.0, "slow")  # type: ignore[arg-type]
    _feed(model, rng, 100, slow)
    assert model.changes >= 1  # residuals of one sign, in a row: a change, not outliers
    assert model.ttft_ms(6000, False, 0.3) == pytest.approx(_truth(6000, False, slow), rel=0.1)
    assert model.ttft_ms(500, False, 0.3) == pytest.approx(_truth(500, False, slow), rel=0.15)


def test_the_recompute_price_is_a_full_steps_cost_a_token_not_one_coefficient() -> None:
    """What recomputing an evicted token costs is read off the fitted curve over a full step
    (``a * budget + b`` ms a token), not off its linear coefficient alone. Over the prompt lengths a
    fleet sees, the quadratic and linear coefficients trade against each other: fits of the same
    engine from different traffic split a step's time between them differently, and the linear
    coefficient alone then differed by up to 2x between identical workers, and so did every price
    of eviction. The full step's cost is what the observations pin down."""
    budget = 8192
    true = Profile(MOCKER_PRIOR.prefill_ms, MOCKER_PRIOR.decode_ms, 1.0, "mocker")
    a, b, _ = true.prefill_ms
    full_step = a * budget + b
    prices, slopes = [], []
    for seed in range(12):
        model = TimingModel(MOCKER_PRIOR, budget)
        rng = random.Random(seed)
        for _ in range(60):
            x = rng.uniform(300, 9000)
            model.observe_ttft(x, True, 0.3, _truth(x, True, true) * (1 + rng.gauss(0, 0.08)))
        prices.append(model.ms_per_token())
        slopes.append(model.describe()["prefill_ms"][1])
    assert all(0.85 * full_step < p < 1.35 * full_step for p in prices)
    assert max(prices) / min(prices) < max(slopes) / min(slopes)  # steadier than the coefficient
    # two curves that agree on a full step price a recomputed token alike, however they split it
    tilted = Profile((a + 1e-6, b - 1e-6 * budget, 16.5), MOCKER_PRIOR.decode_ms, 1.0, "tilted")
    assert TimingModel(tilted, budget).ms_per_token() == pytest.approx(full_step, rel=1e-9)
    assert TimingModel(true, budget).ms_per_token() == pytest.approx(full_step, rel=1e-9)


def test_itl_learns_the_decode_pass() -> None:
    model = TimingModel(MOCKER_PRIOR, 8192)
    for _ in range(300):
        model.observe_itl(2 * MOCKER_PRIOR.decode(0.5), 0.5)
    assert model.decode_ms(0.5) == pytest.approx(2 * MOCKER_PRIOR.decode(0.5), rel=0.02)


def test_profiles_from_worker_info() -> None:
    doc = {"prefill_ms": [1e-7, 0.01, 5.0], "decode_ms": [0.0, 1.0, 2.0], "decode_min_ms": 0.5}
    profile = Profile.from_info(doc)
    assert profile is not None and profile.prefill_ms == (1e-7, 0.01, 5.0) and profile.decode(1.0) == 3.0
    seeded = TimingModel(profile, 8192)
    assert seeded.prefill_ms(1000) == pytest.approx(1e-7 * 1e6 + 10 + 5)
    assert Profile.from_info({"prefill_ms": [1, 2]}) is None
    assert Profile.from_info({"prefill_ms": [-1, 2, 3], "decode_ms": [0, 0, 1]}) is None
    assert Profile.from_info(None) is None


def test_a_wait_for_the_running_step_is_taken_out_before_fitting() -> None:
    """Requests that arrived during another request's prefill step waited it out (0-80 ms here,
    plus the decode pass that ends it) before their own steps ran, each with a decode pass for the
    request that ran it. Told that wait, the fit recovers the same curve as without it, and
    predicts the wait on top; a fit not told it reads it as a longer step."""
    told, untold = TimingModel(MOCKER_PRIOR, 8192), TimingModel(MOCKER_PRIOR, 8192)
    rng = random.Random(5)
    d = TRUE.decode(0.3)
    for _ in range(400):
        x = rng.uniform(50, 16000)
        wait = rng.choice((0.0, rng.uniform(1.0, 80.0)))
        behind = wait + features(x, 8192)[2] * d if wait else 0.0  # (k + 1) passes, not 1
        y = (_truth(x, False) + behind) * (1 + rng.gauss(0, 0.02))
        told.observe_ttft(x, False, 0.3, y, wait)
        untold.observe_ttft(x, False, 0.3, y)
    for x in (200, 3000, 12000):
        assert told.ttft_ms(x, False, 0.3) == pytest.approx(_truth(x, False), rel=0.1)
        k = features(x, 8192)[2]
        assert told.ttft_ms(x, False, 0.3, 40.0) == pytest.approx(_truth(x, False) + 40.0 + k * d, rel=0.1)
    assert told.describe()["ttft_rel_error"] < untold.describe()["ttft_rel_error"]
    assert untold.ttft_ms(200, False, 0.3) > 1.2 * _truth(200, False)
    # behind a running prefill step: that step's own decode pass, and one in each step after it
    learned = told.decode_ms(0.3)
    assert told.ttft_ms(3000, True, 0.3, 10.0) - told.ttft_ms(3000, True, 0.3) == pytest.approx(
        10.0 + 0.5 * learned
    )
    assert told.ttft_ms(3000, False, 0.3, 10.0) - told.ttft_ms(3000, False, 0.3) == pytest.approx(
        10.0 + learned
    )


def test_the_uncertainty_of_a_prediction_narrows_as_the_worker_is_learned() -> None:
    """On its prior the model is unsure of its expected TTFT by tens of ms; after a few hundred
    observations by a few, far less than single TTFTs scatter around it (which no choice of
    worker changes, so it is no reason to call two candidates a tie)."""
    model = TimingModel(MOCKER_PRIOR, 8192)
    cold = model.uncertainty_ms(3000)
    assert cold > 20.0
    _feed(model, random.Random(2), 300, noise=0.1)
    warm = model.uncertainty_ms(3000)
    assert warm < cold / 5
    assert warm < MAD_TO_SD * model.scale_ms


def test_a_blended_worker_predicts_as_the_weighted_mean_of_its_fit_and_the_fleets() -> None:
    """The blend is built once per change of either fit; it must predict exactly what weighing the
    two fits' predictions would, after each of them learns and when the step budget changes."""
    rng = random.Random(5)
    own, fleet = TimingModel(MOCKER_PRIOR, 8192), TimingModel(MOCKER_PRIOR, 8192)
    worker = WorkerTiming(own, fleet, profiled=False)

    def check() -> None:
        w = own.observations / (own.observations + SHRINK)
        for x in (0.0, 300.0, 5000.0, 20000.0):
            for decoding, wait in ((False, 0.0), (True, 0.0), (True, 12.0)):
                want = w * own.ttft_ms(x, decoding, 0.4, wait) + (1 - w) * fleet.ttft_ms(
                    x, decoding, 0.4, wait
                )
                assert worker.ttft_ms(x, decoding, 0.4, wait) == pytest.approx(want, rel=1e-12)
            want = w * own.added_prefill_ms(1000.0, x) + (1 - w) * fleet.added_prefill_ms(1000.0, x)
            assert worker.added_prefill_ms(1000.0, x) == pytest.approx(want, rel=1e-12, abs=1e-12)
            want = w * own.prefill_ms(x) + (1 - w) * fleet.prefill_ms(x)
            assert worker.prefill_ms(x) == pytest.approx(want, rel=1e-12, abs=1e-12)
            want = w * own.uncertainty_ms(x) + (1 - w) * fleet.uncertainty_ms(x)
            assert worker.uncertainty_ms(x) == pytest.approx(want, rel=1e-12)

    check()
    for i in range(60):
        x = rng.uniform(100, 9000)
        target = own if i % 3 else fleet  # the fleet also learns from other workers
        target.observe_ttft(x, True, 0.3, 20 + 0.03 * x + rng.uniform(-5, 5))
        check()
        target.observe_itl(rng.uniform(8, 14), 0.3)
        check()
    own.set_step_budget(2048)  # own chunks differently now: the fits are blended as predictions
    check()
    fleet.set_step_budget(2048)
    check()


def test_a_decoding_worker_s_wait_for_the_pass_in_progress_is_taken_out_before_fitting() -> None:
    """On a decoding worker a request waits for the rest of the decode pass in progress: all of it
    just after the worker streamed its tokens, none just before the next. Told that share, the fit
    takes the wait out and predicts it; one not told sees half a pass on average and the rest as
    noise, so it predicts worse."""
    told, untold = TimingModel(MOCKER_PRIOR, 8192), TimingModel(MOCKER_PRIOR, 8192)
    rng = random.Random(11)
    d = TRUE.decode(0.3)
    for _ in range(400):
        x = rng.uniform(50, 4000)
        rest = rng.random()
        y = (_truth(x, True) + rest * d) * (1 + rng.gauss(0, 0.01))
        for model in (told, untold):
            model.observe_itl(d, 0.3)
        told.observe_ttft(x, True, 0.3, y, 0.0, rest)
        untold.observe_ttft(x, True, 0.3, y)
    assert told.describe()["ttft_rel_error"] < 0.7 * untold.describe()["ttft_rel_error"]
    learned = told.decode_ms(0.3)
    assert told.ttft_ms(3000, True, 0.3, 0.0, 1.0) - told.ttft_ms(
        3000, True, 0.3, 0.0, 0.25
    ) == pytest.approx(0.75 * learned)
    assert told.ttft_ms(3000, True, 0.3) == pytest.approx(told.ttft_ms(3000, True, 0.3, 0.0, 0.5))
    # not decoding: no pass in progress to wait for
    assert told.ttft_ms(3000, False, 0.3, 0.0, 1.0) == told.ttft_ms(3000, False, 0.3)
