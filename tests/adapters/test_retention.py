"""kvmesh.adapters.retention: holds with deadlines, a distinct-block budget, prefix truncation."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.adapters.retention import RetentionLedger, SessionTable


def test_hold_takes_a_reference_per_block_and_release_drops_them() -> None:
    ledger: RetentionLedger[int] = RetentionLedger(budget_blocks=10)
    change = ledger.hold("a", [1, 2, 3], expires_at=5.0)
    assert (change.acquire, change.release, change.held) == ((1, 2, 3), (), 3)
    assert ledger.held_blocks == 3
    assert ledger.release("a") == (1, 2, 3)
    assert ledger.held_blocks == 0
    assert ledger.release("a") == ()


def test_shared_blocks_count_once_against_the_budget() -> None:
    ledger: RetentionLedger[int] = RetentionLedger(budget_blocks=4)
    ledger.hold("a", [1, 2, 3], expires_at=5.0)
    # b shares the first two blocks (a common system prompt): only block 9 is new.
    change = ledger.hold("b", [1, 2, 9], expires_at=5.0)
    assert change.acquire == (1, 2, 9)
    assert ledger.held_blocks == 4
    # Nothing new fits any more, but blocks already held by others still do.
    assert ledger.hold("c", [1, 7, 8], expires_at=5.0).acquire == (1,)


def test_a_hold_that_does_not_fit_keeps_its_longest_prefix() -> None:
    ledger: RetentionLedger[int] = RetentionLedger(budget_blocks=3)
    ledger.hold("a", [1], expires_at=5.0)
    change = ledger.hold("b", [5, 6, 7, 8], expires_at=5.0)
    assert change.acquire == (5, 6)
    assert change.held == 2
    # A prefix, never a hole: 1 is free to hold (a holds it) but follows a block that did not fit.
    assert ledger.hold("c", [9, 1], expires_at=5.0).acquire == ()


def test_replacing_a_hold_acquires_before_releasing_and_may_reuse_its_own_budget() -> None:
    ledger: RetentionLedger[int] = RetentionLedger(budget_blocks=3)
    ledger.hold("s", [1, 2], expires_at=5.0)
    change = ledger.hold("s", [1, 2, 3], expires_at=9.0)
    assert change.acquire == (1, 2, 3)
    assert change.release == (1, 2)
    # The owner's own old blocks do not count against its new hold.
    change = ledger.hold("s", [4, 5, 6], expires_at=9.0)
    assert change.acquire == (4, 5, 6)
    assert change.release == (1, 2, 3)
    assert ledger.held_blocks == 3


def test_an_identical_hold_only_moves_the_deadline() -> None:
    ledger: RetentionLedger[int] = RetentionLedger(budget_blocks=3)
    ledger.hold("a", [1, 2], expires_at=5.0)
    change = ledger.hold("a", [1, 2], expires_at=8.0)
    assert (change.acquire, change.release, change.held) == ((), (), 2)
    assert ledger.expire(6.0) == []
    assert ledger.expire(8.0) == [("a", (1, 2))]


def test_expire_releases_due_holds_earliest_first_and_skips_moved_deadlines() -> None:
    ledger: RetentionLedger[int] = RetentionLedger(budget_blocks=10)
    ledger.hold("late", [1], expires_at=9.0)
    ledger.hold("early", [2], expires_at=3.0)
    ledger.hold("moved", [3], expires_at=2.0)
    assert ledger.extend("moved", 20.0)
    assert not ledger.extend("nobody", 1.0)
    assert ledger.next_expiry() == 3.0
    assert ledger.expire(10.0) == [("early", (2,)), ("late", (1,))]
    assert ledger.next_expiry() == 20.0
    assert "moved" in ledger


def test_an_empty_hold_still_expires() -> None:
    """An open session with no cached prefix yet must still time out."""
    ledger: RetentionLedger[int] = RetentionLedger(budget_blocks=0)
    assert ledger.hold(("session", "s1"), [1, 2], expires_at=4.0).held == 0
    assert ledger.expire(4.0) == [(("session", "s1"), ())]


def test_budget_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="budget_blocks must be >= 0, got -1"):
        RetentionLedger(budget_blocks=-1)


def test_session_table_caps_the_number_of_sessions() -> None:
    table = SessionTable(max_sessions=1)
    assert table.open("a", 30.0)
    assert table.open("a", 60.0)  # re-open: new timeout, no new slot
    assert table.timeout_of("a") == 60.0
    assert not table.open("b", 30.0)
    assert table.close("a")
    assert not table.close("a")
    assert "a" not in table


_ops = st.lists(
    st.tuples(
        st.sampled_from(["hold", "release", "expire"]),
        st.integers(0, 3),  # owner
        st.lists(st.integers(0, 7), max_size=6),  # blocks
        st.integers(0, 20),  # time
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 6), ops=_ops)
def test_engine_references_always_mirror_the_ledger(
    budget: int, ops: list[tuple[str, int, list[int], int]]
) -> None:
    """Apply every change to a brute-force 'engine' of ref counts and check the invariants."""
    ledger: RetentionLedger[int] = RetentionLedger(budget_blocks=budget)
    engine_refs: Counter[int] = Counter()
    model: dict[int, tuple[tuple[int, ...], float]] = {}
    for op, owner, blocks, t in ops:
        if op == "hold":
            change = ledger.hold(owner, blocks, expires_at=float(t))
            assert change.held == len(ledger.blocks_of(owner))
            assert change.acquire in ((), ledger.blocks_of(owner))
            engine_refs.update(change.acquire)
            assert all(engine_refs[b] > 0 for b in change.release)  # acquired before released
            engine_refs.subtract(change.release)
            # What is held is a duplicate-free prefix of what was asked for.
            asked = list(dict.fromkeys(blocks))
            assert list(ledger.blocks_of(owner)) == asked[: change.held]
            model[owner] = (ledger.blocks_of(owner), float(t))
        elif op == "release":
            engine_refs.subtract(ledger.release(owner))
            model.pop(owner, None)
        else:
            for gone, released in ledger.expire(float(t)):
                assert model[gone][1] <= t
                engine_refs.subtract(released)
                del model[gone]
            assert all(deadline > t for _, deadline in model.values())
        expected = Counter(b for held, _ in model.values() for b in held)
        assert +engine_refs == expected
        assert ledger.held_blocks == len(expected) <= max(budget, 0)
