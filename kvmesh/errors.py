"""kvmesh's exception tree.

    KvMeshError
    ├── MalformedEventError      a KV-event frame or payload that does not decode
    ├── ConfigError              a flag, env var or config-file value out of range
    ├── EngineMissing            an adapter's engine is not installed (also an ImportError)
    ├── RequestError             a client request kvmesh refuses (maps to HTTP 4xx)
    │   └── NvextError           an invalid ``nvext`` field or override header
    └── WorkerError              a worker that cannot be reached or is inconsistent

Third-party errors (msgspec, zmq, the HTTP client's socket errors) are translated into these at the module boundary
that sees them, so callers handle one tree.
"""

from __future__ import annotations


class KvMeshError(Exception):
    """Base class of every error kvmesh raises on purpose."""


class MalformedEventError(KvMeshError):
    """A KV-event message (frames or msgpack payload) that cannot be decoded."""


class ConfigError(KvMeshError, ValueError):
    """A configuration value that is missing, of the wrong type or out of range."""


class EngineMissing(KvMeshError, ImportError):
    """The engine an adapter needs is not installed; the message names the extra to install. (An
    engine that is there but fails to import raises its own ImportError, which is not this.)"""


class RequestError(KvMeshError):
    """A client request kvmesh refuses; ``status`` is the HTTP status to answer with."""

    status = 400

    def __init__(self, message: str, *, field: str | None = None, status: int | None = None):
        super().__init__(message)
        self.field = field
        if status is not None:
            self.status = status


class NvextError(RequestError):
    """An invalid ``nvext`` extension field or routing override header."""


class WorkerError(KvMeshError):
    """A worker that cannot be reached, or whose description contradicts the fleet."""
