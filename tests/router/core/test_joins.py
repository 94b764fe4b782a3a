"""kvmesh/router/core/joins.py: how often a request routed right behind the step in progress joins
that step, by how soon after the step's request it was routed, per worker."""

from __future__ import annotations

import pytest

from kvmesh.router.core.joins import EDGES_S, HALVE_AT, SHRINK, Joins

A, B, C = ("a", 0), ("b", 0), ("c", 0)


def test_nothing_seen_is_the_model_s_assumption_that_a_running_step_cannot_be_joined() -> None:
    assert Joins().share(A, 0.0001) == 0.0


def test_the_share_is_per_gap_shrunk_toward_none_while_few_were_seen() -> None:
    j = Joins()
    for _ in range(9):
        j.observe(A, 0.0004, True)  # routed 0.4 ms after the step's request: joined
    j.observe(A, 0.0004, False)
    for _ in range(10):
        j.observe(A, 0.010, False)  # 10 ms after: the step had started
    fleet = 9 / 11
    assert j.share(A, 0.0003) == pytest.approx((9 + SHRINK * fleet) / (10 + SHRINK))
    assert j.share(C, 0.0003) == pytest.approx(fleet)  # a worker not seen yet: the fleet's
    assert j.share(A, 0.012) == 0.0
    assert j.share(A, 0.0015) == 0.0  # a gap never seen says nothing
    j.observe(A, 0.5, True)  # past the last edge: a bin of its own
    assert j.share(C, EDGES_S[-1] * 10) == 1 / 2


def test_a_worker_whose_engine_never_takes_a_request_into_a_running_step_is_learned_apart() -> None:
    """A mixed fleet: a's engine takes requests that arrive before its step starts into it, b's
    defers them to the next step. Each worker's share follows its own engine."""
    j = Joins()
    for _ in range(40):
        j.observe(A, 0.0004, True)
        j.observe(B, 0.0004, False)
    assert j.share(A, 0.0004) > 0.8 and j.share(B, 0.0004) < 0.2
    j.forget(B)
    assert j.share(B, 0.0004) == pytest.approx(40 / 81)  # gone: the fleet's again


def test_old_counts_fade_so_a_changed_engine_is_followed() -> None:
    j = Joins()
    for _ in range(int(HALVE_AT) - 1):
        j.observe(A, 0.0004, True)
    before = j.share(A, 0.0004)
    for _ in range(int(HALVE_AT)):  # the engine (or the path to it) changed: none join any more
        j.observe(A, 0.0004, False)
    assert before > 0.99 and j.share(A, 0.0004) < 0.4
    assert j.describe()["gap_ms"][0] == EDGES_S[0] * 1000.0
