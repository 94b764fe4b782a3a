"""Events, kv_state and pins against SGLang 0.5.23's real radix cache on CPU.

``RadixCache.create_simulated`` is SGLang's own radix tree with its own KV-event recorder (one
``BlockStored`` per page, SHA-256-derived signed hashes, ``BlockRemoved`` per evicted node,
``AllBlocksCleared`` on reset); only the KV memory is a recorder of freed slots, as SGLang's
simulation mode intends. Requests' pages are inserted as the scheduler inserts a finished
request's KV (token ids + the KV slot of each token); evictions come from SGLang's ``evict``.
The batches go out through kvmesh's SGLang publisher (built by SGLang's factory) to kvmesh's
``kv_state`` follower and to a router-side index, on loopback tcp.

Every test runs on both of SGLang's full-attention trees: ``RadixCache`` and ``UnifiedRadixCache``,
the tree 0.5.23's scheduler builds by default (``create_unified_radix_cache``: one FULL component,
the bundled Rust tree core unless ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` says otherwise), the
latter over SGLang's real ``PagedTokenToKVPoolAllocator`` on CPU, so evictions return real pages.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from kvmesh.adapters.sglang.follower import KvStateFollower
from kvmesh.adapters.sglang.pins import RadixPins
from kvmesh.events.wire import BlockStored
from tests.engines import sglang_env
from tests.events.eventkit import free_tcp_port

pytestmark = [pytest.mark.engine_sglang, pytest.mark.timeout(300)]

PAGE = 4


class SlotRecorder:
    """The KV allocator SGLang's simulated cache calls when it evicts (frees) a node's slots."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, value: Any, start_pos: int = 0) -> None:
        self.freed += len(value)


TREES = ("radix", "unified")
POOL_TOKENS = 8192
"""KV slots of the real allocator behind the unified tree (its page 0 is SGLang's reserved page)."""


@pytest.fixture(params=TREES)
def sg(request: pytest.FixtureRequest) -> Any:
    return sglang_modules(request.param)


def sglang_modules(tree: str) -> Any:
    """The SGLang modules the tests use, and which tree :func:`new_cache` builds."""
    sglang_env.prepare()
    radix = sglang_env.engine("sglang.srt.mem_cache.radix_cache")
    base = sglang_env.engine("sglang.srt.mem_cache.base_prefix_cache")
    kv = sglang_env.engine("sglang.srt.disaggregation.kv_events")
    import torch

    class NS:
        pass

    ns = NS()
    ns.radix, ns.base, ns.kv, ns.torch = radix, base, kv, torch
    ns.tree = tree
    return ns


def new_cache(sg: Any) -> Any:
    """A fresh tree of the test's kind; :func:`slots_for` hands out its KV slots."""
    kind = getattr(sg, "tree", "radix")
    if kind == "radix":
        return sg.radix.RadixCache.create_simulated(
            mock_allocator=SlotRecorder(), page_size=PAGE, enable_kv_cache_events=True
        )
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    allocator = PagedTokenToKVPoolAllocator(
        size=POOL_TOKENS, page_size=PAGE, dtype=sg.torch.float16, device="cpu", kvcache=None, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        enable_kv_cache_events=True,
        tree_components=(ComponentType.FULL,),
        tree_core_backend="python" if kind == "unified-python" else None,
    )
    return UnifiedRadixCache(params)


def slots_for(cache: Any) -> Slots:
    allocator = getattr(cache, "token_to_kv_pool_allocator", None)
    return Slots(None if isinstance(allocator, SlotRecorder) else allocator)


class Slots:
    """Hands out KV slots like SGLang's allocator: page-aligned, never two pages the same. With a
    real allocator, the slots are its own (a trailing partial page is allocated whole)."""

    def __init__(self, allocator: Any = None) -> None:
        self.next = 0
        self.allocator = allocator

    def take(self, n: int) -> list[int]:
        if self.allocator is not None:
            got = self.allocator.alloc(-(-n // PAGE) * PAGE)
            assert got is not None, "the test's KV pool is full"
            return [int(s) for s in got[:n].tolist()]
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def insert(sg: Any, cache: Any, slots: Slots, tokens: list[int]) -> None:
    """Insert a finished request's KV: the cached prefix keeps its slots, the rest gets new ones."""
    from array import array

    key = sg.radix.RadixKey(array("q", tokens))
    match = cache.match_prefix(sg.base.MatchPrefixParams(key=key))
    cached = int(match.device_prefix_len)
    prefix = cache.path_device_indices(match.last_device_node)[:cached].tolist() if cached else []
    value = sg.torch.tensor(prefix + slots.take(len(tokens) - cached), dtype=sg.torch.int64)
    cache.insert(sg.base.InsertParams(key=key, value=value))


def cached_prefix(sg: Any, cache: Any, tokens: list[int]) -> int:
    from array import array

    key = sg.radix.RadixKey(array("q", tokens))
    return int(cache.match_prefix(sg.base.MatchPrefixParams(key=key)).device_prefix_len)


def stored_pages(state: dict[str, Any]) -> set[tuple[int, ...]]:
    """Every cached page of a kv_state answer as its token ids."""
    out = set()
    for rank in state["ranks"]:
        for event in rank["events"]:
            assert event["type"] == "BlockStored"
            tokens = event["token_ids"]
            out.update(tuple(tokens[i : i + PAGE]) for i in range(0, len(tokens), PAGE))
    return out


def cache_pages(sg: Any, cache: Any, inserted: list[list[int]]) -> set[tuple[int, ...]]:
    """Every page in SGLang's tree as token ids (keys are page-aligned). The classic tree is walked
    node by node; the unified tree's Rust core has no Python nodes, so its pages are the cached
    prefixes of every sequence inserted (a tree holds only prefixes of what was inserted, and a
    cached page's parents are cached)."""
    out: set[tuple[int, ...]] = set()
    if sg.tree == "unified":
        for tokens in inserted:
            ids = tokens[: cached_prefix(sg, cache, tokens)]
            out.update(tuple(ids[i : i + PAGE]) for i in range(0, len(ids), PAGE))
        return out
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is cache.root_node:
            continue
        ids = list(node.key.token_ids)
        out.update(tuple(ids[i : i + PAGE]) for i in range(0, len(ids), PAGE))
    return out


async def test_tree_events_reach_kv_state_and_match_the_cache(sg: Any) -> None:
    live, replay = free_tcp_port(), free_tcp_port()
    config = json.dumps(
        {
            "publisher": "kvmesh",
            "endpoint": f"tcp://127.0.0.1:{live}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
    )
    from kvmesh.adapters.sglang import plugin

    plugin.register_publisher()
    pub = sg.kv.EventPublisherFactory.create(config, attn_dp_rank=0)
    follower = KvStateFollower(PAGE, [f"tcp://127.0.0.1:{live}"], [f"tcp://127.0.0.1:{replay}"])
    cache = new_cache(sg)
    slots = slots_for(cache)
    rng = random.Random(3)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    published = 0
    inserted: list[list[int]] = []

    def step() -> None:
        nonlocal published
        events = cache.take_events()
        if events:
            pub.publish(sg.kv.KVEventBatch(ts=1.0, events=events, attn_dp_rank=None))
            published += 1

    try:
        step()  # the AllBlocksCleared of the tree's construction, before the follower runs
        follower.start()
        await asyncio.sleep(0.5)  # connected; the first live batch it sees is seq 1: it replays 0
        for n in range(60):
            base = prompts[n % len(prompts)]
            inserted.append(base + [rng.randrange(50) for _ in range(rng.randrange(0, 12))])
            insert(sg, cache, slots, inserted[-1])
            if n % 7 == 6:
                cache.evict(sg.base.EvictParams(num_tokens=rng.randrange(4, 40)))
            step()
            await asyncio.sleep(0)
        state: dict[str, Any] = {}
        for _ in range(200):
            state = follower.answer()
            if state["ranks"][0]["last_seq"] == published - 1:
                break
            await asyncio.sleep(0.02)
        assert state["block_size"] == PAGE
        assert state["ranks"][0]["last_seq"] == published - 1
        pages = cache_pages(sg, cache, inserted)
        assert cache.evictable_size() > 0 and pages
        assert stored_pages(state) == pages
        # SGLang's hashes, as its recorder computed them, are what kv_state hands a router.
        hashes = {h for e in state["ranks"][0]["events"] for h in e["block_hashes"]}
        assert all(isinstance(h, int) and -(2**63) <= h < 2**63 for h in hashes)
        assert any(h < 0 for h in hashes)
        cache.reset()  # /flush_cache
        step()
        for _ in range(200):
            if follower.answer()["ranks"][0]["last_seq"] == published - 1:
                break
            await asyncio.sleep(0.02)
        assert follower.answer()["ranks"][0]["events"] == []
    finally:
        await follower.stop()
        pub.shutdown()


def test_kv_state_dump_is_parents_first(sg: Any) -> None:
    """The dump a router loads keeps SGLang's parent chain (each parent before its children)."""
    import msgspec

    from kvmesh.events.wire import decode_batch
    from kvmesh.worker.block_state import CachedBlockState

    cache = new_cache(sg)
    slots = slots_for(cache)
    state = CachedBlockState()
    for tokens in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 10, 10, 10, 10]):
        insert(sg, cache, slots, tokens)
    batch = sg.kv.KVEventBatch(ts=0.0, events=cache.take_events(), attn_dp_rank=0)
    state.apply(decode_batch(msgspec.msgpack.encode(batch)).events)
    seen: set[int] = set()
    for event in state.dump():
        assert isinstance(event, BlockStored)
        assert event.parent_block_hash is None or event.parent_block_hash in seen
        seen.update(event.block_hashes)
    assert len(seen) == 4


# --- pins ---------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_pin_keeps_a_prefix_under_eviction_pressure_until_its_ttl(sg: Any) -> None:
    cache = new_cache(sg)
    slots = slots_for(cache)
    clock = Clock()
    pins = RadixPins(cache, page_size=PAGE, total_tokens=400, budget_fraction=0.5, clock=clock)
    kept = list(range(100, 116))  # 4 pages
    insert(sg, cache, slots, [*kept, 7, 7])  # the partial page is never cached
    insert(sg, cache, slots, list(range(200, 220)))
    assert pins.pin([*kept, 1, 2, 3, 4], ttl_seconds=30) == 4
    assert cache.protected_size() == 16
    cache.evict(sg.base.EvictParams(num_tokens=10_000))  # everything evictable goes
    assert cached_prefix(sg, cache, kept) == 16
    assert cached_prefix(sg, cache, list(range(200, 220))) == 0
    clock.now += 29
    pins.expire()
    cache.evict(sg.base.EvictParams(num_tokens=10_000))
    assert cached_prefix(sg, cache, kept) == 16
    clock.now += 2
    pins.expire()
    assert cache.protected_size() == 0
    cache.evict(sg.base.EvictParams(num_tokens=10_000))
    assert cached_prefix(sg, cache, kept) == 0


def test_pin_of_a_partly_cached_prompt_locks_exactly_its_cached_pages(sg: Any) -> None:
    cache = new_cache(sg)
    slots = slots_for(cache)
    pins = RadixPins(cache, page_size=PAGE, total_tokens=400, clock=Clock())
    insert(sg, cache, slots, list(range(24)))  # one node of 6 pages
    assert pins.pin(list(range(8)) + [99] * 8, ttl_seconds=10) == 2  # splits the node after page 2
    cache.evict(sg.base.EvictParams(num_tokens=10_000))
    assert cached_prefix(sg, cache, list(range(24))) == 8


def test_pin_budget_keeps_the_longest_prefix_that_fits(sg: Any) -> None:
    cache = new_cache(sg)
    slots = slots_for(cache)
    pins = RadixPins(cache, page_size=PAGE, total_tokens=40, budget_fraction=0.5, clock=Clock())  # 5 pages
    a, b = list(range(0, 16)), list(range(100, 116))
    insert(sg, cache, slots, a)
    insert(sg, cache, slots, b)
    assert pins.pin(a, ttl_seconds=60) == 4
    assert pins.pin(b, ttl_seconds=60) == 1  # one page left in the budget
    assert pins.stats()["pinned_pages"] == 5 == pins.stats()["budget_pages"]
    cache.evict(sg.base.EvictParams(num_tokens=10_000))
    assert cached_prefix(sg, cache, a) == 16
    assert cached_prefix(sg, cache, b) == 4


def test_flush_drops_pins_and_a_new_tree_is_untouched(sg: Any) -> None:
    cache = new_cache(sg)
    slots = slots_for(cache)
    pins = RadixPins(cache, page_size=PAGE, total_tokens=400, clock=Clock())
    insert(sg, cache, slots, list(range(16)))
    assert pins.pin(list(range(16)), ttl_seconds=60) == 4
    cache.reset()  # SGLang's /flush_cache resets the tree whatever is locked
    from kvmesh.adapters.sglang import scheduler_hooks

    class Scheduler:
        pass

    scheduler = Scheduler()
    scheduler.__dict__["_kvmesh_service"] = (scheduler_hooks.SchedulerService(pins), None)
    assert scheduler_hooks.after_flush_cache(True, scheduler) is True
    assert pins.stats()["pins"] == 0
    insert(sg, cache, slots, list(range(16)))
    pins.expire()
    assert cache.protected_size() == 0
    cache.evict(sg.base.EvictParams(num_tokens=10_000))
    assert cached_prefix(sg, cache, list(range(16))) == 0


def test_a_tree_reset_by_any_path_drops_pins_before_anything_is_released(sg: Any) -> None:
    """A disaggregation role switch resets the tree without ``Scheduler.flush_cache`` (so without
    kvmesh's flush hook): the pins notice the new root and never release old nodes into it."""
    cache = new_cache(sg)
    slots = slots_for(cache)
    clock = Clock()
    pins = RadixPins(cache, page_size=PAGE, total_tokens=400, clock=clock)
    insert(sg, cache, slots, list(range(16)))
    assert pins.pin(list(range(16)), ttl_seconds=60) == 4
    cache.reset()
    assert pins.stats()["pins"] == 0 and pins.stats()["pinned_pages"] == 0
    insert(sg, cache, slots, list(range(16)))
    assert pins.pin(list(range(8)), ttl_seconds=10) == 2  # a pin in the new tree still works
    clock.now += 61
    pins.expire()  # the old pin's deadline: nothing of the old tree is released
    assert cache.protected_size() == 0
    cache.evict(sg.base.EvictParams(num_tokens=10_000))
    assert cached_prefix(sg, cache, list(range(16))) == 0


@pytest.mark.parametrize("core", ["unified", "unified-python"])
def test_a_pin_held_while_idle_passes_sglangs_idle_checks(core: str) -> None:
    """What ``Scheduler.on_idle`` checks (0.5.23, ``SchedulerInvariantChecker``), with a pin held
    and no request running: the full pool balances (available + evictable + protected == total: a
    pin's pages count as protected, like a running request's prefix), the request pool is whole (a
    pin holds no request row), and the tree's own ``sanity_check`` (run idle for hybrid models when
    ``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK`` is on) accepts the lock, on both tree cores."""
    sg = sglang_modules(core)
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.runtime_context import get_parallel

    cache = new_cache(sg)
    slots = slots_for(cache)
    allocator = cache.token_to_kv_pool_allocator
    rows = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    observer = SchedulerPoolStatsObserver(
        tree_cache=cache,
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=rows,
        session_controller=None,
        hisparse_coordinator=None,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hisparse=False,
        full_tokens_per_layer=None,
        swa_tokens_per_layer=None,
        max_total_num_tokens=POOL_TOKENS,
    )
    checker = SchedulerInvariantChecker(
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        disaggregation_mode=DisaggregationMode.NULL,
        page_size=PAGE,
        full_tokens_per_layer=None,
        swa_tokens_per_layer=None,
        max_total_num_tokens=POOL_TOKENS,
        tree_cache=cache,
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=rows,
        pool_stats_observer=observer,
        get_last_batch=lambda: None,
        get_running_batch=lambda: None,
        scheduler_stage_metrics=None,
    )

    def idle_checks() -> str:
        with get_parallel().override(dcp_enabled=False):  # no scheduler published a parallel config
            leak, messages = checker._check_all_pools(observer.get_pool_stats())
        assert not leak, messages
        checker._check_req_pool()  # raises with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE (default)
        cache.sanity_check()
        return messages[0]

    clock = Clock()
    pins = RadixPins(cache, page_size=PAGE, total_tokens=POOL_TOKENS, clock=clock)
    insert(sg, cache, slots, list(range(32)))
    insert(sg, cache, slots, list(range(100, 116)))
    idle_checks()
    assert pins.pin(list(range(32)), ttl_seconds=60) == 8
    assert "evictable=16, protected=32" in idle_checks()
    clock.now += 61
    pins.expire()
    assert "evictable=48, protected=0" in idle_checks()
