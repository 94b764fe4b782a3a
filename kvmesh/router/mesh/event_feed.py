"""A worker's KV events into the router's index: cold start, live streams, resets, quiet probes.

For one worker the feed

1. cold-starts the index from ``/kvmesh/kv_state`` (when the worker serves kvmesh's RPCs) and
   remembers each data-parallel rank's last published sequence;
2. follows one :class:`EventSubscriber` per rank from that sequence, applying every batch to the
   KvRouter and counting it;
3. on a stream reset (a gap replay could not fill, an engine restart) clears that rank's part of the
   index and re-syncs it from ``kv_state``;
4. after each quiet spell of a stream, asks once whether anything was published since the last
   batch it holds (a replay from the next sequence, or the ``kv_state`` sequence when the worker
   has no replay socket): a batch lost just before a quiet period is revealed by no later batch, so
   without this the index would stay wrong until the next burst.

The registry decides *when* (admission, health checks, removal); this module knows *how*.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh._types import WorkerId
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.router.core.kv_router import KvRouter
from kvmesh.router.mesh.metrics import Metrics
from kvmesh.router.mesh.worker_rpc import WorkerRpc
from kvmesh.router.upstream.forwarder import ConnectFailed

logger = logging.getLogger("kvmesh.router")


@dataclass(slots=True)
class Streams:
    """One worker's event subscriptions and what the quiet-stream probe remembers about them."""

    subscribers: list[EventSubscriber] = field(default_factory=list)
    events_applied: int = 0
    # Per dp rank: the subscriber's received count at the last check, and the count at which a
    # quiet stream was last probed for a lost final batch.
    seen_received: dict[int, int] = field(default_factory=dict)
    probed_received: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FeedTarget:
    """What the feed needs to know of a worker: who, where, and whether it serves ``kv_state``."""

    worker_id: WorkerId
    url: str
    kv_events_endpoints: tuple[str, ...]
    kv_replay_endpoints: tuple[str | None, ...]
    has_rpc: bool


class EventFeed:
    """Cold start, subscriptions and repair of every worker's KV-event streams."""

    def __init__(
        self,
        router: KvRouter,
        rpc: WorkerRpc,
        metrics: Metrics,
        *,
        spawn: Callable[[Any], None],
    ) -> None:
        self.router = router
        self.rpc = rpc
        self.metrics = metrics
        self._spawn = spawn
        self.streams: dict[WorkerId, Streams] = {}

    def events_applied(self, worker_id: WorkerId) -> int:
        s = self.streams.get(worker_id)
        return s.events_applied if s is not None else 0

    async def follow(self, target: FeedTarget, still_wanted: Callable[[], bool]) -> None:
        """Cold-start then subscribe to every rank; ``still_wanted`` is asked after each await
        (a worker removed meanwhile must not be followed)."""
        await self.unfollow(target.worker_id)
        streams = self.streams[target.worker_id] = Streams()
        last_seqs: dict[int, int | None] = {}
        if target.has_rpc:
            try:
                state = await self.rpc.kv_state(target.worker_id, target.url)
                for rank in state.get("ranks", []):
                    dp_rank = int(rank.get("dp_rank", 0))
                    self.router.load_state(target.worker_id, dp_rank, _stored_events(rank))
                    last_seqs[dp_rank] = rank.get("last_seq")
            except (ConnectFailed, KeyError, TypeError, ValueError, AttributeError) as e:
                logger.warning(
                    "worker %s: no kv_state cold start (%s); following live events only", target.worker_id, e
                )
        if not still_wanted() or self.streams.get(target.worker_id) is not streams:
            return
        for rank, endpoint in enumerate(target.kv_events_endpoints):
            sub = EventSubscriber(
                endpoint,
                self._on_batch(target.worker_id, streams, rank),
                replay_endpoint=target.kv_replay_endpoints[rank],
                on_reset=self._on_reset(target, rank),
                name=f"{target.worker_id}#{rank}",
            )
            last = last_seqs.get(rank)
            if last is not None:
                sub.resume_from(last)
            streams.subscribers.append(sub)
            sub.start()

    async def unfollow(self, worker_id: WorkerId) -> None:
        streams = self.streams.pop(worker_id, None)
        if streams is None:
            return
        subs, streams.subscribers = streams.subscribers, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.stop()

    async def stop(self) -> None:
        for worker_id in list(self.streams):
            await self.unfollow(worker_id)

    # ---------------------------------------------------------------- live batches
    def _on_batch(
        self, worker_id: WorkerId, streams: Streams, rank: int
    ) -> Callable[[int, EventBatch], None]:
        applied = self.metrics.events_applied

        def on_batch(seq: int, batch: EventBatch) -> None:
            if batch.data_parallel_rank is None and rank:
                batch = EventBatch(batch.ts, batch.events, rank)
            try:
                self.router.apply_events(worker_id, batch)
            except Exception:
                applied.labels("batch", "error").inc()
                raise
            streams.events_applied += len(batch.events)
            for event in batch.events:
                applied.labels(type(event).__name__, "ok").inc()

        return on_batch

    def _on_reset(self, target: FeedTarget, rank: int) -> Callable[[str], None]:
        def on_reset(reason: str) -> None:
            logger.warning(
                "worker %s rank %d: event stream reset (%s); re-syncing", target.worker_id, rank, reason
            )
            self.router.clear_worker_index(target.worker_id, rank)
            if target.has_rpc:
                self._spawn(self._resync(target, rank))

        return on_reset

    # ---------------------------------------------------------------- repair
    async def _resync(self, target: FeedTarget, rank: int) -> None:
        state = await self._rank_state(target, rank)
        if state is not None:
            self._load_rank_state(target.worker_id, rank, state)

    async def _rank_state(self, target: FeedTarget, rank: int) -> dict[str, Any] | None:
        """One rank's part of the worker's ``/kvmesh/kv_state`` (None when unavailable)."""
        try:
            state = await self.rpc.kv_state(target.worker_id, target.url)
        except ConnectFailed as e:
            logger.warning("worker %s: kv_state re-sync failed: %s", target.worker_id, e)
            return None
        for r in state.get("ranks", []) if isinstance(state, dict) else ():
            if isinstance(r, dict) and int(r.get("dp_rank", 0)) == rank:
                return r
        return None

    def _load_rank_state(self, worker_id: WorkerId, rank: int, r: dict[str, Any]) -> None:
        streams = self.streams.get(worker_id)
        if streams is None:  # unfollowed meanwhile
            return
        self.router.load_state(worker_id, rank, _stored_events(r))
        if r.get("last_seq") is not None and rank < len(streams.subscribers):
            streams.subscribers[rank].resume_from(int(r["last_seq"]))

    async def check_quiet_streams(self, target: FeedTarget) -> None:
        """Once per quiet spell of a stream (no batch read since the last check), ask whether the
        worker published more than we hold: a replay from the next sequence (it answers with
        nothing when we are in step), or, without a replay socket, the kv_state's sequence and a
        cold start if ahead."""
        streams = self.streams.get(target.worker_id)
        if streams is None:
            return
        for rank, sub in enumerate(list(streams.subscribers)):
            received = sub.stats.received
            if streams.seen_received.get(rank) != received:  # traffic: a later batch reveals gaps
                streams.seen_received[rank] = received
                continue
            if streams.probed_received.get(rank) == received:
                continue  # already probed during this quiet spell
            streams.probed_received[rank] = received
            expected = sub.expected_seq
            if sub.replay_endpoint is not None:
                sub.resume_from((expected or 0) - 1)
            elif target.has_rpc:
                r = await self._rank_state(target, rank)
                last = r.get("last_seq") if r is not None else None
                if r is None or last is None or (expected is not None and int(last) < expected):
                    continue
                logger.warning(
                    "worker %s rank %d: published up to seq %d, we hold %s; cold start from kv_state",
                    target.worker_id,
                    rank,
                    int(last),
                    "nothing" if expected is None else f"up to {expected - 1}",
                )
                self.router.clear_worker_index(target.worker_id, rank)
                self._load_rank_state(target.worker_id, rank, r)


def _stored_events(rank_state: dict[str, Any]) -> list[BlockStored]:
    return [_stored_from_json(e) for e in rank_state.get("events", []) if e.get("type") == "BlockStored"]


def _stored_from_json(d: dict[str, Any]) -> BlockStored:
    def h(x: Any) -> Any:
        return bytes.fromhex(x) if isinstance(x, str) else x

    return BlockStored(
        block_hashes=[h(x) for x in d["block_hashes"]],
        parent_block_hash=h(d.get("parent_block_hash")),
        token_ids=list(d["token_ids"]),
        block_size=int(d["block_size"]),
        lora_name=d.get("lora_name"),
        medium=d.get("medium"),
    )
