"""Small shared types: identifiers and storage tiers."""

from __future__ import annotations

import enum
from typing import Union

WorkerId = str
"""A worker's name in the fleet (its base URL unless configured otherwise)."""

DpRank = int
"""Data-parallel rank inside one worker; 0 when the engine has no data parallelism."""

WorkerKey = tuple[WorkerId, DpRank]
"""One schedulable unit: a worker and one of its data-parallel ranks."""

EngineHash = Union[int, bytes]
"""A block hash as an engine publishes it: opaque, signed or unsigned 64-bit, or raw bytes."""


class Tier(enum.IntEnum):
    """Where a cached block lives; lower tiers earn a smaller overlap credit when routing."""

    DEVICE = 0
    HOST = 1
    DISK = 2
    EXTERNAL = 3


def tier_of_medium(medium: str | None) -> Tier:
    """Map an event's ``medium`` string onto a tier (``None`` means the GPU, as engines mean it)."""
    if medium is None:
        return Tier.DEVICE
    m = medium.upper()
    if m == "GPU":
        return Tier.DEVICE
    if m.startswith("CPU"):
        return Tier.HOST
    if m in ("DISK", "NVME"):
        return Tier.DISK
    return Tier.EXTERNAL
