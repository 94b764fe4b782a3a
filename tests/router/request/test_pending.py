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


def test_an_owner_settles_only_its_own_count() -> None:
    ran: list[str] = []
    pending = PendingCounts()

    def first() -> None:
        ran.append("first")

    def second() -> None:
        ran.append("second")

    pending.defer(5, first)
    pending.settle(5)  # a request beginning like it had it counted
    pending.defer(5, second)
    pending.settle(5, first)  # the first one's timer, late: not the second one's count
    assert ran == ["first"]
    pending.settle(5, second)
    assert ran == ["first", "second"]
