"""Reading a worker's ``/kvmesh/kv_state``: what kvmesh's workers write comes back as the events the
wire carries, and any other shape is refused whole, naming what is wrong."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.events.wire import BlockStored
from kvmesh.router.mesh.event_feed import KvStateError, read_kv_state
from kvmesh.worker.block_state import kv_state_answer, rank_state


def test_what_a_worker_writes_reads_back_as_the_events_it_holds() -> None:
    stored = [
        BlockStored(
            block_hashes=[b"\x01" * 32, b"\x02" * 32],
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
        ),
        BlockStored(block_hashes=[7], parent_block_hash=b"\x02" * 32, token_ids=[(5, 1)] * 16, block_size=16),
    ]
    answer = kv_state_answer(16, [rank_state(1, 42, stored[1:]), rank_state(0, None, stored)])
    ranks = read_kv_state(answer)
    assert sorted(ranks) == [0, 1]
    assert ranks[0].last_seq is None and ranks[1].last_seq == 42
    for got, want in zip([*ranks[0].stored, *ranks[1].stored], [*stored, *stored[1:]], strict=True):
        assert (got.block_hashes, got.parent_block_hash, got.block_size) == (
            want.block_hashes,
            want.parent_block_hash,
            want.block_size,
        )
        assert list(got.token_ids) == list(want.token_ids)


def _stored(**change: Any) -> dict[str, Any]:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [0] * 16}
    return {**event, "block_size": 16, **change}


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([], "'ranks' must be a list"),
        ({"ranks": {"0": {}}}, "'ranks' must be a list"),
        ({"ranks": [3]}, "each rank must be an object"),
        ({"ranks": [{"dp_rank": "0"}]}, "dp_rank must be a rank number, got '0'"),
        ({"ranks": [{"dp_rank": True}]}, "dp_rank must be a rank number, got True"),
        ({"ranks": [{"dp_rank": 0, "last_seq": "soon"}]}, "last_seq must be a sequence number or null"),
        ({"ranks": [{"dp_rank": 0, "last_seq": -1}]}, "last_seq must be a sequence number or null"),
        # (past the wire's 8 bytes, the stream's replay request failed at every reconnection)
        ({"ranks": [{"dp_rank": 0, "last_seq": 2**64 - 1}]}, "last_seq must be a sequence number or null"),
        ({"ranks": [{"dp_rank": 0, "events": {}}]}, "events must be a list of objects"),
        (
            {"ranks": [{"dp_rank": 0, "events": [_stored(block_hashes=["zz"])]}]},
            "a BlockStored event is malformed",
        ),
        (
            {"ranks": [{"dp_rank": 0, "events": [_stored(token_ids="abc")]}]},
            "a BlockStored event is malformed",
        ),
        (
            {"ranks": [{"dp_rank": 0, "events": [_stored(block_size=1.5)]}]},
            "a BlockStored event is malformed",
        ),
        (
            {"ranks": [{"dp_rank": 0, "events": [{"type": "BlockStored"}]}]},
            "a BlockStored event is malformed",
        ),
    ],
)
def test_any_other_shape_is_refused_whole_naming_what_is_wrong(answer: Any, message: str) -> None:
    with pytest.raises(KvStateError, match=message):
        read_kv_state(answer)
