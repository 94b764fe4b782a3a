"""Who may say "a peer already routed this": the internal hop headers and their proof.

A replica that forwards a request to a peer marks it with three headers: ``x-kvmesh-hop`` (the
forwarding replica's name), ``x-kvmesh-request-id`` (its id for the request, under which the peer
counts the load, so that replica sync counts it once) and, when the replicas share a
``mesh_secret``, ``x-kvmesh-hop-auth``: an HMAC-SHA256 of the two, hex. Clients can send any header,
so these are read only through :func:`read_hop`, and always removed from the request before it
goes further (to the routing path, the engine or another worker):

* with a mesh secret, a hop whose proof checks is *trusted*: served here, counted under the given id;
  a missing or wrong proof makes the request an ordinary client request (routed, ``nvext``
  validated);
* without one, nothing can be proven: a hop is served here (routing again could bounce it between
  replicas whose views differ) but *untrusted*: its body is validated like any client's, ``nvext``
  stripped before the engine, and the client's request id ignored (a fresh one is minted, so no
  client can make its load collide with another request's).

docs/security.md states the trust model.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

HOP_HEADER = b"x-kvmesh-hop"
REQUEST_ID_HEADER = b"x-kvmesh-request-id"
HOP_AUTH_HEADER = b"x-kvmesh-hop-auth"
_INTERNAL = frozenset((HOP_HEADER, REQUEST_ID_HEADER, HOP_AUTH_HEADER))

Headers = Sequence[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Hop:
    """A request another replica says it routed here."""

    origin: str
    request_id: str | None
    """The forwarding replica's id for the request; None unless the hop is trusted."""
    trusted: bool


def sign(secret: str, origin: str, request_id: str) -> bytes:
    """The proof a forwarding replica sends with ``origin`` and ``request_id``."""
    message = origin.encode() + b"\n" + request_id.encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest().encode()


def hop_headers(secret: str | None, origin: str, request_id: str) -> list[tuple[bytes, bytes]]:
    """The headers that mark a forwarded request (the proof only with a secret)."""
    out = [(HOP_HEADER, origin.encode()), (REQUEST_ID_HEADER, request_id.encode())]
    if secret:
        out.append((HOP_AUTH_HEADER, sign(secret, origin, request_id)))
    return out


def hop_header_map(secret: str | None, origin: str, request_id: str) -> dict[str, str]:
    """:func:`hop_headers` as text, for a request the router makes itself (a warm-up, a copy)."""
    return {name.decode(): value.decode() for name, value in hop_headers(secret, origin, request_id)}


def read_hop(headers: Headers, secret: str | None) -> Hop | None:
    """The hop these headers claim, judged against ``secret``; None for an ordinary request
    (no hop header, or a secret is configured and the proof is missing or wrong)."""
    origin = request_id = proof = None
    for name, value in headers:
        if name == HOP_HEADER:
            origin = value
        elif name == REQUEST_ID_HEADER:
            request_id = value
        elif name == HOP_AUTH_HEADER:
            proof = value
    if origin is None:
        return None
    origin_text = origin.decode("latin-1")
    if not secret:
        return Hop(origin_text, None, trusted=False)
    if request_id is None or proof is None:
        return None
    rid = request_id.decode("latin-1")
    if not rid or not hmac.compare_digest(proof, sign(secret, origin_text, rid)):
        return None
    return Hop(origin_text, rid, trusted=True)


def strip_internal(headers: Headers) -> list[tuple[bytes, bytes]]:
    """``headers`` without the hop headers (a client's copies must never travel further)."""
    return [(k, v) for k, v in headers if k not in _INTERNAL]


def has_internal(headers: Headers) -> bool:
    return any(k in _INTERNAL for k, _ in headers)
