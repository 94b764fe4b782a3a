"""The ``kvmesh`` KV-event publisher that vLLM's scheduler creates from ``--kv-events-config``.

It sends vLLM's own event batches unchanged (same ZMQ frames and msgpack payload as vLLM's
``zmq`` publisher, so every existing consumer keeps working) through kvmesh's
:class:`~kvmesh.events.publisher.BatchPublisher`, and it keeps the engine's current set of cached
blocks (:class:`~kvmesh.worker.block_state.CachedBlockState`) so that ``/kvmesh/kv_state`` can
hand a router that starts late, or lost more than the replay buffer, a consistent snapshot: the
blocks plus the sequence number of the last batch they include.

vLLM's scheduler calls :meth:`publish` once per step in the engine-core thread; kvmesh's engine
RPCs (utility calls) run in the same thread, and a lock keeps ``(state, last_seq)`` consistent for
any other caller.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec

from kvmesh.adapters.vllm._vllm import import_vllm
from kvmesh.events.publisher import BatchPublisher
from kvmesh.events.wire import decode_batch
from kvmesh.worker.block_state import CachedBlockState, rank_state

PUBLISHER_NAME = "kvmesh"


class KvMeshPublisher:
    """vLLM's ``EventPublisher`` interface (publish / shutdown / get_publisher_config)."""

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        import_vllm()
        from vllm.distributed.kv_events import ZmqEventPublisher

        # Same per-rank endpoints as vLLM's own publisher: port + rank, or an inproc suffix.
        offset = ZmqEventPublisher.offset_endpoint_port
        self.data_parallel_rank = data_parallel_rank
        self._pub = BatchPublisher(
            offset(endpoint, data_parallel_rank) or endpoint,
            replay_endpoint=offset(replay_endpoint, data_parallel_rank),
            topic=topic,
            buffer_batches=buffer_steps,
            hwm=hwm,
        )
        self._config = dict(buffer_steps=buffer_steps, hwm=hwm, max_queue_size=max_queue_size, topic=topic)
        self._state = CachedBlockState()
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return self._pub.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._pub.replay_endpoint

    def publish(self, events: Any) -> None:
        """Publish one of vLLM's ``KVEventBatch`` es and fold it into the cached-block state."""
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self.data_parallel_rank
        # vLLM's exact payload, read back as kvmesh's wire structs (which re-encode to the same bytes).
        batch = decode_batch(self._encoder.encode(events))
        with self._lock:
            self._state.apply(batch.events)
            self._pub.publish(batch)

    def snapshot(self) -> dict[str, Any]:
        """This rank's part of ``/kvmesh/kv_state``: cached blocks, parents first, and the last seq."""
        with self._lock:
            events = self._state.dump()
            last_seq = self._pub.last_seq
        return rank_state(self.data_parallel_rank, last_seq, events)

    def shutdown(self) -> None:
        self._pub.close()

    def get_publisher_config(self) -> Any:
        """The resolved endpoints, reported to vLLM's front end (``/kv_event_sources``).

        Reported as ``zmq``: that is the protocol a consumer speaks to these sockets, and vLLM's
        front end decodes this config with the original publisher names only."""
        from vllm.config.kv_events import KVEventsConfig

        return KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self._pub.endpoint,
            replay_endpoint=self._pub.replay_endpoint,
            **self._config,
        )
