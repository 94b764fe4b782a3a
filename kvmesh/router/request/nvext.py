"""Parse and validate a request's ``nvext`` extension and the routing override headers.

``nvext`` is a top-level object in an OpenAI request body (NVIDIA Dynamo's extension field)::

    {"backend_instance_id": str, "prefill_worker_id": str, "decode_worker_id": str,
     "extra_fields": ["worker_id", "timing"],
     "agent_hints": {"priority": int, "latency_sensitivity": float, "osl": int,
                     "speculative_prefill": bool, "kv_overlap_score_credit": float in [0, 1],
                     "kv_overlap_score_weight": float in [0, 1e6] (older name, mapped as the reference maps it)},
     "session_control": {"session_id": str, "action": "open" | "close" | "bind", "timeout": float},
     "cache_control": {"type": "ephemeral", "ttl": "600" | "5m" | "1h"},
     "greed_sampling": bool, "use_raw_prompt": bool, "annotations": ["token_ids" | "formatted_prompt"],
     "token_data": [int, ...], "max_thinking_tokens": int,
     "ignore_eos": bool, "top_k": int, "repetition_penalty": float}

The headers ``x-worker-instance-id`` and ``x-prefill-instance-id`` override the body's worker ids.
Every problem raises :class:`NvextError` whose message names the offending field, so the client
gets a 400 it can act on; that includes a field kvmesh does not know (a field accepted and then
ignored would let a client believe it took effect). Worker ids are only checked for shape here;
whether they name a registered worker is the registry's call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvmesh._http import HEADER_SAFE_RULE, header_safe
from kvmesh.errors import NvextError
from kvmesh.hashing import MAX_TOKEN_ID
from kvmesh.router.core.config import MAX_PREFILL_LOAD_SCALE

WORKER_HEADER = "x-worker-instance-id"
PREFILL_HEADER = "x-prefill-instance-id"

CACHE_TTL_MIN = 300.0
CACHE_TTL_MAX = 3600.0
# Integer hints reach the engine (priority) and float arithmetic (queue keys, output decay): a
# 32-bit range is what engines schedule with, and every value in it converts to a float exactly.
INT_HINT_MIN = -(2**31)
INT_HINT_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class NvextLimits:
    """Bounds on what a client may ask for (the router's flags set them; see RouterConfig)."""

    session_id_max_len: int = 256
    session_timeout_max: float = 86400.0


DEFAULT_LIMITS = NvextLimits()

SessionAction = Literal["open", "close", "bind"]
_ACTIONS: frozenset[str] = frozenset(("open", "close", "bind"))
_EXTRA_FIELDS: frozenset[str] = frozenset(("worker_id", "timing"))
ANNOTATIONS: frozenset[str] = frozenset(("token_ids", "formatted_prompt"))
_NVEXT_KEYS: frozenset[str] = frozenset(
    (
        "backend_instance_id",
        "prefill_worker_id",
        "decode_worker_id",
        "extra_fields",
        "agent_hints",
        "session_control",
        "cache_control",
        "greed_sampling",
        "use_raw_prompt",
        "annotations",
        "token_data",
        "max_thinking_tokens",
        *("ignore_eos", "top_k", "repetition_penalty"),
    )
)
# Sampling knobs of the reference's nvext that engines take under the same top-level name.
SAMPLING_KEYS: tuple[str, ...] = ("ignore_eos", "top_k", "repetition_penalty")
_HINT_KEYS: frozenset[str] = frozenset(
    (
        "priority",
        "latency_sensitivity",
        "osl",
        "speculative_prefill",
        "kv_overlap_score_credit",
        "kv_overlap_score_weight",
    )
)
_SESSION_KEYS: frozenset[str] = frozenset(("session_id", "action", "timeout"))
_CACHE_KEYS: frozenset[str] = frozenset(("type", "ttl"))
_TTL_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class AgentHints:
    priority: int | None = None
    latency_sensitivity: float | None = None
    osl: int | None = None
    speculative_prefill: bool = False
    kv_overlap_score_credit: float | None = None
    prefill_load_scale: float | None = None
    """From the older ``kv_overlap_score_weight``: the reference maps a weight W to a prefill load
    scale of W (and W = 0 to an overlap credit of 0 as well)."""


@dataclass(frozen=True, slots=True)
class SessionControl:
    session_id: str
    action: SessionAction
    timeout: float | None = None
    """Seconds; None when the client gave none: the router's --router-session-timeout-secs applies."""


@dataclass(frozen=True, slots=True)
class Nvext:
    """The validated routing extension of one request (all fields optional)."""

    backend_instance_id: str | None = None
    prefill_worker_id: str | None = None
    decode_worker_id: str | None = None
    want_worker_id: bool = False
    want_timing: bool = False
    hints: AgentHints = AgentHints()
    session: SessionControl | None = None
    cache_ttl: float | None = None  # seconds, already clamped to [300, 3600]
    greedy: bool = False
    use_raw_prompt: bool = False
    annotations: tuple[str, ...] = ()
    token_data: tuple[int, ...] | None = None
    """A pre-tokenized prompt: the router hashes these ids and never tokenizes the body."""
    max_thinking_tokens: int | None = None
    sampling: tuple[tuple[str, Any], ...] = ()
    """``ignore_eos`` / ``top_k`` / ``repetition_penalty``: forwarded as the engine's own fields."""

    @property
    def pinned_worker(self) -> str | None:
        """The worker the client asked for, if any (the decode worker when both are named)."""
        return self.backend_instance_id or self.decode_worker_id or self.prefill_worker_id

    @property
    def wants_echo(self) -> bool:
        return self.want_worker_id or self.want_timing


EMPTY = Nvext()


def parse_nvext(
    body: Mapping[str, Any], headers: Mapping[str, str] | None = None, limits: NvextLimits = DEFAULT_LIMITS
) -> Nvext:
    """Validate ``body["nvext"]`` and the override headers; raise NvextError naming the field."""
    raw = body.get("nvext")
    header_worker = _header_id(headers, WORKER_HEADER)
    header_prefill = _header_id(headers, PREFILL_HEADER)
    if raw is None:
        if header_worker is None and header_prefill is None:
            return EMPTY
        return Nvext(backend_instance_id=header_worker, prefill_worker_id=header_prefill)
    if not isinstance(raw, dict):
        raise NvextError("nvext must be an object", field="nvext")
    _known_keys(raw, _NVEXT_KEYS, "nvext.")
    want_worker_id, want_timing = _extra_fields(raw.get("extra_fields"))
    return Nvext(
        backend_instance_id=header_worker or _worker_id(raw, "backend_instance_id"),
        prefill_worker_id=header_prefill or _worker_id(raw, "prefill_worker_id"),
        decode_worker_id=_worker_id(raw, "decode_worker_id"),
        want_worker_id=want_worker_id,
        want_timing=want_timing,
        hints=_agent_hints(raw.get("agent_hints")),
        session=_session_control(raw.get("session_control"), limits),
        cache_ttl=_cache_control(raw.get("cache_control")),
        greedy=_flag(raw, "greed_sampling"),
        use_raw_prompt=_flag(raw, "use_raw_prompt"),
        annotations=_annotations(raw.get("annotations")),
        token_data=_token_data(raw.get("token_data")),
        max_thinking_tokens=None
        if raw.get("max_thinking_tokens") is None
        else _integer(raw["max_thinking_tokens"], "nvext.max_thinking_tokens", lo=0),
        sampling=_sampling(raw),
    )


def _sampling(raw: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    out: list[tuple[str, Any]] = []
    if raw.get("ignore_eos") is not None:
        out.append(("ignore_eos", _flag(raw, "ignore_eos")))
    if raw.get("top_k") is not None:
        out.append(("top_k", _integer(raw["top_k"], "nvext.top_k", lo=-1)))
    if raw.get("repetition_penalty") is not None:
        penalty = _number(raw["repetition_penalty"], "nvext.repetition_penalty", lo=0.0)
        if penalty == 0.0:
            raise NvextError("nvext.repetition_penalty must be > 0", field="nvext.repetition_penalty")
        out.append(("repetition_penalty", penalty))
    return tuple(out)


def _known_keys(raw: Mapping[str, Any], known: frozenset[str], prefix: str) -> None:
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        field = prefix + str(unknown[0])
        raise NvextError(
            f"{field} is not a field kvmesh knows (known: {', '.join(sorted(known))})", field=field
        )


def _flag(raw: Mapping[str, Any], key: str) -> bool:
    value = raw.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise NvextError(f"nvext.{key} must be a boolean", field=f"nvext.{key}")
    return value


def _annotations(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    field = "nvext.annotations"
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NvextError(f"{field} must be a list of strings", field=field)
    unknown = sorted(set(value) - ANNOTATIONS)
    if unknown:
        raise NvextError(
            f"{field}: unknown annotation {unknown[0]!r} (known: {', '.join(sorted(ANNOTATIONS))})",
            field=field,
        )
    return tuple(dict.fromkeys(value))


def _token_data(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    field = "nvext.token_data"
    if (
        not isinstance(value, list)
        or not value
        or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)
    ):
        raise NvextError(f"{field} must be a non-empty list of token ids in [0, 2**32)", field=field)
    return tuple(value)


def _header_id(headers: Mapping[str, str] | None, name: str) -> str | None:
    if headers is None:
        return None
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    if not value:
        raise NvextError(f"header {name} must not be empty", field=name)
    return value


def _worker_id(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    # Dynamo's ids are integers; kvmesh's are strings (a URL by default). Accept both shapes.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise NvextError(f"nvext.{key} must be a string or an integer", field=f"nvext.{key}")
    text = str(value).strip()
    if not text:
        raise NvextError(f"nvext.{key} must not be empty", field=f"nvext.{key}")
    return text


def _extra_fields(value: Any) -> tuple[bool, bool]:
    if value is None:
        return False, False
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NvextError("nvext.extra_fields must be a list of strings", field="nvext.extra_fields")
    unknown = set(value) - _EXTRA_FIELDS
    if unknown:
        raise NvextError(
            f"nvext.extra_fields: unknown field {sorted(unknown)[0]!r} (known: timing, worker_id)",
            field="nvext.extra_fields",
        )
    return "worker_id" in value, "timing" in value


def _number(value: Any, field: str, *, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise NvextError(f"{field} must be a finite number", field=field)
    try:
        number = float(value)  # a JSON integer literal may exceed every float
    except OverflowError:
        raise NvextError(f"{field} must be a finite number", field=field) from None
    if not math.isfinite(number):
        raise NvextError(f"{field} must be a finite number", field=field)
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise NvextError(f"{field} must be in {bounds}, got {number:g}", field=field)
    return number


def _integer(value: Any, field: str, *, lo: int = INT_HINT_MIN, hi: int = INT_HINT_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise NvextError(f"{field} must be an integer", field=field)
    if not lo <= value <= hi:
        shown = value if abs(value) < 10**30 else f"an integer of {value.bit_length()} bits"
        raise NvextError(f"{field} must be in [{lo}, {hi}], got {shown}", field=field)
    return value


def _agent_hints(value: Any) -> AgentHints:
    if value is None:
        return AgentHints()
    if not isinstance(value, dict):
        raise NvextError("nvext.agent_hints must be an object", field="nvext.agent_hints")
    f = "nvext.agent_hints."
    _known_keys(value, _HINT_KEYS, f)
    priority = value.get("priority")
    sensitivity = value.get("latency_sensitivity")
    osl = value.get("osl")
    speculative = value.get("speculative_prefill", False)
    credit = value.get("kv_overlap_score_credit")
    if not isinstance(speculative, bool):
        raise NvextError(f"{f}speculative_prefill must be a boolean", field=f + "speculative_prefill")
    weight = value.get("kv_overlap_score_weight")
    scale = (
        None
        if weight is None
        else _number(weight, f + "kv_overlap_score_weight", lo=0.0, hi=MAX_PREFILL_LOAD_SCALE)
    )
    if scale == 0.0:
        if credit not in (None, 0, 0.0):
            raise NvextError(
                f"{f}kv_overlap_score_weight 0 means no overlap credit; it contradicts "
                f"{f}kv_overlap_score_credit",
                field=f + "kv_overlap_score_weight",
            )
        credit = 0.0
    return AgentHints(
        priority=None if priority is None else _integer(priority, f + "priority"),
        latency_sensitivity=None
        if sensitivity is None
        else _number(sensitivity, f + "latency_sensitivity", lo=0.0),
        osl=None if osl is None else _integer(osl, f + "osl", lo=1),
        speculative_prefill=speculative,
        kv_overlap_score_credit=None
        if credit is None
        else _number(credit, f + "kv_overlap_score_credit", lo=0.0, hi=1.0),
        prefill_load_scale=scale,
    )


def _session_control(value: Any, limits: NvextLimits) -> SessionControl | None:
    if value is None:
        return None
    f = "nvext.session_control."
    if not isinstance(value, dict):
        raise NvextError("nvext.session_control must be an object", field="nvext.session_control")
    _known_keys(value, _SESSION_KEYS, f)
    session_id = value.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        raise NvextError(f"{f}session_id must be a non-empty string", field=f + "session_id")
    if len(session_id) > limits.session_id_max_len:
        raise NvextError(
            f"{f}session_id is longer than {limits.session_id_max_len} characters", field=f + "session_id"
        )
    if not header_safe(session_id):  # (what went wrong before: the function's docstring)
        raise NvextError(
            f"{f}session_id must be {HEADER_SAFE_RULE} (the engine receives it as the X-Session-ID header)",
            field=f + "session_id",
        )
    action = value.get("action", "bind")
    if not isinstance(action, str) or action not in _ACTIONS:
        shown = (
            repr(action) if isinstance(action, str) and len(action) <= 64 else f"a {type(action).__name__}"
        )
        raise NvextError(f"{f}action must be one of open, close, bind; got {shown}", field=f + "action")
    timeout = value.get("timeout")
    return SessionControl(
        session_id=session_id,
        action=action,  # type: ignore[arg-type]  # checked against _ACTIONS just above
        timeout=None
        if timeout is None
        else _number(timeout, f + "timeout", lo=0.001, hi=limits.session_timeout_max),
    )


def _cache_control(value: Any) -> float | None:
    if value is None:
        return None
    f = "nvext.cache_control."
    if not isinstance(value, dict):
        raise NvextError("nvext.cache_control must be an object", field="nvext.cache_control")
    _known_keys(value, _CACHE_KEYS, f)
    kind = value.get("type", "ephemeral")
    if kind != "ephemeral":
        raise NvextError(f"{f}type must be 'ephemeral', got {kind!r}", field=f + "type")
    ttl = value.get("ttl", "5m")
    return min(max(parse_ttl(ttl, f + "ttl"), CACHE_TTL_MIN), CACHE_TTL_MAX)


def parse_ttl(value: Any, field: str) -> float:
    """``600`` / ``"600"`` (seconds), ``"5m"``, ``"1h"``, ``"30s"`` -> seconds."""
    if isinstance(value, bool):
        raise NvextError(f"{field} must be seconds or a duration like '5m' or '1h'", field=field)
    if isinstance(value, (int, float)):
        return _number(value, field, lo=0.0)
    if isinstance(value, str):
        text = value.strip().lower()
        scale = _TTL_UNITS.get(text[-1:])
        digits = text[:-1] if scale is not None else text
        try:
            seconds = float(digits) * (scale or 1.0)
        except ValueError:
            pass
        else:
            if math.isfinite(seconds) and seconds >= 0:
                return seconds
    raise NvextError(f"{field} must be seconds or a duration like '5m' or '1h', got {value!r}", field=field)


def strip_nvext(body: dict[str, Any]) -> dict[str, Any]:
    """The body an engine should see: without ``nvext`` (engines may reject unknown fields)."""
    if "nvext" not in body:
        return body
    return {k: v for k, v in body.items() if k != "nvext"}


def write_sampling(params: dict[str, Any], sampling: tuple[tuple[str, Any], ...], greedy: bool) -> None:
    """Write ``nvext``'s sampling fields into ``params`` (a body, or its ``sampling_params``), and
    the reference's greedy sampling over whatever the body asked for: temperature 0, top-k 1, no
    top-p."""
    params.update(sampling)
    if greedy:
        params["temperature"] = 0.0
        params["top_k"] = 1
        params.pop("top_p", None)
