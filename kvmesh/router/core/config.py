"""RouterConfig: every routing flag, one frozen object.

Flag names mirror NVIDIA Dynamo's router (``--router-*``) so a deployment can move between the two
without relearning knobs. Each flag has exactly one row in ``_FLAGS``; argparse options, the
``KVMESH_ROUTER_*`` environment variables and the keys of a TOML ``[router]`` table are all derived
from that row, so they cannot drift apart.

Environment variable name: ``KVMESH_ROUTER_`` + the flag without ``--`` and without a leading
``router-``, upper-cased, dashes as underscores (``--router-temperature`` ->
``KVMESH_ROUTER_TEMPERATURE``, ``--active-decode-blocks-threshold`` ->
``KVMESH_ROUTER_ACTIVE_DECODE_BLOCKS_THRESHOLD``).

The deprecated ``--router-kv-overlap-score-weight`` (alias ``--kv-overlap-score-weight``) maps the
way the reference maps it: ``prefill_load_scale = weight``, and a weight of 0 also sets
``overlap_score_credit = 0`` (pure load balancing).

``--load-aware`` is a preset for load-only routing: overlap credit 0, no KV events, no KV-reuse
assumption, active blocks and prefill tokens tracked; ``prefill_load_scale`` is kept.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvmesh.errors import ConfigError
from kvmesh.router.core.settings_table import Setting, bind_defaults, check_all, key_index
from kvmesh.router.core.settings_table import add_arguments as add_table_arguments

RouterMode = Literal["kv", "round-robin", "random", "direct"]
QueuePolicy = Literal["fcfs", "lcfs", "wspt"]
CostModel = Literal["latency", "dynamo"]
PrefillLoadModel = Literal["none", "aic"]

ROUTER_MODES: tuple[str, ...] = ("kv", "round-robin", "random", "direct")
QUEUE_POLICIES: tuple[str, ...] = ("fcfs", "lcfs", "wspt")
COST_MODELS: tuple[str, ...] = ("latency", "dynamo")
PREFILL_LOAD_MODELS: tuple[str, ...] = ("none", "aic")
ENV_PREFIX = "KVMESH_ROUTER_"
MAX_PREFILL_LOAD_SCALE = 1e6
"""The largest prefill weight taken (``--router-prefill-load-scale``, the deprecated overlap score
weight, a request's ``kv_overlap_score_weight``). A million already makes any prefill outweigh
every other term of either cost; far beyond it the latency cost's terms overflow to infinity and
no worker can be told from another (a weight of 1e308 made every request a 500)."""


@dataclass(frozen=True)
class RouterConfig:
    """Routing flags (defaults in brackets in each ``--help`` line)."""

    router_mode: RouterMode = "kv"
    # cost model
    router_cost_model: CostModel = "latency"
    router_prefill_load_model: PrefillLoadModel = "none"
    overlap_score_credit: float = 1.0
    prefill_load_scale: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    router_temperature: float = 0.0
    router_background_copies: bool = True
    # index
    use_kv_events: bool = True
    router_ttl_secs: float = 120.0
    router_max_tree_size: int = 2**20
    router_prune_target_ratio: float = 0.8
    router_predicted_ttl_secs: float | None = None
    router_index_max_blocks: int = 2**23
    # load model
    router_track_active_blocks: bool = True
    router_track_output_blocks: bool = False
    router_assume_kv_reuse: bool = True
    router_track_prefill_tokens: bool = True
    router_request_timeout_secs: float = 600.0
    # admission queue
    router_queue_threshold: float | None = 4.0
    router_queue_policy: QueuePolicy = "fcfs"
    router_queue_max_length: int = 10_000
    router_queue_refresh_secs: float = 1.0
    # busy filtering (None disables that test)
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None
    busy_retry_after_secs: float = 1.0
    # replicas and sessions
    router_replica_sync: bool = False
    router_session_timeout_secs: float = 300.0
    # limits on what one client can make the router hold (each refusal is a 4xx naming the field)
    router_session_id_max_len: int = 256
    router_session_timeout_max_secs: float = 86400.0
    router_max_sessions: int = 100_000
    router_max_sessions_per_client: int = 1_000
    router_max_pins_per_worker: int = 10_000
    load_aware: bool = False
    # agent features
    enable_cache_control: bool = False
    router_event_threads: int = 1

    def __post_init__(self) -> None:
        if self.load_aware:
            # The preset wins over individual flags, as in the reference.
            for name, value in _LOAD_AWARE.items():
                object.__setattr__(self, name, value)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the flag and its allowed range for the first bad value."""
        check_all(self, _FLAGS)
        if self.router_mode in ("round-robin", "random"):
            _refuse_cost_flags(self)
        if self.router_predicted_ttl_secs is not None and not self.use_kv_events:
            # Without events the approximate index already records every decision (for
            # --router-ttl-secs): a predict-on-route TTL would be accepted and change nothing.
            raise ConfigError(
                "--router-predicted-ttl-secs needs KV events; without them the approximate index "
                "already records each decision (set --router-ttl-secs instead)"
            )

    def with_overrides(self, **changes: Any) -> RouterConfig:
        """A copy with some fields changed (validated)."""
        unknown = set(changes) - _FIELD_NAMES
        if unknown:
            raise ConfigError(f"unknown router setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ sources
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
        """Add every routing flag to an argparse parser (or argument group)."""
        group = parser.add_argument_group("routing") if hasattr(parser, "add_argument_group") else parser
        add_table_arguments(group, _FLAGS)
        group.add_argument(
            "--router-kv-overlap-score-weight",
            "--kv-overlap-score-weight",
            dest="overlap_score_weight",
            default=None,
            type=str,
            metavar="W",
            help="deprecated: sets --router-prefill-load-scale to W (W=0 also sets the overlap credit to 0)",
        )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, *, base: RouterConfig | None = None) -> RouterConfig:
        """Build from parsed arguments; flags left unset keep ``base`` (or the defaults)."""
        raw = {spec.field: getattr(ns, spec.field, None) for spec in _FLAGS}
        raw["overlap_score_weight"] = getattr(ns, "overlap_score_weight", None)
        return cls._build({k: v for k, v in raw.items() if v is not None}, base, source="flag")

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, base: RouterConfig | None = None) -> RouterConfig:
        """Build from ``KVMESH_ROUTER_*`` variables; absent ones keep ``base`` (or the defaults)."""
        raw: dict[str, Any] = {}
        for spec in _FLAGS:
            if spec.env is not None and spec.env in environ:
                raw[spec.field] = environ[spec.env]
        for name in (ENV_PREFIX + "KV_OVERLAP_SCORE_WEIGHT",):
            if name in environ:
                raw["overlap_score_weight"] = environ[name]
        return cls._build(raw, base, source="env")

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], *, base: RouterConfig | None = None) -> RouterConfig:
        """Build from a TOML ``[router]`` table. Keys are field names or flag names
        (``router_temperature``, ``router-temperature`` and ``temperature`` all work)."""
        raw: dict[str, Any] = {}
        for key, value in table.items():
            field = _KEY_TO_FIELD.get(key.replace("-", "_").lower())
            if field is None:
                raise ConfigError(f"unknown router setting {key!r} in the [router] table")
            raw[field] = value
        return cls._build(raw, base, source="mapping")

    @classmethod
    def _build(cls, raw: dict[str, Any], base: RouterConfig | None, *, source: str) -> RouterConfig:
        values: dict[str, Any] = dataclasses.asdict(base) if base is not None else {}
        weight = raw.pop("overlap_score_weight", None)
        for field, value in raw.items():
            spec = _SPEC_BY_FIELD[field]
            values[field] = spec.coerce(value, _spelled(spec, source))
        if weight is not None:
            w = _WEIGHT.coerce(weight, _spelled(_WEIGHT, source))
            # The deprecated weight sets the scale (and a weight of 0 the credit): given beside
            # either in one source, one of the two would be dropped without a word.
            scale = raw.get("prefill_load_scale")
            if scale is not None and values["prefill_load_scale"] != w:
                raise ConfigError(
                    f"{_spelled(_WEIGHT, source)} {w:g} sets {_spelled(_SPEC_BY_FIELD['prefill_load_scale'], source)}, "
                    f"given as {values['prefill_load_scale']:g}: give one of them"
                )
            credit = raw.get("overlap_score_credit")
            if w == 0 and credit is not None and values["overlap_score_credit"] != 0:
                raise ConfigError(
                    f"{_spelled(_WEIGHT, source)} 0 means no overlap credit; it contradicts "
                    f"{_spelled(_SPEC_BY_FIELD['overlap_score_credit'], source)} "
                    f"{values['overlap_score_credit']:g}"
                )
            values["prefill_load_scale"] = w
            if w == 0:
                values["overlap_score_credit"] = 0.0
        return cls(**values)


def _refuse_cost_flags(config: RouterConfig) -> None:
    """Round-robin and random pick a worker without a cost or a prefix index: a cost or index flag
    given with them would be read and change nothing, so it is refused, naming it. (The load model,
    the busy thresholds, the queue and sessions still apply to them.)"""
    mode = config.router_mode
    if config.load_aware:
        given = ["--load-aware"]  # (the preset's own values are not the user's)
    else:
        given = [
            spec.name
            for spec in _FLAGS
            if spec.field in _KV_ONLY and getattr(config, spec.field) != spec.default
        ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: no effect with --router-mode {mode}, which picks workers without "
            "a cost or a prefix index (leave it out, or use --router-mode kv)"
        )


# ---------------------------------------------------------------------- flag table
_LOAD_AWARE: dict[str, Any] = {
    "overlap_score_credit": 0.0,
    "use_kv_events": False,
    "router_assume_kv_reuse": False,
    "router_track_active_blocks": True,
    "router_track_prefill_tokens": True,
}


def _flag(
    field: str,
    flag: str,
    kind: type,
    help: str,
    low: float | None = None,
    high: float | None = None,
    **more: Any,
) -> Setting:
    """A row whose variable and TOML keys follow from the flag (see the module docstring)."""
    env = ENV_PREFIX + flag[2:].removeprefix("router-").upper().replace("-", "_")
    short = flag[2:].replace("-", "_")
    aliases = (short, short.removeprefix("router_"))
    return Setting(field, flag, env, field, kind, help, low, high, key_aliases=aliases, **more)


# Deprecated: not a field of its own, it sets others (see the module docstring).
_WEIGHT = Setting(
    "overlap_score_weight",
    "--router-kv-overlap-score-weight",
    ENV_PREFIX + "KV_OVERLAP_SCORE_WEIGHT",
    "kv_overlap_score_weight",
    float,
    "",
    0.0,
    MAX_PREFILL_LOAD_SCALE,
)


def _spelled(spec: Setting, source: str) -> str:
    """How a setting is named in an error about a value from ``source``: the spelling it was given in."""
    if source == "env" and spec.env is not None:
        return spec.env
    if source == "mapping" and spec.key is not None:
        return f"[router] {spec.key}"
    return spec.name


def _dashed(value: str, name: str) -> str:
    return value.replace("_", "-")  # round_robin is round-robin


_FLAGS: tuple[Setting, ...] = (
    _flag(
        "router_mode",
        "--router-mode",
        str,
        "how to pick a worker: kv, round-robin, random or direct (round-robin and random have no "
        "cost or prefix index, and refuse their flags)",
        choices=ROUTER_MODES,
        metavar="MODE",
        convert=_dashed,
    ),
    _flag(
        "router_cost_model",
        "--router-cost-model",
        str,
        "latency: predicted time to first token per worker, from a timing model fitted online; "
        "dynamo: Dynamo's prefill blocks + decode blocks",
        choices=COST_MODELS,
        metavar="MODEL",
    ),
    _flag(
        "router_prefill_load_model",
        "--router-prefill-load-model",
        str,
        "none: a request's prefill tokens count in full until its first token; aic: the oldest "
        "active prefill on each worker decays over its predicted prefill duration (Dynamo's meaning). "
        "It sets the prefill tokens Dynamo's cost, the prefill busy thresholds and the queue see; "
        "the latency cost always predicts the rest of the prefill step running on each worker",
        choices=PREFILL_LOAD_MODELS,
        metavar="MODEL",
    ),
    _flag(
        "overlap_score_credit",
        "--router-kv-overlap-score-credit",
        float,
        "how much each cached device block reduces a worker's prefill cost",
        0.0,
        1.0,
    ),
    _flag(
        "prefill_load_scale",
        "--router-prefill-load-scale",
        float,
        "weight of prefill (blocks after credits; with the latency cost, predicted prefill time) "
        "against decode in the cost",
        0.0,
        MAX_PREFILL_LOAD_SCALE,
    ),
    _flag(
        "host_cache_hit_weight",
        "--router-host-cache-hit-weight",
        float,
        "credit for prefix blocks held in host (CPU) memory",
        0.0,
        1.0,
    ),
    _flag(
        "disk_cache_hit_weight",
        "--router-disk-cache-hit-weight",
        float,
        "credit for prefix blocks held on disk or external storage",
        0.0,
        1.0,
    ),
    _flag(
        "router_temperature",
        "--router-temperature",
        float,
        "softmax sampling temperature over normalised costs; 0 picks the cheapest worker",
        0.0,
    ),
    _flag(
        "router_background_copies",
        "--router-background-copies",
        bool,
        "latency cost at temperature 0: copy a hot shared prefix to one more worker by a prefill of "
        "the prefix alone "
        "(a token-id /v1/completions request of one token), sent to the worker the cost chose for "
        "the copy while the request that would have made it goes where it is fastest; "
        "--no-router-background-copies makes that request the copy",
    ),
    _flag(
        "use_kv_events",
        "--router-kv-events",
        bool,
        "follow workers' KV events; --no-router-kv-events predicts caches from routing decisions",
        aliases=("--kv-events",),
    ),
    _flag(
        "router_ttl_secs",
        "--router-ttl-secs",
        float,
        "lifetime of a routed block in the approximate index (no KV events)",
        0.0,
        low_open=True,
    ),
    _flag(
        "router_max_tree_size",
        "--router-max-tree-size",
        int,
        "approximate index size (blocks) that triggers pruning",
        1.0,
    ),
    _flag(
        "router_prune_target_ratio",
        "--router-prune-target-ratio",
        float,
        "fraction of --router-max-tree-size to prune down to",
        0.0,
        1.0,
        low_open=True,
    ),
    _flag(
        "router_predicted_ttl_secs",
        "--router-predicted-ttl-secs",
        float,
        "predict-on-route: remember each decision this long beside the event index (none = off)",
        0.0,
        low_open=True,
        optional=True,
    ),
    _flag(
        "router_index_max_blocks",
        "--router-index-max-blocks",
        int,
        "memory budget of the event-driven index in (block, worker) entries; oldest pruned first",
        1.0,
    ),
    _flag(
        "router_track_active_blocks",
        "--router-track-active-blocks",
        bool,
        "count blocks of in-flight requests as decode load",
        aliases=("--track-active-blocks",),
    ),
    _flag(
        "router_track_output_blocks",
        "--router-track-output-blocks",
        bool,
        "add generated-token blocks to decode load for requests without agent_hints.osl (a request "
        "with an osl counts its answer's blocks from dispatch either way, decayed by progress toward it)",
        aliases=("--track-output-blocks",),
    ),
    _flag(
        "router_assume_kv_reuse",
        "--router-assume-kv-reuse",
        bool,
        "deduplicate prefix blocks shared by in-flight requests on a worker",
        aliases=("--assume-kv-reuse",),
    ),
    _flag(
        "router_track_prefill_tokens",
        "--router-track-prefill-tokens",
        bool,
        "count prompt tokens of requests still in prefill as load",
    ),
    _flag(
        "router_request_timeout_secs",
        "--router-request-timeout-secs",
        float,
        "forget an in-flight request whose finish never arrived after this long idle",
        0.0,
        low_open=True,
    ),
    _flag(
        "router_queue_threshold",
        "--router-queue-threshold",
        float,
        "hold requests while every worker has active prefill tokens above this fraction of "
        "max_num_batched_tokens (none = never queue)",
        0.0,
        optional=True,
    ),
    _flag(
        "router_queue_policy",
        "--router-queue-policy",
        str,
        "order of the admission queue: fcfs, lcfs or wspt",
        choices=QUEUE_POLICIES,
        metavar="POLICY",
    ),
    _flag(
        "router_queue_max_length",
        "--router-queue-max-length",
        int,
        "waiting requests beyond this are refused with 'queue full'",
        1.0,
    ),
    _flag(
        "router_queue_refresh_secs",
        "--router-queue-refresh-secs",
        float,
        "a request that waited longer than this gets its cache overlap recomputed before dispatch",
        0.0,
    ),
    _flag(
        "active_decode_blocks_threshold",
        "--active-decode-blocks-threshold",
        float,
        "a worker is busy above this fraction of its KV blocks in use (none = off)",
        0.0,
        1.0,
        optional=True,
    ),
    _flag(
        "active_prefill_tokens_threshold",
        "--active-prefill-tokens-threshold",
        int,
        "a worker is busy above this many active prefill tokens (none = off)",
        0.0,
        optional=True,
    ),
    _flag(
        "active_prefill_tokens_threshold_frac",
        "--active-prefill-tokens-threshold-frac",
        float,
        "a worker is busy above this fraction of max_num_batched_tokens in prefill (none = off)",
        0.0,
        optional=True,
    ),
    _flag(
        "busy_retry_after_secs",
        "--router-busy-retry-after-secs",
        float,
        "Retry-After sent when every worker is busy or the queue is full",
        0.0,
    ),
    _flag(
        "router_replica_sync",
        "--router-replica-sync",
        bool,
        "share routing decisions with other router replicas so load views agree",
    ),
    _flag(
        "router_session_timeout_secs",
        "--router-session-timeout-secs",
        float,
        "default session affinity lifetime when a request gives none",
        0.0,
        low_open=True,
    ),
    _flag(
        "router_session_id_max_len",
        "--router-session-id-max-len",
        int,
        "longest nvext.session_control.session_id accepted (400 beyond)",
        1.0,
    ),
    _flag(
        "router_session_timeout_max_secs",
        "--router-session-timeout-max-secs",
        float,
        "largest nvext.session_control.timeout accepted (400 beyond)",
        0.0,
        low_open=True,
    ),
    _flag(
        "router_max_sessions",
        "--router-max-sessions",
        int,
        "live sessions the router holds in total; a new one beyond is refused (429)",
        1.0,
    ),
    _flag(
        "router_max_sessions_per_client",
        "--router-max-sessions-per-client",
        int,
        "live sessions one client address may hold; a new one beyond is refused (429)",
        1.0,
    ),
    _flag(
        "router_max_pins_per_worker",
        "--router-max-pins-per-worker",
        int,
        "live cache_control pins the router asks one worker to hold; a new one beyond is refused (429)",
        1.0,
    ),
    _flag(
        "load_aware",
        "--load-aware",
        bool,
        "preset: route on load only (no overlap credit, no KV events, no reuse assumption)",
    ),
    Setting(
        "enable_cache_control",
        "--enable-cache-control",
        "KVMESH_ROUTER_ENABLE_CACHE_CONTROL",
        "enable_cache_control",
        bool,
        "honour nvext.cache_control: pin each finished answer's prefix on its worker for the TTL "
        "(off: such requests get a 400)",
    ),
    _flag(
        "router_event_threads",
        "--router-event-threads",
        int,
        "threads applying KV events; kvmesh applies them on the router's event loop, so only 1",
        1.0,
        1.0,
    ),
)

_FLAGS = bind_defaults(RouterConfig, _FLAGS)
# What only the KV mode's cost and prefix index read.
_KV_ONLY = frozenset(
    (
        "router_cost_model",
        "overlap_score_credit",
        "prefill_load_scale",
        "host_cache_hit_weight",
        "disk_cache_hit_weight",
        "router_temperature",
        "router_background_copies",
        "use_kv_events",
        "router_ttl_secs",
        "router_max_tree_size",
        "router_prune_target_ratio",
        "router_predicted_ttl_secs",
        "router_index_max_blocks",
    )
)
_SPEC_BY_FIELD: dict[str, Setting] = {s.field: s for s in _FLAGS}
_FIELD_NAMES = frozenset(s.field for s in _FLAGS)
_KEY_TO_FIELD: dict[str, str] = {key: row.field for key, row in key_index(_FLAGS).items()}
_KEY_TO_FIELD["overlap_score_weight"] = "overlap_score_weight"
_KEY_TO_FIELD["router_kv_overlap_score_weight"] = "overlap_score_weight"
_KEY_TO_FIELD["kv_overlap_score_weight"] = "overlap_score_weight"
