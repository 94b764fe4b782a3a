"""The NATS side of the event plane: options, subjects, and one long-lived connection.

kvmesh speaks NATS only when ``--event-plane nats://host:4222[,...]`` asks for it; ``nats-py`` is an
optional extra (``pip install 'kvmesh[nats]'``) imported on first use.

Names on the wire (``prefix`` defaults to ``kvmesh``)::

    <prefix>.events.<publisher>.<rank>   a publisher's KV-event batches, in the JetStream stream
                                         ``<PREFIX>_EVENTS`` (bounded by age and bytes)
    <prefix>.sync.<replica>              router replica sync (core NATS, not stored)
    bucket <prefix>_workers              worker registrations (key = the worker's name)

A batch keeps the ZMQ wire's payload byte for byte; its sequence number and the publisher's epoch
(a random id per publisher process, so a restart that counts from 0 again is told apart from old
messages still in the stream) ride in headers.

:class:`NatsLink` owns one connection for a process: it connects in the background and keeps
trying (a router must start, and keep routing, while NATS is down), reports every disconnect and
reconnect, and tells listeners so they can re-sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvmesh.errors import ConfigError

logger = logging.getLogger("kvmesh.events")

INSTALL_HINT = "the NATS event plane needs nats-py: pip install 'kvmesh[nats]'"
NATS_ENDPOINT_PREFIX = "nats:"
"""A ``kv_events_endpoints`` entry ``nats:<subject>`` says: this rank's events are on NATS."""
SEQ_HEADER = "Kvmesh-Seq"
EPOCH_HEADER = "Kvmesh-Epoch"
_TOKEN_BAD = re.compile(r"[^A-Za-z0-9_-]")
_PREFIX = re.compile(r"[A-Za-z0-9_-]+")

MAX_SECONDS = (2**63 - 1) // 10**9
"""The longest duration JetStream takes (a stream's age, a bucket's ttl): it counts nanoseconds in
a signed 64-bit integer, some 292 years. (Past it the server refused the stream's JSON, or nats-py
overflowed turning the seconds to nanoseconds, and the plane retried for ever.)"""
MAX_BYTES = 1 << 60
"""The largest stream size taken, an exbibyte: JetStream's field is a signed 64-bit integer, and
a power of two stays exact where a settings row keeps its bound as a float (2**63 - 1 does not)."""
MAX_REPLICAS = 5
"""JetStream keeps at most five replicas of a stream."""


def import_nats() -> Any:
    """The ``nats`` package, or ImportError with the install hint."""
    try:
        import nats
        import nats.js.api
        import nats.js.errors
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return nats


def subject_token(name: str) -> str:
    """``name`` as one subject token / KV key: every character but ``[A-Za-z0-9_-]`` becomes ``_``
    (``http://10.0.0.1:8000`` -> ``http___10_0_0_1_8000``)."""
    token = _TOKEN_BAD.sub("_", name)
    if not token:
        raise ConfigError(f"cannot make a NATS subject token of {name!r}")
    return token


def prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` cannot lead kvmesh's subjects, stream and bucket (None when it can).

    One subject token of letters, digits, ``_`` and ``-``: a space, ``*`` or ``>`` made every
    subject invalid (the server refused the stream and the plane retried for ever), and a dot or a
    character ``subject_token`` folds gave two fleets the same stream and bucket (``a.b``, ``a_b``).
    """
    if not _PREFIX.fullmatch(prefix):
        return "must be one NATS subject token of letters, digits, '_' and '-' (like kvmesh or fleet-2)"
    return None


def subject_problem(subject: str) -> str | None:
    """Why ``subject`` is not one literal subject kvmesh publishes on (None when it is): tokens of
    letters, digits, ``_`` and ``-`` joined by dots. A worker that listed ``nats:kvmesh.events.>``
    would otherwise have had every worker's events applied to its own index."""
    if not all(_PREFIX.fullmatch(token) for token in subject.split(".")):
        return "must be a NATS subject of tokens of letters, digits, '_' and '-' joined by dots, no wildcard"
    return None


def parse_event_plane(text: str) -> tuple[str, ...]:
    """``zmq`` -> ``()``; ``nats://h:4222[,tls://h2:4222...]`` -> the server URLs; ConfigError otherwise."""
    value = text.strip()
    if value.lower() == "zmq":
        return ()
    servers = tuple(s.strip() for s in value.split(",") if s.strip())
    if not servers:
        raise ConfigError(f"event plane {text!r} must be 'zmq' or nats://host:port[,...]")
    for server in servers:
        unlike = f"event plane server {server!r} must look like nats://host:port (or tls://)"
        try:
            parts = urlsplit(server)
        except ValueError:  # (an unclosed or invalid bracketed IPv6 host)
            raise ConfigError(unlike) from None
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise ConfigError(unlike)
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise ConfigError(f"event plane server {server!r} has an invalid port") from None
    return servers


@dataclass(frozen=True)
class NatsOptions:
    """How to reach NATS and how the event stream is shaped (one per process)."""

    servers: tuple[str, ...]
    token: str | None = None
    user: str | None = None
    password: str | None = None
    creds_file: str | None = None
    """A ``.creds`` file (JWT + NKey seed), as ``nsc`` writes it."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    prefix: str = "kvmesh"
    stream_max_age: float = 600.0
    """Seconds a batch stays replayable."""
    stream_max_bytes: int = 1 << 30
    stream_replicas: int = 1
    """JetStream replicas of the event stream and the worker bucket (3 on a 3-node cluster)."""
    consumer_heartbeat: float = 1.0
    """Idle heartbeat of each stream consumer; two missed ones re-create it (node failover)."""

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("NATS options need at least one server")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--nats-tls-cert and --nats-tls-key go together")
        if self.token is not None and self.user is not None:
            raise ConfigError("give either a NATS token or a user/password, not both")
        # The settings and the relay's flags check these first, naming the variable or flag; this
        # is for everyone else who makes options, so that no value reaches the server to be refused.
        problem = prefix_problem(self.prefix)
        if problem:
            raise ConfigError(f"--nats-prefix {problem}, got {self.prefix!r}")
        if not 0 < self.stream_max_age <= MAX_SECONDS:
            raise ConfigError(
                f"--nats-stream-max-age must be in (0, {MAX_SECONDS}], got {self.stream_max_age}"
            )
        if not 1 <= self.stream_max_bytes <= MAX_BYTES:
            raise ConfigError(
                f"--nats-stream-max-bytes must be in [1, {MAX_BYTES}], got {self.stream_max_bytes}"
            )
        if not 1 <= self.stream_replicas <= MAX_REPLICAS:
            raise ConfigError(f"--nats-replicas must be in [1, {MAX_REPLICAS}], got {self.stream_replicas}")

    @property
    def stream(self) -> str:
        return f"{subject_token(self.prefix).upper()}_EVENTS"

    @property
    def bucket(self) -> str:
        return f"{subject_token(self.prefix)}_workers"

    def events_subject(self, publisher: str, rank: int) -> str:
        return f"{self.prefix}.events.{subject_token(publisher)}.{rank}"

    @property
    def sync_subject_all(self) -> str:
        return f"{self.prefix}.sync.*"

    def sync_subject(self, replica: str) -> str:
        return f"{self.prefix}.sync.{subject_token(replica)}"

    def connect_kwargs(self) -> dict[str, Any]:
        """The credentials and TLS part of ``nats.connect()``."""
        kwargs: dict[str, Any] = {}
        if self.token is not None:
            kwargs["token"] = self.token
        if self.user is not None:
            kwargs["user"] = self.user
            kwargs["password"] = self.password or ""
        if self.creds_file is not None:
            kwargs["user_credentials"] = self.creds_file
        if self.tls_ca or self.tls_cert or any(s.startswith("tls://") for s in self.servers):
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert is not None:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            kwargs["tls"] = context
        return kwargs


Listener = Callable[[], Awaitable[None]]


class NatsLink:
    """One NATS connection that comes back by itself; ``connected`` says whether it is up now.

    ``start()`` returns at once; the connection is made (and re-made) in the background. Listeners
    added with ``on_up`` run after every (re)connection, once the event stream exists: that is
    where subscribers re-sync. Nothing here ever raises at a caller because NATS is away.
    """

    def __init__(self, options: NatsOptions, *, name: str = "kvmesh", stream: bool = True) -> None:
        self.options = options
        self.name = name
        self._want_stream = stream
        self.nc: Any = None
        self.js: Any = None
        self.connected = False
        self.disconnects = 0
        self.reconnects = 0
        self.last_error: str | None = None
        self.stream_problem: str | None = None
        """Why the event stream could not be made or checked, while connected to a server."""
        self.since = time.monotonic()
        self._up = asyncio.Event()
        self._listeners: list[Listener] = []
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._connect_loop(), name="kvmesh-nats")

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """True once connected (within ``timeout`` seconds, None: no limit)."""
        if self.connected:
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._up.wait(), timeout)
        return self.connected

    async def close(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._set_connected(False)
        nc, self.nc = self.nc, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        self._set_connected(False)

    def on_up(self, listener: Listener) -> None:
        """Run ``listener`` after every (re)connection (and now, soon, if connected)."""
        self._listeners.append(listener)
        if self.connected:
            asyncio.get_running_loop().create_task(self._run_listener(listener))

    def remove_listener(self, listener: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def describe(self) -> dict[str, Any]:
        """What ``/kvmesh/router`` and ``/health`` show about the plane."""
        return {
            "kind": "nats",
            "servers": list(self.options.servers),
            "connected": self.connected,
            "state_for_s": round(time.monotonic() - self.since, 3),
            "disconnects": self.disconnects,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
            "stream": self.options.stream,
            "stream_problem": self.stream_problem,
        }

    # ---------------------------------------------------------------- internals
    def _set_connected(self, up: bool) -> None:
        if up != self.connected:
            self.since = time.monotonic()
        self.connected = up
        if up:
            self._up.set()
        else:
            self._up.clear()

    async def _connect_loop(self) -> None:
        nats = import_nats()
        delay = 0.2
        while not self._closing:
            try:
                self.nc = await nats.connect(
                    servers=list(self.options.servers),
                    name=self.name,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,
                    connect_timeout=2,
                    ping_interval=2,
                    max_outstanding_pings=2,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    **self.options.connect_kwargs(),
                )
                break
            except Exception as e:  # no server reachable yet: keep trying, quietly after the first
                self.last_error = f"{type(e).__name__}: {e}"
                if delay <= 0.2:
                    logger.warning("NATS %s unreachable (%s); retrying", ",".join(self.options.servers), e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.js = self.nc.jetstream(timeout=2.0)
        await self._came_up()

    async def _came_up(self) -> None:
        if self._want_stream:
            while not self._closing:
                try:
                    await ensure_stream(self.js, self.options)
                    self.stream_problem = None
                    break
                except Exception as e:  # JetStream not ready (a cluster electing), or a refusal
                    error = f"{type(e).__name__}: {e}"
                    if error != self.stream_problem:  # said once, not at every retry
                        logger.warning(
                            "NATS event stream %s not ready (%s); retrying", self.options.stream, error
                        )
                    self.last_error = self.stream_problem = error
                    await asyncio.sleep(0.25)
        self._set_connected(True)
        logger.info("NATS event plane connected (%s)", self.nc.connected_url.netloc if self.nc else "?")
        for listener in list(self._listeners):
            await self._run_listener(listener)

    async def _run_listener(self, listener: Listener) -> None:
        try:
            await listener()
        except Exception:
            logger.exception("NATS re-sync listener failed")

    async def _on_error(self, e: Exception) -> None:
        self.last_error = f"{type(e).__name__}: {e}"
        logger.debug("NATS error: %s", e)

    async def _on_disconnected(self) -> None:
        if self._closing:
            return
        if self.connected:
            self.disconnects += 1
            logger.warning("NATS event plane disconnected; routing on the last known state")
        self._set_connected(False)

    async def _on_reconnected(self) -> None:
        if self._closing:
            return
        self.reconnects += 1
        await self._came_up()


async def ensure_stream(js: Any, options: NatsOptions) -> None:
    """Create (or update to these limits) the event stream; idempotent."""
    nats = import_nats()
    api = nats.js.api
    config = api.StreamConfig(
        name=options.stream,
        subjects=[f"{options.prefix}.events.>"],
        retention=api.RetentionPolicy.LIMITS,
        discard=api.DiscardPolicy.OLD,
        max_age=options.stream_max_age,
        max_bytes=options.stream_max_bytes,
        storage=api.StorageType.FILE,
        num_replicas=options.stream_replicas,
        duplicate_window=min(120.0, options.stream_max_age),
    )
    try:
        await js.add_stream(config=config)
    except nats.js.errors.BadRequestError as refused:  # it exists with other limits: take these
        try:
            info = await js.stream_info(options.stream)
        except nats.js.errors.NotFoundError:
            raise refused from None  # there is no such stream: the refusal was of these limits
        held = list(info.config.subjects or [])
        if held != config.subjects:
            # The same stream name from another prefix (names are upper-cased: Fleet and fleet).
            # Updating would move that fleet's stream onto these subjects and lose its events.
            raise ConfigError(
                f"stream {options.stream} holds {', '.join(held) or 'no subjects'}, another fleet's; "
                f"give this fleet a --nats-prefix of another name"
            ) from None
        await js.update_stream(config=config)


async def worker_bucket(js: Any, options: NatsOptions, ttl: float) -> Any:
    """The worker-registration KV bucket (created with ``ttl`` if missing)."""
    nats = import_nats()
    try:
        return await js.key_value(options.bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    config = nats.js.api.KeyValueConfig(
        bucket=options.bucket, history=1, ttl=ttl, replicas=options.stream_replicas
    )
    try:
        return await js.create_key_value(config=config)
    except nats.js.errors.BadRequestError:  # another process created it meanwhile
        return await js.key_value(options.bucket)
