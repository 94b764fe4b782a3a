"""MeshSettings: everything the middleware and the standalone router need besides routing flags.

Sources, later ones winning: defaults < ``KVMESH_CONFIG`` TOML file < ``KVMESH_*`` environment
variables < command-line flags. Engines such as vLLM instantiate the middleware with no
arguments, so the environment and the config file are the only way in there.

Environment variables::

    KVMESH_WORKERS           comma-separated worker base URLs (http://host:port)
    KVMESH_SELF_URL          this engine's own base URL when the middleware is embedded
    KVMESH_WORKER_ID         this engine's worker id (default: the worker whose URL is KVMESH_SELF_URL)
    KVMESH_TOKENIZER         "builtin" (mock fleets), "engine" (the engine's own) or a local HF path
    KVMESH_ADMIN_TOKEN       shared token guarding /kvmesh/* RPCs and POST /busy_threshold
    KVMESH_MAX_BODY_BYTES    largest request body accepted (413 beyond) [8 MiB]
    KVMESH_BLOCK_SIZE        the fleet's KV block size when no worker describes it [16]
    KVMESH_HEALTH_INTERVAL   seconds between worker health checks [2]
    KVMESH_SYNC_ENDPOINT     with --router-replica-sync: where this replica publishes its routing
                             decisions (tcp://host:port; port * picks one) [tcp://<self host>:*]
    KVMESH_SYNC_PEERS        comma-separated sync endpoints of replicas that are not workers
                             (standalone routers); embedded replicas are found through the workers
    KVMESH_CONFIG            path of a TOML file (below)
    KVMESH_ROUTER_*          routing flags (see RouterConfig)

TOML file::

    self_url = "http://10.0.0.1:8000"
    tokenizer = "/models/llama-3-8b"
    [router]
    router_temperature = 0.0
    [[workers]]
    url = "http://10.0.0.1:8000"           # a worker that serves /kvmesh/info needs nothing more
    [[workers]]
    url = "http://10.0.0.2:8000"           # a plain `vllm serve --kv-events-config ...`
    id = "gpu-2"
    backend = "vllm"
    block_size = 16
    kv_events_endpoints = ["tcp://10.0.0.2:5557"]
    kv_replay_endpoints = ["tcp://10.0.0.2:5558"]
    max_num_batched_tokens = 8192
    total_kv_blocks = 20000

``sync_endpoint`` and ``sync_peers`` (a list) set the replica-sync sockets in the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvmesh.errors import ConfigError
from kvmesh.router.core.config import RouterConfig

DEFAULT_BODY_LIMIT = 8 * 1024 * 1024
DEFAULT_BLOCK_SIZE = 16
POLARITIES = ("lower_first", "higher_first", "none")
# vLLM schedules lower values first; what a backend name implies when its spec does not say.
BACKEND_POLARITY = {"vllm": "lower_first", "mock": "lower_first", "sglang": "higher_first", "trtllm": "none"}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker as configured; fields left None come from its ``/kvmesh/info``."""

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
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``; ConfigError if unusable."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    text = text.rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} {url!r} must look like http://host:port")
    if parts.query or parts.fragment:
        raise ConfigError(f"{what} {url!r} must not have a query or fragment")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ConfigError(f"{what} {url!r} has an invalid port") from None
    return text


def parse_worker_list(text: str) -> tuple[WorkerSpec, ...]:
    """``URL[,URL...]`` -> specs whose id is the normalized URL."""
    specs = []
    for item in text.split(","):
        if item.strip():
            url = normalize_url(item)
            specs.append(WorkerSpec(url=url, worker_id=url))
    return tuple(specs)


_INT_FIELDS = ("block_size", "dp_size", "max_num_batched_tokens", "total_kv_blocks")
WORKER_KEYS = frozenset(
    ("url", "id", "worker_id", "backend", "model", "kv_events_endpoints", "kv_replay_endpoints",
     "priority_polarity", *_INT_FIELDS)
)  # fmt: skip


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
    values: dict[str, Any] = {"url": url, "worker_id": worker_id}
    for name in _INT_FIELDS:
        if name in table:
            value = table[name]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise bad(name, f"must be a positive integer, got {value!r}")
            values[name] = value
    for name in ("backend", "model"):
        if name in table:
            values[name] = str(table[name])
    if "priority_polarity" in table:
        if table["priority_polarity"] not in POLARITIES:
            raise bad("priority_polarity", f"must be one of {', '.join(POLARITIES)}")
        values["priority_polarity"] = table["priority_polarity"]
    for name in ("kv_events_endpoints", "kv_replay_endpoints"):
        if name in table:
            value = table[name]
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(v is None or isinstance(v, str) for v in value):
                raise bad(name, "must be a list of endpoint strings")
            values[name] = tuple(value)
    return WorkerSpec(**values)


def check_sync_endpoint(endpoint: str, what: str = "KVMESH_SYNC_ENDPOINT") -> str:
    """``tcp://host:port`` (port may be ``*`` or 0: any free one); ConfigError otherwise."""
    text = endpoint.strip()
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if not text.startswith("tcp://") or not sep or not host or not (port == "*" or port.isdigit()):
        raise ConfigError(f"{what} {endpoint!r} must look like tcp://host:port")
    if port.isdigit() and int(port) > 65535:
        raise ConfigError(f"{what} {endpoint!r} has an invalid port")
    return text


@dataclass(frozen=True)
class MeshSettings:
    workers: tuple[WorkerSpec, ...] = ()
    router: RouterConfig = field(default_factory=RouterConfig)
    tokenizer: str = "builtin"
    admin_token: str | None = None
    max_body_bytes: int = DEFAULT_BODY_LIMIT
    self_url: str | None = None
    self_worker_id: str | None = None
    block_size: int | None = None
    health_interval: float = 2.0
    health_failures: int = 2
    connect_timeout: float = 3.0
    sync_endpoint: str | None = None
    """Replica sync PUB address (with ``router.router_replica_sync``); None: self host, any port."""
    sync_peers: tuple[str, ...] = ()
    """Sync endpoints of replicas that are not workers (standalone routers)."""

    def __post_init__(self) -> None:
        ids = [w.worker_id for w in self.workers]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ConfigError(f"worker id {sorted(dup)[0]!r} is configured twice")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"KVMESH_MAX_BODY_BYTES must be positive, got {self.max_body_bytes}")
        if self.health_interval <= 0:
            raise ConfigError(f"KVMESH_HEALTH_INTERVAL must be positive, got {self.health_interval}")
        if self.sync_endpoint is not None:
            object.__setattr__(self, "sync_endpoint", check_sync_endpoint(self.sync_endpoint))
        object.__setattr__(
            self,
            "sync_peers",
            tuple(check_sync_endpoint(p, "KVMESH_SYNC_PEERS entry") for p in self.sync_peers),
        )
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


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name} must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {text!r}")
    return value


def _positive_float(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a positive number, got {text!r}") from None
    if not value > 0:
        raise ConfigError(f"{name} must be a positive number, got {text!r}")
    return value


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env.get("KVMESH_WORKERS"):
        out["workers"] = parse_worker_list(env["KVMESH_WORKERS"])
    if env.get("KVMESH_SELF_URL"):
        out["self_url"] = normalize_url(env["KVMESH_SELF_URL"], "KVMESH_SELF_URL")
    if env.get("KVMESH_WORKER_ID"):
        out["self_worker_id"] = env["KVMESH_WORKER_ID"]
    if env.get("KVMESH_TOKENIZER"):
        out["tokenizer"] = env["KVMESH_TOKENIZER"]
    if env.get("KVMESH_ADMIN_TOKEN"):
        out["admin_token"] = env["KVMESH_ADMIN_TOKEN"]
    if env.get("KVMESH_MAX_BODY_BYTES"):
        out["max_body_bytes"] = _positive_int("KVMESH_MAX_BODY_BYTES", env["KVMESH_MAX_BODY_BYTES"])
    if env.get("KVMESH_BLOCK_SIZE"):
        out["block_size"] = _positive_int("KVMESH_BLOCK_SIZE", env["KVMESH_BLOCK_SIZE"])
    if env.get("KVMESH_HEALTH_INTERVAL"):
        out["health_interval"] = _positive_float("KVMESH_HEALTH_INTERVAL", env["KVMESH_HEALTH_INTERVAL"])
    if env.get("KVMESH_SYNC_ENDPOINT"):
        out["sync_endpoint"] = env["KVMESH_SYNC_ENDPOINT"]
    if env.get("KVMESH_SYNC_PEERS"):
        out["sync_peers"] = tuple(split_csv([env["KVMESH_SYNC_PEERS"]]))
    return out


def _from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    workers = getattr(args, "workers", None)
    if workers:
        out["workers"] = parse_worker_list(",".join(workers) if isinstance(workers, list) else workers)
    for name in (
        "tokenizer",
        "admin_token",
        "max_body_bytes",
        "block_size",
        "health_interval",
        "sync_endpoint",
    ):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value
    peers = getattr(args, "sync_peers", None)
    if peers:
        out["sync_peers"] = tuple(split_csv(peers))
    return out


def _from_toml(path: str) -> tuple[dict[str, Any], RouterConfig]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ConfigError("KVMESH_CONFIG needs Python 3.11+ (tomllib)") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    out: dict[str, Any] = {}
    router_table = data.pop("router", {})
    if not isinstance(router_table, dict):
        raise ConfigError(f"{path}: [router] must be a table")
    router = RouterConfig.from_mapping(router_table)
    workers = data.pop("workers", None)
    if workers is not None:
        out["workers"] = _workers_from_toml(workers, path)
    for key, kind in (
        ("self_url", str),
        ("worker_id", str),
        ("tokenizer", str),
        ("admin_token", str),
        ("max_body_bytes", int),
        ("block_size", int),
        ("health_interval", (int, float)),
        ("sync_endpoint", str),
    ):
        if key in data:
            value = data.pop(key)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ConfigError(f"{path}: {key} has the wrong type ({type(value).__name__})")
            out["self_worker_id" if key == "worker_id" else key] = value
    if "self_url" in out:
        out["self_url"] = normalize_url(out["self_url"], "self_url")
    if "sync_peers" in data:
        peers = data.pop("sync_peers")
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ConfigError(f"{path}: sync_peers must be a list of endpoint strings")
        out["sync_peers"] = tuple(peers)
    if data:
        raise ConfigError(f"{path}: unknown setting {sorted(data)[0]!r}")
    return out, router


def _workers_from_toml(workers: Any, path: str) -> tuple[WorkerSpec, ...]:
    if not isinstance(workers, list):
        raise ConfigError(f"{path}: workers must be a list of URLs or [[workers]] tables")
    specs: list[WorkerSpec] = []
    for i, item in enumerate(workers):
        if isinstance(item, str):
            url = normalize_url(item)
            specs.append(WorkerSpec(url=url, worker_id=url))
        elif isinstance(item, dict):
            specs.append(worker_from_mapping(item, f"workers[{i}]"))
        else:
            raise ConfigError(f"{path}: workers[{i}] must be a URL or a table")
    return tuple(specs)


def add_arguments(parser: argparse.ArgumentParser, *, workers_required: bool = False) -> None:
    """The non-routing flags of ``kvmesh router``."""
    parser.add_argument(
        "--workers",
        action="append",
        required=False,
        metavar="URL[,URL...]",
        help="worker base URLs (repeatable; or KVMESH_WORKERS, or [[workers]] in --config)",
    )
    parser.add_argument("--config", default=None, help="TOML config file (or KVMESH_CONFIG)")
    parser.add_argument(
        "--tokenizer", default=None, help="'builtin' (mock fleets) or a local Hugging Face tokenizer path"
    )
    parser.add_argument(
        "--admin-token", default=None, help="token guarding POST /busy_threshold and admin RPCs"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=None, help="largest request body accepted [8 MiB]"
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="fleet block size when no worker reports it [16]"
    )
    parser.add_argument(
        "--health-interval", type=float, default=None, help="seconds between health checks [2]"
    )
    parser.add_argument(
        "--router-sync-endpoint",
        dest="sync_endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="with --router-replica-sync: where to publish routing decisions (or KVMESH_SYNC_ENDPOINT)",
    )
    parser.add_argument(
        "--router-sync-peers",
        dest="sync_peers",
        action="append",
        default=None,
        metavar="ENDPOINT[,ENDPOINT...]",
        help="sync endpoints of other standalone router replicas (or KVMESH_SYNC_PEERS)",
    )


def split_csv(values: Sequence[str] | None) -> list[str]:
    return [x.strip() for v in values or () for x in v.split(",") if x.strip()]
