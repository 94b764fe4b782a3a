"""MeshSettings: everything the middleware and the standalone router need besides routing flags.

Sources, later ones winning: defaults < ``KVMESH_CONFIG`` TOML file < ``KVMESH_*`` environment
variables < command-line flags. Engines such as vLLM instantiate the middleware with no
arguments, so the environment and the config file are the only way in there.

Each setting is one row of ``SETTINGS`` (see :mod:`kvmesh.router.core.settings_table`): its flag,
variable, TOML key, type, range and help come from there, so every source accepts and refuses the
same values. ``kvmesh router --help`` shows each with its default. Environment variables::

    KVMESH_WORKERS           comma-separated worker base URLs (http://host:port)
    KVMESH_PREFILL_WORKERS   comma-separated prefill worker URLs (two-stage, disaggregated routing)
    KVMESH_SELF_URL          this engine's own base URL when the middleware is embedded
    KVMESH_WORKER_ID         this engine's worker id (default: the worker whose URL is KVMESH_SELF_URL)
    KVMESH_TOKENIZER         "builtin" (mock fleets), "engine" (the engine's own) or a local HF path
    KVMESH_ADMIN_TOKEN       token guarding this router's admin API (and, on a worker without
                             KVMESH_WORKER_TOKEN, its /kvmesh/* RPCs)
    KVMESH_WORKER_TOKEN      token this router presents to workers' /kvmesh/* RPCs [none]
    KVMESH_MESH_SECRET       secret replicas sign forwarded requests and sync with (docs/security.md) [none]
    KVMESH_BODY_READ_TIMEOUT seconds a client may take to send its whole request body (408 beyond) [30]
    KVMESH_MAX_BODY_BYTES    largest request body accepted (413 beyond) [8 MiB]
    KVMESH_MAX_UPLOAD_BYTES  largest form body accepted: speech to text's audio, relayed unread
                             (413 beyond) [32 MiB]
    KVMESH_LOG_REQUESTS      log one line per request as its answer ends (logger kvmesh.requests)
                             [off]
    KVMESH_BLOCK_SIZE        the fleet's KV block size when no worker describes it [16]
    KVMESH_HEALTH_INTERVAL   seconds between worker health checks [2]
    KVMESH_HEALTH_FAILURES   failed checks in a row that take a worker out of routing [2]
    KVMESH_CONNECT_TIMEOUT   seconds for a connection, a health check or a small worker RPC [3]
    KVMESH_KV_STATE_TIMEOUT  seconds for a worker's whole /kvmesh/kv_state (cold start) [30]
    KVMESH_SYNC_ENDPOINT     with --router-replica-sync: where this replica publishes its routing
                             decisions (tcp://host:port; port * picks one) [tcp://<self host>:*]
    KVMESH_SYNC_PEERS        comma-separated sync endpoints of replicas that are not workers
                             (standalone routers); embedded replicas are found through the workers
    KVMESH_EVENT_PLANE       "zmq" (direct links, the default) or nats://host:port[,...] (docs/scale.md)
    KVMESH_NATS_TOKEN        NATS token; or KVMESH_NATS_USER + KVMESH_NATS_PASSWORD; or
    KVMESH_NATS_USER         ...
    KVMESH_NATS_PASSWORD     ...
    KVMESH_NATS_CREDS        a NATS credentials file (JWT + NKey seed)
    KVMESH_NATS_TLS_CA       CA bundle for tls:// servers
    KVMESH_NATS_TLS_CERT     client certificate and key for mutual TLS
    KVMESH_NATS_TLS_KEY      ...
    KVMESH_NATS_PREFIX       first token of every kvmesh subject [kvmesh]
    KVMESH_NATS_STREAM_MAX_AGE    seconds a KV-event batch stays replayable [600]
    KVMESH_NATS_STREAM_MAX_BYTES  size limit of the KV-event stream [1 GiB]
    KVMESH_NATS_REPLICAS     JetStream replicas of the stream and the worker bucket [1]
    KVMESH_NATS_WORKER_TTL   seconds a worker registration lives without renewal [6]
    KVMESH_CONFIG            path of a TOML file (below)
    KVMESH_ROUTER_*          routing flags (see RouterConfig)

TOML file (keys are the field names, but ``worker_id`` for this engine's id)::

    self_url = "http://10.0.0.1:8000"
    tokenizer = "/models/llama-3-8b"
    kv_state_timeout = 60
    sync_peers = ["tcp://10.0.0.9:5600"]
    [router]
    router_temperature = 0.0
    [[workers]]
    url = "http://10.0.0.1:8000"           # a worker that serves /kvmesh/info needs nothing more,
    [[workers]]                            # nor a stock vLLM or SGLang started with KV events
    url = "http://10.0.0.3:8000"           # (read from /kv_event_sources or /server_info)
    [[workers]]
    url = "http://10.0.0.2:8000"           # a stock `vllm serve --kv-events-config ...` in full
    id = "gpu-2"
    backend = "vllm"
    block_size = 16
    kv_events_endpoints = ["tcp://10.0.0.2:5557"]
    kv_replay_endpoints = ["tcp://10.0.0.2:5558"]
    max_num_batched_tokens = 8192
    total_kv_blocks = 20000
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvmesh._http import HEADER_SAFE_RULE, header_safe
from kvmesh.errors import ConfigError
from kvmesh.events.endpoint import bound_to_every_interface, check_endpoint, endpoint_problem
from kvmesh.events.nats_link import MAX_BYTES as MAX_NATS_BYTES
from kvmesh.events.nats_link import MAX_REPLICAS as MAX_NATS_REPLICAS
from kvmesh.events.nats_link import MAX_SECONDS as MAX_NATS_SECONDS
from kvmesh.events.nats_link import (
    NATS_ENDPOINT_PREFIX,
    NatsOptions,
    parse_event_plane,
    prefix_problem,
    subject_problem,
)
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.settings_table import Setting, bind_defaults, check_all, key_index
from kvmesh.router.core.settings_table import add_arguments as add_table_arguments

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

DEFAULT_BODY_LIMIT = 8 * 1024 * 1024
DEFAULT_UPLOAD_LIMIT = 32 * 1024 * 1024
"""A form's (speech to text: the audio file), above vLLM's 25 MB clip limit
(``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``), so the engine, not the router, says what is too long."""
DEFAULT_BLOCK_SIZE = 16
POLARITIES = ("lower_first", "higher_first", "none")
ROLES = ("aggregated", "prefill", "decode")
"""A worker's part in disaggregated serving; a fleet with prefill workers routes in two stages."""
# vLLM schedules lower values first; what a backend name implies when its spec does not say.
BACKEND_POLARITY = {"vllm": "lower_first", "mock": "lower_first", "sglang": "higher_first", "trtllm": "none"}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker as configured; fields left None come from its ``/kvmesh/info`` (or a stock engine's
    own routes: :mod:`~kvmesh.router.mesh.engine_discovery`)."""

    url: str
    worker_id: str
    backend: str | None = None
    model: str | None = None
    block_size: int | None = None
    dp_size: int | None = None
    kv_events_endpoints: tuple[str, ...] | None = None
    kv_replay_endpoints: tuple[str | None, ...] | None = None
    max_num_batched_tokens: int | None = None
    total_kv_blocks: int | None = None
    priority_polarity: str | None = None
    role: str | None = None
    bootstrap_port: int | None = None
    """SGLang's ``--disaggregation-bootstrap-port`` on a prefill worker."""
    tokens_api: bool | None = None
    """Its server answers vLLM's token-in-token-out API (``/inference/v1/generate``)."""

    @property
    def described(self) -> bool:
        """True when the spec alone is enough for KV routing (no /kvmesh/info needed)."""
        return (
            self.block_size is not None
            and self.kv_events_endpoints is not None
            and self.max_num_batched_tokens is not None
            and self.total_kv_blocks is not None
        )


def normalize_url(url: str, what: str = "worker URL") -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``; ConfigError if unusable.

    The result is what kvmesh puts on the wire, and a worker's id when none is given, which answers
    carry in a header: so it is printable ASCII with no space. A host in another script is
    IDNA-encoded (as the ``Host`` header already was); anything else outside that is refused, since
    the URL parser would drop a tab or newline silently and a space broke the request line."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    text = text.rstrip("/")
    try:
        parts = urlsplit(text)
    except ValueError:  # (an unclosed or invalid bracketed IPv6 host)
        raise ConfigError(f"{what} {url!r} must look like http://host:port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} {url!r} must look like http://host:port")
    if parts.query or parts.fragment:
        raise ConfigError(f"{what} {url!r} must not have a query or fragment")
    if "@" in parts.netloc:
        # (kvmesh sends no credentials from a URL, and a URL-only worker's id is its URL, which
        # every answer shows the client)
        raise ConfigError(f"{what} {url!r} must not carry credentials (user@): they would not be sent")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ConfigError(f"{what} {url!r} has an invalid port") from None
    if not parts.netloc.isascii():
        try:
            host = parts.hostname.encode("idna").decode("ascii")
        except UnicodeError:
            raise ConfigError(f"{what} {url!r} has a host that IDNA cannot encode") from None
        port = "" if parts.port is None else f":{parts.port}"
        text = f"{parts.scheme}://{host}{port}{parts.path}"
    if not (text.isascii() and text.isprintable()) or " " in text:
        raise ConfigError(
            f"{what} {url!r} must be printable ASCII, with no space or control character "
            "(percent-encode the path)"
        )
    return text


def parse_worker_list(text: str) -> tuple[WorkerSpec, ...]:
    """``URL[,URL...]`` -> specs whose id is the normalized URL."""
    specs = []
    for item in text.split(","):
        if item.strip():
            url = normalize_url(item)
            specs.append(WorkerSpec(url=url, worker_id=url))
    return tuple(specs)


_INT_FIELDS = ("block_size", "dp_size", "max_num_batched_tokens", "total_kv_blocks", "bootstrap_port")
WORKER_KEYS = frozenset(
    ("url", "id", "worker_id", "backend", "model", "kv_events_endpoints", "kv_replay_endpoints",
     "priority_polarity", "role", "tokens_api", *_INT_FIELDS)
)  # fmt: skip
FACT_KEYS = WORKER_KEYS - {"url", "id", "worker_id"}
"""The keys of a worker's own description (``/kvmesh/info``) that say what a config entry says."""
MAX_DP_SIZE = 1024
"""Ranks one worker URL may have (and event endpoints, one a rank). Every decision scores every
rank: at 100,000 ranks one ``route()`` took half a second, and a worker describing itself with
ten million stalled the router at its admission."""
_INT_LIMITS = {"dp_size": MAX_DP_SIZE, "bootstrap_port": 65535}


class WorkerSpecError(ConfigError):
    """A worker description with a bad field; ``field`` names it (for an HTTP 400)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def worker_from_mapping(table: Mapping[str, Any], where: str = "") -> WorkerSpec:
    """A WorkerSpec from a ``[[workers]]`` table or a ``POST /kvmesh/workers`` body.

    ``where`` prefixes messages (``workers[2]``); WorkerSpecError names the bad field."""
    prefix = f"{where}." if where else ""

    def bad(name: str, problem: str) -> WorkerSpecError:
        return WorkerSpecError(f"{prefix}{name} {problem}", name)

    unknown = set(table) - WORKER_KEYS
    if unknown:
        key = sorted(unknown)[0]
        raise WorkerSpecError(f"{where + ': ' if where else ''}unknown key {key!r}", key)
    if not isinstance(table.get("url"), str):
        raise bad("url", "must be a string")
    try:
        url = normalize_url(table["url"])
    except ConfigError as e:
        raise WorkerSpecError(str(e), "url") from None
    worker_id = table.get("id", table.get("worker_id", url))
    if not isinstance(worker_id, str) or not worker_id:
        raise bad("id", "must be a non-empty string")
    if not header_safe(worker_id):
        # (answers carry it in x-kvmesh-worker-id, and clients pin it in x-worker-instance-id: a
        # worker registered with CR or LF in its id broke every answer it gave)
        raise bad("id", f"must be {HEADER_SAFE_RULE} (answers name their worker in a header)")
    values: dict[str, Any] = {"url": url, "worker_id": worker_id}
    for name in _INT_FIELDS:
        if name in table:
            value = table[name]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise bad(name, f"must be a positive integer, got {value!r}")
            limit = _INT_LIMITS.get(name)
            if limit is not None and value > limit:
                raise bad(name, f"must be at most {limit}, got {value}")
            values[name] = value
    for name in ("backend", "model"):
        if name in table:
            values[name] = str(table[name])
    if "priority_polarity" in table:
        if table["priority_polarity"] not in POLARITIES:
            raise bad("priority_polarity", f"must be one of {', '.join(POLARITIES)}")
        values["priority_polarity"] = table["priority_polarity"]
    if "role" in table:
        if table["role"] not in ROLES:
            raise bad("role", f"must be one of {', '.join(ROLES)}")
        values["role"] = table["role"]
    if "tokens_api" in table:
        if not isinstance(table["tokens_api"], bool):
            raise bad("tokens_api", f"must be true or false, got {table['tokens_api']!r}")
        values["tokens_api"] = table["tokens_api"]
    for name in ("kv_events_endpoints", "kv_replay_endpoints"):
        if name in table:
            value = table[name]
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(v is None or isinstance(v, str) for v in value):
                raise bad(name, "must be a list of endpoint strings")
            if len(value) > MAX_DP_SIZE:
                raise bad(name, f"must list at most {MAX_DP_SIZE} endpoints (one a rank), got {len(value)}")
            for endpoint in value:  # (the router connects to each; a port past 65535 wrapped)
                problem = _endpoint_problem(name, endpoint)
                if problem is None:
                    continue
                if bound_to_every_interface(endpoint):  # (an engine bound there, with no host to tell)
                    problem += "; set KVMESH_ADVERTISE_HOST (or KVMESH_SELF_URL) on the engine"
                raise bad(name, f"entry {endpoint!r} {problem}")
            values[name] = tuple(value)
    return WorkerSpec(**values)


def _endpoint_problem(name: str, endpoint: str | None) -> str | None:
    """What is wrong with one entry of a worker's ``name`` endpoint list, or None. A rank's events
    may be on NATS (``nats:<subject>``); its replay endpoint, when it has one, is a ZMQ socket.

    A worker's endpoint naming every interface (``0.0.0.0``, ``[::]``) is refused as ``*`` is: a
    router dials its own host there. A router on another host followed nothing while showing the
    events live, or an engine of its own host under the worker's name, so that engines that all
    advertised ``tcp://0.0.0.0:5557`` would each have credited every peer with their own cache
    (read from the code: it takes two hosts)."""
    if endpoint is None:
        return None
    if name == "kv_events_endpoints" and endpoint.startswith(NATS_ENDPOINT_PREFIX):
        return subject_problem(endpoint.removeprefix(NATS_ENDPOINT_PREFIX))
    problem = endpoint_problem(endpoint, bind=False)
    if problem is None and bound_to_every_interface(endpoint):
        host = endpoint.removeprefix("tcp://").rpartition(":")[0]
        problem = f"names {host!r}, every interface of the engine's, where a router dials its own host"
    return problem


def worker_from_info(info: Mapping[str, Any], url: str, worker_id: str, where: str) -> WorkerSpec:
    """What a worker's own description (its ``/kvmesh/info``, or the one it registered) says of it,
    held to the rules of a config entry: a bad fact is a WorkerSpecError naming it, where a text
    or a list read as a number had left the worker ``pending`` with no reason, ``1.5`` or ``true``
    had been read as a block size of 1, and a string of endpoints as one endpoint a character.
    Facts given as null count as not given."""
    table = {k: v for k, v in info.items() if k in FACT_KEYS and v is not None}
    return worker_from_mapping({**table, "url": url, "id": worker_id}, where)


def mesh_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an engine's environment describes a fleet (``KVMESH_WORKERS`` or ``KVMESH_CONFIG``):
    what makes an engine adapter route, and read these settings, rather than only serve."""
    env = os.environ if environ is None else environ
    return bool(env.get("KVMESH_WORKERS") or env.get("KVMESH_CONFIG"))


def check_sync_endpoint(endpoint: str, what: str = "KVMESH_SYNC_ENDPOINT", *, bind: bool = True) -> str:
    """``tcp://host:port`` to bind (port may be ``*`` or 0: any free one) or to connect to (a
    peer's); ConfigError otherwise."""
    text = endpoint.strip()
    if not text.startswith("tcp://"):
        raise ConfigError(f"{what} {endpoint!r} must look like tcp://host:port")
    return check_endpoint(text, bind=bind, what=what)


@dataclass(frozen=True)
class MeshSettings:
    """The fleet and the runtime around the routing core; one row of ``SETTINGS`` per field."""

    workers: tuple[WorkerSpec, ...] = ()
    prefill_workers: tuple[WorkerSpec, ...] = ()
    """Workers with role ``prefill`` (merged into ``workers`` on construction)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    tokenizer: str = "builtin"
    admin_token: str | None = None
    """Guards this router's admin API; never sent anywhere."""
    worker_token: str | None = None
    """What this router presents to workers' ``/kvmesh/*`` RPCs (a different credential)."""
    mesh_secret: str | None = None
    """Shared by the replicas: signs the hop and request-id headers of forwarded requests."""
    max_body_bytes: int = DEFAULT_BODY_LIMIT
    max_upload_bytes: int = DEFAULT_UPLOAD_LIMIT
    """The bound of a form body (speech to text's audio), which the router relays unread."""
    body_read_timeout: float = 30.0
    """Seconds from the request head to the last body byte (a stalled body gets a 408)."""
    log_requests: bool = False
    """One log line per request as its answer ends (``kvmesh.router.asgi.request_log``)."""
    self_url: str | None = None
    self_worker_id: str | None = None
    block_size: int | None = None
    health_interval: float = 2.0
    health_failures: int = 2
    connect_timeout: float = 3.0
    """Connecting to a worker, a health check, a small RPC (``/kvmesh/info``, session control)."""
    kv_state_timeout: float = 30.0
    """A worker's whole ``/kvmesh/kv_state``: every cached block, megabytes on a large cache."""
    sync_endpoint: str | None = None
    """Replica sync PUB address (with ``router.router_replica_sync``); None: self host, any port."""
    sync_peers: tuple[str, ...] = ()
    """Sync endpoints of replicas that are not workers (standalone routers)."""
    event_plane: str = "zmq"
    """``zmq`` (direct links, no broker) or ``nats://host:port[,...]`` (see docs/scale.md)."""
    nats_token: str | None = None
    nats_user: str | None = None
    nats_password: str | None = None
    nats_creds: str | None = None
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    nats_prefix: str = "kvmesh"
    nats_stream_max_age: float = 600.0
    nats_stream_max_bytes: int = 1 << 30
    nats_replicas: int = 1
    nats_worker_ttl: float = 6.0

    @property
    def nats_options(self) -> NatsOptions | None:
        """The NATS event plane's options, None with ``event_plane = zmq``."""
        servers = parse_event_plane(self.event_plane)
        if not servers:
            return None
        return NatsOptions(
            servers,
            token=self.nats_token,
            user=self.nats_user,
            password=self.nats_password,
            creds_file=self.nats_creds,
            tls_ca=self.nats_tls_ca,
            tls_cert=self.nats_tls_cert,
            tls_key=self.nats_tls_key,
            prefix=self.nats_prefix,
            stream_max_age=self.nats_stream_max_age,
            stream_max_bytes=self.nats_stream_max_bytes,
            stream_replicas=self.nats_replicas,
        )

    def __post_init__(self) -> None:
        check_all(self, SETTINGS)
        if self.prefill_workers:
            prefill = tuple(dataclasses.replace(w, role="prefill") for w in self.prefill_workers)
            object.__setattr__(self, "workers", (*self.workers, *prefill))
            object.__setattr__(self, "prefill_workers", ())
        ids = [w.worker_id for w in self.workers]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ConfigError(f"worker id {sorted(dup)[0]!r} is configured twice")
        if self.sync_endpoint is not None:
            object.__setattr__(self, "sync_endpoint", check_sync_endpoint(self.sync_endpoint))
        object.__setattr__(self, "sync_peers", _endpoints(self.sync_peers, "KVMESH_SYNC_PEERS"))
        servers = parse_event_plane(self.event_plane)
        object.__setattr__(self, "event_plane", ",".join(servers) if servers else "zmq")
        stray = [
            r.name for r in SETTINGS if r.field in _NATS_DEFAULTS and getattr(self, r.field) != r.default
        ]
        if not servers and stray:
            raise ConfigError(f"{stray[0]} needs --event-plane nats://host:port (the event plane is zmq)")
        self.nats_options  # noqa: B018 - checks the combination (TLS pair, token vs user)
        if self.self_url is not None and self.self_worker_id is None:
            if not self.workers:  # an engine on its own is a fleet of one
                object.__setattr__(self, "workers", (WorkerSpec(self.self_url, self.self_url),))
                ids = [self.self_url]
            match = next((w.worker_id for w in self.workers if w.url == self.self_url), None)
            if match is None:
                raise ConfigError(
                    f"this engine ({self.self_url}) is not among the workers ({', '.join(ids)}); "
                    "add it to KVMESH_WORKERS"
                )
            object.__setattr__(self, "self_worker_id", match)
        if self.self_worker_id is not None and self.self_worker_id not in ids:
            raise ConfigError(
                f"this engine ({self.self_url or self.self_worker_id}) is not among the workers "
                f"({', '.join(ids) or 'none'}); add it to KVMESH_WORKERS"
            )

    @property
    def embedded_worker(self) -> WorkerSpec | None:
        """This engine's own worker spec when the middleware is embedded in one."""
        return next((w for w in self.workers if w.worker_id == self.self_worker_id), None)

    def replace(self, **changes: Any) -> MeshSettings:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ sources
    @classmethod
    def load(
        cls,
        environ: Mapping[str, str] | None = None,
        args: argparse.Namespace | None = None,
        **overrides: Any,
    ) -> MeshSettings:
        """Defaults < KVMESH_CONFIG file (or ``args.config``) < KVMESH_* env < ``args`` < overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        router = RouterConfig()
        config_path = getattr(args, "config", None) or env.get("KVMESH_CONFIG")
        if config_path:
            file_values, router = _from_toml(config_path)
            values.update(file_values)
        values.update(_from_env(env))
        router = RouterConfig.from_env(env, base=router)
        if args is not None:
            values.update(_from_args(args))
            router = RouterConfig.from_namespace(args, base=router)
        values.update(overrides)
        values.setdefault("router", router)
        return cls(**values)


# ---------------------------------------------------------------------- the table
def _worker_specs(items: list[Any], name: str) -> tuple[WorkerSpec, ...]:
    """URLs (any source) or ``[[workers]]`` tables (the file) -> specs."""
    specs: list[WorkerSpec] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            url = normalize_url(item)
            specs.append(WorkerSpec(url=url, worker_id=url))
        elif isinstance(item, dict):
            specs.append(worker_from_mapping(item, f"{name}[{i}]"))
        else:
            raise ConfigError(f"{name}[{i}] must be a URL or a table, got {item!r}")
    return tuple(specs)


def _endpoints(items: Any, name: str) -> tuple[str, ...]:
    if not all(isinstance(p, str) for p in items):
        raise ConfigError(f"{name} must be a list of endpoint strings")
    return tuple(check_sync_endpoint(p, f"{name} entry", bind=False) for p in items)


def _nats_prefix(value: str, name: str) -> str:
    problem = prefix_problem(value)
    if problem:
        raise ConfigError(f"{name} {problem}, got {value!r}")
    return value


# Each row: field, flag, variable, TOML key, type, help, then the range (low, high, low_open,
# choices), None allowed (optional), a normaliser (convert) and the default as --help shows it.
SETTINGS: tuple[Setting, ...] = bind_defaults(
    MeshSettings,
    (
        Setting(
            "workers", "--workers", "KVMESH_WORKERS", "workers", list,
            "worker base URLs, comma-separated or repeated ([[workers]] tables in the file)",
            metavar="URL[,URL...]", convert=_worker_specs, shown="none",
        ),
        Setting(
            "prefill_workers", "--prefill-workers", "KVMESH_PREFILL_WORKERS", "prefill_workers", list,
            "prefill worker base URLs: with any, requests are routed in two stages (prefill, then decode)",
            metavar="URL[,URL...]", convert=_worker_specs, shown="none",
        ),
        Setting(
            "tokenizer", "--tokenizer", "KVMESH_TOKENIZER", "tokenizer", str,
            "'builtin' (mock fleets), 'engine' (the embedding engine's own) or a local Hugging Face path",
        ),
        Setting(
            "admin_token", "--admin-token", "KVMESH_ADMIN_TOKEN", "admin_token", str,
            "token guarding this router's admin API (reads included); never sent to workers",
            optional=True, shown="none",
        ),
        Setting(
            "worker_token", "--worker-token", "KVMESH_WORKER_TOKEN", "worker_token", str,
            "token this router presents to the workers' /kvmesh/* RPCs and discovery calls",
            optional=True, shown="none",
        ),
        Setting(
            "mesh_secret", "--mesh-secret", "KVMESH_MESH_SECRET", "mesh_secret", str,
            "secret shared by the router replicas: forwarded requests carry an HMAC of their id and "
            "every replica sync message is sealed with it; without it, hop headers from outside are "
            "stripped and sync is unauthenticated",
            optional=True, shown="none",
        ),
        Setting(
            "body_read_timeout", "--body-read-timeout", "KVMESH_BODY_READ_TIMEOUT", "body_read_timeout",
            float, "seconds a client may take to send its whole request body (408 beyond)", 0, low_open=True,
        ),
        Setting(
            "max_body_bytes", "--max-body-bytes", "KVMESH_MAX_BODY_BYTES", "max_body_bytes", int,
            "largest request body accepted (413 beyond)", 1, shown="8 MiB",
        ),
        Setting(
            "max_upload_bytes", "--max-upload-bytes", "KVMESH_MAX_UPLOAD_BYTES", "max_upload_bytes", int,
            "largest form body accepted: speech to text's audio, relayed unread (413 beyond)", 1,
            shown="32 MiB",
        ),
        Setting(
            "log_requests", "--log-requests", "KVMESH_LOG_REQUESTS", "log_requests", bool,
            "log one line per request as its answer ends: the worker, cached tokens predicted and "
            "reported, time to first token, tokens out, total time, or the refusal (logger "
            "kvmesh.requests, INFO; nothing of the prompt)",
        ),
        Setting(
            "self_url", None, "KVMESH_SELF_URL", "self_url", str,
            "this engine's own base URL when the middleware is embedded",
            optional=True, convert=normalize_url,
        ),
        Setting(
            "self_worker_id", None, "KVMESH_WORKER_ID", "worker_id", str,
            "this engine's worker id (default: the worker whose URL is the self URL)", optional=True,
        ),
        Setting(
            "block_size", "--block-size", "KVMESH_BLOCK_SIZE", "block_size", int,
            "the fleet's KV block size when no worker describes it", 1,
            optional=True, shown="from the workers, else 16",
        ),
        Setting(
            "health_interval", "--health-interval", "KVMESH_HEALTH_INTERVAL", "health_interval", float,
            "seconds between worker health checks", 0, low_open=True,
        ),
        Setting(
            "health_failures", "--health-failures", "KVMESH_HEALTH_FAILURES", "health_failures", int,
            "failed health checks in a row that take a worker out of routing", 1,
        ),
        Setting(
            "connect_timeout", "--connect-timeout", "KVMESH_CONNECT_TIMEOUT", "connect_timeout", float,
            "seconds for a connection, a health check or a small worker RPC", 0, low_open=True,
        ),
        Setting(
            "kv_state_timeout", "--kv-state-timeout", "KVMESH_KV_STATE_TIMEOUT", "kv_state_timeout", float,
            "seconds for a worker's whole /kvmesh/kv_state (the cold start of its index)", 0, low_open=True,
        ),
        Setting(
            "sync_endpoint", "--router-sync-endpoint", "KVMESH_SYNC_ENDPOINT", "sync_endpoint", str,
            "with --router-replica-sync: where this replica publishes its routing decisions",
            optional=True, convert=check_sync_endpoint, metavar="tcp://HOST:PORT", shown="tcp://<self host>:*",
        ),
        Setting(
            "sync_peers", "--router-sync-peers", "KVMESH_SYNC_PEERS", "sync_peers", list,
            "sync endpoints of router replicas that are not workers (standalone routers)",
            metavar="ENDPOINT[,ENDPOINT...]", convert=_endpoints,
        ),
        Setting(
            "event_plane", "--event-plane", "KVMESH_EVENT_PLANE", "event_plane", str,
            "how KV events, replica sync and discovery travel: 'zmq' (direct, no broker) or "
            "nats://host:port[,...] (needs kvmesh[nats]; see docs/scale.md)",
            metavar="zmq|nats://HOST:PORT[,...]",
        ),
        Setting(
            "nats_token", "--nats-token", "KVMESH_NATS_TOKEN", "nats_token", str,
            "NATS authentication token", optional=True, shown="none",
        ),
        Setting(
            "nats_user", "--nats-user", "KVMESH_NATS_USER", "nats_user", str,
            "NATS user name (with --nats-password)", optional=True, shown="none",
        ),
        Setting(
            "nats_password", "--nats-password", "KVMESH_NATS_PASSWORD", "nats_password", str,
            "NATS password", optional=True, shown="none",
        ),
        Setting(
            "nats_creds", "--nats-creds", "KVMESH_NATS_CREDS", "nats_creds", str,
            "NATS credentials file (JWT + NKey seed)", optional=True, metavar="FILE", shown="none",
        ),
        Setting(
            "nats_tls_ca", "--nats-tls-ca", "KVMESH_NATS_TLS_CA", "nats_tls_ca", str,
            "CA bundle that signs the NATS servers' certificates", optional=True, metavar="FILE", shown="none",
        ),
        Setting(
            "nats_tls_cert", "--nats-tls-cert", "KVMESH_NATS_TLS_CERT", "nats_tls_cert", str,
            "client certificate for NATS mutual TLS (with --nats-tls-key)", optional=True, metavar="FILE",
            shown="none",
        ),
        Setting(
            "nats_tls_key", "--nats-tls-key", "KVMESH_NATS_TLS_KEY", "nats_tls_key", str,
            "client key for NATS mutual TLS", optional=True, metavar="FILE", shown="none",
        ),
        Setting(
            "nats_prefix", "--nats-prefix", "KVMESH_NATS_PREFIX", "nats_prefix", str,
            "first subject token of every kvmesh subject; fleets sharing one NATS use different ones",
            convert=_nats_prefix,
        ),
        Setting(
            "nats_stream_max_age", "--nats-stream-max-age", "KVMESH_NATS_STREAM_MAX_AGE", "nats_stream_max_age",
            float, "seconds a KV-event batch stays replayable in the stream", 0, MAX_NATS_SECONDS,
            low_open=True,
        ),
        Setting(
            "nats_stream_max_bytes", "--nats-stream-max-bytes", "KVMESH_NATS_STREAM_MAX_BYTES",
            "nats_stream_max_bytes", int, "largest size of the KV-event stream (oldest batches go first)", 1,
            MAX_NATS_BYTES, shown="1 GiB",
        ),
        Setting(
            "nats_replicas", "--nats-replicas", "KVMESH_NATS_REPLICAS", "nats_replicas", int,
            "JetStream replicas of the event stream and the worker bucket (3 on a 3-node cluster)", 1,
            MAX_NATS_REPLICAS,
        ),
        Setting(
            "nats_worker_ttl", "--nats-worker-ttl", "KVMESH_NATS_WORKER_TTL", "nats_worker_ttl", float,
            "seconds a worker registration lives without renewal (workers renew every third of it)",
            0, MAX_NATS_SECONDS, low_open=True,
        ),
    ),
    exclude=("router",),
)  # fmt: skip
_BY_KEY = key_index(SETTINGS)
_NATS_DEFAULTS = frozenset(f.name for f in dataclasses.fields(MeshSettings) if f.name.startswith("nats_"))


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """``KVMESH_*`` variables; an empty one counts as unset."""
    return {row.field: row.coerce(env[row.env], row.env) for row in SETTINGS if row.env and env.get(row.env)}


def _from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in SETTINGS:
        value = getattr(args, row.field, None) if row.flag else None
        if value is not None:
            out[row.field] = row.coerce(value, row.flag or row.field)
    return out


MAX_CONFIG_BYTES = 8 << 20
"""A config file's size limit. (A fleet of a thousand ``[[workers]]`` tables is some 200 kB; a
path to a device or a large file given by mistake was read on and on: ``/dev/zero`` filled the
memory before anything was said.)"""


def _from_toml(path: str) -> tuple[dict[str, Any], RouterConfig]:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: is it the right file?"
        )
    try:
        data = tomllib.loads(raw.decode())
    except UnicodeDecodeError as e:  # (a binary file: it was a traceback)
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.start}): is it the right file?"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    router_table = data.pop("router", {})
    if not isinstance(router_table, dict):
        raise ConfigError(f"{path}: [router] must be a table")
    router = RouterConfig.from_mapping(router_table)
    out: dict[str, Any] = {}
    for key, value in data.items():
        row = _BY_KEY.get(key.replace("-", "_").lower())
        if row is None:
            raise ConfigError(f"{path}: unknown setting {key!r}")
        out[row.field] = row.coerce(value, f"{path}: {key}")
    return out, router


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The non-routing flags of ``kvmesh router``: one per row of ``SETTINGS``, and ``--config``."""
    parser.add_argument("--config", default=None, help="TOML config file (or KVMESH_CONFIG) [none]")
    add_table_arguments(parser, SETTINGS)
