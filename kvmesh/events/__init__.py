"""Engine-agnostic KV-event wire protocol and ZMQ transport.

wire.py         the format vLLM and SGLang publish: structs, encode/decode, frames
publisher.py    BatchPublisher (PUB + replay ROUTER) and KvEventPublisher (for custom engines)
subscriber.py   EventSubscriber: in-order, exactly-once delivery with gap repair by replay
"""

from kvmesh.events.publisher import BatchPublisher, KvEventPublisher
from kvmesh.events.subscriber import EventSubscriber, SubscriberStats
from kvmesh.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    decode_batch,
    encode_batch,
    event_to_json,
)

__all__ = [
    "AllBlocksCleared",
    "BatchPublisher",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "EventSubscriber",
    "KvEventPublisher",
    "SubscriberStats",
    "decode_batch",
    "encode_batch",
    "event_to_json",
]
