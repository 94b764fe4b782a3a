"""Parse and validate a request's ``nvext`` extension and the routing override headers.

``nvext`` is a top-level object in an OpenAI request body (NVIDIA Dynamo's extension field)::

    {"backend_instance_id": str, "prefill_worker_id": str, "decode_worker_id": str,
     "extra_fields": ["worker_id", "timing"],
     "agent_hints": {"priority": int, "latency_sensitivity": float, "osl": int,
                     "speculative_prefill": bool, "kv_overlap_score_credit": float in [0, 1]},
     "session_control": {"session_id": str, "action": "open" | "close" | "bind", "timeout": float},
     "cache_control": {"type": "ephemeral", "ttl": "600" | "5m" | "1h"}}

The headers ``x-worker-instance-id`` and ``x-prefill-instance-id`` override the body's worker ids.
Every problem raises :class:`NvextError` whose message names the offending field, so the client
gets a 400 it can act on. Worker ids are only checked for shape here; whether they name a
registered worker is the registry's call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvmesh.errors import NvextError

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
_TTL_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class AgentHints:
    priority: int | None = None
    latency_sensitivity: float | None = None
    osl: int | None = None
    speculative_prefill: bool = False
    kv_overlap_score_credit: float | None = None


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
    # Other keys of Dynamo's nvext (sampling knobs, annotations) are not routing concerns: they are
    # ignored here and stripped with the rest of nvext before the engine sees the body.
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
    )


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
    priority = value.get("priority")
    sensitivity = value.get("latency_sensitivity")
    osl = value.get("osl")
    speculative = value.get("speculative_prefill", False)
    credit = value.get("kv_overlap_score_credit")
    if not isinstance(speculative, bool):
        raise NvextError(f"{f}speculative_prefill must be a boolean", field=f + "speculative_prefill")
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
    )


def _session_control(value: Any, limits: NvextLimits) -> SessionControl | None:
    if value is None:
        return None
    f = "nvext.session_control."
    if not isinstance(value, dict):
        raise NvextError("nvext.session_control must be an object", field="nvext.session_control")
    session_id = value.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        raise NvextError(f"{f}session_id must be a non-empty string", field=f + "session_id")
    if len(session_id) > limits.session_id_max_len:
        raise NvextError(
            f"{f}session_id is longer than {limits.session_id_max_len} characters", field=f + "session_id"
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
