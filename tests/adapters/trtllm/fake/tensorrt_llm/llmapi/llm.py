"""Fake of ``tensorrt_llm/llmapi/llm.py`` (class ``LLM``) with a paged prefix cache behind it.

Mirrors, from TensorRT-LLM's published source:

* ``LLM.args``: the pydantic ``LlmArgs`` (here a namespace): ``kv_cache_config`` (``tokens_per_block``,
  ``event_buffer_max_size``, ``enable_block_reuse``, ``max_tokens``), ``enable_attention_dp``,
  ``tensor_parallel_size``, ``max_num_tokens``;
* ``generate_async(inputs, sampling_params, lora_request, prompt_adapter_request, streaming,
  kv_cache_retention_config, disaggregated_params, _postproc_params, scheduling_params,
  cache_salt)``: the 1.0-1.2 signature (no ``priority``); :class:`LLMWithPriority` adds
  ``priority: float = 0.5`` as newer main does. The result is awaitable with ``aresult()`` and has
  ``prompt_token_ids``, ``outputs[0].token_ids``, ``finished`` and ``cached_tokens``;
* ``get_kv_cache_events_async(timeout)``: one destructive, bounded queue (``event_buffer_max_size``;
  the oldest events fall out when it is full) that yields what is queued and then raises
  ``asyncio.QueueEmpty`` (what trtllm-serve's newest handler catches), or ``IndexError`` with
  ``empty_error=IndexError`` (the 1.0 handler's);
* ``get_stats_async(timeout)``: iteration-stats dicts with ``kvCacheStats``.

Event dicts follow ``KVCacheEventSerializer`` (``tensorrt_llm/_utils.py``): ``event_id`` counted per
attention-DP rank, ``window_size``, ``attention_dp_rank`` only with attention DP; ``created`` first;
``stored`` with ``parent_hash`` and ``stored_block`` entries whose ``tokens`` are ``unique_token``
dicts; a prompt's last token is never stored, so a prompt's tail becomes a partial block
(``tests/unittest/llmapi/test_llm_kv_cache_events.py``: 5 tokens, 64 per block -> one 4-token block).
Block hashes are this fake's own (BLAKE2b over parent and tokens), u64 like TensorRT-LLM's V1 keys,
or SHA-256 hex strings with ``hash_algo="v2_sha256"``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


@dataclass
class SamplingParams:
    max_tokens: int = 2


class KvCacheRetentionConfig:
    """Fake of the binding ``tensorrt_llm.bindings.executor.KvCacheRetentionConfig``."""

    class TokenRangeRetentionConfig:
        def __init__(self, token_start, token_end=None, priority=35, duration_ms=None):
            self.token_start = token_start
            self.token_end = token_end
            self.priority = priority
            self.duration_ms = duration_ms

    def __init__(
        self, token_range_retention_configs=(), decode_retention_priority=35, decode_duration_ms=None
    ):
        self.token_range_retention_configs = list(token_range_retention_configs)
        self.decode_retention_priority = decode_retention_priority
        self.decode_duration_ms = decode_duration_ms


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    tokens_per_block: int = 32
    event_buffer_max_size: int = 0
    max_tokens: int | None = None


@dataclass
class _Block:
    key: Any
    parent: Any
    tokens: tuple
    priority: int = 35
    last_use: int = 0
    children: set = field(default_factory=set)


class _Cache:
    """One rank's radix of blocks: full blocks are reusable; a partial tail is stored but only
    matched whole (enough for the events' shapes)."""

    def __init__(self, llm: LLM, rank: int | None, capacity: int) -> None:
        self.llm = llm
        self.rank = rank
        self.capacity = capacity
        self.blocks: OrderedDict[Any, _Block] = OrderedDict()
        self.clock = 0
        self.next_event_id = 0

    def key(self, parent: Any, tokens: tuple) -> Any:
        data = repr((parent, tokens)).encode()
        if self.llm.hash_algo == "v2_sha256":
            return hashlib.sha256(data).hexdigest()
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

    def emit(self, data: dict, window: int | None = None) -> None:
        for w in [window] if window is not None else self.llm.window_sizes:
            event = {"event_id": self.next_event_id, "data": data, "window_size": w}
            self.next_event_id += 1
            if self.rank is not None:
                event["attention_dp_rank"] = self.rank
            if self.llm.hash_algo != "v1_block_key":
                event["hash_algo"] = self.llm.hash_algo
            self.llm._queue.append(event)

    def serve(self, prompt: list[int], retention: Any) -> int:
        size = self.llm.tokens_per_block
        stored_len = len(prompt) - 1  # the last prompt token is never stored
        parent = None
        reused = 0
        new: list[dict] = []
        new_parent = None
        position = 0
        while position < stored_len:
            tokens = tuple(prompt[position : position + size])
            if position + len(tokens) > stored_len:
                tokens = tuple(prompt[position:stored_len])
            key = self.key(parent, tokens)
            block = self.blocks.get(key)
            self.clock += 1
            if block is not None and not new:
                block.last_use = self.clock
                if len(tokens) == size:
                    reused += size
            else:
                if not new:
                    new_parent = parent
                block = _Block(key, parent, tokens, last_use=self.clock)
                self.blocks[key] = block
                if parent is not None and parent in self.blocks:
                    self.blocks[parent].children.add(key)
                new.append(
                    {
                        "type": "stored_block",
                        "block_hash": key,
                        "tokens": [
                            {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens
                        ],
                        "cache_level": 0,
                        "priority": 35,
                    }
                )
            self._retain(block, position, retention)
            parent = key
            position += len(tokens)
        if new:
            self.emit({"type": "stored", "parent_hash": new_parent, "blocks": new})
        self._evict()
        return reused

    def _retain(self, block: _Block, position: int, retention: Any) -> None:
        if retention is None:
            return
        for r in retention.token_range_retention_configs:
            end = r.token_end if r.token_end is not None else float("inf")
            if r.token_start <= position < end:
                block.priority = r.priority

    def _evict(self) -> None:
        while len(self.blocks) > self.capacity:
            leaves = [b for b in self.blocks.values() if not b.children]
            victim = min(leaves, key=lambda b: (b.priority, b.last_use))
            del self.blocks[victim.key]
            if victim.parent in self.blocks:
                self.blocks[victim.parent].children.discard(victim.key)
            self.emit({"type": "removed", "block_hashes": [victim.key]})

    def full_block_keys(self) -> set:
        size = self.llm.tokens_per_block
        return {k for k, b in self.blocks.items() if len(b.tokens) == size}


class _Output:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.text = "".join(chr(97 + t % 26) for t in token_ids)


class _Result:
    """Stands in for ``RequestOutput`` / ``GenerationResult``."""

    def __init__(self, prompt_token_ids: list[int], outputs: list[int], cached_tokens: int) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [_Output(outputs)]
        self.cached_tokens = cached_tokens
        self.finished = True

    async def aresult(self) -> _Result:
        return self

    def __aiter__(self):
        async def once():
            yield self

        return once()


class LLM:
    def __init__(
        self,
        model: str = "fake-model",
        *,
        kv_cache_config: KvCacheConfig | dict | None = None,
        enable_attention_dp: bool = False,
        tensor_parallel_size: int = 1,
        max_num_tokens: int = 8192,
        window_sizes: tuple[int, ...] = (4096,),
        hash_algo: str = "v1_block_key",
        capacity_blocks: int = 64,
        empty_error: type[BaseException] = asyncio.QueueEmpty,
        **_: Any,
    ) -> None:
        if isinstance(kv_cache_config, dict):
            kv_cache_config = KvCacheConfig(**kv_cache_config)
        kv = kv_cache_config or KvCacheConfig()
        self.args = SimpleNamespace(
            model=model,
            kv_cache_config=kv,
            enable_attention_dp=enable_attention_dp,
            tensor_parallel_size=tensor_parallel_size,
            max_num_tokens=max_num_tokens,
        )
        self.tokens_per_block = kv.tokens_per_block
        self.window_sizes = window_sizes
        self.hash_algo = hash_algo
        self.empty_error = empty_error
        self.events_enabled = kv.event_buffer_max_size > 0 and kv.enable_block_reuse
        self._queue: deque = deque(maxlen=max(kv.event_buffer_max_size, 1))
        ranks = tensor_parallel_size if enable_attention_dp else 1
        self.caches = [
            _Cache(self, r if enable_attention_dp else None, capacity_blocks) for r in range(ranks)
        ]
        self.calls: list[dict] = []
        self._next_rank = 0
        self._stats: deque = deque()
        for cache in self.caches:
            cache.emit({"type": "created", "num_blocks_per_cache_level": [capacity_blocks, 0]})
        if not self.events_enabled:
            self._queue.clear()

    # --- generation ---------------------------------------------------------------------------
    def generate_async(
        self,
        inputs,
        sampling_params=None,
        lora_request=None,
        prompt_adapter_request=None,
        streaming=False,
        kv_cache_retention_config=None,
        disaggregated_params=None,
        _postproc_params=None,
        scheduling_params=None,
        cache_salt=None,
    ):
        return self._generate(inputs, sampling_params, kv_cache_retention_config, scheduling_params, None)

    def _generate(self, inputs, sampling_params, retention, scheduling_params, priority):
        prompt = list(inputs) if isinstance(inputs, list) else list(str(inputs).encode())
        self.calls.append(
            {
                "prompt": prompt,
                "sampling_params": sampling_params,
                "kv_cache_retention_config": retention,
                "scheduling_params": scheduling_params,
                "priority": priority,
            }
        )
        rank = getattr(scheduling_params, "attention_dp_rank", None)
        if rank is None:
            rank = self._next_rank
            self._next_rank = (self._next_rank + 1) % len(self.caches)
        cached = self.caches[rank].serve(prompt, retention)
        if not self.events_enabled:
            self._queue.clear()
        self._stats.append(
            {
                "kvCacheStats": {
                    "maxNumBlocks": self.caches[0].capacity,
                    "tokensPerBlock": self.tokens_per_block,
                }
            }
        )
        max_tokens = getattr(sampling_params, "max_tokens", 2) or 2
        return _Result(prompt, [1] * max_tokens, cached)

    # --- events and stats ---------------------------------------------------------------------
    def get_kv_cache_events_async(self, timeout=2):
        queue, empty = self._queue, self.empty_error

        async def events():
            while queue:
                yield queue.popleft()
            raise empty()

        return events()

    def get_stats_async(self, timeout=2):
        stats = self._stats

        async def gen():
            while stats:
                yield stats.popleft()

        return gen()

    def restart(self) -> None:
        """Test knob: the executor came back empty (event ids restart at 0 with ``created``)."""
        for i, cache in enumerate(self.caches):
            fresh = _Cache(self, cache.rank, cache.capacity)
            self.caches[i] = fresh
            fresh.emit({"type": "created", "num_blocks_per_cache_level": [cache.capacity, 0]})

    def shutdown(self) -> None:
        pass


class LLMWithPriority(LLM):
    """Newer main's LLM API: ``generate_async(..., priority: float = 0.5)``, range [0, 1]."""

    def generate_async(
        self,
        inputs,
        sampling_params=None,
        lora_request=None,
        prompt_adapter_request=None,
        streaming=False,
        kv_cache_retention_config=None,
        disaggregated_params=None,
        _postproc_params=None,
        scheduling_params=None,
        conversation_params=None,
        cache_salt=None,
        priority: float = 0.5,
    ):
        return self._generate(inputs, sampling_params, kv_cache_retention_config, scheduling_params, priority)
