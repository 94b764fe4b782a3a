"""kvmesh/router/core/joins.py: how often a request routed right behind the step in progress joins
that step, by how soon after the step's request it was routed."""

from __future__ import annotations

from kvmesh.router.core.joins import EDGES_S, HALVE_AT, Joins


def test_nothing_seen_is_the_model_s_assumption_that_a_running_step_cannot_be_joined() -> None:
    assert Joins().share(0.0001) == 0.0


def test_the_share_is_per_gap_shrunk_toward_none_while_few_were_seen() -> None:
    j = Joins()
    for _ in range(9):
        j.observe(0.0004, True)  # routed 0.4 ms after the step's request: joined
    j.observe(0.0004, False)
    for _ in range(10):
        j.observe(0.010, False)  # 10 ms after: the step had started
    assert j.share(0.0003) == 9 / 11
    assert j.share(0.012) == 0.0
    assert j.share(0.0015) == 0.0  # a gap never seen says nothing
    j.observe(0.5, True)  # past the last edge: a bin of its own
    assert j.share(EDGES_S[-1] * 10) == 1 / 2


def test_old_counts_fade_so_a_changed_engine_is_followed() -> None:
    j = Joins()
    for _ in range(int(HALVE_AT) - 1):
        j.observe(0.0004, True)
    before = j.share(0.0004)
    for _ in range(int(HALVE_AT)):  # the engine (or the path to it) changed: none join any more
        j.observe(0.0004, False)
    assert before > 0.99 and j.share(0.0004) < 0.4
    assert j.describe()["gap_ms"][0] == EDGES_S[0] * 1000.0
