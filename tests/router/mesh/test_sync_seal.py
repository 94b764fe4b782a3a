"""Replica sync's seal read as hostile input: any frame, sealed or not, is applied without a fault,
and only one sealed with this replica's key (and not seen before) changes what it counts."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import KvRouter
from kvmesh.router.mesh.replica_sync import Envelope, Heartbeat, ReplicaSync, Routed, Session, encode
from kvmesh.router.mesh.sync_seal import BAD_PROOF, MARK, NO_SECRET_HERE, UNSEALED, seal, sync_key, unseal

KEY = sync_key("s3")
OTHER = sync_key("another secret")


def _replica(secret: str | None) -> ReplicaSync:
    router = KvRouter(RouterConfig(), random.Random(0))
    router.add_worker("w0", total_blocks=1024, max_num_batched_tokens=8192, block_size=16)
    return ReplicaSync(router, "me", 1, endpoint="tcp://127.0.0.1:0", secret=secret)


def _decision(seq: int, rid: str = "p-1") -> bytes:
    return encode(Envelope("peer", 7, seq, Routed(rid, "w0", 0, list(range(8)), 128, 0)))


envelopes = st.builds(
    Envelope,
    st.text(max_size=8),
    st.integers(min_value=0, max_value=2**63 - 1),
    st.integers(min_value=0, max_value=2**63 - 1),
    st.one_of(
        st.builds(
            Routed,
            st.text(max_size=8),
            st.just("w0"),
            st.integers(0, 3),
            st.lists(st.integers(0, 2**63 - 1), max_size=4),
            st.integers(0, 10**6),
            st.integers(0, 64),
        ),
        st.builds(
            Session,
            st.text(max_size=8),
            st.sampled_from(["w0", None]),
            st.integers(0, 3),
            st.floats(0.001, 1e6),
        ),
        st.builds(Heartbeat, st.lists(st.text(max_size=8), max_size=4)),
    ),
)
"""Messages a replica could send (any of them, sealed with another key, must change nothing)."""


@given(payload=st.binary(max_size=512), flip=st.integers(min_value=0))
def test_a_sealed_frame_reads_back_and_any_changed_byte_refuses_it(payload: bytes, flip: int) -> None:
    frame = seal(KEY, payload)
    assert frame.startswith(MARK) and unseal(KEY, frame) == payload
    assert unseal(OTHER, frame) == BAD_PROOF
    assert unseal(None, frame) == NO_SECRET_HERE
    i = flip % len(frame)
    changed = frame[:i] + bytes([frame[i] ^ 0x01]) + frame[i + 1 :]
    assert unseal(KEY, changed) in (BAD_PROOF, UNSEALED)  # (a changed mark: no seal at all)
    assert unseal(KEY, frame[: len(frame) - 1 - flip % len(frame)]) in (BAD_PROOF, UNSEALED)
    assert unseal(KEY, payload) == UNSEALED or payload.startswith(MARK)


@settings(max_examples=300)
@given(
    frames=st.lists(
        st.one_of(
            st.binary(max_size=256),
            st.binary(max_size=256).map(lambda b: seal(OTHER, b)),
            envelopes.map(lambda e: seal(OTHER, encode(e))),
            envelopes.map(encode),
            st.binary(max_size=64).map(lambda b: MARK + b),
        ),
        max_size=8,
    )
)
def test_with_a_secret_no_frame_without_its_seal_is_heard(frames: list[bytes]) -> None:
    replica = _replica("s3")
    for frame in frames:
        replica.apply(frame, 1.0)
    assert replica.stats.unauthenticated == len(frames) == replica.stats.received
    assert replica.stats.counted == replica.stats.malformed == 0
    assert replica.describe()["peers"] == []
    assert [w.active_requests for w in replica.router.worker_snapshot()] == [0]


@settings(max_examples=300)
@given(junk=st.lists(st.binary(max_size=256), max_size=4), sent=st.lists(envelopes, max_size=4))
def test_sealed_with_the_key_any_payload_is_read_without_a_fault(
    junk: list[bytes], sent: list[Envelope]
) -> None:
    replica = _replica("s3")
    for frame in [*junk, *map(encode, sent)]:
        replica.apply(seal(KEY, frame), 1.0)
    stats = replica.stats
    assert stats.unauthenticated == 0 and stats.received == len(junk) + len(sent)
    assert stats.malformed <= len(junk)  # (a replica's own messages are never malformed)
    heard = {(e.replica, e.epoch) for e in sent} - {("me", 1)}  # (its own are ignored)
    assert {(p["replica"], p["epoch"]) for p in replica.describe()["peers"]} >= heard


def test_a_decision_sealed_with_the_key_is_load_once_however_often_it_is_sent() -> None:
    replica = _replica("s3")
    first = seal(KEY, _decision(1))
    replica.apply(first, 1.0)
    assert replica.router.tracking("p-1") and replica.stats.counted == 1
    replica.apply(seal(KEY, encode(Envelope("peer", 7, 2, Heartbeat([])))), 1.1)  # (p-1 is freed)
    assert not replica.router.tracking("p-1")
    replica.apply(first, 1.2)  # a replay of the decision, seal and all
    assert not replica.router.tracking("p-1")
    assert (replica.stats.counted, replica.stats.duplicates, replica.stats.reconciled) == (1, 1, 1)


def test_without_a_secret_a_sealed_frame_is_refused_and_a_plain_one_heard() -> None:
    replica = _replica(None)
    replica.apply(seal(KEY, _decision(1)), 1.0)
    assert not replica.router.tracking("p-1") and replica.stats.unauthenticated == 1
    replica.apply(_decision(2), 1.0)
    assert replica.router.tracking("p-1") and replica.stats.malformed == 0
    assert replica.describe()["sealed"] is False and _replica("s3").describe()["sealed"] is True
