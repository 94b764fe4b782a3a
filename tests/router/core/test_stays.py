"""The learned stays (``kvmesh.router.core.stays.Stays``): moving averages per worker and over the
fleet, which the latency cost divides by."""

from __future__ import annotations

import pytest

from kvmesh.router.core.stays import ALPHA, Stays

A, B = ("a", 0), ("b", 0)


def test_a_worker_s_first_stay_is_taken_whole_and_later_ones_are_averaged_in() -> None:
    s = Stays()
    s.finished(A, 2.0, 3.0)
    assert s.decode_s[A] == 2.0 and s.in_system_s[A] == 3.0
    s.finished(A, 4.0, 3.0)
    assert s.decode_s[A] == pytest.approx(2.0 + ALPHA * 2.0)
    assert s.in_system_s[A] == pytest.approx(3.0)


def test_a_worker_seen_little_reads_the_fleet_s_stay_until_it_has_its_own() -> None:
    s = Stays()
    assert s.decode_of(A) == 0.0  # nothing finished anywhere: no stay known
    s.finished(A, 2.0, 2.5)
    assert s.decode_of(B) == s.decode_fleet == 2.0
    s.finished(B, 1.0, 1.0)
    assert s.decode_of(B) == 1.0  # its own now
    assert s.decode_fleet == pytest.approx(2.0 - ALPHA * 1.0)  # the fleet moves by one request's weight


def test_a_forgotten_worker_falls_back_to_the_fleet() -> None:
    s = Stays()
    s.finished(A, 2.0, 2.0)
    s.finished(B, 6.0, 6.0)
    s.forget(B)
    assert B not in s.decode_s and B not in s.in_system_s
    assert s.decode_of(B) == s.decode_fleet


def test_output_tokens_and_hit_share_start_from_their_first_value() -> None:
    s = Stays()
    s.generated(100)
    s.hit(0.0)  # a first share of 0 is still a first value
    assert s.out_tokens == 100 and s.reuse_fleet == 0.0
    s.generated(200)
    s.hit(1.0)
    assert s.out_tokens == pytest.approx(100 + ALPHA * 100)
    assert s.reuse_fleet == pytest.approx(ALPHA)


def test_the_fleet_s_stay_is_the_whole_stay_and_before_any_finish_the_time_since_the_first_dispatch() -> None:
    s = Stays()
    assert s.fleet_stay(5.0) == 0.0  # nothing dispatched: no stay
    s.dispatched(10.0)
    s.dispatched(10.4)  # (only the first counts)
    assert s.fleet_stay(10.5) == pytest.approx(0.5)
    assert s.fleet_stay(11.0) == pytest.approx(1.0)
    s.finished(A, 0.3, 0.4)
    # learned from then on: the whole stay, dispatch to finish (Little's law's), not the decode
    assert s.fleet_stay(12.0) == s.in_system_fleet == 0.4
