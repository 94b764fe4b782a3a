"""Cost per candidate, busy filtering and the pick (argmin or temperature sampling).

Cost of sending a request to worker w (lower is better)::

    credited   = credit * device_blocks + host_weight * host_blocks + disk_weight * disk_blocks
    prefill(w) = active_prefill_tokens(w) + max(ISL - credited * block_size, 0)     (tokens)
    cost(w)    = prefill_load_scale * prefill(w) / block_size + decode_blocks(w)

``decode_blocks(w)`` is the active decode load plus the request's blocks not already active there.
With every credit at 1 this is the reference's "prefill blocks + decode blocks" (worked example:
8 + 10 = 18, 5 + 5 = 10, 2 + 9 = 11 -> worker 2).

Temperature 0 picks the argmin; ties go to the worker with the smallest indexed tree, then to a
random one. Temperature T > 0 samples with ``p ∝ exp(-((cost - min) / (max - min)) / T)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import random


@dataclass(frozen=True, slots=True)
class CostWeights:
    overlap_score_credit: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    prefill_load_scale: float = 1.0


def projected_prefill_tokens(
    active_prefill_tokens: float,
    isl_tokens: int,
    device_blocks: int,
    host_blocks: int,
    disk_blocks: int,
    block_size: int,
    weights: CostWeights,
) -> float:
    """Active prefill tokens plus this request's tokens that the credited cache does not cover."""
    credited = (
        weights.overlap_score_credit * device_blocks
        + weights.host_cache_hit_weight * host_blocks
        + weights.disk_cache_hit_weight * disk_blocks
    )
    return active_prefill_tokens + max(isl_tokens - credited * block_size, 0.0)


def cost(prefill_tokens: float, decode_blocks: float, block_size: int, prefill_load_scale: float) -> float:
    return prefill_load_scale * prefill_tokens / block_size + decode_blocks


def is_busy(
    active_decode_blocks: float,
    active_prefill_tokens: float,
    *,
    total_blocks: int,
    max_num_batched_tokens: int,
    decode_blocks_frac: float | None,
    prefill_tokens_abs: int | None,
    prefill_tokens_frac: float | None,
) -> bool:
    """Any of the three thresholds exceeded (a None threshold is off)."""
    if decode_blocks_frac is not None and active_decode_blocks > decode_blocks_frac * total_blocks:
        return True
    if prefill_tokens_abs is not None and active_prefill_tokens > prefill_tokens_abs:
        return True
    return (
        prefill_tokens_frac is not None
        and active_prefill_tokens > prefill_tokens_frac * max_num_batched_tokens
    )


def softmax_probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """Sampling probabilities over range-normalised costs (uniform when all costs are equal)."""
    lo = min(costs)
    span = max(costs) - lo
    if span <= 0:
        return [1.0 / len(costs)] * len(costs)
    logits = [-((c - lo) / span) / temperature for c in costs]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def pick(costs: Sequence[float], tree_sizes: Sequence[int], temperature: float, rng: random.Random) -> int:
    """Index of the chosen candidate."""
    n = len(costs)
    if n == 1:
        return 0
    if temperature > 0:
        probs = softmax_probabilities(costs, temperature)
        r = rng.random()
        acc = 0.0
        for i, p in enumerate(probs):
            acc += p
            if r < acc:
                return i
        return n - 1
    best = min(costs)
    tied = [i for i in range(n) if costs[i] == best]
    if len(tied) == 1:
        return tied[0]
    smallest = min(tree_sizes[i] for i in tied)
    tied = [i for i in tied if tree_sizes[i] == smallest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
