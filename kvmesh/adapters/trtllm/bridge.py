"""The event bridge: the single owner of TensorRT-LLM's KV-event queue, publishing kvmesh's wire.

``LLM.get_kv_cache_events_async(timeout)`` drains one destructive queue; trtllm-serve's own
``POST /kv_cache_events`` handler drains the same one. Two readers would each see half the
events, so the bridge is the only reader of the engine's queue, and it puts a stand-in on the
LLM object (an instance attribute that shadows the method) that hands out, once, the raw events
the bridge drained: ``POST /kv_cache_events`` and any other in-process reader keep working and
see every event exactly once, in order (up to a bounded buffer; the oldest fall out first).
Outside the engine (``kvmesh events trtllm``) the bridge has no engine (``llm=None``): its caller
reads the queue through a stock trtllm-serve's ``POST /kv_cache_events`` (:mod:`.served_queue`)
and hands the events to :meth:`KvEventBridge.publish`; nothing is shared or polled here.

Each poll drains what is queued (``timeout=0``), converts it (:mod:`.convert`), and publishes one
batch per attention-DP rank on that rank's own PUB socket (base port + rank, as vLLM and
TensorRT-LLM's own publisher number theirs), through :class:`kvmesh.events.BatchPublisher`: the
same frames and msgpack payload vLLM publishes, with a replay socket. The same batch goes into
that rank's :class:`.record.RankRecord` for ``kv_state`` and pins.

Polling backs off while the queue is empty, from ``min_delay`` doubling to ``max_delay``, and
drops back to ``min_delay`` as soon as events arrive: an event waits at most ``max_delay`` (plus
one conversion) before it is published, and an idle engine costs a few wake-ups per second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import REGISTRY, Counter

from kvmesh.adapters.trtllm.convert import EventConverter
from kvmesh.adapters.trtllm.record import RankRecord
from kvmesh.errors import ConfigError
from kvmesh.events.publisher import BatchPublisher
from kvmesh.events.wire import Event, EventBatch
from kvmesh.worker.block_state import rank_state

logger = logging.getLogger("kvmesh.adapters.trtllm")


def _counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
    """A process-wide counter, created once even if this module is imported again."""
    existing = getattr(REGISTRY, "_names_to_collectors", {}).get(name)
    if isinstance(existing, Counter):
        return existing
    return Counter(name, documentation, labels)


EVENTS_BRIDGED = _counter(
    "kvmesh_trtllm_events_bridged", "TensorRT-LLM KV events converted into kvmesh wire events"
)
EVENTS_DROPPED = _counter(
    "kvmesh_trtllm_events_dropped",
    "TensorRT-LLM KV events (or stored blocks) not published, by reason",
    ("reason",),
)
RESYNCS = _counter(
    "kvmesh_trtllm_event_resyncs", "AllBlocksCleared sent after an event-id gap or an engine restart"
)

_EMPTY = (IndexError, asyncio.QueueEmpty, TimeoutError, StopAsyncIteration)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """``tcp://host:port`` -> port + rank (rank 0 unchanged); other transports get a suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit() and int(port) != 0:
            return f"{head}:{int(port) + rank}"
        return endpoint
    return f"{endpoint}_dp{rank}"


def check_rank_ports(endpoint: str, replay_endpoint: str | None, dp_size: int) -> None:
    """ConfigError when the ranks' sockets (each base port + rank) cannot all be bound: the PUB and
    replay ranges overlap (rank 1's PUB on rank 0's replay port, with 5557 and 5558 and two ranks),
    or run past port 65535. Said before anything binds, naming the ports."""
    ports = []
    for text in (endpoint, replay_endpoint):
        tail = (text or "").rpartition(":")[2]
        if text and text.startswith("tcp://") and tail.isdigit() and int(tail):
            ports.append(int(tail))
    if len(ports) == 2 and abs(ports[0] - ports[1]) < dp_size:
        raise ConfigError(
            f"the KV-event ports {ports[0]} (events) and {ports[1]} (replay) overlap over {dp_size} "
            f"attention-DP ranks (rank r binds each port + r): set them at least {dp_size} apart"
        )
    if ports and max(ports) + dp_size - 1 > 65535:
        raise ConfigError(f"the KV-event port {max(ports)} + {dp_size - 1} ranks is past 65535")


class KvEventBridge:
    """Drains the engine's KV events, publishes them per DP rank and keeps a record of each rank."""

    def __init__(
        self,
        llm: Any,
        *,
        block_size: int,
        dp_size: int,
        endpoint: str,
        replay_endpoint: str | None,
        min_delay: float = 0.005,
        max_delay: float = 0.05,
        http_buffer: int = 10_000,
        publisher_factory: Callable[..., BatchPublisher] = BatchPublisher,
    ) -> None:
        if not 0 < min_delay <= max_delay:
            raise ValueError(f"need 0 < min_delay <= max_delay, got {min_delay}, {max_delay}")
        check_rank_ports(endpoint, replay_endpoint, dp_size)
        if "get_kv_cache_events_async" in getattr(llm, "__dict__", {}):
            raise RuntimeError(
                "this LLM's KV-event queue already has a reader installed (one bridge per LLM)"
            )
        self.llm = llm
        self.block_size = block_size
        self.dp_size = dp_size
        self.min_delay = min_delay
        self.max_delay = max_delay
        self.converter = EventConverter(block_size)
        self.records = {r: RankRecord(block_size) for r in range(dp_size)}
        self.publishers = {
            r: publisher_factory(
                offset_endpoint(endpoint, r),
                replay_endpoint=None if replay_endpoint is None else offset_endpoint(replay_endpoint, r),
                bind=True,  # the engine side listens; routers dial it
            )
            for r in range(dp_size)
        }
        self._http: deque[dict[str, Any]] = deque(maxlen=http_buffer)
        # The engine's own; the only call that reads it (none without an engine: see the docstring).
        self._drain = None if llm is None else llm.get_kv_cache_events_async
        self._task: asyncio.Task[None] | None = None
        self._dropped_seen: dict[str, int] = {}
        self._errors_logged: set[str] = set()
        self.polls = 0
        if llm is not None:  # what trtllm-serve's POST /kv_cache_events (and anyone else) now reads
            llm.get_kv_cache_events_async = self.reserved_events

    # ------------------------------------------------------------------ endpoints
    @property
    def endpoints(self) -> list[str]:
        return [self.publishers[r].endpoint for r in range(self.dp_size)]

    @property
    def replay_endpoints(self) -> list[str | None]:
        return [self.publishers[r].replay_endpoint for r in range(self.dp_size)]

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        if self._drain is None:
            raise TypeError("a bridge without an engine is fed through publish(); it has no queue to poll")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvmesh-trtllm-bridge")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for pub in self.publishers.values():
            pub.close()
        if (
            self.llm is not None
            and self.llm.__dict__.get("get_kv_cache_events_async") == self.reserved_events
        ):
            del self.llm.get_kv_cache_events_async

    async def _run(self) -> None:
        delay = self.min_delay
        while True:
            try:
                got = await self.poll_once()
            except Exception as e:  # an engine error must not stop the bridge; say it once per kind
                kind = type(e).__name__
                if kind not in self._errors_logged:
                    self._errors_logged.add(kind)
                    logger.exception("kvmesh: polling TensorRT-LLM's KV events failed")
                got = 0
            delay = self.min_delay if got else min(delay * 2, self.max_delay)
            await asyncio.sleep(delay)

    async def poll_once(self) -> int:
        """Drain what the engine has queued now, publish it; returns how many raw events came."""
        if self._drain is None:
            raise TypeError("a bridge without an engine is fed through publish(); it has no queue to poll")
        self.polls += 1
        raw: list[dict[str, Any]] = []
        try:
            async for event in self._drain(0):
                raw.append(event)
        except _EMPTY:
            pass
        except (RuntimeError, AttributeError) as e:  # the executor is not up yet, or shutting down
            logger.debug("kvmesh: TensorRT-LLM KV events not available: %s", e)
        if raw:
            self._http.extend(raw)
            self.publish(raw)
        return len(raw)

    def publish(self, raw: list[dict[str, Any]]) -> None:
        converter = self.converter
        bridged, resyncs = converter.bridged, converter.resyncs
        converted = converter.convert(raw)
        per_rank: dict[int, list[Event]] = {}
        for rank, event in converted:
            per_rank.setdefault(rank, []).append(event)
        for rank, events in per_rank.items():
            publisher = self.publishers.get(rank)
            if publisher is None:
                converter.dropped["unknown_rank"] += 1
                continue
            self.records[rank].apply(events)
            publisher.publish(EventBatch(ts=time.time(), events=events, data_parallel_rank=rank))
        EVENTS_BRIDGED.inc(converter.bridged - bridged)
        RESYNCS.inc(converter.resyncs - resyncs)
        for reason, count in converter.dropped.items():
            seen = self._dropped_seen.get(reason, 0)
            if count > seen:
                EVENTS_DROPPED.labels(reason).inc(count - seen)
                self._dropped_seen[reason] = count
                if reason in ("malformed", "unusable_block", "unknown_rank"):
                    logger.warning("kvmesh: dropped %d TensorRT-LLM KV event(s): %s", count - seen, reason)

    # ------------------------------------------------------------------ readers
    def reserved_events(self, timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """Stand-in for ``LLM.get_kv_cache_events_async``: the raw events the bridge drained and
        nobody has read yet, each handed out once; ends at once when there are none."""
        buffer = self._http

        async def events() -> AsyncIterator[dict[str, Any]]:
            while buffer:
                yield buffer.popleft()

        return events()

    def kv_state_ranks(self) -> list[dict[str, Any]]:
        return [
            rank_state(r, self.publishers[r].last_seq, self.records[r].state.dump())
            for r in range(self.dp_size)
        ]
