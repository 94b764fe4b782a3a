"""Session affinity with a sliding TTL."""

from __future__ import annotations

from kvmesh.router.core.sessions import SessionTable


def test_lookup_slides_the_expiry() -> None:
    t = SessionTable(default_timeout=10)
    t.bind("s", ("a", 0), now=0)
    assert t.lookup("s", now=8) == ("a", 0)
    assert t.expire(now=15) == []  # slid to 18
    assert t.lookup("s", now=17) == ("a", 0)
    assert t.expire(now=27) == [("s", ("a", 0))]
    assert t.lookup("s", now=28) is None


def test_an_expired_session_does_not_route_even_before_collection() -> None:
    t = SessionTable()
    t.bind("s", ("a", 0), now=0, timeout=5)
    assert t.lookup("s", now=5) is None
    assert t.expire(now=5) == [("s", ("a", 0))]


def test_close_and_remove_worker() -> None:
    t = SessionTable()
    t.bind("s1", ("a", 0), now=0)
    t.bind("s2", ("a", 1), now=0)
    t.bind("s3", ("b", 0), now=0)
    assert t.close("s3") == ("b", 0)
    assert t.close("s3") is None
    assert sorted(t.remove_worker("a")) == [("s1", ("a", 0)), ("s2", ("a", 1))]
    assert len(t) == 0
