"""Replica sync messages sealed with the mesh secret, so only a replica can speak on sync.

A replica's sync messages steer every other replica: a decision counts as load on a worker, a
session bind sends that session's turns to a worker, a home sends requests naming a stored
response there. Without proof, anything that reached a replica's SUB socket (a process at a peer's
old address, a configured peer that is not a replica) or published on the NATS sync subjects
could do the same. With a mesh secret, every message is sent as::

    MARK | HMAC-SHA256(key, payload) | payload

``MARK`` begins with 0xc1, a byte msgpack never writes, so a replica without the secret reads a
sealed message as what it is rather than as a malformed envelope. The key is derived from the mesh
secret for this use alone: a proof made here is never a valid hop proof (``x-kvmesh-hop-auth``),
nor the reverse.

The seal proves who sent a message, not that it is fresh: a captured message can be sent again.
:class:`~kvmesh.router.mesh.replica_sync.ReplicaSync` drops a message whose sequence number it has
already passed, so a replay counts nothing while its sender runs; docs/security.md says the rest.
"""

from __future__ import annotations

import hashlib
import hmac

MARK = b"\xc1kvmesh-sync-1"
_PROOF_LEN = hashlib.sha256().digest_size
_KEY_LABEL = b"kvmesh replica sync v1"

UNSEALED = "unsealed"
"""A plain message, where this replica holds a mesh secret."""
BAD_PROOF = "bad proof"
"""A sealed message whose proof does not check (another secret, or changed on the way)."""
NO_SECRET_HERE = "sealed, no secret here"
"""A sealed message, where this replica holds no mesh secret to check it with."""


def sync_key(secret: str) -> bytes:
    """The key replicas sharing ``secret`` seal their sync messages with."""
    return hmac.new(secret.encode(), _KEY_LABEL, hashlib.sha256).digest()


def seal(key: bytes, payload: bytes) -> bytes:
    return MARK + hmac.digest(key, payload, "sha256") + payload


def unseal(key: bytes | None, frame: bytes) -> bytes | str:
    """The payload of ``frame`` when it may be read here, else why not (one of the reasons above)."""
    sealed = frame.startswith(MARK)
    if key is None:
        return NO_SECRET_HERE if sealed else frame
    if not sealed:
        return UNSEALED
    start = len(MARK) + _PROOF_LEN
    if len(frame) < start:
        return BAD_PROOF
    payload = frame[start:]
    if not hmac.compare_digest(hmac.digest(key, payload, "sha256"), frame[len(MARK) : start]):
        return BAD_PROOF
    return payload
