"""Fake of ``tensorrt_llm/llmapi/__init__.py``: the names kvmesh imports from it."""

from tensorrt_llm.llmapi.llm import (
    LLM,
    KvCacheConfig,
    KvCacheRetentionConfig,
    LLMWithPriority,
    SamplingParams,
)

__all__ = ["LLM", "KvCacheConfig", "KvCacheRetentionConfig", "LLMWithPriority", "SamplingParams"]
