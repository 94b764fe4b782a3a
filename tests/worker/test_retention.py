"""kvmesh.worker.retention: pins and sessions in one ledger, a distinct-block budget, both policies."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.worker.retention import OverBudgetPolicy, PinBudgetExceeded, Retention, TooManySessions


class Engine:
    """The engine side of the ledger: a reference count per block, and every call in order."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def acquire(self, blocks: tuple[int, ...]) -> None:
        self.calls.append(("acquire", tuple(blocks)))
        self.refs.update(blocks)

    def release(self, blocks: tuple[int, ...]) -> None:
        self.calls.append(("release", tuple(blocks)))
        for block in blocks:
            assert self.refs[block] > 0, f"block {block} released without a reference"
            self.refs[block] -= 1

    def held(self) -> set[int]:
        return {b for b, n in self.refs.items() if n > 0}


def ledger(
    engine: Engine,
    budget: int,
    policy: OverBudgetPolicy = "truncate",
    max_sessions: int | None = None,
) -> Retention[int]:
    return Retention(
        budget,
        acquire=engine.acquire,
        release=engine.release,
        on_over_budget=policy,
        total_blocks=32,
        budget_setting="--pin-budget",
        max_sessions=max_sessions,
    )


# ---------------------------------------------------------------------------------- pins


def test_a_pin_takes_one_reference_per_block_until_its_ttl_then_releases_tail_first() -> None:
    engine = Engine()
    r = ledger(engine, budget=10)
    assert r.pin([1, 2, 3], ttl=5.0, now=100.0) == 3
    assert engine.calls == [("acquire", (1, 2, 3))]
    assert r.num_retained == 3 and r.num_holds == 1
    assert r.next_expiry() == 105.0
    assert r.expire(104.9) == []
    assert engine.held() == {1, 2, 3}
    assert r.expire(105.0) == []  # no session timed out; the pin is gone all the same
    assert engine.calls[-1] == ("release", (3, 2, 1))
    assert r.num_retained == 0 and r.num_holds == 0 and r.next_expiry() is None


def test_pinning_nothing_pins_nothing() -> None:
    engine = Engine()
    r = ledger(engine, budget=10, policy="reject")
    assert r.pin([], ttl=5.0, now=0.0) == 0
    assert engine.calls == [] and r.num_holds == 0


def test_pinning_the_same_prefix_again_extends_it_and_never_shortens_it() -> None:
    engine = Engine()
    r = ledger(engine, budget=10)
    r.pin([1, 2], ttl=10.0, now=0.0)
    r.pin([1, 2], ttl=50.0, now=0.0)
    r.pin([1, 2], ttl=5.0, now=1.0)  # a shorter pin does not cut the longer one
    assert engine.calls == [("acquire", (1, 2))]  # one hold, one reference per block
    assert r.next_expiry() == 50.0
    r.expire(49.0)
    assert engine.held() == {1, 2}
    r.expire(50.0)
    assert engine.held() == set()


def test_overlapping_pins_keep_the_shared_head_until_the_last_one_ends() -> None:
    engine = Engine()
    r = ledger(engine, budget=10)
    r.pin([1, 2, 3], ttl=10.0, now=0.0)
    r.pin([1, 2], ttl=100.0, now=0.0)  # a shorter prefix of the same chain, held longer
    assert r.num_retained == 3 and r.num_holds == 2
    r.expire(10.0)
    assert engine.held() == {1, 2}
    r.expire(100.0)
    assert engine.held() == set()


def test_shared_blocks_count_once_against_the_budget() -> None:
    engine = Engine()
    r = ledger(engine, budget=4)
    r.pin([1, 2, 3], ttl=5.0, now=0.0)
    # This prefix shares the first two blocks (a common system prompt): only block 9 is new.
    assert r.pin([1, 2, 9], ttl=5.0, now=0.0) == 3
    assert r.num_retained == 4
    # Nothing new fits any more, but a block already held by others still does.
    assert r.pin([1, 7, 8], ttl=5.0, now=0.0) == 1


def test_truncate_keeps_the_longest_prefix_that_fits_never_a_hole() -> None:
    engine = Engine()
    r = ledger(engine, budget=3, policy="truncate")
    r.pin([1], ttl=5.0, now=0.0)
    assert r.pin([5, 6, 7, 8], ttl=5.0, now=0.0) == 2
    assert engine.calls[-1] == ("acquire", (5, 6))
    # 1 is free to hold (another pin holds it) but comes after a block that does not fit.
    assert r.pin([9, 1, 10], ttl=5.0, now=0.0) == 0
    assert r.num_retained == 3


def test_reject_pins_nothing_past_the_budget_and_says_by_how_much() -> None:
    engine = Engine()
    r = ledger(engine, budget=8, policy="reject")
    assert r.pin([1, 2, 3, 4, 5], ttl=30.0, now=0.0) == 5
    assert r.pin([1, 2, 3, 4, 5], ttl=30.0, now=1.0) == 5  # re-pinning the same prefix costs nothing
    calls = list(engine.calls)
    with pytest.raises(PinBudgetExceeded) as caught:
        r.pin([1, 2, 6, 7, 8, 9], ttl=30.0, now=1.0)  # 4 new blocks: 9 > 8
    assert str(caught.value) == (
        "pin budget exceeded: pinning 4 more blocks would retain 9 of 32 blocks; the limit is 8 (--pin-budget)"
    )
    assert caught.value.status == 409 and caught.value.field == "token_ids"
    assert engine.calls == calls and r.num_retained == 5 and r.num_holds == 1
    assert r.pin([1, 2, 6, 7, 8], ttl=30.0, now=1.0) == 5  # exactly the budget fits


# ---------------------------------------------------------------------------------- sessions


def test_an_open_session_with_nothing_cached_still_times_out() -> None:
    engine = Engine()
    r = ledger(engine, budget=0)
    assert r.open_session("s1", timeout=4.0, now=0.0) is True
    assert r.num_holds == 1 and dict(r.sessions) == {"s1": 4.0}
    assert r.retain_for_session("s1", [1, 2]) == 0  # a zero budget holds nothing
    assert r.expire(4.0) == ["s1"]
    assert "s1" not in r.sessions and r.num_holds == 0
    assert engine.calls == []


def test_each_turn_replaces_the_held_prefix_acquiring_before_releasing() -> None:
    engine = Engine()
    r = ledger(engine, budget=3)
    r.open_session("s", timeout=60.0, now=0.0)
    assert r.retain_for_session("s", [1, 2]) == 2
    assert r.retain_for_session("s", [1, 2, 3]) == 3
    assert engine.calls[-2:] == [("acquire", (1, 2, 3)), ("release", (2, 1))]
    # The session's own old blocks do not count against its new prefix.
    assert r.retain_for_session("s", [4, 5, 6]) == 3
    assert engine.held() == {4, 5, 6} and r.session_blocks("s") == (4, 5, 6)
    # An identical turn changes nothing.
    calls = list(engine.calls)
    assert r.retain_for_session("s", [4, 5, 6]) == 3
    assert engine.calls == calls


def test_a_session_keeps_its_longest_fitting_prefix_even_when_pins_are_rejected() -> None:
    engine = Engine()
    r = ledger(engine, budget=4, policy="reject")
    r.pin([1, 2], ttl=60.0, now=0.0)
    r.open_session("s", timeout=60.0, now=0.0)
    assert r.retain_for_session("s", [1, 2, 3, 4, 5, 6]) == 4  # 1 and 2 are shared with the pin
    assert r.session_blocks("s") == (1, 2, 3, 4)


def test_turns_and_reopens_slide_the_idle_deadline_but_retaining_does_not() -> None:
    engine = Engine()
    r = ledger(engine, budget=10)
    r.open_session("s", timeout=10.0, now=0.0)
    r.retain_for_session("s", [1, 2])
    assert r.next_expiry() == 10.0  # retaining a turn's blocks leaves the deadline alone
    assert r.touch_session("s", now=9.0) is True
    assert r.next_expiry() == 19.0
    assert r.open_session("s", timeout=30.0, now=10.0) is False  # re-open: new timeout, slid
    assert r.next_expiry() == 40.0
    assert r.expire(39.0) == [] and engine.held() == {1, 2}
    assert r.expire(40.0) == ["s"]
    assert engine.held() == set()


def test_closing_releases_and_unknown_sessions_are_refused_quietly() -> None:
    engine = Engine()
    r = ledger(engine, budget=10)
    r.open_session("s", timeout=60.0, now=0.0)
    r.retain_for_session("s", [1, 2, 3])
    assert r.close_session("s") is True
    assert engine.calls[-1] == ("release", (3, 2, 1))
    assert r.close_session("s") is False
    assert r.touch_session("s", now=1.0) is False
    assert r.retain_for_session("s", [1]) == 0
    assert r.num_holds == 0 and r.next_expiry() is None


def test_expire_goes_earliest_first_and_skips_moved_deadlines() -> None:
    engine = Engine()
    r = ledger(engine, budget=10)
    r.open_session("late", timeout=9.0, now=0.0)
    r.open_session("early", timeout=3.0, now=0.0)
    r.open_session("moved", timeout=2.0, now=0.0)
    r.touch_session("moved", now=18.0)
    assert r.next_expiry() == 3.0
    assert r.expire(10.0) == ["early", "late"]
    assert r.next_expiry() == 20.0
    assert list(r.sessions) == ["moved"]


def test_max_sessions_caps_new_sessions_only() -> None:
    r = ledger(Engine(), budget=10, max_sessions=1)
    r.open_session("a", timeout=30.0, now=0.0)
    assert r.open_session("a", timeout=60.0, now=0.0) is False  # re-open: no new slot
    with pytest.raises(TooManySessions, match=r"^too many open sessions \(1\)$"):
        r.open_session("b", timeout=30.0, now=0.0)
    assert r.close_session("a")
    assert r.open_session("b", timeout=30.0, now=0.0) is True


def test_the_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="budget_blocks must be >= 0, got -1"):
        ledger(Engine(), budget=-1)
    with pytest.raises(ValueError, match="on_over_budget must be 'reject' or 'truncate', got 'drop'"):
        ledger(Engine(), budget=1, policy="drop")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- model check

# Blocks come in chains, as in an engine: a prefix is named by its last block.
CHAINS = ((0, 1, 2, 3, 4), (0, 1, 5, 6, 7), (8, 9, 10))
SESSIONS = ("s0", "s1")

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("pin"), st.sampled_from(CHAINS), st.integers(1, 5), st.integers(1, 8)),
        st.tuples(st.just("open"), st.sampled_from(SESSIONS), st.integers(1, 8)),
        st.tuples(st.just("retain"), st.sampled_from(SESSIONS), st.sampled_from(CHAINS), st.integers(0, 5)),
        st.tuples(st.just("touch"), st.sampled_from(SESSIONS)),
        st.tuples(st.just("close"), st.sampled_from(SESSIONS)),
        st.tuples(st.just("tick"), st.integers(0, 4)),
    ),
    max_size=40,
)


def _fits(union_of_others: set[int], blocks: tuple[int, ...], budget: int) -> bool:
    return len(union_of_others | set(blocks)) <= budget


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 8), policy=st.sampled_from(["reject", "truncate"]), ops=_ops)
def test_the_ledger_matches_a_brute_force_model(
    budget: int, policy: OverBudgetPolicy, ops: list[tuple[Any, ...]]
) -> None:
    """Every operation against a model that recomputes the budget from scratch: the same holds,
    the same deadlines, and engine references that always mirror them."""
    engine = Engine()
    r = ledger(engine, budget, policy)
    # holder -> (blocks, deadline); a holder is ("pin", last block) or ("session", id)
    model: dict[tuple[str, Any], tuple[tuple[int, ...], float]] = {}
    timeouts: dict[str, float] = {}
    now = 0.0

    def others(holder: tuple[str, Any]) -> set[int]:
        return {b for h, (blocks, _) in model.items() if h != holder for b in blocks}

    def longest_fitting(holder: tuple[str, Any], blocks: tuple[int, ...]) -> tuple[int, ...]:
        rest = others(holder)
        return next(blocks[:k] for k in range(len(blocks), -1, -1) if _fits(rest, blocks[:k], budget))

    for op in ops:
        kind = op[0]
        if kind == "pin":
            _, chain, length, ttl = op
            blocks = chain[:length]
            holder = ("pin", blocks[-1])
            previous = model.get(holder)
            deadline = max(now + ttl, previous[1]) if previous else now + ttl
            if policy == "reject" and not _fits(others(holder), blocks, budget):
                with pytest.raises(PinBudgetExceeded):
                    r.pin(blocks, ttl, now)
            else:
                kept = longest_fitting(holder, blocks)
                assert r.pin(blocks, ttl, now) == len(kept)
                model[holder] = (kept, deadline)
        elif kind == "open":
            _, sid, timeout = op
            holder = ("session", sid)
            assert r.open_session(sid, timeout, now) is (sid not in timeouts)
            timeouts[sid] = timeout
            model[holder] = (model.get(holder, ((), 0.0))[0], now + timeout)
        elif kind == "retain":
            _, sid, chain, length = op
            holder = ("session", sid)
            if holder in model:
                kept = longest_fitting(holder, chain[:length])
                model[holder] = (kept, model[holder][1])
                assert r.retain_for_session(sid, chain[:length]) == len(kept)
            else:
                assert r.retain_for_session(sid, chain[:length]) == 0
        elif kind == "touch":
            _, sid = op
            holder = ("session", sid)
            assert r.touch_session(sid, now) is (holder in model)
            if holder in model:
                model[holder] = (model[holder][0], now + timeouts[sid])
        elif kind == "close":
            _, sid = op
            assert r.close_session(sid) is (("session", sid) in model)
            model.pop(("session", sid), None)
            timeouts.pop(sid, None)
        else:
            now += op[1]
            due = {h for h, (_, deadline) in model.items() if deadline <= now}
            assert set(r.expire(now)) == {h[1] for h in due if h[0] == "session"}
            for h in due:
                del model[h]
                if h[0] == "session":
                    del timeouts[h[1]]
        expected = Counter(b for blocks, _ in model.values() for b in blocks)
        assert +engine.refs == expected
        assert r.num_retained == len(expected) <= budget
        assert r.num_holds == len(model)
        assert dict(r.sessions) == timeouts
        assert r.next_expiry() == min((d for _, d in model.values()), default=None)
