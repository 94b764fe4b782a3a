"""``/kvmesh/kv_state`` for SGLang: what each DP rank has cached, from its own KV-event stream.

SGLang publishes one stream per DP rank (``port + rank``). The server process follows its own
streams with kvmesh's :class:`~kvmesh.events.subscriber.EventSubscriber` (sequence checks,
replay on gaps) and folds every batch into a :class:`~kvmesh.worker.block_state.CachedBlockState`
per rank; ``kv_state`` dumps those with the sequence number of the last batch applied.

Why a follower rather than asking the scheduler: it reads exactly the bytes every router reads,
so a router that loads the dump and resumes after ``last_seq`` sees a consistent stream by
construction; it works with SGLang's own ``zmq`` publisher as well as kvmesh's; and it costs the
scheduler nothing (the alternative, a dump of the radix tree through SGLang's IPC, would stall a
scheduler step for a walk of the whole tree). It starts before SGLang serves its first request
and replays from sequence 0, so it has every batch since the cache was created (SGLang's first
batch is the ``AllBlocksCleared`` of the tree's construction). A follower that falls further
behind than the publisher's replay buffer resets that rank and says so in the answer
(``"complete": false``) until the next ``AllBlocksCleared`` makes the state whole again.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import AllBlocksCleared, EventBatch
from kvmesh.worker.block_state import CachedBlockState, kv_state_answer, rank_state

logger = logging.getLogger("kvmesh.adapters.sglang")


class _Rank:
    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.state = CachedBlockState()
        self.last_seq: int | None = None
        self.complete = True

    def apply(self, seq: int, batch: EventBatch) -> None:
        if not self.complete and any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self.complete = True
        self.state.apply(batch.events)
        self.last_seq = seq

    def reset(self, reason: str) -> None:
        logger.warning("kvmesh: kv_state of DP rank %d lost events (%s)", self.dp_rank, reason)
        self.state.clear()
        self.complete = False


class KvStateFollower:
    """Follows ``endpoints[r]`` (and ``replay_endpoints[r]``) for every DP rank ``r``."""

    def __init__(
        self,
        block_size: int,
        endpoints: list[str],
        replay_endpoints: list[str | None],
        *,
        topic: str = "",
    ) -> None:
        self.block_size = block_size
        self._ranks = [_Rank(r) for r in range(len(endpoints))]
        self._subscribers = [
            EventSubscriber(
                endpoint,
                rank.apply,
                replay_endpoint=replay,
                topic=topic.encode(),
                on_reset=rank.reset,
                name=f"kv_state dp{rank.dp_rank}",
            )
            for rank, endpoint, replay in zip(self._ranks, endpoints, replay_endpoints, strict=True)
        ]

    def start(self) -> None:
        for sub in self._subscribers:
            sub.start()

    async def stop(self) -> None:
        for sub in self._subscribers:
            await sub.stop()

    def answer(self) -> dict[str, Any]:
        ranks = []
        for rank in self._ranks:
            entry = rank_state(rank.dp_rank, rank.last_seq, rank.state.dump())
            if not rank.complete:
                entry["complete"] = False
            ranks.append(entry)
        return kv_state_answer(self.block_size, ranks)
