"""kvmesh: route each LLM request to the engine that already holds its prompt's KV cache."""

from kvmesh.errors import ConfigError, KvMeshError, MalformedEventError, NvextError, RequestError, WorkerError
from kvmesh.hashing import block_hashes, sequence_hashes

__all__ = [
    "ConfigError",
    "KvMeshError",
    "MalformedEventError",
    "NvextError",
    "RequestError",
    "WorkerError",
    "block_hashes",
    "sequence_hashes",
]
