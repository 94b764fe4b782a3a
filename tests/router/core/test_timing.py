"""The online timing model: it recovers a known curve, shrugs off an outlier, follows a slowdown."""

from __future__ import annotations

import random

import pytest

from kvmesh.router.core.timing import MOCKER_PRIOR, Profile, TimingModel, features

TRUE = Profile((2.0e-06, 0.04, 30.0), (0.0, 0.0, 8.0), 8.0, "truth")
"""A worker ~2.5x slower than the prior on long prompts, with an 8 ms decode pass."""


def _truth(x: float, decoding: bool, profile: Profile = TRUE, budget: int = 8192) -> float:
    s2, s1, k = features(x, budget)
    a, b, c = profile.prefill_ms
    return a * s2 * 1e6 + b * s1 * 1e3 + c * k + (k if decoding else 1.0) * profile.decode(0.3)


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


def test_the_fit_recovers_known_coefficients_from_the_mocker_prior() -> None:
    model = TimingModel(MOCKER_PRIOR, 8192)
    _feed(model, random.Random(1), 400)
    a, b, c = model.describe()["prefill_ms"]
    assert a == pytest.approx(2.0e-06, rel=0.15)
    assert b == pytest.approx(0.04, rel=0.15)
    assert c == pytest.approx(30.0, rel=0.2)
    for x in (200, 3000, 12000):
        assert model.ttft_ms(x, True, 0.3) == pytest.approx(_truth(x, True), rel=0.1)
    assert model.describe()["ttft_rel_error"] < 0.1


def test_one_outlier_barely_moves_the_fit() -> None:
    model = TimingModel(MOCKER_PRIOR, 8192)
    _feed(model, random.Random(2), 300)
    before = model.ttft_ms(4000, False, 0.3)
    model.observe_ttft(200, False, 0.3, 60_000.0)  # a request that stalled for a minute
    after = model.ttft_ms(4000, False, 0.3)
    assert model.outliers >= 1
    assert after == pytest.approx(before, rel=0.05)
    unclipped = _truth(4000, False) + 60_000  # what an unclipped least-squares step would chase
    assert abs(after - before) < 0.01 * abs(unclipped - before)


def test_the_fit_follows_a_worker_that_slows_down() -> None:
    model = TimingModel(MOCKER_PRIOR, 8192)
    rng = random.Random(3)
    _feed(model, rng, 300)
    slow = Profile(tuple(3 * v for v in TRUE.prefill_ms), TRUE.decode_ms, 8.0, "slow")  # type: ignore[arg-type]
    _feed(model, rng, 300, slow)
    assert model.ttft_ms(6000, False, 0.3) == pytest.approx(_truth(6000, False, slow), rel=0.1)


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
