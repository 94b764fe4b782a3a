"""TensorRT-LLM KV-event dicts, shaped exactly as ``KVCacheEventSerializer`` (tensorrt_llm/_utils.py)
writes them, for the converter tests. Shapes (not values) come from that serializer and from
``tests/unittest/llmapi/test_llm_kv_cache_events.py`` (created first; a 5-token prompt with 64
tokens per block stores one 4-token block with no parent)."""

from __future__ import annotations

from typing import Any


def tokens(ids: list[int]) -> list[dict[str, Any]]:
    return [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]


def block(h: Any, ids: list[int], *, cache_level: int = 0, priority: int = 35) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": tokens(ids),
        "cache_level": cache_level,
        "priority": priority,
    }


def event(
    event_id: int, data: dict[str, Any], *, window: int = 4096, rank: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": window}
    if rank is not None:
        out["attention_dp_rank"] = rank
    return out


def created(event_id: int = 0, blocks: int = 100, **kw: Any) -> dict[str, Any]:
    return event(event_id, {"type": "created", "num_blocks_per_cache_level": [blocks, 0]}, **kw)


def stored(event_id: int, parent: Any, blocks: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return event(event_id, {"type": "stored", "parent_hash": parent, "blocks": blocks}, **kw)


def removed(event_id: int, hashes: list[Any], **kw: Any) -> dict[str, Any]:
    return event(event_id, {"type": "removed", "block_hashes": hashes}, **kw)


def updated(event_id: int, h: Any, **kw: Any) -> dict[str, Any]:
    diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
    prio = {"type": "event_diff", "new_value": 100, "old_value": 35}
    return event(event_id, {"type": "updated", "block_hash": h, "cache_level": diff, "priority": prio}, **kw)
