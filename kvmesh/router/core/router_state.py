"""What the router's parts read together: the load, the timing models and what was learned.

:class:`~kvmesh.router.core.kv_router.KvRouter` owns every piece and changes them through its own
calls; :class:`~kvmesh.router.core.latency_cost.LatencyCost` prices candidates from them and
:class:`~kvmesh.router.core.observations.Observations` teaches them. One object names the set, so
each part is handed the same pieces, by reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh._types import WorkerId, WorkerKey
from kvmesh.router.core.conversations import Conversations
from kvmesh.router.core.copies import SharedPrefixes
from kvmesh.router.core.joins import Joins
from kvmesh.router.core.load import ActiveSequences
from kvmesh.router.core.pass_lag import PassLag
from kvmesh.router.core.stays import Stays
from kvmesh.router.core.tail import TtftTail
from kvmesh.router.core.timing import WorkerTiming
from kvmesh.router.core.wait_spread import WaitSpread


@dataclass(slots=True)
class WorkerLimits:
    """A registered worker: its data-parallel ranks and the limits every rank shares."""

    dp_size: int
    total_blocks: int
    max_num_batched_tokens: int
    block_size: int


@dataclass(frozen=True, slots=True)
class RouterState:
    load: ActiveSequences
    """The requests in flight, per worker."""
    timing: dict[WorkerKey, WorkerTiming]
    """Each worker's fitted timing model."""
    workers: dict[WorkerId, WorkerLimits]
    """The registered workers and their limits."""
    conversations: Conversations
    joins: Joins
    wait_spread: WaitSpread
    shared: SharedPrefixes
    stays: Stays
    tail: TtftTail
    """The fleet's observed times to first token: their 99th percentile."""
    pass_lag: PassLag
    """How much further into its decode pass an engine is than its last tokens say."""


class ReadsState:
    """A part of the router that reads the state: its pieces held as attributes of its own (read
    for every candidate of every decision, an attribute lookup less each time)."""

    def __init__(self, state: RouterState) -> None:
        self._load = state.load
        self._timing = state.timing
        self._workers = state.workers
        self._conversations = state.conversations
        self._joins = state.joins
        self._wait_spread = state.wait_spread
        self._shared = state.shared
        self._stays = state.stays
        self._tail = state.tail
        self._pass_lag = state.pass_lag

    @property
    def block_size(self) -> int:
        """Tokens per KV block: the fleet's, which the load model takes at the first worker
        registered (only registered workers are priced or observed)."""
        return self._load.block_size
