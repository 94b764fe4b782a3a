"""Replica sync: router replicas tell each other what they routed, so their load views agree.

Every replica (an engine embedding the middleware, or a standalone router) started with
``--router-replica-sync`` binds one ZMQ PUB socket and publishes its routing lifecycle, one
single-frame msgpack :class:`Envelope` per step:

* :class:`Routed`      a decision, or a request the replica makes itself (a speculative-prefill
  warm-up, a prefix copy): request id, worker, the prompt's block hashes and length (exactly what
  ``KvRouter.track()`` needs to count the request as load);
* :class:`PrefillDone` the first token streamed: its prompt stops counting as prefill load;
* :class:`Freed`       the stream ended or the client left: its load goes away;
* :class:`Heartbeat`   every interval: the ids this replica still has in flight;
* :class:`Session`     a session bound, used (its expiry slides) or closed, so a ``bind`` made
  through one replica is honoured by every other, and no replica's copy expires (closing the
  engine session) while the conversation goes on through another.
* :class:`Home`        where a thing only one engine has lives, learned or forgotten (a stored
  response, a SageMaker or SGLang session opened through this replica), so a request naming it
  through another replica goes there too (:attr:`ReplicaSync.homes`).

It follows every peer's socket with one SUB socket (connected to many endpoints) and feeds their
messages into its own KvRouter under the origin's request ids, which are unique per replica and
process (replica name + a random epoch + a counter). The same id reaches a worker that embeds the
middleware in the ``x-kvmesh-request-id`` header of a forwarded request, so a request counted
there both as a hop and through sync counts once.

A heartbeat reconciles: a tracked request the peer no longer lists is freed (its Freed was lost).
A peer is one (replica, epoch): a process. One silent for ``peer_timeout`` seconds has its requests
dropped, which is also what becomes of a replica's old process after a restart.

With a mesh secret (``secret=``), every message is sealed with a key derived from it and a
message without a valid seal is dropped and counted (``unauthenticated``): only replicas that
share the secret speak on sync (:mod:`kvmesh.router.mesh.sync_seal`). A message whose sequence
number a peer has already passed is dropped as a duplicate (a replay, or a peer followed at two
addresses).

Known limit: PUB/SUB drops what is sent before a subscriber is connected, so requests already in
flight when two replicas first connect are not counted by the newcomer.

On the NATS event plane (``nats=`` a :class:`~kvmesh.events.nats_link.NatsLink`) the same
envelopes go to ``<prefix>.sync.<replica>`` and every replica listens on ``<prefix>.sync.*``: one
connection per replica instead of N² links, and no peer discovery. Messages are queued and sent by
one task (a publish needs the event loop); while NATS is away they wait in the client's buffer or
are counted as ``send_dropped``, and the heartbeats reconcile once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import zmq

from kvmesh._types import WorkerKey
from kvmesh.errors import ConfigError
from kvmesh.events.endpoint import needs_ipv6
from kvmesh.events.nats_link import NatsLink
from kvmesh.events.readiness import SocketWatch, drain
from kvmesh.router.core.kv_router import KvRouter
from kvmesh.router.mesh.sync_seal import seal, sync_key, unseal
from kvmesh.router.request.responses_api import ResponseHomes

logger = logging.getLogger("kvmesh.router")

_DRAIN_LIMIT = 1024  # messages handled per wake-up before yielding to the event loop


Count = Annotated[int, msgspec.Meta(ge=0)]
"""A rank, a length or a number of blocks: a negative one comes from no replica, and the message
is dropped as malformed rather than read."""
Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=sys.float_info.max)]
"""A session's timeout: positive and finite. (A NaN or infinite one bound a session that never
expired on the replica that took it: its turns went to that worker for good.)"""


def _dial(sub: zmq.Socket[bytes], endpoint: str) -> None:
    """Connect ``sub`` to a peer's endpoint, IPv6 on for an IPv6 address (the option applies to
    the connections made after it is set, so each peer gets its own)."""
    sub.setsockopt(zmq.IPV6, needs_ipv6(endpoint, bind=False))
    sub.connect(endpoint)


class Routed(msgspec.Struct, tag="routed", array_like=True):
    request_id: str
    worker_id: str
    dp_rank: Count
    local_hashes: list[int]
    isl_tokens: Count
    overlap_blocks: Count
    osl: Count | None = None


class PrefillDone(msgspec.Struct, tag="prefill_done", array_like=True):
    request_id: str


class Freed(msgspec.Struct, tag="freed", array_like=True):
    request_id: str


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    active: list[str]


class Session(msgspec.Struct, tag="session", array_like=True):
    session_id: str
    worker_id: str | None
    """None: the session was closed."""
    dp_rank: Count
    timeout: Seconds


class Home(msgspec.Struct, tag="home", array_like=True):
    kind: str
    """What is held: ``response`` (a stored response), ``sagemaker_session``, ``sglang_session``."""
    key: str
    worker_id: str | None
    """None: forgotten (the session closed)."""


SyncMessage = Routed | PrefillDone | Freed | Heartbeat | Session | Home


class Envelope(msgspec.Struct, array_like=True):
    replica: str
    epoch: int
    seq: int
    """Per (replica, epoch), +1 per message: a jump means messages were lost."""
    message: SyncMessage


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(envelope: Envelope) -> bytes:
    return _encoder.encode(envelope)


@dataclass
class SyncStats:
    published: int = 0
    send_dropped: int = 0
    """Messages the PUB socket refused (high-water mark reached)."""
    received: int = 0
    counted: int = 0
    """Peer requests counted as load here from their messages (a decision, a warm-up, a prefix
    copy), leaving out those already counted as hops forwarded here."""
    malformed: int = 0
    unauthenticated: int = 0
    """Messages dropped for their seal: unsealed or with a wrong proof where this replica holds a
    mesh secret, or sealed where it holds none."""
    duplicates: int = 0
    """Messages whose sequence number their sender had already passed (dropped)."""
    lost: int = 0
    """Messages a peer sent that never arrived (sequence jumps)."""
    unknown_worker: int = 0
    """Peer decisions for a worker this replica does not route to (ignored)."""
    reconciled: int = 0
    """Peer requests freed by a heartbeat that no longer listed them."""
    peers_expired: int = 0


@dataclass
class _Peer:
    replica: str
    epoch: int
    last_heard: float
    seq: int
    requests: set[str] = field(default_factory=set)


class ReplicaSync:
    """Publishes this replica's routing lifecycle and applies its peers' (one event loop)."""

    def __init__(
        self,
        router: KvRouter,
        replica: str,
        epoch: int,
        *,
        endpoint: str,
        advertise_host: str | None = None,
        interval: float = 2.0,
        peer_timeout: float | None = None,
        nats: NatsLink | None = None,
        secret: str | None = None,
    ) -> None:
        self.router = router
        self._key = sync_key(secret) if secret else None
        self._refusals_logged: set[str] = set()
        self.nats = nats
        self._outbox: list[bytes] = []
        self._outbox_ready = asyncio.Event()
        self._nats_sub: Any = None
        self.replica = replica
        self.epoch = epoch
        self.stats = SyncStats()
        self.homes: dict[str, ResponseHomes] = {}
        """The homes peers tell this replica of, by kind (the Mesh's)."""
        head, _, port = endpoint.rpartition(":")
        self._bind_to = f"{head}:*" if port == "0" else endpoint  # ZMQ's spelling of "any port"
        self._advertise_host = advertise_host
        self._interval = interval
        self._peer_timeout = peer_timeout if peer_timeout is not None else max(3 * interval, 1.0)
        self.endpoint: str | None = None
        """The address peers connect to (known once started)."""
        self._seq = 0
        self._mine: set[str] = set()
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._following: set[str] = set()
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: zmq.Socket[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Bind the PUB socket, open the SUB socket and start listening (on the running loop)."""
        if self._pub is not None or self._tasks:
            return
        if self.nats is not None:
            self._start_nats(self.nats)
            return
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.setsockopt(zmq.IPV6, needs_ipv6(self._bind_to, bind=True))
        try:
            pub.bind(self._bind_to)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            raise ConfigError(f"cannot bind the replica sync endpoint {self._bind_to!r}: {e}") from None
        bound = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        host, _, port = bound.removeprefix("tcp://").rpartition(":")
        if self._advertise_host and host in ("0.0.0.0", "[::]", "*"):
            host = self._advertise_host
        self.endpoint = f"tcp://{host}:{port}"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._pub, self._sub = pub, sub
        for endpoint in self._following:
            _dial(sub, endpoint)
        self.router.observer = self
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._listen(sub), name="kvmesh-sync-listen"),
            loop.create_task(self._tick(), name="kvmesh-sync-heartbeat"),
        ]

    def _start_nats(self, link: NatsLink) -> None:
        self.router.observer = self
        link.on_up(self._nats_subscribe)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._nats_flush(link), name="kvmesh-sync-nats-send"),
            loop.create_task(self._tick(), name="kvmesh-sync-heartbeat"),
        ]

    async def _nats_subscribe(self) -> None:
        """Once connected: listen to every replica (the client re-subscribes after reconnects)."""
        link = self.nats
        if link is None or self._nats_sub is not None:
            return

        async def on_message(msg: Any) -> None:
            self.apply(msg.data, time.monotonic())

        self._nats_sub = await link.nc.subscribe(link.options.sync_subject_all, cb=on_message)

    async def _nats_flush(self, link: NatsLink) -> None:
        subject = link.options.sync_subject(self.replica)
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            frames, self._outbox = self._outbox, []
            if not link.connected or link.nc is None:
                self.stats.send_dropped += len(frames)
                continue
            for i, frame in enumerate(frames):
                try:
                    await link.nc.publish(subject, frame)
                    self.stats.published += 1
                except Exception:  # the client's buffer is full or closed: NATS is away
                    self.stats.send_dropped += len(frames) - i
                    break

    async def stop(self) -> None:
        if self.nats is not None:
            self.nats.remove_listener(self._nats_subscribe)
            sub, self._nats_sub = self._nats_sub, None
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        if self.router.observer is self:
            self.router.observer = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        for sock in (self._sub, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None
        for peer in list(self._peers.values()):
            self._forget(peer)

    # ---------------------------------------------------------------- peers
    @property
    def following(self) -> frozenset[str]:
        return frozenset(self._following)

    def follow(self, endpoint: str) -> None:
        """Subscribe to a peer's sync endpoint (idempotent; our own is ignored)."""
        if endpoint in self._following or endpoint == self.endpoint:
            return
        self._following.add(endpoint)
        if self._sub is not None:
            try:
                _dial(self._sub, endpoint)
            except zmq.ZMQError as e:
                self._following.discard(endpoint)
                logger.warning("replica sync: cannot follow %s: %s", endpoint, e)

    def unfollow(self, endpoint: str) -> None:
        if endpoint not in self._following:
            return
        self._following.discard(endpoint)
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disconnect(endpoint)

    @property
    def peers_heard(self) -> int:
        """Replica processes heard from and not yet expired."""
        return len(self._peers)

    def describe(self) -> dict[str, Any]:
        """What ``GET /kvmesh/router`` shows about sync."""
        now = time.monotonic()
        return {
            "transport": "nats" if self.nats is not None else "zmq",
            "sealed": self._key is not None,
            "following": sorted(self._following),
            "in_flight": len(self._mine),
            "peers": [
                {
                    "replica": p.replica,
                    "epoch": p.epoch,
                    "requests": len(p.requests),
                    "last_heard_s": round(now - p.last_heard, 3),
                }
                for p in self._peers.values()
            ],
            "stats": dataclasses.asdict(self.stats),
        }

    # ---------------------------------------------------------------- RoutingObserver
    def routed(
        self,
        request_id: str,
        worker: WorkerKey,
        local_hashes: Sequence[int],
        isl_tokens: int,
        overlap_blocks: int,
        osl: int | None,
    ) -> None:
        self._mine.add(request_id)
        hashes = local_hashes if isinstance(local_hashes, list) else list(local_hashes)
        self._send(Routed(request_id, worker[0], worker[1], hashes, isl_tokens, overlap_blocks, osl))

    def prefill_done(self, request_id: str) -> None:
        if request_id in self._mine:
            self._send(PrefillDone(request_id))

    def freed(self, request_id: str) -> None:
        if request_id in self._mine:
            self._mine.discard(request_id)
            self._send(Freed(request_id))

    def session(self, session_id: str, worker: WorkerKey | None, timeout: float) -> None:
        if worker is None:
            self._send(Session(session_id, None, 0, timeout))
        else:
            self._send(Session(session_id, worker[0], worker[1], timeout))

    def home(self, kind: str, key: str, worker_id: str | None) -> None:
        self._send(Home(kind, key, worker_id))

    # ---------------------------------------------------------------- publishing
    def _frame(self, message: SyncMessage) -> bytes:
        """The next message on the wire: numbered, and sealed when the replicas share a secret."""
        self._seq += 1
        payload = encode(Envelope(self.replica, self.epoch, self._seq, message))
        return payload if self._key is None else seal(self._key, payload)

    def _send(self, message: SyncMessage) -> None:
        if self.nats is not None:
            if self._tasks:
                self._outbox.append(self._frame(message))
                self._outbox_ready.set()
            return
        pub = self._pub
        if pub is None:
            return
        try:
            pub.send(self._frame(message), zmq.NOBLOCK)
            self.stats.published += 1
        except zmq.Again:
            self.stats.send_dropped += 1

    def heartbeat(self) -> None:
        """Publish the ids still in flight (ids the router dropped on its own are forgotten)."""
        router = self.router
        gone = [rid for rid in self._mine if not router.tracking(rid)]
        for rid in gone:
            self._mine.discard(rid)
        self._send(Heartbeat(list(self._mine)))

    async def _tick(self) -> None:
        while True:
            try:
                self.heartbeat()
                self.expire(time.monotonic())
            except Exception:  # the heartbeat must survive a bug in one round
                logger.exception("replica sync heartbeat failed")
            await asyncio.sleep(self._interval)

    def expire(self, now: float) -> None:
        """Drop peers not heard of for ``peer_timeout`` seconds, with their requests."""
        for peer in [p for p in self._peers.values() if now - p.last_heard > self._peer_timeout]:
            logger.warning(
                "replica sync: %s silent for %.1f s; dropping its %d requests",
                peer.replica,
                now - peer.last_heard,
                len(peer.requests),
            )
            self.stats.peers_expired += 1
            self._forget(peer)

    def _forget(self, peer: _Peer) -> None:
        self._peers.pop((peer.replica, peer.epoch), None)
        now = time.monotonic()
        for rid in peer.requests:
            self.router.cancel(rid, now)
        peer.requests.clear()

    # ---------------------------------------------------------------- receiving
    async def _listen(self, sub: zmq.Socket[bytes]) -> None:
        watch = SocketWatch()  # (one message per peer decision: see kvmesh.events.readiness)
        watch.watch(sub)
        try:
            while True:
                watch.clear()
                if drain(sub, _recv_now, self._apply_now, _DRAIN_LIMIT):
                    await asyncio.sleep(0)  # more there: let the rest of the loop run first
                else:
                    await watch.wait()
        finally:
            watch.unwatch(sub)  # (stop() closes the socket once this task has ended)

    def _apply_now(self, frame: bytes) -> None:
        self.apply(frame, time.monotonic())

    def apply(self, frame: bytes, now: float) -> None:
        """Apply one peer message (bad input is counted and logged, never raised)."""
        self.stats.received += 1
        payload = unseal(self._key, frame)
        if isinstance(payload, str):
            self._refuse(payload)
            return
        try:
            env = _decoder.decode(payload)
        except msgspec.DecodeError as e:
            self.stats.malformed += 1
            logger.warning("replica sync: dropping a malformed message: %s", e)
            return
        if env.replica == self.replica and env.epoch == self.epoch:
            return  # our own, through a loop in the configuration
        key = (env.replica, env.epoch)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(env.replica, env.epoch, now, env.seq - 1)
        elif env.seq <= peer.seq:
            self.stats.duplicates += 1
            return
        if env.seq > peer.seq + 1:
            self.stats.lost += env.seq - peer.seq - 1
        peer.seq = env.seq
        peer.last_heard = now
        router = self.router
        message = env.message
        if isinstance(message, Routed):
            key = (message.worker_id, message.dp_rank)
            if not router.knows(key):
                self.stats.unknown_worker += 1
                return
            rid = message.request_id
            peer.requests.add(rid)
            if not router.tracking(rid):  # a forwarded request may already count here as a hop
                self.stats.counted += 1
                router.track(
                    rid,
                    key,
                    message.local_hashes,
                    message.isl_tokens,
                    now,
                    overlap_blocks=message.overlap_blocks,
                    osl=message.osl,
                )
        elif isinstance(message, PrefillDone):
            if message.request_id in peer.requests:
                router.first_token(message.request_id, now)
        elif isinstance(message, Session):
            worker = None if message.worker_id is None else (message.worker_id, message.dp_rank)
            router.apply_session(message.session_id, worker, message.timeout, now)
        elif isinstance(message, Home):
            homes = self.homes.get(message.kind)
            if homes is None:
                return  # (a kind this replica keeps no homes of)
            if message.worker_id is None:
                homes.unlearn(message.key)
            else:
                homes.learn(message.key, message.worker_id)
        elif isinstance(message, Freed):
            if message.request_id in peer.requests:
                peer.requests.discard(message.request_id)
                router.finished(message.request_id, now)
        else:
            active = set(message.active)
            for rid in [r for r in peer.requests if r not in active]:
                peer.requests.discard(rid)
                self.stats.reconciled += 1
                router.finished(rid, now)
            for rid in peer.requests:
                router.output_tokens(rid, 0, now)  # still alive: keeps the request from timing out

    def _refuse(self, reason: str) -> None:
        """Count a message dropped for its seal; said once per reason (a peer with another secret
        would otherwise fill the log at its message rate)."""
        self.stats.unauthenticated += 1
        if reason in self._refusals_logged:
            return
        self._refusals_logged.add(reason)
        if self._key is None:
            advice = "a peer seals its messages with a mesh secret this replica lacks: set KVMESH_MESH_SECRET"
        else:
            advice = "only replicas with this replica's mesh secret (KVMESH_MESH_SECRET) are heard"
        logger.warning(
            "replica sync: dropping a message (%s); %s (counted as unauthenticated)", reason, advice
        )


def _recv_now(sock: zmq.Socket[bytes]) -> bytes:
    """One frame, without blocking (a peer's message is one frame)."""
    return sock.recv(zmq.NOBLOCK)
