"""Cost formula, busy filtering and the pick, with hand-computed expectations."""

from __future__ import annotations

import math
import random

import pytest

from kvmesh.router.core.selector import (
    CostWeights,
    cost,
    is_busy,
    pick,
    projected_prefill_tokens,
    softmax_probabilities,
)


def test_reference_worked_example_picks_worker_2() -> None:
    # prefill blocks / decode blocks of the reference's example: 8+10, 5+5, 2+9
    costs = [cost(p * 16, d, 16, 1.0) for p, d in [(8, 10), (5, 5), (2, 9)]]
    assert costs == [18, 10, 11]
    assert pick(costs, [0, 0, 0], 0.0, random.Random(0)) == 1


def test_prefill_tokens_credit_each_tier() -> None:
    w = CostWeights(1.0, 0.75, 0.25, 1.0)
    # ISL 100, block 10: credited = 2 + 0.75*2 + 0.25*4 = 4.5 blocks = 45 tokens; plus 7 active
    assert projected_prefill_tokens(7, 100, 2, 2, 4, 10, w) == 62
    # credit never drives a worker's own prompt share below zero
    assert projected_prefill_tokens(7, 10, 5, 0, 0, 10, w) == 7


def test_overlap_credit_scales_device_blocks() -> None:
    half = CostWeights(0.5, 0.75, 0.25, 1.0)
    assert projected_prefill_tokens(0, 100, 6, 0, 0, 10, half) == 70
    none = CostWeights(0.0, 0.0, 0.0, 1.0)
    assert projected_prefill_tokens(0, 100, 6, 0, 0, 10, none) == 100


def test_prefill_load_scale_weighs_prefill_against_decode() -> None:
    assert cost(160, 3, 16, 2.0) == 2 * 10 + 3
    assert cost(160, 3, 16, 0.0) == 3


def test_ties_go_to_the_smallest_tree_then_random() -> None:
    assert pick([5, 5, 7], [30, 10, 0], 0.0, random.Random(0)) == 1
    seen = {pick([5, 5, 7], [10, 10, 0], 0.0, random.Random(seed)) for seed in range(40)}
    assert seen == {0, 1}


def test_softmax_over_range_normalised_costs() -> None:
    probs = softmax_probabilities([0, 5, 10], 1.0)
    weights = [1, math.exp(-0.5), math.exp(-1)]
    assert probs == pytest.approx([x / sum(weights) for x in weights])
    # scale-free: the same shape for costs 10x larger
    assert softmax_probabilities([0, 50, 100], 1.0) == pytest.approx(probs)
    assert softmax_probabilities([3, 3], 0.5) == [0.5, 0.5]


def test_temperature_sampling_follows_the_probabilities() -> None:
    rng = random.Random(7)
    counts = [0, 0, 0]
    for _ in range(6000):
        counts[pick([0, 5, 10], [0, 0, 0], 1.0, rng)] += 1
    expected = softmax_probabilities([0, 5, 10], 1.0)
    for c, p in zip(counts, expected, strict=True):
        assert abs(c / 6000 - p) < 0.03


@pytest.mark.parametrize(
    ("decode", "prefill", "kw", "busy"),
    [
        (90, 0, {"decode_blocks_frac": 0.9}, False),
        (91, 0, {"decode_blocks_frac": 0.9}, True),
        (0, 500, {"prefill_tokens_abs": 500}, False),
        (0, 501, {"prefill_tokens_abs": 500}, True),
        (0, 1025, {"prefill_tokens_frac": 0.5}, True),
        (0, 1024, {"prefill_tokens_frac": 0.5}, False),
        (10**6, 10**6, {}, False),
    ],
)
def test_busy_thresholds(decode: int, prefill: int, kw: dict, busy: bool) -> None:
    args = {"decode_blocks_frac": None, "prefill_tokens_abs": None, "prefill_tokens_frac": None, **kw}
    assert is_busy(decode, prefill, total_blocks=100, max_num_batched_tokens=2048, **args) is busy
