"""Carry an engine's stock ZMQ KV-event stream into the NATS event plane, unchanged.

An engine that publishes KV events on its own ZMQ sockets (vLLM's or SGLang's publisher with its
replay endpoint, a TRT-LLM bridge, kvmesh's ``KvEventPublisher``) joins a NATS fleet through
``kvmesh events relay``: one :class:`EventSubscriber` per data-parallel rank follows the engine's
PUB socket exactly as a router would (in order, gaps repaired through the replay socket), and each
batch is stored in the JetStream stream by a :class:`NatsBatchPublisher` under the engine's own
sequence number (``publish_payload``), on the subject of that rank. The batch's events and DP rank
are re-encoded as decoded (vLLM's own encoding); fields a newer engine adds and kvmesh does not
know are not carried, which routers ignore anyway.

What the relay cannot repair it passes on: an unrecoverable gap upstream becomes the same gap in
the stream (routers then cold-start that rank from ``kv_state``); an engine restart (a sequence
that goes back) starts a new epoch, which routers treat as a restart. A relay always starts a new
epoch and replays what the engine still buffers from sequence 0, so a relay restart looks like an
engine restart to routers: correct, at the cost of one re-sync.

Optionally the relay also registers the engine in the worker bucket (:class:`WorkerAnnouncer`),
with its ``/kvmesh/info`` and/or facts given on the command line, its ``kv_events_endpoints``
replaced by the NATS subjects: routers then read the stream, not the engine's sockets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.events.nats_discovery import WorkerAnnouncer
from kvmesh.events.nats_link import NatsLink, NatsOptions
from kvmesh.events.nats_publisher import NatsBatchPublisher
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import EventBatch, encode_batch

logger = logging.getLogger("kvmesh.events")


@dataclass(frozen=True)
class RelaySource:
    """One DP rank's ZMQ endpoints on the engine."""

    endpoint: str
    replay_endpoint: str | None = None


@dataclass
class RankRelay:
    """One rank: the NATS publisher and what went through it (the subscriber calls in)."""

    rank: int
    publisher: NatsBatchPublisher
    relayed: int = 0
    epochs: int = 1
    last_seq: int | None = None
    resets: list[str] = field(default_factory=list)

    def on_batch(self, seq: int, batch: EventBatch) -> None:
        if self.last_seq is not None and seq <= self.last_seq:
            self.publisher.new_epoch()  # the engine restarted and counts from 0 again
            self.epochs += 1
        self.last_seq = seq
        self.publisher.publish_payload(seq, encode_batch(batch))
        self.relayed += 1

    def on_reset(self, reason: str) -> None:
        self.resets.append(reason)


class EventRelay:
    """Relays every rank of one engine from ZMQ to NATS; ``start()`` / ``stop()`` on one loop."""

    def __init__(
        self,
        options: NatsOptions,
        name: str,
        sources: list[RelaySource],
        *,
        topic: bytes = b"",
        buffer_batches: int = 10_000,
    ) -> None:
        if not sources:
            raise ValueError("a relay needs at least one ZMQ endpoint")
        self.options = options
        self.name = name
        self.ranks: list[RankRelay] = []
        self.subscribers: list[EventSubscriber] = []
        for rank, source in enumerate(sources):
            publisher = NatsBatchPublisher(options, name, rank=rank, buffer_batches=buffer_batches)
            relay = RankRelay(rank, publisher)
            subscriber = EventSubscriber(
                source.endpoint,
                relay.on_batch,
                replay_endpoint=source.replay_endpoint,
                topic=topic,
                on_reset=relay.on_reset,
                name=f"relay {name}#{rank}",
                from_beginning=True,
            )
            self.ranks.append(relay)
            self.subscribers.append(subscriber)
        self.announcer: WorkerAnnouncer | None = None
        self._link: NatsLink | None = None

    @property
    def nats_endpoints(self) -> list[str]:
        """``nats:<subject>`` per rank: what the engine's registration lists as its events."""
        return [r.publisher.endpoint for r in self.ranks]

    def start(self) -> list[asyncio.Task[None]]:
        return [s.start() for s in self.subscribers]

    def register(self, worker_id: str, url: str, info: Mapping[str, Any], *, ttl: float) -> None:
        """Keep the engine's entry in the worker bucket (renewed every ``ttl / 3`` s) until stop()."""
        doc = {
            **info,
            "kv_events_endpoints": self.nats_endpoints,
            "kv_replay_endpoints": [],
            "dp_size": len(self.ranks),
        }
        self._link = NatsLink(self.options, name=f"kvmesh-relay {self.name}", stream=False)
        self._link.start()
        self.announcer = WorkerAnnouncer(self._link, worker_id, url, lambda: doc, interval=ttl / 3, ttl=ttl)
        self.announcer.start()

    def stats(self) -> dict[str, Any]:
        return {
            "relayed": sum(r.relayed for r in self.ranks),
            "gaps": sum(s.stats.gaps for s in self.subscribers),
            "unrecoverable": sum(s.stats.unrecoverable for s in self.subscribers),
            "epochs": sum(r.epochs for r in self.ranks),
            "stored": sum(r.publisher.stored for r in self.ranks),
            "dropped": sum(r.publisher.dropped for r in self.ranks),
        }

    async def stop(self, timeout: float = 2.0) -> None:
        """Stop following; store what is queued (up to ``timeout`` s); delete the registration."""
        for s in self.subscribers:
            await s.stop()
        if self.announcer is not None:
            await self.announcer.stop()
        if self._link is not None:
            await self._link.close()
        await asyncio.gather(*(asyncio.to_thread(r.publisher.close, timeout) for r in self.ranks))
