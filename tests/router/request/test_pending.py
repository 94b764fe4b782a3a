"""PendingCounts: a deferred count runs once, when its key is asked for or its owner settles it."""

from __future__ import annotations

from kvmesh.router.request.pending import PendingCounts


def test_a_count_runs_once_when_its_key_is_settled() -> None:
    ran: list[str] = []
    pending = PendingCounts()
    pending.defer(1, lambda: ran.append("a"))
    pending.defer(2, lambda: ran.append("b"))
    assert len(pending) == 2
    pending.settle(3)  # nothing kept there
    pending.settle(2)
    pending.settle(2)
    assert ran == ["b"]
    pending.settle(1)
    assert ran == ["b", "a"] and len(pending) == 0


def test_a_second_count_under_a_key_runs_the_first_one_first() -> None:
    ran: list[str] = []
    pending = PendingCounts()
    pending.defer(7, lambda: ran.append("first"))
    pending.defer(7, lambda: ran.append("second"))
    assert ran == ["first"]
    pending.settle(7)
    assert ran == ["first", "second"]
