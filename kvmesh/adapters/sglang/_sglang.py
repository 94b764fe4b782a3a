"""The one place that imports SGLang for the adapter, with the install hint when it is missing."""

from __future__ import annotations

import logging
from types import ModuleType

from kvmesh.errors import EngineMissing

SUPPORTED_SGLANG = "0.5.23"
"""The SGLang release this adapter is written and tested against (its internals are not a stable API)."""

logger = logging.getLogger("kvmesh.adapters.sglang")
_warned = False


def import_sglang() -> ModuleType:
    """Import SGLang, or raise ImportError naming the extra to install."""
    global _warned
    try:
        import sglang
    except ImportError as e:
        if e.name is not None and not e.name.startswith("sglang"):
            raise  # SGLang is there but one of its own dependencies is not: show that error
        raise EngineMissing(
            f"kvmesh's SGLang adapter needs SGLang {SUPPORTED_SGLANG}: pip install 'kvmesh[sglang]'"
        ) from e
    version = getattr(sglang, "__version__", "unknown")
    if version != SUPPORTED_SGLANG and not _warned:
        _warned = True
        logger.warning(
            "kvmesh's SGLang adapter targets SGLang %s but found %s; its engine hooks may not fit",
            SUPPORTED_SGLANG,
            version,
        )
    module: ModuleType = sglang
    return module
