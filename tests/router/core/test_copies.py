"""The value of one more copy of a shared prefix, and the age of a prefix's demand."""

from __future__ import annotations

import pytest

from kvmesh.router.core.copies import MAX_PREFIXES, SharedPrefixes, copy_saving_ms


def test_a_copy_saves_the_prefill_queueing_its_share_of_the_demand_would_cause() -> None:
    # 20 requests/s with 20 ms prefill steps on one holder: each waits 20 * 0.02 * 0.02 / 2 s,
    # 80 ms of waiting a second in all; on two holders each half waits half as long: 40 ms a
    # second saved, 400 ms in 10 s
    assert copy_saving_ms(20.0, 20.0, 1, 10.0) == pytest.approx(400.0)
    assert copy_saving_ms(40.0, 20.0, 1, 10.0) == pytest.approx(4 * 400.0)  # quadratic in demand
    assert copy_saving_ms(20.0, 20.0, 1, 5.0) == pytest.approx(200.0)  # linear in the horizon
    # each further copy saves less: 2/(m(m+1)) of what the first one did
    saved = [copy_saving_ms(20.0, 20.0, m, 10.0) for m in (1, 2, 3, 7)]
    assert saved == pytest.approx([400.0, 400.0 / 3, 400.0 / 6, 400.0 / 28])


@pytest.mark.parametrize(
    "args", [(0.0, 20.0, 1, 10.0), (20.0, 0.0, 1, 10.0), (20.0, 20.0, 0, 10.0), (20.0, 20.0, 1, 0.0)]
)
def test_nothing_to_save_without_demand_work_holders_or_time(args: tuple[float, float, int, float]) -> None:
    assert copy_saving_ms(*args) == 0.0


def test_a_prefix_ages_while_it_stays_shared_and_starts_over_when_its_demand_lapses() -> None:
    shared = SharedPrefixes()
    assert shared.age(7, 100.0, stay_s=0.5) == 0.0
    for t in range(1, 21):  # seen every 0.4 s: never out of flight longer than a stay
        age = shared.age(7, 100.0 + 0.4 * t, stay_s=0.5)
    assert age == pytest.approx(8.0)
    # unseen for 6 s, less than the 8 s it had been shared: it keeps its age
    assert shared.age(7, 114.0, stay_s=0.5) == pytest.approx(14.0)
    # unseen for longer than it had been shared: a new demand
    assert shared.age(7, 150.0, stay_s=0.5) == 0.0
    # a young prefix lapses after a stay
    assert shared.age(7, 150.3, stay_s=0.5) == pytest.approx(0.3)
    assert shared.age(7, 151.0, stay_s=0.5) == 0.0


def test_only_the_most_recently_seen_prefixes_are_remembered() -> None:
    shared = SharedPrefixes()
    shared.age(-1, 0.0, stay_s=1.0)
    for ident in range(MAX_PREFIXES):
        shared.age(ident, 0.5, stay_s=1.0)
        if ident == MAX_PREFIXES // 2:
            shared.age(-1, 0.5, stay_s=1.0)  # seen again: kept over older ones
    assert len(shared) == MAX_PREFIXES
    assert shared.age(-1, 0.9, stay_s=1.0) == pytest.approx(0.9)  # remembered since 0
    assert shared.age(0, 0.9, stay_s=1.0) == 0.0  # the least recently seen was forgotten
