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

import asyncio
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
from enginekit import (
    Collector,
    LossyRelay,
    free_tcp_port,
    import_engine_module,
    replay_answers,
    run_tap,
    wait_sent,
)

from kvmesh.events.publisher import BatchPublisher, KvEventPublisher
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import BlockStored, decode_batch, encode_batch

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
    """A batch as the plain data its msgpack encoding carries; SGLang's ``cache_salt`` key is
    dropped, as kvmesh does not keep it (hashes are already salted; routing never needs it)."""
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    for event in data[1]:
        event.pop("cache_salt", None)
    return data


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
    saw_pairs = saw_negative = saw_missing_medium = False
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
    assert saw_pairs and saw_negative and saw_missing_medium


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
    encoder = msgspec.msgpack.Encoder()
    batches = engine_batches[:8]
    with (
        sglang_publisher(
            sglang, ipc_endpoint("s-pub"), ipc_endpoint("s-replay"), buffer_steps=5, topic="kv"
        ) as theirs,
        BatchPublisher(
            ipc_endpoint("k-pub"), replay_endpoint=ipc_endpoint("k-replay"), buffer_batches=5, topic="kv"
        ) as ours,
    ):
        for batch in batches:
            theirs.publish(batch)
            ours.publish(decode_batch(encoder.encode(batch)))
        s_replay, k_replay = theirs._replay_endpoint, ours.replay_endpoint
        assert k_replay is not None
        asyncio.run(wait_sent(s_replay, 7))
        asyncio.run(wait_sent(k_replay, 7))
        for start in (0, 3, 6, 8, 2**40):
            expected, got = replay_answers(s_replay, start), replay_answers(k_replay, start)
            # Frames are identical except inside BlockStored payloads, whose map headers differ
            # in width (SGLang's struct declares fewer fields) and which lose cache_salt.
            assert [f[:3] for f in got] == [f[:3] for f in expected]
            assert [decode_batch(f[3]) for f in got[:-1]] == [decode_batch(f[3]) for f in expected[:-1]]
            assert got[-1] == expected[-1] == [b"", b"", b"\xff" * 8, b""]
        assert [int.from_bytes(f[2], "big") for f in replay_answers(k_replay, 0)[:-1]] == [3, 4, 5, 6, 7]


# --- SGLang's publisher -> kvmesh's subscriber --------------------------------------------------


async def test_late_subscriber_recovers_through_sglangs_replay(
    sglang: SimpleNamespace, engine_batches: list[Any]
) -> None:
    got = Collector()
    endpoint, replay = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    # SGLang's explicit bind= lets it bind a concrete loopback address.
    with sglang_publisher(sglang, endpoint, replay, bind=True) as theirs:
        for batch in engine_batches[: N // 2]:
            theirs.publish(batch)
        await wait_sent(replay, N // 2 - 1)
        sub = EventSubscriber(endpoint, got.on_batch, replay_endpoint=replay, on_reset=got.on_reset)
        sub.start()
        try:
            await asyncio.sleep(0.1)
            for i, batch in enumerate(engine_batches[N // 2 :]):
                theirs.publish(batch)
                if i % 100 == 0:
                    await asyncio.sleep(0.001)
            await got.wait_for(N)
            await asyncio.sleep(0.05)
        finally:
            await sub.stop()
    assert got.seqs == list(range(N))
    assert [as_builtins(b) for _, b in got.batches] == [as_builtins(b) for b in engine_batches]
    assert got.resets == [] and sub.stats.replayed >= N // 2


async def test_sglang_connecting_to_a_bound_subscriber_slow_joiner(
    sglang: SimpleNamespace, engine_batches: list[Any]
) -> None:
    got = Collector()
    endpoint, replay = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    with sglang_publisher(sglang, endpoint, replay, bind=False) as theirs:
        for batch in engine_batches[:100]:  # before anyone listens: lost on the live path
            theirs.publish(batch)
        await wait_sent(replay, 99)
        sub = EventSubscriber(
            endpoint, got.on_batch, replay_endpoint=replay, bind=True, on_reset=got.on_reset
        )
        sub.start()
        try:
            for batch in engine_batches[100:300]:
                theirs.publish(batch)
                await asyncio.sleep(0.005)
            await got.wait_for(300)
            await asyncio.sleep(0.05)
        finally:
            await sub.stop()
    assert got.seqs == list(range(300))
    assert [as_builtins(b) for _, b in got.batches] == [as_builtins(b) for b in engine_batches[:300]]
    assert got.resets == [] and sub.stats.replayed >= 100


async def test_lossy_link_repaired_through_sglangs_replay(
    sglang: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    got = Collector()
    with sglang_publisher(sglang, ipc_endpoint("pub"), ipc_endpoint("replay")) as theirs:
        relay = LossyRelay(theirs._endpoint, ipc_endpoint("relay"), last_seq=N - 1)
        sub = EventSubscriber(
            relay.endpoint, got.on_batch, replay_endpoint=theirs._replay_endpoint, on_reset=got.on_reset
        )
        sub.start()
        try:
            await asyncio.sleep(0.3)
            for i, batch in enumerate(engine_batches):
                theirs.publish(batch)
                if i % 50 == 0:
                    await asyncio.sleep(0.002)
            await got.wait_for(N, timeout=60)
            while relay.highest_seen < N - 1:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
        finally:
            await sub.stop()
            relay.close()
    assert relay.dropped == [s for s in range(N - 1) if s % 20 == 7]
    assert got.seqs == list(range(N))
    assert [as_builtins(b) for _, b in got.batches] == [as_builtins(b) for b in engine_batches]
    assert got.resets == [] and sub.stats.replayed >= len(relay.dropped)


def test_tap_reads_sglangs_publisher(
    sglang: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    with sglang_publisher(sglang, ipc_endpoint("pub"), ipc_endpoint("replay")) as theirs:
        for batch in engine_batches[:5]:
            theirs.publish(batch)
        tap = run_tap(
            theirs._endpoint,
            "--replay-endpoint",
            theirs._replay_endpoint,
            "--from-seq",
            "0",
            "--count",
            "12",
            "--json",
            "--timeout",
            "60",
        )
        deadline = time.monotonic() + 90
        rest = iter(engine_batches[5:])
        while tap.poll() is None and time.monotonic() < deadline:
            theirs.publish(next(rest))
            time.sleep(0.05)
        out, err = tap.communicate(timeout=30)
    assert tap.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["seq"] for line in lines] == list(range(12))
    for line, batch in zip(lines, engine_batches, strict=False):
        assert line["dp_rank"] == 0 and line["ts"] == batch.ts
        assert [e["type"] for e in line["events"]] == [type(e).__name__ for e in batch.events]
        for shown, event in zip(line["events"], batch.events, strict=True):
            if shown["type"] == "BlockStored":
                assert shown["block_hashes"] == event.block_hashes
                assert shown["parent_block_hash"] == event.parent_block_hash
                assert shown["token_ids"] == [list(t) if isinstance(t, tuple) else t for t in event.token_ids]
                assert (shown["medium"], shown["lora_name"]) == (event.medium, event.lora_name)
            elif shown["type"] == "BlockRemoved":
                assert (shown["block_hashes"], shown["medium"]) == (event.block_hashes, event.medium)
