"""What a plain engine (vLLM or SGLang with no kvmesh plugin or adapter, so no ``/kvmesh/info``)
says of itself on its own routes, so that a router given only its URL can follow its KV events.

vLLM 0.33 serves, with or without kvmesh:

* ``GET /kv_event_sources``: its KV-event publisher per data-parallel rank, as the engine cores
  resolved it (``{"0": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": ...}}``;
  each rank's ports already offset by its rank). An engine started without
  ``--kv-events-config`` answers ``{}``.
* ``GET /metrics``: the gauge ``vllm:cache_config_info``, whose labels are the cache config's
  fields, ``block_size`` and ``num_gpu_blocks`` among them (one series per engine core).

From these the router learns the block size, the DP ranks and their event and replay endpoints,
and the blocks each rank's cache holds. What vLLM shows nowhere stays the router's default unless
the worker's config entry gives it: ``max_num_batched_tokens`` (chunked prefill is then not
modelled) and ``priority_polarity`` (a plain vLLM's priority is sent as the client gave it). The
served model is the first ``/v1/models`` entry that is no LoRA adapter.

SGLang 0.5.23 serves ``GET /server_info``: its resolved server arguments, its scheduler's facts
and ``kv_events``, the description of its publisher that SGLang writes for KV-aware routers
(``{"publisher", "endpoint_host", "endpoint_port_base", "topic", "block_size", "dp_size",
"replay_endpoint_port_base"}``; rank r publishes on the base port + r; null without
``--kv-events-config``). The rest comes from the same answer as kvmesh's SGLang adapter reads it:
the blocks a rank holds (``max_total_num_tokens`` over the block size), the prefill chunk
(``chunked_prefill_size``, else ``max_prefill_tokens``), the priority order
(``enable_priority_scheduling``, ``schedule_low_priority_values_first``) and the served model.

An endpoint bound to every interface (``tcp://*:5557``, ``0.0.0.0``, ``::``) is dialled at the
worker URL's host.

A stock trtllm-serve describes no publisher: its KV events are a queue that ``POST
/kv_cache_events`` drains, so two readers would each get half. Its refusal says to run ``kvmesh
events trtllm URL`` (the one reader, publishing kvmesh's ZMQ wire) and give the entry what it prints.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvmesh.events.endpoint import bound_to_every_interface
from kvmesh.router.mesh.engine_load import series_labels

SOURCES_PATH = "/kv_event_sources"
SERVER_INFO_PATH = "/server_info"
TRTLLM_EVENTS_PATH = "/kv_cache_events"
"""trtllm-serve's ``POST`` route that drains the engine's KV-event queue: asked with ``GET``, it
answers 405, which tells a trtllm-serve without drawing from its queue."""
CACHE_INFO = b"vllm:cache_config_info"
_MAX_RANKS = 1024
"""DP ranks one server may report: more is a broken answer, not a fleet."""
_MAX_BLOCKS = 1 << 40


class NotDiscovered(Exception):
    """The worker's own routes do not describe it well enough to follow; the message says what
    is missing and how to give it."""


class NoRoutes(NotDiscovered):
    """The worker has neither engine's route, or one failed: it must be described by hand."""


Get = Callable[[str], Awaitable[tuple[int, bytes]]]
"""A whole GET of one of the engine's paths: (status, body), or (0, why) when nothing answered."""


async def read_stock_engine(get: Get, url: str) -> tuple[dict[str, Any], str]:
    """(the facts, the route they came from) of the engine at ``url``, which has no
    ``/kvmesh/info``: vLLM's ``/kv_event_sources`` (with ``/metrics`` and ``/v1/models``), else,
    on its 404, SGLang's ``/server_info``. NoRoutes when neither answers, NotDiscovered naming the
    engine when its answer describes nothing a router can follow. Shared by the router's registry
    and the event tools, which read over their own transports."""
    status, body = await get(SOURCES_PATH)
    if status == 200:
        metrics_status, metrics = await get("/metrics")
        models_status, models = await get("/v1/models")
        try:
            facts = described_vllm(
                _json(SOURCES_PATH, body),
                metrics if metrics_status == 200 else b"",
                url,
                _json("/v1/models", models) if models_status == 200 else None,
            )
        except NotDiscovered as e:
            raise NotDiscovered(f"a vLLM without kvmesh's plugin that {e}") from None
        return facts, SOURCES_PATH
    if status != 404:
        raise NoRoutes(f"vLLM's {SOURCES_PATH} {_failed(status, body)}")
    status, body = await get(SERVER_INFO_PATH)
    if status != 200:
        if status == 404 and (await get(TRTLLM_EVENTS_PATH))[0] == 405:
            raise NoRoutes(
                f"no {SOURCES_PATH} (vLLM's) or {SERVER_INFO_PATH} (SGLang's); a trtllm-serve (it has "
                f"POST {TRTLLM_EVENTS_PATH}), whose events a router cannot share: run "
                f"`kvmesh events trtllm {url}` beside it and give this entry the kv_events_endpoints "
                "and block_size it prints"
            )
        raise NoRoutes(f"no {SOURCES_PATH} (vLLM's), and SGLang's {SERVER_INFO_PATH} {_failed(status, body)}")
    try:
        return described_sglang(_json(SERVER_INFO_PATH, body), url), SERVER_INFO_PATH
    except NotDiscovered as e:
        raise NotDiscovered(f"an SGLang without kvmesh's adapter that {e}") from None


def _json(path: str, body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise NotDiscovered(f"answers {path} with no JSON") from None


def _failed(status: int, body: bytes) -> str:
    return f"answered HTTP {status}" if status else f"got no answer ({body.decode('utf-8', 'replace')})"


def described_vllm(sources: Any, metrics: bytes, url: str, models: Any = None) -> dict[str, Any]:
    """The facts of a worker's ``/kvmesh/info`` that a plain vLLM's ``/kv_event_sources`` answer
    ``sources``, its ``/metrics`` page and its ``/v1/models`` answer give (the module docstring);
    NotDiscovered when it publishes no KV events a router can dial."""
    ranks = _ranks(sources)
    if not ranks:
        raise NotDiscovered(
            "publishes no KV events (its /kv_event_sources is empty): start vLLM with "
            '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", '
            '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\', or run the router '
            "with --no-router-kv-events (it then predicts caches from its own routing)"
        )
    host = _url_host(url)
    facts: dict[str, Any] = {
        "backend": "vllm",
        "dp_size": len(ranks),
        "kv_events_endpoints": [_dialable(source["endpoint"], host) for _, source in ranks],
        "kv_replay_endpoints": [
            _dialable(source["replay_endpoint"], host) if source.get("replay_endpoint") else None
            for _, source in ranks
        ],
    }
    cache = cache_config(metrics)
    if "block_size" in cache:
        facts["block_size"] = cache["block_size"]
    if "num_gpu_blocks" in cache:
        facts["total_kv_blocks"] = cache["num_gpu_blocks"]
    model = _served_model(models)
    if model is not None:
        facts["model"] = model
    return facts


def described_sglang(server_info: Any, url: str) -> dict[str, Any]:
    """The facts of a worker's ``/kvmesh/info`` that a plain SGLang's ``/server_info`` answer gives
    (see the module docstring); NotDiscovered when it publishes no KV events a router can dial."""
    if not isinstance(server_info, dict):
        raise NotDiscovered(f"{SERVER_INFO_PATH} is not SGLang's answer (an object)")
    events = server_info.get("kv_events")
    if events is None:
        raise NotDiscovered(
            f"publishes no KV events ({SERVER_INFO_PATH} has no kv_events): start SGLang with "
            '--kv-events-config \'{"publisher": "zmq", "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5567"}\', or run the router with --no-router-kv-events '
            "(it then predicts caches from its own routing)"
        )
    if not isinstance(events, dict):
        raise NotDiscovered(f"{SERVER_INFO_PATH} is not SGLang's answer (kv_events)")
    block_size = _count(events, "block_size")
    dp_size = _count(events, "dp_size", _MAX_RANKS)
    base = _count(events, "endpoint_port_base", 65535)
    replay = events.get("replay_endpoint_port_base")
    if replay is not None:
        replay = _count(events, "replay_endpoint_port_base", 65535)
    if events.get("publisher") != "zmq" or base + dp_size > 65536 or (replay or 0) + dp_size > 65536:
        raise NotDiscovered(f"{SERVER_INFO_PATH} describes a publisher kvmesh cannot dial: {events!r:.200}")
    bound = events.get("endpoint_host")
    if not isinstance(bound, str) or not bound:
        bound = "*"  # (SGLang writes the host it binds; none given is read as every interface)
    elif ":" in bound and not bound.startswith("["):
        bound = f"[{bound}]"  # (SGLang writes an IPv6 host bare: "::")
    host = _url_host(url)
    facts: dict[str, Any] = {
        "backend": "sglang",
        "block_size": block_size,
        "dp_size": dp_size,
        "kv_events_endpoints": [_dialable(f"tcp://{bound}:{base + r}", host) for r in range(dp_size)],
        "kv_replay_endpoints": [
            None if replay is None else _dialable(f"tcp://{bound}:{replay + r}", host) for r in range(dp_size)
        ],
        "priority_polarity": _sglang_polarity(server_info),
    }
    tokens = _positive(server_info.get("max_total_num_tokens"))
    if tokens is not None and tokens // block_size > 0:
        facts["total_kv_blocks"] = tokens // block_size
    for name in ("chunked_prefill_size", "max_prefill_tokens"):
        chunk = _positive(server_info.get(name))
        if chunk is not None:
            facts["max_num_batched_tokens"] = chunk
            break
    for name in ("served_model_name", "model_path"):
        model = server_info.get(name)
        if isinstance(model, str) and model:
            facts["model"] = model
            break
    return facts


def _sglang_polarity(server_info: dict[str, Any]) -> str:
    """SGLang's priority order, as kvmesh's SGLang adapter reports it."""
    if server_info.get("enable_priority_scheduling") is not True:
        return "none"
    return "lower_first" if server_info.get("schedule_low_priority_values_first") is True else "higher_first"


def _count(fields: dict[str, Any], name: str, most: int = _MAX_BLOCKS) -> int:
    value = _positive(fields.get(name))
    if value is None or value > most:
        raise NotDiscovered(
            f"{SERVER_INFO_PATH} is not SGLang's answer (kv_events.{name}: {fields.get(name)!r:.40})"
        )
    return value


def _positive(value: Any) -> int | None:
    """``value`` when it is a positive integer below :data:`_MAX_BLOCKS` (no bool), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _MAX_BLOCKS:
        return value
    return None


def _url_host(url: str) -> str:
    """The worker URL's host, as an endpoint writes it (an IPv6 address in brackets)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def cache_config(metrics: bytes) -> dict[str, int]:
    """``block_size`` and ``num_gpu_blocks`` of the first ``vllm:cache_config_info`` series of a
    Prometheus text page that gives them as positive integers ({} when none does: metrics
    disabled, or an engine still profiling its memory, whose block count is ``None``)."""
    found: dict[str, int] = {}
    for line in metrics.splitlines():
        if not line.startswith(CACHE_INFO + b"{"):
            continue
        labels = series_labels(line[len(CACHE_INFO) + 1 : line.rfind(b"}")])
        for name in ("block_size", "num_gpu_blocks"):
            value = labels.get(name.encode(), b"")
            if name not in found and value.isdigit() and 0 < int(value) < _MAX_BLOCKS:
                found[name] = int(value)
        if len(found) == 2:
            break
    return found


def _ranks(sources: Any) -> list[tuple[int, dict[str, Any]]]:
    """The ranks of a ``/kv_event_sources`` answer that publish on ZMQ, by rank; NotDiscovered for
    an answer vLLM does not give."""
    if not isinstance(sources, dict) or len(sources) > _MAX_RANKS:
        raise NotDiscovered(f"{SOURCES_PATH} is not vLLM's answer (an object of DP ranks)")
    ranks = []
    for key, source in sources.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(source, dict)):
            raise NotDiscovered(f"{SOURCES_PATH} is not vLLM's answer (rank {key!r})")
        endpoint = source.get("endpoint")
        if source.get("publisher") != "zmq" or not isinstance(endpoint, str):
            continue  # (a rank with the null publisher, or a custom one kvmesh cannot dial)
        replay = source.get("replay_endpoint")
        if replay is not None and not isinstance(replay, str):
            raise NotDiscovered(f"{SOURCES_PATH} is not vLLM's answer (rank {key}'s replay_endpoint)")
        ranks.append((int(key), source))
    return sorted(ranks, key=lambda pair: pair[0])


def _dialable(endpoint: str, host: str) -> str:
    """A rank's endpoint as this router dials it (a bind to every interface: the worker's host);
    NotDiscovered for a loopback bind of a worker on another host, which this router would dial
    on its own host and hear nothing from."""
    if bound_to_every_interface(endpoint):
        return f"tcp://{host}:{endpoint.rpartition(':')[2]}"
    if _is_loopback(endpoint.removeprefix("tcp://").rpartition(":")[0]) and not _is_loopback(host):
        raise NotDiscovered(
            f"publishes its KV events on {endpoint}, a loopback address: a router on another host "
            "cannot reach it; bind the publisher to every interface (tcp://*:PORT)"
        )
    return endpoint


def _is_loopback(host: str) -> bool:
    name = host.strip("[]").lower()
    return name == "localhost" or name == "::1" or name.startswith("127.")


def _served_model(models: Any) -> str | None:
    """The first ``/v1/models`` entry with no parent (vLLM lists its LoRA adapters with one)."""
    data = models.get("data") if isinstance(models, dict) else None
    for card in data if isinstance(data, list) else ():
        if (
            isinstance(card, dict)
            and isinstance(card.get("id"), str)
            and card["id"]
            and not card.get("parent")
        ):
            return str(card["id"])
    return None


__all__ = [
    "CACHE_INFO",
    "SERVER_INFO_PATH",
    "SOURCES_PATH",
    "Get",
    "NoRoutes",
    "NotDiscovered",
    "cache_config",
    "described_sglang",
    "described_vllm",
    "read_stock_engine",
]
