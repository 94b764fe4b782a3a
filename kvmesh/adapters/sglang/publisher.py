"""The ``kvmesh`` KV-event publisher that SGLang's scheduler creates from ``--kv-events-config``.

SGLang's ``EventPublisherFactory`` calls it with the keyword arguments of its own ZMQ publisher
(``attn_dp_rank, endpoint, bind, replay_endpoint, buffer_steps, hwm, max_queue_size, topic``).
It sends SGLang's own ``KVEventBatch`` es unchanged on the wire (three frames, msgpack payload,
replay socket) through kvmesh's :class:`~kvmesh.events.publisher.BatchPublisher`, the publisher
kvmesh's subscriber is tested against, on the same per-rank ports as SGLang's ``zmq`` publisher
(``port + attn_dp_rank`` for the live and the replay socket). Every batch carries its rank.

Why not just SGLang's ``zmq`` publisher: both work with kvmesh (``/kvmesh/kv_state`` follows
either, see :mod:`.follower`). This one refuses live and replay port ranges that collide across
DP ranks (SGLang's own publisher knows its rank, not the DP size, and with the usual
``replay = live + 1`` and ``--dp-size 2`` rank 0's replay port is rank 1's live port); the launcher
passes the size in ``KVMESH_SGLANG_DP_SIZE``.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from kvmesh.adapters.sglang._sglang import import_sglang
from kvmesh.errors import ConfigError
from kvmesh.events.publisher import BatchPublisher
from kvmesh.events.wire import decode_batch

PUBLISHER_NAME = "kvmesh"
DP_SIZE_ENV = "KVMESH_SGLANG_DP_SIZE"


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """SGLang's per-rank endpoint: a tcp port moves up by the rank, other transports get a suffix."""
    import_sglang()
    from sglang.srt.disaggregation.kv_events import ZmqEventPublisher

    result: str | None = ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
    return result


def check_port_ranges(endpoint: str, replay_endpoint: str | None, dp_size: int) -> None:
    """Refuse live and replay port ranges that overlap across ``dp_size`` ranks."""
    if replay_endpoint is None or dp_size <= 1:
        return
    live, replay = _tcp_port(endpoint), _tcp_port(replay_endpoint)
    if live is None or replay is None:
        return
    if live < replay + dp_size and replay < live + dp_size:
        raise ConfigError(
            f"kv-events ports collide across {dp_size} DP ranks: live {live}..{live + dp_size - 1}, "
            f"replay {replay}..{replay + dp_size - 1}; put the replay port at {live + dp_size} or above"
        )


def _tcp_port(endpoint: str) -> int | None:
    if not endpoint.startswith("tcp://"):
        return None
    _, _, port = endpoint.rpartition(":")
    return int(port) if port.isdigit() else None


class KvMeshPublisher:
    """SGLang's ``EventPublisher`` interface: ``publish(batch)`` and ``shutdown()``."""

    def __init__(
        self,
        attn_dp_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        bind: bool | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        if bind is False:
            raise ConfigError('the kvmesh KV-event publisher binds its sockets; drop "bind": false')
        check_port_ranges(endpoint, replay_endpoint, int(os.environ.get(DP_SIZE_ENV, "1")))
        self.attn_dp_rank = attn_dp_rank
        self._pub = BatchPublisher(
            offset_endpoint(endpoint, attn_dp_rank) or endpoint,
            replay_endpoint=offset_endpoint(replay_endpoint, attn_dp_rank),
            topic=topic,
            buffer_batches=buffer_steps,
            hwm=hwm,
            bind=True,
        )
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def endpoint(self) -> str:
        return self._pub.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._pub.replay_endpoint

    def publish(self, events: Any) -> None:
        """Publish one of SGLang's ``KVEventBatch`` es (its exact payload, read back as kvmesh's
        wire structs, which re-encode to the same fields)."""
        if getattr(events, "attn_dp_rank", None) is None:
            events.attn_dp_rank = self.attn_dp_rank
        self._pub.publish(decode_batch(self._encoder.encode(events)))

    def shutdown(self) -> None:
        self._pub.close()
