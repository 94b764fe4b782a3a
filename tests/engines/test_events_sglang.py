"""kvmesh's event transport against SGLang 0.5.23's own code, on CPU.

SGLang's real event classes (``sglang.srt.disaggregation.kv_events``: signed 64-bit hashes, one
``BlockStored`` per page, optional keys left out when None, ``cache_salt`` / ``session_id`` /
``lora_name``, EAGLE token pairs) travel through SGLang's real ``ZmqEventPublisher`` (built by its
``EventPublisherFactory`` from the ``--kv-events-config`` JSON) to kvmesh's ``EventSubscriber``
and ``kvmesh events tap``, including recovery through SGLang's replay socket. In the other
direction, SGLang's own decoder reads what kvmesh's ``KvEventPublisher`` sends.

The events are built with SGLang's classes rather than produced by its radix cache: importing
``sglang.srt.mem_cache.radix_cache`` needs ``transformers``, which the engine environment (see
``scripts/engine-env.sh``) does not install.

Run inside the env from ``scripts/engine-env.sh sglang`` (``make test-engines``).
"""

from __future__ import annotations

import atexit
import json
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvmesh.events.publisher import BatchPublisher, KvEventPublisher
from kvmesh.events.wire import BlockStored, decode_batch, encode_batch
from tests.engines.enginekit import (
    bound_subscriber_catches_up,
    import_engine_module,
    late_subscriber_recovers,
    lossy_link_is_repaired,
    replay_answers,
    replay_answers_of_both,
    tap_shows_batches,
)
from tests.events.eventkit import free_tcp_port

pytestmark = [pytest.mark.engine_sglang, pytest.mark.timeout(180)]

PAGE = 4
N = 2000


@pytest.fixture(scope="module")
def sglang() -> SimpleNamespace:
    """SGLang's event module; an ImportError here fails every test (the engine tier never skips)."""
    return SimpleNamespace(kv_events=import_engine_module("sglang.srt.disaggregation.kv_events"))


def test_it_is_sglang_0_5_23(sglang: SimpleNamespace) -> None:
    assert version("sglang") == "0.5.23"


def signed_hash(rng: random.Random) -> int:
    return rng.randrange(-(2**63), 2**63)


@pytest.fixture(scope="module")
def engine_batches(sglang: SimpleNamespace) -> list[Any]:
    """2,000 KVEventBatch objects in the shapes SGLang publishes: a page per BlockStored chained by
    parent hash, evictions, cache flushes, optional keys present or absent, EAGLE pairs."""
    kv = sglang.kv_events
    rng = random.Random(7)
    batches = []
    tip: int | None = None
    for n in range(N):
        events: list[Any] = []
        if n % 150 == 149:
            events.append(kv.AllBlocksCleared())
            tip = None
        else:
            for _ in range(rng.randrange(1, 4)):
                page_hash = signed_hash(rng)
                eagle = n % 10 == 3
                tokens = (
                    [(t, t + 1) for t in range(n, n + PAGE)]
                    if eagle
                    else [rng.randrange(0, 150_000) for _ in range(PAGE)]
                )
                extra: dict[str, Any] = {}
                if n % 5 == 0:
                    extra["medium"] = "GPU"
                if n % 7 == 0:
                    extra.update(cache_salt="salt-1", session_id=f"session-{n % 3}")
                if n % 11 == 0:
                    extra["lora_name"] = "adapter-b"
                events.append(
                    kv.BlockStored(
                        block_hashes=[page_hash],
                        parent_block_hash=tip,
                        token_ids=tokens,
                        block_size=PAGE,
                        lora_id=None,
                        **extra,
                    )
                )
                tip = page_hash
            if n % 4 == 0:
                events.append(
                    kv.BlockRemoved(
                        block_hashes=[signed_hash(rng) for _ in range(2)], medium="GPU" if n % 8 else None
                    )
                )
        batches.append(kv.KVEventBatch(ts=1.8e9 + n, events=events, attn_dp_rank=0))
    return batches


def as_builtins(batch: Any) -> Any:
    """A batch as the plain data its msgpack encoding carries. kvmesh keeps SGLang's
    ``cache_salt``: the router hashes tokens itself, so a salted block must not be indexed as the
    unsalted prefix with the same tokens (issue 16, ``BlockStored.keyed_from``)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(batch))


@contextmanager
def sglang_publisher(sglang: SimpleNamespace, endpoint: str, replay: str, **config: Any) -> Iterator[Any]:
    cli_value = json.dumps({"publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay, **config})
    publisher = sglang.kv_events.EventPublisherFactory.create(cli_value, attn_dp_rank=0)
    assert type(publisher) is sglang.kv_events.ZmqEventPublisher
    try:
        yield publisher
    finally:
        publisher.shutdown()
        atexit.unregister(publisher.shutdown)  # SGLang registers it; a second call waits 1 s


# --- the wire format --------------------------------------------------------------------------


def test_kvmesh_decodes_sglang_bytes(engine_batches: list[Any]) -> None:
    encoder = msgspec.msgpack.Encoder()
    saw_pairs = saw_negative = saw_missing_medium = saw_salted = False
    for batch in engine_batches:
        payload = encoder.encode(batch)
        decoded = decode_batch(payload)
        assert as_builtins(decoded) == as_builtins(batch)
        # Re-encoding keeps every key kvmesh knows, in SGLang's values.
        assert msgspec.msgpack.decode(encode_batch(decoded)) == as_builtins(batch)
        for event in decoded.events:
            if isinstance(event, BlockStored):
                saw_pairs |= isinstance(event.token_ids[0], tuple)
                saw_negative |= event.block_hashes[0] < 0
                saw_missing_medium |= event.medium is msgspec.UNSET
                if event.cache_salt not in (msgspec.UNSET, None):
                    saw_salted = True
                    assert event.keyed_from == 0  # never indexed under a token-only hash
    assert saw_pairs and saw_negative and saw_missing_medium and saw_salted


def test_sglang_decodes_what_kvmesh_publishes(
    sglang: SimpleNamespace, ipc_endpoint: Callable[[str], str]
) -> None:
    kv = sglang.kv_events
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    with KvEventPublisher(
        ipc_endpoint("pub"), replay_endpoint=ipc_endpoint("replay"), block_size=PAGE, data_parallel_rank=2
    ) as pub:
        pub.stored([-(2**63), 5], list(range(8)), parent_block_hash=-1, lora_name="adapter-a")
        pub.removed([5], medium="CPU_PINNED")
        pub.flush()
        pub.cleared()
        pub.flush()
        time.sleep(0.1)
        assert pub.replay_endpoint is not None
        answers = replay_answers(pub.replay_endpoint, 0)
    first, second = (decoder.decode(frames[3]) for frames in answers[:-1])
    assert first.attn_dp_rank == 2
    assert first.events == [
        kv.BlockStored(
            block_hashes=[-(2**63), 5],
            parent_block_hash=-1,
            token_ids=list(range(8)),
            block_size=PAGE,
            lora_id=None,
            medium="GPU",
            lora_name="adapter-a",
        ),
        kv.BlockRemoved(block_hashes=[5], medium="CPU_PINNED"),
    ]
    assert second.events == [kv.AllBlocksCleared()]


def test_replay_protocol_answers_like_sglang(
    sglang: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    with (
        sglang_publisher(
            sglang, ipc_endpoint("s-pub"), ipc_endpoint("s-replay"), buffer_steps=5, topic="kv"
        ) as theirs,
        BatchPublisher(
            ipc_endpoint("k-pub"), replay_endpoint=ipc_endpoint("k-replay"), buffer_batches=5, topic="kv"
        ) as ours,
    ):
        pairs = replay_answers_of_both(theirs, theirs._replay_endpoint, ours, engine_batches[:8])
    for expected, got in pairs:
        # Frames are identical except inside BlockStored payloads, whose map headers differ
        # in width (SGLang's struct declares fewer fields) and which lose cache_salt.
        assert [f[:3] for f in got] == [f[:3] for f in expected]
        assert [decode_batch(f[3]) for f in got[:-1]] == [decode_batch(f[3]) for f in expected[:-1]]
        assert got[-1] == expected[-1] == [b"", b"", b"\xff" * 8, b""]


# --- SGLang's publisher -> kvmesh's subscriber --------------------------------------------------


async def test_late_subscriber_recovers_through_sglangs_replay(
    sglang: SimpleNamespace, engine_batches: list[Any]
) -> None:
    endpoint, replay = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    # SGLang's explicit bind= lets it bind a concrete loopback address.
    with sglang_publisher(sglang, endpoint, replay, bind=True) as theirs:
        await late_subscriber_recovers(theirs, endpoint, replay, engine_batches, as_builtins)


async def test_sglang_connecting_to_a_bound_subscriber_slow_joiner(
    sglang: SimpleNamespace, engine_batches: list[Any]
) -> None:
    endpoint, replay = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    with sglang_publisher(sglang, endpoint, replay, bind=False) as theirs:
        await bound_subscriber_catches_up(theirs, endpoint, replay, engine_batches, as_builtins)


async def test_lossy_link_repaired_through_sglangs_replay(
    sglang: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    with sglang_publisher(sglang, ipc_endpoint("pub"), ipc_endpoint("replay")) as theirs:
        await lossy_link_is_repaired(
            theirs,
            theirs._endpoint,
            theirs._replay_endpoint,
            ipc_endpoint("relay"),
            engine_batches,
            as_builtins,
        )


def test_tap_reads_sglangs_publisher(
    sglang: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    def check_event(shown: dict[str, Any], event: Any) -> None:
        if shown["type"] == "BlockStored":
            assert shown["block_hashes"] == event.block_hashes
            assert shown["parent_block_hash"] == event.parent_block_hash
            assert shown["token_ids"] == [list(t) if isinstance(t, tuple) else t for t in event.token_ids]
            assert (shown["medium"], shown["lora_name"]) == (event.medium, event.lora_name)
        elif shown["type"] == "BlockRemoved":
            assert (shown["block_hashes"], shown["medium"]) == (event.block_hashes, event.medium)

    with sglang_publisher(sglang, ipc_endpoint("pub"), ipc_endpoint("replay")) as theirs:
        tap_shows_batches(theirs, theirs._endpoint, theirs._replay_endpoint, engine_batches, check_event)
