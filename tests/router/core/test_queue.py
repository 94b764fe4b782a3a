"""Admission queue: policy keys, order, bound, cancellation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.core.queue import AdmissionQueue, Waiting, jump_of, queue_key


def test_jump_prefers_priority_clamped_at_zero_else_latency_sensitivity() -> None:
    assert jump_of(3, 9) == 3
    assert jump_of(-2, 9) == 0
    assert jump_of(None, 1.5) == 1.5
    assert jump_of(None, None) == 0


def test_keys() -> None:
    assert queue_key("fcfs", 2.0, 10.0, 100) == -8.0
    assert queue_key("lcfs", 2.0, 10.0, 100) == 12.0
    assert queue_key("wspt", 3.0, 10.0, 100) == 0.04
    assert queue_key("wspt", 0.0, 10.0, 0) == 1.0


def test_fcfs_with_a_jump_overtakes_that_many_seconds_of_arrivals() -> None:
    q = AdmissionQueue("fcfs")
    for rid, arrival, jump in [("a", 0.0, 0), ("b", 1.0, 0), ("c", 3.0, 2.5), ("d", 4.0, 0)]:
        q.push(Waiting(rid, queue_key("fcfs", jump, arrival, 1), arrival, 1))
    assert q.order() == ["a", "c", "b", "d"]


def test_wspt_prefers_short_uncached_work() -> None:
    q = AdmissionQueue("wspt")
    q.push(Waiting("long", queue_key("wspt", 0, 0.0, 4000), 0.0, 4000))
    q.push(Waiting("short", queue_key("wspt", 0, 1.0, 100), 1.0, 100))
    assert q.pop().request_id == "short"  # type: ignore[union-attr]


def test_bounded_queue_says_full() -> None:
    q = AdmissionQueue("fcfs", max_length=2)
    assert q.push(Waiting("a", 0, 0, 10)) == 0
    assert q.push(Waiting("b", -1, 1, 10)) == 1
    assert q.push(Waiting("c", -2, 2, 10)) is None
    assert (len(q), q.pending_tokens) == (2, 20)


def test_cancel_then_requeue_keeps_one_live_entry() -> None:
    q = AdmissionQueue("fcfs")
    q.push(Waiting("a", 0, 0, 5))
    q.push(Waiting("b", -1, 1, 5))
    assert q.cancel("a") is not None
    assert q.cancel("a") is None
    q.push(Waiting("a", -5, 5, 5))
    assert q.order() == ["b", "a"]
    assert [q.pop().request_id, q.pop().request_id, q.pop()] == ["b", "a", None]  # type: ignore[union-attr]
    assert q.pending_tokens == 0


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["fcfs", "lcfs", "wspt"]),
    st.lists(
        st.tuples(
            st.floats(0, 100, allow_nan=False),
            st.one_of(st.none(), st.floats(-5, 5, allow_nan=False)),
            st.one_of(st.none(), st.floats(0, 5, allow_nan=False)),
            st.integers(0, 5000),
        ),
        max_size=30,
    ),
    st.sets(st.integers(0, 29)),
)
def test_release_order_matches_the_policy_keys(policy, items, cancelled) -> None:
    q = AdmissionQueue(policy)
    keys = {}
    for i, (arrival, prio, lat, tokens) in enumerate(items):
        key = queue_key(policy, jump_of(prio, lat), arrival, tokens)
        keys[f"r{i}"] = (key, i)
        q.push(Waiting(f"r{i}", key, arrival, tokens))
    for i in cancelled:
        if i < len(items):
            q.cancel(f"r{i}")
            del keys[f"r{i}"]
    released = []
    while (item := q.pop()) is not None:
        released.append(item.request_id)
    assert released == sorted(keys, key=lambda r: (-keys[r][0], keys[r][1]))
