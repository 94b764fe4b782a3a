"""The one place that imports TensorRT-LLM for the adapter, with the install hint when it is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvmesh.errors import EngineMissing

INSTALL_HINT = (
    "kvmesh's TensorRT-LLM adapter needs TensorRT-LLM (its wheel comes from NVIDIA's own package "
    "index; install it from there first), then: pip install 'kvmesh[trtllm]'"
)

DEFAULT_BLOCK_SIZE = 32
"""TensorRT-LLM's default ``kv_cache_config.tokens_per_block``."""

VERIFIED_AGAINST = "TensorRT-LLM 1.x published source, the 1.0/1.1 (llm=) and 1.2+ (generator=) shapes"
"""What the adapter was written against; see docs/trtllm.md. It was never run against the real engine."""


def import_trtllm(module: str = "tensorrt_llm") -> ModuleType:
    """Import ``module`` (TensorRT-LLM or one of its submodules), or raise ImportError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and not e.name.startswith("tensorrt_llm"):
            raise  # TensorRT-LLM is there but one of its own dependencies is not: show that error
        raise EngineMissing(INSTALL_HINT) from e
