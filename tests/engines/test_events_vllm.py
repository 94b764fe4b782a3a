"""kvmesh's event transport against vLLM 0.33.0's own code, on CPU.

Events come from vLLM's real ``BlockPool`` (prefix caching with LRU eviction, events enabled) and
travel through vLLM's real ``ZmqEventPublisher`` (built by its ``EventPublisherFactory`` from a
``KVEventsConfig``, as the engine does) to kvmesh's ``EventSubscriber`` and ``kvmesh events tap``,
including recovery through vLLM's replay socket. In the other direction, vLLM's own decoder reads
what kvmesh's ``KvEventPublisher`` sends, and both publishers answer the replay protocol with the
same bytes.

Run inside the env from ``scripts/engine-env.sh vllm`` (``make test-engines``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq

from kvmesh.events.publisher import BatchPublisher, KvEventPublisher
from kvmesh.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
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

pytestmark = [pytest.mark.engine_vllm, pytest.mark.timeout(180)]

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    """vLLM's modules; an ImportError here fails every test (the engine tier never skips)."""
    return SimpleNamespace(
        version=import_engine_module("vllm").__version__,
        kv_events=import_engine_module("vllm.distributed.kv_events"),
        config=import_engine_module("vllm.config.kv_events"),
        block_pool=import_engine_module("vllm.v1.core.block_pool"),
        kv_cache_utils=import_engine_module("vllm.v1.core.kv_cache_utils"),
        request=import_engine_module("vllm.v1.request"),
        sampling=import_engine_module("vllm.sampling_params"),
        hashing=import_engine_module("vllm.utils.hashing"),
    )


def test_it_is_vllm_0_33_0(vllm: SimpleNamespace) -> None:
    assert vllm.version == "0.33.0"


class VllmCache:
    """vLLM's BlockPool driven like its scheduler drives it: look up the cached prefix, allocate
    the rest (evicting LRU blocks), cache the full blocks, free them when the request ends."""

    def __init__(self, vllm: SimpleNamespace, *, num_blocks: int = 24, seed: int = 0) -> None:
        self.v = vllm
        sha256 = vllm.hashing.sha256
        vllm.kv_cache_utils.init_none_hash(sha256)
        self.pool = vllm.block_pool.BlockPool(
            num_gpu_blocks=num_blocks,
            enable_caching=True,
            hash_block_size=BLOCK_SIZE,
            enable_kv_cache_events=True,
        )
        self.hasher = vllm.kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, sha256)
        self.rng = random.Random(seed)
        self.prefixes = [[100 * k + i for i in range(12)] for k in range(1, 5)]
        self.step_no = 0

    def step(self) -> list[Any]:
        """Serve one request; return the events the pool emitted (possibly none)."""
        self.step_no += 1
        if self.step_no % 97 == 0:
            self.pool.reset_prefix_cache()  # all blocks are free between requests, so this clears
            return list(self.pool.take_events())
        tokens = self.rng.choice(self.prefixes) + [
            self.rng.randrange(1000, 30000) for _ in range(self.rng.randrange(1, 14))
        ]
        request = self.v.request.Request(
            f"req-{self.step_no}",
            tokens,
            self.v.sampling.SamplingParams(max_tokens=1),
            None,
            block_hasher=self.hasher,
        )
        full = len(tokens) // BLOCK_SIZE
        hits = []
        for block_hash in request.block_hashes[:full]:
            cached = self.pool.get_cached_block(block_hash, [0])
            if cached is None:
                break
            hits.append(cached[0])
        self.pool.touch(hits)
        blocks = hits + self.pool.get_new_blocks(full - len(hits))
        self.pool.cache_full_blocks(request, blocks, len(hits), full, BLOCK_SIZE, 0)
        self.pool.free_blocks(reversed(blocks))  # tail first, so eviction takes leaves first
        return list(self.pool.take_events())


@pytest.fixture(scope="module")
def engine_batches(vllm: SimpleNamespace) -> list[Any]:
    """2,000 vLLM KVEventBatch objects, one per scheduler step that changed the cache."""
    cache = VllmCache(vllm)
    batches = []
    while len(batches) < 2000:
        events = cache.step()
        if events:
            batches.append(
                vllm.kv_events.KVEventBatch(ts=1.8e9 + len(batches), events=events, data_parallel_rank=0)
            )
    return batches


def as_builtins(batch: Any) -> Any:
    """A batch as the plain data its msgpack encoding carries: the neutral ground on which vLLM's
    objects and kvmesh's are compared."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(batch))


@contextmanager
def vllm_publisher(vllm: SimpleNamespace, endpoint: str, replay: str, **config: Any) -> Iterator[Any]:
    kv_config = vllm.config.KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay, **config
    )
    publisher = vllm.kv_events.EventPublisherFactory.create(kv_config, data_parallel_rank=0)
    assert type(publisher) is vllm.kv_events.ZmqEventPublisher
    try:
        yield publisher
    finally:
        publisher.shutdown()


# --- the wire format --------------------------------------------------------------------------


def test_block_pool_events_cover_every_kind(engine_batches: list[Any], vllm: SimpleNamespace) -> None:
    kinds = {type(e).__name__ for b in engine_batches for e in b.events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    hashes = [
        h for b in engine_batches for e in b.events if hasattr(e, "block_hashes") for h in e.block_hashes
    ]
    assert any(h >= 2**63 for h in hashes), "vLLM's unsigned 64-bit hashes should exceed int64"
    assert any(getattr(e, "parent_block_hash", None) is not None for b in engine_batches for e in b.events)


def test_kvmesh_reencodes_vllm_bytes_exactly(engine_batches: list[Any], vllm: SimpleNamespace) -> None:
    encoder = msgspec.msgpack.Encoder()
    for batch in engine_batches:
        payload = encoder.encode(batch)
        decoded = decode_batch(payload)
        assert encode_batch(decoded) == payload
        assert as_builtins(decoded) == as_builtins(batch)
        for ours, theirs in zip(decoded.events, batch.events, strict=True):
            if isinstance(ours, BlockStored):
                assert (ours.block_hashes, ours.parent_block_hash, ours.token_ids) == (
                    theirs.block_hashes,
                    theirs.parent_block_hash,
                    theirs.token_ids,
                )
                assert ours.medium == "GPU" and ours.adapter is None


def test_bytes_block_hashes(vllm: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    cache = VllmCache(vllm, seed=1)
    events = [e for _ in range(30) for e in cache.step()]
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert stored and all(isinstance(h, bytes) and len(h) == 32 for e in stored for h in e.block_hashes)
    payload = msgspec.msgpack.encode(vllm.kv_events.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))
    decoded = decode_batch(payload)
    assert encode_batch(decoded) == payload
    assert [e.block_hashes for e in decoded.events if isinstance(e, BlockStored)] == [
        e.block_hashes for e in stored
    ]


def test_vllm_decodes_what_kvmesh_publishes(
    vllm: SimpleNamespace, ipc_endpoint: Callable[[str], str]
) -> None:
    decoder = msgspec.msgpack.Decoder(vllm.kv_events.KVEventBatch)
    with KvEventPublisher(
        ipc_endpoint("pub"), replay_endpoint=ipc_endpoint("replay"), block_size=4, data_parallel_rank=1
    ) as pub:
        pub.stored([2**64 - 1, 7], list(range(8)), parent_block_hash=3, lora_name="adapter-a")
        pub.removed([7], medium="CPU")
        pub.flush()
        pub.cleared()
        pub.flush()
        pub.stored([b"\x05" * 32], [1, 2, 3, 4])
        pub.flush()
        time.sleep(0.1)
        assert pub.replay_endpoint is not None
        answers = replay_answers(pub.replay_endpoint, 0)
    first, second, third = (decoder.decode(frames[3]) for frames in answers[:-1])
    kv = vllm.kv_events
    assert first.data_parallel_rank == 1
    assert first.events == [
        kv.BlockStored(
            block_hashes=[2**64 - 1, 7],
            parent_block_hash=3,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name="adapter-a",
        ),
        kv.BlockRemoved(block_hashes=[7], medium="CPU"),
    ]
    assert second.events == [kv.AllBlocksCleared()]
    assert third.events[0].block_hashes == [b"\x05" * 32]


def test_replay_protocol_answers_like_vllm_byte_for_byte(
    vllm: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    with (
        vllm_publisher(
            vllm, ipc_endpoint("v-pub"), ipc_endpoint("v-replay"), buffer_steps=5, topic="kv@0"
        ) as theirs,
        BatchPublisher(
            ipc_endpoint("k-pub"), replay_endpoint=ipc_endpoint("k-replay"), buffer_batches=5, topic="kv@0"
        ) as ours,
    ):
        pairs = replay_answers_of_both(
            theirs, theirs.get_publisher_config().replay_endpoint, ours, engine_batches[:8]
        )
    for expected, got in pairs:
        assert got == expected
    assert [f[2] for f in pairs[-1][0]] == [b"\xff" * 8]  # from far past the end: only the end marker


def test_pub_frames_match_vllm_byte_for_byte(
    vllm: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    encoder = msgspec.msgpack.Encoder()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with (
        vllm_publisher(vllm, ipc_endpoint("v-pub"), ipc_endpoint("v-replay"), topic="kv") as theirs,
        BatchPublisher(ipc_endpoint("k-pub"), topic="kv") as ours,
    ):
        subs = []
        for endpoint in (theirs.get_publisher_config().endpoint, ours.endpoint):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            subs.append(sub)
        try:
            time.sleep(0.3)
            for batch in engine_batches[:20]:
                theirs.publish(batch)
                ours.publish(decode_batch(encoder.encode(batch)))
            got = []
            for sub in subs:
                frames = []
                for _ in range(20):
                    assert sub.poll(5000)
                    frames.append(sub.recv_multipart())
                got.append(frames)
        finally:
            for sub in subs:
                sub.close(linger=0)
    assert got[0] == got[1]
    assert [f[1] for f in got[0]] == [i.to_bytes(8, "big") for i in range(20)]


# --- vLLM's publisher -> kvmesh's subscriber ----------------------------------------------------


async def test_late_subscriber_recovers_through_vllms_replay(
    vllm: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    with vllm_publisher(vllm, ipc_endpoint("pub"), ipc_endpoint("replay")) as theirs:
        config = theirs.get_publisher_config()
        await late_subscriber_recovers(
            theirs, config.endpoint, config.replay_endpoint, engine_batches, as_builtins
        )


async def test_vllm_connecting_to_a_bound_subscriber_slow_joiner(
    vllm: SimpleNamespace, engine_batches: list[Any]
) -> None:
    endpoint, replay = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    # A concrete tcp address: vLLM connects its PUB to it (and binds only the replay ROUTER).
    with vllm_publisher(vllm, endpoint, replay) as theirs:
        await bound_subscriber_catches_up(theirs, endpoint, replay, engine_batches, as_builtins)


async def test_lossy_link_repaired_through_vllms_replay(
    vllm: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    with vllm_publisher(vllm, ipc_endpoint("pub"), ipc_endpoint("replay")) as theirs:
        config = theirs.get_publisher_config()
        await lossy_link_is_repaired(
            theirs,
            config.endpoint,
            config.replay_endpoint,
            ipc_endpoint("relay"),
            engine_batches,
            as_builtins,
        )


def test_tap_reads_vllms_publisher(
    vllm: SimpleNamespace, engine_batches: list[Any], ipc_endpoint: Callable[[str], str]
) -> None:
    def check_event(shown: dict[str, Any], event: Any) -> None:
        if shown["type"] == "BlockStored":
            assert shown["block_hashes"] == event.block_hashes
            assert shown["parent_block_hash"] == event.parent_block_hash
            assert shown["token_ids"] == event.token_ids
            assert (shown["block_size"], shown["medium"], shown["lora_name"]) == (BLOCK_SIZE, "GPU", None)
        elif shown["type"] == "BlockRemoved":
            assert shown["block_hashes"] == event.block_hashes

    with vllm_publisher(vllm, ipc_endpoint("pub"), ipc_endpoint("replay")) as theirs:
        config = theirs.get_publisher_config()
        tap_shows_batches(theirs, config.endpoint, config.replay_endpoint, engine_batches, check_event)


def test_kvmesh_structs_accept_every_vllm_event_field(vllm: SimpleNamespace) -> None:
    # vLLM 0.33.0 declares these BlockStored fields; kvmesh declares the same, in the same order,
    # which is what makes its map header (and so its bytes) identical. After them comes SGLang's
    # cache_salt, which vLLM never sends (unset, it is omitted: the bytes stay vLLM's).
    theirs = list(vllm.kv_events.BlockStored.__struct_fields__)
    assert list(BlockStored.__struct_fields__) == [*theirs, "cache_salt"]
    assert list(BlockRemoved.__struct_fields__) == list(vllm.kv_events.BlockRemoved.__struct_fields__)
    assert AllBlocksCleared.__struct_fields__ == vllm.kv_events.AllBlocksCleared.__struct_fields__
    assert EventBatch.__struct_fields__ == vllm.kv_events.EventBatch.__struct_fields__
