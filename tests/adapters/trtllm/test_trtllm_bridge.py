"""The event bridge (kvmesh/adapters/trtllm/bridge.py): the fake engine's KV events, bridged over
real ZMQ on loopback into kvmesh's own subscriber, whose view must match the engine's cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import pytest

from kvmesh.adapters.trtllm.backend import WorkerOptions
from kvmesh.adapters.trtllm.bridge import EVENTS_BRIDGED, KvEventBridge, check_rank_ports, offset_endpoint
from kvmesh.adapters.trtllm.convert import map_hash
from kvmesh.errors import ConfigError
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import AllBlocksCleared, EventBatch
from kvmesh.worker.block_state import CachedBlockState
from tests.events.eventkit import Collector

B = 4


class Follower:
    """A kvmesh subscriber on one rank, folding what it receives into a CachedBlockState."""

    def __init__(self, endpoint: str, replay: str | None) -> None:
        self.collector = Collector()
        self.state = CachedBlockState()
        self.sub = EventSubscriber(
            endpoint, self._on_batch, replay_endpoint=replay, on_reset=self.collector.on_reset
        )

    def _on_batch(self, seq: int, batch: Any) -> None:
        self.collector.on_batch(seq, batch)
        self.state.apply(batch.events)

    async def caught_up(self, last_seq: int | None) -> None:
        await self.collector.wait_for(0 if last_seq is None else last_seq + 1)


@pytest.fixture
async def rig(
    fake_trtllm: ModuleType, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Any, KvEventBridge, list[Follower]]]:
    from tensorrt_llm.llmapi import LLM

    kwargs = getattr(request, "param", {})
    llm = LLM(
        kv_cache_config={"tokens_per_block": B, "event_buffer_max_size": 4096}, capacity_blocks=8, **kwargs
    )
    dp = llm.args.tensor_parallel_size if llm.args.enable_attention_dp else 1
    bridge = KvEventBridge(
        llm, block_size=B, dp_size=dp, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"
    )
    followers = [Follower(bridge.endpoints[r], bridge.replay_endpoints[r]) for r in range(dp)]
    for f in followers:
        f.sub.start()
    for r, f in enumerate(followers):
        # A PUB drops what it sends before a SUB has joined, and a lost *last* batch reveals no
        # gap: probe with empty batches until one arrives, so the test's batches all count.
        for _ in range(2000):
            if f.collector.batches:
                break
            bridge.publishers[r].publish(EventBatch(ts=0.0, events=[], data_parallel_rank=r))
            await asyncio.sleep(0.01)
        await f.caught_up(bridge.publishers[r].last_seq)
    yield llm, bridge, followers
    for f in followers:
        await f.sub.stop()
    await bridge.stop()


def expected(llm: Any, rank: int) -> set[int]:
    return {map_hash(k) for k in llm.caches[rank].full_block_keys()}


async def settle(bridge: KvEventBridge, followers: list[Follower]) -> None:
    await bridge.poll_once()
    for r, f in enumerate(followers):
        await f.caught_up(bridge.publishers[r].last_seq)


PROMPTS = [
    list(range(1, 12)),  # 2 full blocks + a partial tail (10 stored tokens)
    [*list(range(1, 10)), 50, 51, 52, 53, 54],  # shares 2 blocks, adds one more
    [7] * 9,
    [8] * 17,  # 4 full blocks: the 8-block cache starts evicting
    list(range(1, 12)),
    [9] * 13,
]


async def test_the_subscriber_index_matches_the_engines_full_blocks(rig: Any) -> None:
    llm, bridge, (follower,) = rig
    bridged_before = EVENTS_BRIDGED._value.get()
    for prompt in PROMPTS:
        llm.generate_async(prompt)
        await settle(bridge, [follower])
        assert follower.state.hashes() == expected(llm, 0)
    assert bridge.converter.dropped["partial_block"] > 0
    assert any(
        e
        for _, batch in follower.collector.batches
        for e in batch.events
        if type(e).__name__ == "BlockRemoved"
    )
    assert follower.collector.resets == []
    assert EVENTS_BRIDGED._value.get() > bridged_before
    # kv_state serves the bridge's own record: the same blocks, and the seq they include.
    (rank,) = bridge.kv_state_ranks()
    assert rank["last_seq"] == bridge.publishers[0].last_seq
    dumped = {h for e in rank["events"] for h in e["block_hashes"]}
    assert dumped == expected(llm, 0)


@pytest.mark.parametrize("rig", [{"window_sizes": (8, 4096)}], indirect=True)
async def test_sliding_window_streams_are_not_published(rig: Any) -> None:
    llm, bridge, (follower,) = rig
    for prompt in PROMPTS[:3]:
        llm.generate_async(prompt)
    await settle(bridge, [follower])
    assert follower.state.hashes() == expected(llm, 0)
    assert bridge.converter.dropped["window"] > 0


@pytest.mark.parametrize("rig", [{"enable_attention_dp": True, "tensor_parallel_size": 2}], indirect=True)
async def test_each_attention_dp_rank_publishes_on_its_own_socket(rig: Any) -> None:
    llm, bridge, followers = rig
    for prompt in PROMPTS:
        llm.generate_async(prompt)  # the fake spreads requests over the ranks
    await settle(bridge, followers)
    for r, f in enumerate(followers):
        assert f.state.hashes() == expected(llm, r)
        assert {b.data_parallel_rank for _, b in f.collector.batches} == {r}
    assert expected(llm, 0) and expected(llm, 1)


@pytest.mark.parametrize("rig", [{"hash_algo": "v2_sha256"}], indirect=True)
async def test_sha256_hex_hashes(rig: Any) -> None:
    llm, bridge, (follower,) = rig
    for prompt in PROMPTS:
        llm.generate_async(prompt)
        await settle(bridge, [follower])
    assert follower.state.hashes() == expected(llm, 0)


async def test_lost_events_clear_the_rank_and_the_index_never_holds_what_the_engine_lacks(rig: Any) -> None:
    llm, bridge, (follower,) = rig
    llm.generate_async(PROMPTS[0])
    await settle(bridge, [follower])
    llm.generate_async(PROMPTS[3])
    llm.generate_async(PROMPTS[2])
    llm._queue.popleft()  # an event lost between the engine and the bridge
    await settle(bridge, [follower])
    events = [e for _, b in follower.collector.batches for e in b.events]
    assert AllBlocksCleared() in events
    assert follower.state.hashes() <= expected(llm, 0)
    assert bridge.converter.resyncs == 1
    llm.generate_async([5] * 9)
    await settle(bridge, [follower])
    assert {
        map_hash(k) for k in llm.caches[0].full_block_keys() if llm.caches[0].blocks[k].tokens[0] == 5
    } <= (follower.state.hashes())


async def test_an_engine_restart_clears_and_rebuilds(rig: Any) -> None:
    llm, bridge, (follower,) = rig
    for prompt in PROMPTS[:3]:
        llm.generate_async(prompt)
    await settle(bridge, [follower])
    llm.restart()
    llm.generate_async([3] * 9)
    await settle(bridge, [follower])
    assert follower.state.hashes() == expected(llm, 0)
    assert bridge.converter.resyncs == 1


async def test_post_kv_cache_events_readers_get_every_drained_event_once(rig: Any) -> None:
    llm, bridge, _ = rig
    llm.generate_async(PROMPTS[0])
    await bridge.poll_once()
    got = [e async for e in llm.get_kv_cache_events_async(2)]  # what trtllm-serve's handler calls
    assert [e["data"]["type"] for e in got] == ["created", "stored"]
    assert [e async for e in llm.get_kv_cache_events_async(2)] == []


async def test_the_background_loop_publishes_without_being_asked(rig: Any) -> None:
    llm, bridge, (follower,) = rig
    bridge.start()
    llm.generate_async(PROMPTS[0])
    for _ in range(1000):
        if follower.state.hashes() == expected(llm, 0):
            break
        await asyncio.sleep(0.01)
    assert follower.state.hashes() == expected(llm, 0)


def test_endpoints_are_numbered_per_rank() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_ranks_whose_ports_collide_are_refused_before_anything_binds() -> None:
    """With two attention-DP ranks, events on 5557 and replay on 5558 (the launcher's old default)
    put rank 1's events on rank 0's replay port: the server failed at start-up with a bind error.
    The default replay port is now ten above, and a collision is named before any socket opens."""
    options = WorkerOptions()
    check_rank_ports(options.events_endpoint, options.replay_endpoint, 10)  # (ten ranks fit)
    with pytest.raises(ConfigError, match=r"5557 \(events\) and 5558 \(replay\) overlap over 2 attention-DP"):
        KvEventBridge(
            object(), block_size=4, dp_size=2, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558"
        )
    with pytest.raises(ConfigError, match=r"65535 \+ 1 ranks is past 65535"):
        check_rank_ports("tcp://127.0.0.1:65535", None, 2)
    check_rank_ports("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 8)  # (any free ports: nothing to collide)
    check_rank_ports("ipc:///tmp/kv", "ipc:///tmp/kv-replay", 2)


async def test_a_bridge_without_an_engine_refuses_to_poll_and_publishes_what_it_is_fed() -> None:
    """``kvmesh events trtllm`` reads the queue itself and hands the events to ``publish``: a bridge
    built without an engine refuses to poll (it would poll nothing, silently), and publishes what
    it is given."""
    bridge = KvEventBridge(
        None, block_size=4, dp_size=1, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"
    )
    try:
        with pytest.raises(TypeError, match="fed through publish"):
            await bridge.poll_once()
        with pytest.raises(TypeError, match="fed through publish"):
            bridge.start()
        stored = {
            "type": "stored",
            "parent_hash": None,
            "blocks": [{"block_hash": 7, "tokens": [1, 2, 3, 4]}],
        }
        bridge.publish([{"event_id": 0, "data": stored}])
        assert bridge.publishers[0].last_seq == 0 and bridge.converter.bridged == 1
    finally:
        await bridge.stop()
