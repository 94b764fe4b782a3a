"""The one place that imports vLLM for the adapter, with the install hint when it is missing."""

from __future__ import annotations

import logging
from types import ModuleType

from kvmesh.errors import EngineMissing

SUPPORTED_VLLM = "0.33.0"
"""The vLLM release this adapter is written and tested against (its internals are not a stable API)."""

logger = logging.getLogger("kvmesh.adapters.vllm")
_warned = False


def import_vllm() -> ModuleType:
    """Import vLLM, or raise ImportError naming the extra to install."""
    global _warned
    try:
        import vllm
    except ImportError as e:
        if e.name is not None and not e.name.startswith("vllm"):
            raise  # vLLM is there but one of its own dependencies is not: show that error
        raise EngineMissing(
            f"kvmesh's vLLM adapter needs vLLM {SUPPORTED_VLLM}: pip install 'kvmesh[vllm]'"
        ) from e
    version = getattr(vllm, "__version__", "unknown")
    if version != SUPPORTED_VLLM and not _warned:
        _warned = True
        logger.warning(
            "kvmesh's vLLM adapter targets vLLM %s but found %s; its engine hooks may not fit",
            SUPPORTED_VLLM,
            version,
        )
    module: ModuleType = vllm
    return module
