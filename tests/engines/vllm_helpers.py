"""Real vLLM 0.33.0 pieces that run on CPU, for kvmesh's vLLM adapter tests.

What is real here: vLLM's KVCacheManager / BlockPool (caching, LRU eviction, events), its request
block hasher, its Request, its EngineCoreProc utility-call dispatch and the msgpack codec its
engine core uses to send utility results to the front end, its KVEventsConfig and VllmConfig.
What is not: the model and the GPU. The scheduler's part is played by :class:`PromptRunner`,
which drives the KV cache manager through the same calls the scheduler makes for a prefill
(get_computed_blocks, allocate_slots, free) and publishes ``take_events()`` once per step, exactly
like ``Scheduler.update_from_output``.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# vLLM decides its platform once per process; this environment is CPU-only.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm.config import VllmConfig
from vllm.config.cache import CacheConfig
from vllm.config.device import DeviceConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

BLOCK_SIZE = 4

ENTRY_POINTS = """\
[vllm.general_plugins]
kvmesh = kvmesh.adapters.vllm.plugin:register

[vllm.endpoint_plugins]
kvmesh = kvmesh.adapters.vllm.endpoints:endpoint_plugin
"""


def write_dist_info(root: Path) -> Path:
    """A minimal installed-distribution record declaring kvmesh's two vLLM entry points, the way
    ``pip install kvmesh`` would, so that vLLM's loaders (importlib.metadata) find them once
    ``root`` is on sys.path. The check that it matches pyproject.toml is in the plugin test."""
    info = root / "kvmesh-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvmesh\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return info


def make_manager(num_blocks: int, *, events: bool = True) -> KVCacheManager:
    """A real KVCacheManager over ``num_blocks`` blocks (block 0 is vLLM's null block)."""
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32),
            )
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
        enable_kv_cache_events=events,
    )


def make_hasher() -> Any:
    """vLLM's request block hasher, as EngineCore builds it (sha256 NONE_HASH seed)."""
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(BLOCK_SIZE, fn)


class NoRoom(Exception):
    pass


class PromptRunner:
    """Plays the scheduler for prefill-only requests: allocate, cache, publish one step, free."""

    def __init__(self, manager: KVCacheManager, hasher: Any, publisher: Any = None) -> None:
        self.manager = manager
        self.hasher = hasher
        self.publisher = publisher
        self.steps_published = 0
        self._ids = iter(range(1 << 30))

    def request(self, tokens: list[int], session_id: str | None = None) -> Request:
        return Request(
            request_id=f"r{next(self._ids)}",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self.hasher,
            session_id=session_id,
        )

    def run(self, tokens: list[int], session_id: str | None = None) -> int:
        """Prefill ``tokens``; returns the prefix-cache hit in tokens. Raises NoRoom when the
        pool cannot hold the prompt (everything else is pinned or in use)."""
        manager = self.manager
        req = self.request(tokens, session_id)
        blocks, hit, _ = manager.get_computed_blocks(req)
        if manager.allocate_slots(req, len(tokens) - hit, hit, blocks) is None:
            raise NoRoom(f"no room for {len(tokens)} tokens")
        req.num_computed_tokens = len(tokens)
        self.step()
        manager.free(req)
        return hit

    def step(self) -> None:
        events = self.manager.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.steps_published += 1

    def cached_hit(self, tokens: list[int]) -> int:
        """Tokens of ``tokens`` the prefix cache would serve now (all full blocks considered)."""
        req = self.request(tokens)
        _, hit, _ = self.manager.get_computed_blocks(req, max_cache_hit_length=len(tokens))
        return hit


def pool_hashes(manager: KVCacheManager) -> set[int]:
    """The external (event) hashes of every block in the pool's prefix cache right now."""
    return {
        maybe_convert_block_hash(get_block_hash(key))
        for key in manager.block_pool.cached_block_hash_to_block._cache
    }


def prompts(
    seed: int, count: int, *, shared: int = 8, tail: tuple[int, int] = (4, 24)
) -> Iterator[list[int]]:
    """Prompts sharing a ``shared``-token system prefix, with tails of varied length."""
    import random

    rng = random.Random(seed)
    system = [rng.randrange(1000, 2000) for _ in range(shared)]
    for _ in range(count):
        yield system + [rng.randrange(2000, 50_000) for _ in range(rng.randint(*tail))]


class LoopbackEngineCore:
    """vLLM's EngineCoreProc utility-call path, without a model: ``call(method, *args)`` goes
    through ``EngineCoreProc._handle_client_request`` (getattr dispatch, msgspec arg conversion,
    failure reporting) and the engine core's msgpack codec, like a call over ZMQ."""

    def __init__(self, manager: KVCacheManager, hasher: Any, publisher: Any = None) -> None:
        core = object.__new__(EngineCoreProc)  # no __init__: no model, no executor, no sockets
        core.shutdown_state = EngineShutdownState.RUNNING
        core.output_queue = queue.Queue()
        core.request_block_hasher = hasher
        core.scheduler = type("SchedulerView", (), {})()
        core.scheduler.kv_cache_manager = manager
        core.scheduler.kv_event_publisher = publisher
        self.core = core
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._call_ids = iter(range(1, 1 << 30))

    def call(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self.core._handle_client_request(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        _, outputs = self.core.output_queue.get_nowait()
        out = self._decoder.decode(self._encoder.encode(outputs)).utility_output
        assert out.call_id == call_id
        if out.failure_message is not None:
            raise RuntimeError(out.failure_message)
        return out.result.result


class LoopbackCoreClient:
    """The async core client's utility surface over one or more LoopbackEngineCores."""

    def __init__(self, cores: list[LoopbackEngineCore]) -> None:
        self.cores = cores

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return self.cores[0].call(method, *args)

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        return [core.call(method, *args) for core in self.cores]


class LoopbackEngineClient:
    """The parts of vLLM's EngineClient (AsyncLLM) that kvmesh's endpoint plugin reads."""

    def __init__(
        self, cores: list[LoopbackEngineCore], *, policy: str = "priority", num_gpu_blocks: int
    ) -> None:
        self.engine_core = LoopbackCoreClient(cores)
        self.vllm_config = VllmConfig(
            device_config=DeviceConfig(device="cpu"),
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            scheduler_config=SchedulerConfig(
                policy=policy, max_num_batched_tokens=2048, max_model_len=4096, is_encoder_decoder=False
            ),
            parallel_config=ParallelConfig(),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.resets = 0

    def get_kv_event_sources(self) -> dict[int, Any]:
        return {
            i: core.core.scheduler.kv_event_publisher.get_publisher_config()
            for i, core in enumerate(self.engine_core.cores)
        }

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.resets += 1
        return all(c.core.scheduler.kv_cache_manager.reset_prefix_cache() for c in self.engine_core.cores)


def use_cpu_platform(monkeypatch: Any) -> None:
    """Make vLLM resolve its CPU platform, even if something resolved it before the env was set
    (vLLM's argument parser builds a DeviceConfig, which needs a platform with a device type)."""
    import vllm.platforms

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    if not vllm.platforms.current_platform.device_type:
        monkeypatch.setattr(vllm.platforms, "_current_platform", None)
