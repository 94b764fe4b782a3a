"""A worker's KV events into the router's index: cold start, live streams, resets, quiet probes.

For one worker the feed

1. cold-starts the index from ``/kvmesh/kv_state`` (when the worker serves kvmesh's RPCs) and
   remembers each data-parallel rank's last published sequence;
2. follows one :class:`EventSubscriber` per rank from that sequence (a
   :class:`NatsEventSubscriber` for a rank published on the NATS event plane, ``nats:<subject>``), applying every batch to the
   KvRouter and counting it;
3. on a stream reset (a gap replay could not fill, an engine restart) clears that rank's part of the
   index and re-syncs it from ``kv_state``;
4. while a stream is quiet, asks at each health check whether anything was published since the
   last batch it holds (a replay from the next sequence; the ``kv_state`` sequence, every few
   checks, when the worker has no replay socket): a batch lost just before a quiet period is
   revealed by no later batch, so without this the index would stay wrong until the next burst;
5. notices an event path that died while HTTP stays healthy: when two probes in a row find batches
   the live stream never delivered, the worker publishes and nothing reaches us. That rank's index
   is marked *stale*: cleared (its overlap is no longer credited), re-synced from ``kv_state``,
   logged at warning level and counted (``kvmesh_kv_event_faults_total{fault="stale"}``); it is
   live again with the next batch the stream itself delivers;
6. turns the subscribers' fault counts (gaps, batches recovered by replay, malformed messages,
   duplicates skipped, resets) into ``kvmesh_kv_event_faults_total`` and ``GET /kvmesh/workers`` at each check, with a
   warning for every repaired gap, so a stream that needs repair never does so silently.

The registry decides *when* (admission, health checks, removal); this module knows *how*.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvmesh._types import WorkerId
from kvmesh.errors import WorkerError
from kvmesh.events.nats_link import NATS_ENDPOINT_PREFIX, NatsLink
from kvmesh.events.nats_subscriber import NatsEventSubscriber
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import MAX_SEQ, BlockStored, EventBatch
from kvmesh.router.core.kv_router import KvRouter
from kvmesh.router.mesh.metrics import Metrics
from kvmesh.router.mesh.worker_rpc import WorkerRpc
from kvmesh.router.upstream.forwarder import ConnectFailed

logger = logging.getLogger("kvmesh.router")


# Fault name -> the SubscriberStats fields it sums (the counters the metric and the admin API show).
_FAULTS: dict[str, tuple[str, ...]] = {
    "gap": ("gaps",),
    "replayed": ("replayed",),
    "malformed": ("malformed",),
    "duplicate": ("duplicates",),
    "reset": ("unrecoverable", "restarts"),
}
_MISSES_FOR_STALE = 2  # probes in a row that found batches the live stream never delivered
_STATE_PROBE_EVERY = 5  # quiet checks between kv_state probes (no replay socket: a whole dump)


@dataclass(slots=True)
class Streams:
    """One worker's event subscriptions and what the quiet-stream probe remembers about them."""

    subscribers: list[EventSubscriber | NatsEventSubscriber] = field(default_factory=list)
    events_applied: int = 0
    # Per dp rank: the subscriber's received count at the last check, the quiet checks since, the
    # replayed count when it was last probed, and the probes in a row that found missed batches.
    seen_received: dict[int, int] = field(default_factory=dict)
    quiet_checks: dict[int, int] = field(default_factory=dict)
    probe_replayed: dict[int, int] = field(default_factory=dict)
    misses: dict[int, int] = field(default_factory=dict)
    stale: set[int] = field(default_factory=set)
    stale_detections: int = 0
    reported: dict[str, int] = field(default_factory=dict)
    """Fault totals already turned into metrics."""

    def faults(self) -> dict[str, int]:
        return {
            name: sum(getattr(sub.stats, f) for sub in self.subscribers for f in fields)
            for name, fields in _FAULTS.items()
        }


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
        nats: NatsLink | None = None,
    ) -> None:
        self.router = router
        self.nats = nats
        """The NATS event plane, when the router runs on one: ``nats:<subject>`` endpoints."""
        self.rpc = rpc
        self.metrics = metrics
        self._spawn = spawn
        self.streams: dict[WorkerId, Streams] = {}

    def events_applied(self, worker_id: WorkerId) -> int:
        s = self.streams.get(worker_id)
        return s.events_applied if s is not None else 0

    def status(self, worker_id: WorkerId) -> dict[str, Any]:
        """The worker's event path for ``GET /kvmesh/workers``: ``live`` | ``stale`` | ``none``
        (no stream followed), the stale ranks and the fault counts."""
        s = self.streams.get(worker_id)
        if s is None or not s.subscribers:
            return {"state": "none"}
        return {
            "state": "stale" if s.stale else "live",
            "stale_ranks": sorted(s.stale),
            "stale_detections": s.stale_detections,
            **s.faults(),
        }

    async def follow(self, target: FeedTarget, still_wanted: Callable[[], bool]) -> None:
        """Cold-start then subscribe to every rank; ``still_wanted`` is asked after each await
        (a worker removed meanwhile must not be followed)."""
        await self.unfollow(target.worker_id)
        if self.nats is None and any(e.startswith(NATS_ENDPOINT_PREFIX) for e in target.kv_events_endpoints):
            raise WorkerError(
                f"its KV events are on NATS ({target.kv_events_endpoints[0]}); "
                "start the router with --event-plane nats://host:port"
            )
        streams = self.streams[target.worker_id] = Streams()
        last_seqs: dict[int, int | None] = {}
        if target.has_rpc:
            try:
                ranks = read_kv_state(await self.rpc.kv_state(target.worker_id, target.url))
            except (ConnectFailed, KvStateError) as e:
                logger.warning(
                    "worker %s: no kv_state cold start (%s); following live events only", target.worker_id, e
                )
                ranks = {}
            for dp_rank, rank_state in ranks.items():
                self.router.load_state(target.worker_id, dp_rank, rank_state.stored)
                last_seqs[dp_rank] = rank_state.last_seq
        if not still_wanted() or self.streams.get(target.worker_id) is not streams:
            return
        for rank, endpoint in enumerate(target.kv_events_endpoints):
            sub: EventSubscriber | NatsEventSubscriber
            if endpoint.startswith(NATS_ENDPOINT_PREFIX):
                assert self.nats is not None
                sub = NatsEventSubscriber(
                    self.nats,
                    endpoint.removeprefix(NATS_ENDPOINT_PREFIX),
                    self._on_batch(target.worker_id, streams, rank),
                    on_reset=self._on_reset(target, rank),
                    name=f"{target.worker_id}#{rank}",
                )
            else:
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

    async def _rank_state(self, target: FeedTarget, rank: int) -> RankState | None:
        """One rank's part of the worker's ``/kvmesh/kv_state`` (None when unavailable or
        unreadable)."""
        try:
            return read_kv_state(await self.rpc.kv_state(target.worker_id, target.url)).get(rank)
        except (ConnectFailed, KvStateError) as e:
            logger.warning("worker %s: kv_state re-sync failed: %s", target.worker_id, e)
            return None

    def _load_rank_state(self, worker_id: WorkerId, rank: int, r: RankState) -> None:
        streams = self.streams.get(worker_id)
        if streams is None:  # unfollowed meanwhile
            return
        self.router.load_state(worker_id, rank, r.stored)
        if r.last_seq is not None and rank < len(streams.subscribers):
            streams.subscribers[rank].resume_from(r.last_seq)

    async def check_quiet_streams(self, target: FeedTarget) -> None:
        """At each health check: report the streams' faults, and for each quiet stream (no batch
        read since the last check) ask whether the worker published more than we hold: a replay
        from the next sequence (it answers with nothing when we are in step), or, without a replay
        socket, the kv_state's sequence and a cold start if ahead (module docstring, 4 and 5)."""
        streams = self.streams.get(target.worker_id)
        if streams is None:
            return
        self._report_faults(target.worker_id, streams)
        for rank, sub in enumerate(list(streams.subscribers)):
            received = sub.stats.received
            if streams.seen_received.get(rank) != received:  # traffic: a later batch reveals gaps
                streams.seen_received[rank] = received
                streams.quiet_checks[rank] = 0
                streams.misses[rank] = 0
                streams.probe_replayed.pop(rank, None)
                if rank in streams.stale:
                    streams.stale.discard(rank)
                    logger.warning(
                        "worker %s rank %d: KV-event stream delivers again", target.worker_id, rank
                    )
                continue
            quiet = streams.quiet_checks[rank] = streams.quiet_checks.get(rank, 0) + 1
            expected = sub.expected_seq
            if sub.replay_endpoint is not None:
                before = streams.probe_replayed.get(rank)
                if before is not None:
                    missed = sub.stats.replayed > before
                    streams.misses[rank] = streams.misses.get(rank, 0) + 1 if missed else 0
                streams.probe_replayed[rank] = sub.stats.replayed
                sub.resume_from((expected or 0) - 1)
            elif target.has_rpc and quiet % _STATE_PROBE_EVERY == 1:
                r = await self._rank_state(target, rank)
                last = r.last_seq if r is not None else None
                if r is None or last is None or (expected is not None and last < expected):
                    streams.misses[rank] = 0
                    continue
                streams.misses[rank] = streams.misses.get(rank, 0) + 1
                logger.warning(
                    "worker %s rank %d: published up to seq %d, we hold %s; cold start from kv_state",
                    target.worker_id,
                    rank,
                    last,
                    "nothing" if expected is None else f"up to {expected - 1}",
                )
                self.router.clear_worker_index(target.worker_id, rank)
                self._load_rank_state(target.worker_id, rank, r)
            if streams.misses.get(rank, 0) >= _MISSES_FOR_STALE and rank not in streams.stale:
                self._mark_stale(target, streams, rank)

    def _mark_stale(self, target: FeedTarget, streams: Streams, rank: int) -> None:
        """The worker publishes, its HTTP answers, and its live stream reaches us no more."""
        streams.stale.add(rank)
        streams.stale_detections += 1
        self.metrics.event_faults.labels(target.worker_id, "stale").inc()
        logger.warning(
            "worker %s rank %d: KV-event stream silent while the worker publishes and answers HTTP; "
            "index marked stale (cleared, re-synced%s) until the stream delivers again",
            target.worker_id,
            rank,
            " from kv_state" if target.has_rpc else " by replay at each check",
        )
        self.router.clear_worker_index(target.worker_id, rank)
        if target.has_rpc:
            self._spawn(self._resync(target, rank))

    def _report_faults(self, worker_id: WorkerId, streams: Streams) -> None:
        totals = streams.faults()
        deltas = {name: n - streams.reported.get(name, 0) for name, n in totals.items()}
        streams.reported = totals
        counter = self.metrics.event_faults
        for name, delta in deltas.items():
            if delta > 0:
                counter.labels(worker_id, name).inc(delta)
        if deltas["gap"] > 0 or deltas["replayed"] > 0 or deltas["reset"] > 0 or deltas["malformed"] > 0:
            logger.warning(
                "worker %s: KV-event stream repaired: %d gap(s), %d batch(es) recovered by replay, "
                "%d malformed message(s), %d reset(s) since the last check",
                worker_id,
                max(deltas["gap"], 0),
                max(deltas["replayed"], 0),
                max(deltas["malformed"], 0),
                max(deltas["reset"], 0),
            )


class KvStateError(ValueError):
    """A ``/kvmesh/kv_state`` answer that is not the shape kvmesh's workers give."""


@dataclass(frozen=True, slots=True)
class RankState:
    """One data-parallel rank's part of a worker's ``/kvmesh/kv_state``, read."""

    stored: list[BlockStored]
    last_seq: int | None
    """The sequence number of the last published batch the blocks include (None before any)."""


def read_kv_state(state: Any) -> dict[int, RankState]:
    """Every rank of a ``/kvmesh/kv_state`` answer (:func:`kvmesh.worker.block_state.rank_state`
    writes them), by rank; :class:`KvStateError` naming what is wrong otherwise. (Read piecemeal,
    a sequence number that was not a number raised out of the worker's admission, which left it
    ``pending`` for good with no reason, and out of every fifth health check of a quiet stream,
    whose other work it skipped.)"""
    ranks = state.get("ranks", []) if isinstance(state, dict) else None
    if not isinstance(ranks, list):
        raise KvStateError("kv_state: 'ranks' must be a list")
    out: dict[int, RankState] = {}
    for r in ranks:
        if not isinstance(r, dict):
            raise KvStateError("kv_state: each rank must be an object")
        dp_rank, last_seq, events = r.get("dp_rank", 0), r.get("last_seq"), r.get("events", [])
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise KvStateError(f"kv_state: dp_rank must be a rank number, got {dp_rank!r}")
        if last_seq is not None and (
            isinstance(last_seq, bool) or not isinstance(last_seq, int) or not 0 <= last_seq < MAX_SEQ
        ):  # (past the wire's 8 bytes, the stream's replay request failed at every reconnection)
            raise KvStateError(f"kv_state: last_seq must be a sequence number or null, got {last_seq!r}")
        if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
            raise KvStateError("kv_state: events must be a list of objects")
        try:
            stored = [_stored_from_json(e) for e in events if e.get("type") == "BlockStored"]
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as e:
            raise KvStateError(f"kv_state: a BlockStored event is malformed ({e!r})") from None
        out[dp_rank] = RankState(stored, last_seq)
    return out


def _stored_from_json(d: dict[str, Any]) -> BlockStored:
    """A BlockStored from its JSON form (:func:`kvmesh.events.wire.event_to_json`: bytes hashes as
    hex), its fields' types checked as the wire decoder checks them."""

    def h(x: Any) -> Any:
        return bytes.fromhex(x) if isinstance(x, str) else x

    return msgspec.convert(
        {
            "type": "BlockStored",
            "block_hashes": [h(x) for x in d["block_hashes"]],
            "parent_block_hash": h(d.get("parent_block_hash")),
            "token_ids": d["token_ids"],
            "block_size": d["block_size"],
            "lora_name": d.get("lora_name"),
            "medium": d.get("medium"),
        },
        BlockStored,
    )
