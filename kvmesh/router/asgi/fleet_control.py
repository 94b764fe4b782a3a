"""The standalone router's engine controls for a training loop, applied to the whole fleet at once:
pause and resume generation, put the engines to sleep and wake them, read whether they are.

A reinforcement-learning loop that samples through the router pauses every engine before it loads
new weights, and resumes them after; it has one address for the fleet. Before, the router answered
404 for each of these paths, and the loop had to find and call every engine itself.

Paths, as the installed engines route them:

* vLLM 0.33, whose server has them with ``VLLM_SERVER_DEV_MODE=1``: ``POST /pause`` (query ``mode``
  abort, wait or keep, and ``clear_cache``), ``/resume``, ``/sleep`` (query ``level``, ``mode``),
  ``/wake_up`` (query ``tags``), ``/release_kv_cache_memory``, ``/update_weight_version``;
  ``GET /is_paused``, ``/is_sleeping``, ``/weight_info``.
* SGLang 0.5.23: ``POST /pause_generation`` (body ``mode``), ``/continue_generation``,
  ``/update_weights_from_disk``, ``/update_weight_version``, ``/begin_weight_update``,
  ``/end_weight_update`` (around a load of in-place-quantized weights); GET or POST
  ``/release_memory_occupation``, ``/resume_memory_occupation``.
* vLLM's resets of its multimodal input cache and its encoder cache (``POST /reset_mm_cache``,
  ``/reset_encoder_cache``, with ``VLLM_SERVER_DEV_MODE=1``): a benchmark or a loop that changes
  its images resets every engine's. (Its prefix cache reset, ``/reset_prefix_cache``, is
  :mod:`.flush`'s.)
* The profilers of both: ``/start_profile`` and ``/stop_profile`` (vLLM's a POST, served with a
  profiler configured; SGLang's GET or POST), so one call profiles the whole fleet; SGLang's
  recorder of expert use (``/start_expert_distribution_record``, ``/stop_...``, ``/dump_...``).
* Reads an RL loop compares across the fleet after a weight update: vLLM's ``POST
  /weight_checker`` (checksums, or a ``compare`` whose ``match`` is true only when every engine
  matched) and ``GET /get_world_size``; SGLang's ``/get_weights_by_name`` and ``/weights_checker``.
  Each worker's answer is under ``workers``.
* SGLang's run-time settings: ``/set_internal_state`` (POST or PUT), ``/configure_logging``,
  ``/set_trace_level``, ``/slow_down``, ``/freeze_gc``; its hierarchical cache's storage backend
  (``/hicache/storage-backend``: GET, PUT to attach, DELETE to detach; ``POST .../clear``); and
  the external corpora of its n-gram speculative decoding (``POST /add_external_corpus``,
  ``/remove_external_corpus``, ``GET /list_external_corpora``). A corpus added without a
  ``corpus_id`` is given one by the router, so that every engine holds it under the same id and
  one ``/remove_external_corpus`` removes it from the fleet (each engine would have drawn its own).
* LoRA adapters loaded and unloaded at run time: vLLM's ``POST /v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` (served with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), SGLang's
  ``POST /load_lora_adapter`` and ``/unload_lora_adapter``. A worker that did it has its adapters
  read again at once, so the adapter's requests are routed to it (and no longer to one that
  unloaded it) from the answer on, not from a later health check.

Each request goes to every up worker at once, as the client sent it: its method, query string and
body, and its ``authorization`` unless that is the router's admin token. The router waits for every
answer. A client that leaves does not stop the others: a fleet left half paused is worse than an
answer nobody reads. With an admin token set, the token is required, as on ``/flush_cache``.

The answer:

* every worker answered 2xx: 200 with the answer they share, plus ``workers`` (worker id: its
  answer). Where their answers differ, a yes/no field (``is_paused``, ``is_sleeping``,
  ``success``, ``match``) is true only when it is true on every worker (a loop that waits for
  "paused" waits for the whole fleet), and any other field is null (the fleet has no one value);
* every worker refused with the same 4xx (the client's mistake, such as a ``mode`` the engines do
  not know): that status, with the first worker's answer, which names the field;
* otherwise 502, listing ``succeeded`` and ``failed`` (worker id: why); 503 when no worker is up.

Only the workers up when the control arrives are asked. The others (down, or not yet seen up) are
named in ``not_asked`` (worker id: its state), so a loop knows which engines missed the control:
one that comes back later comes back as it was (not paused, with the weights it had).

A control that empties an engine's prefix cache (a pause unless ``clear_cache=false``, a sleep of
level 1 or 2, a release of KV cache memory, a weight load from disk unless ``flush_cache`` is
false) makes the router forget what it predicted that worker caches;
what the engine's KV events said, its own "all blocks cleared" event clears.

Weight transfers whose arguments differ from engine to engine (vLLM's
``/init_weight_transfer_engine`` takes each engine's rank offset, and what follows it needs that
group; SGLang's ``/init_weights_update_group``, its transfers between instances and from IPC
handles, likewise), and one engine's own role (SGLang's ``/pd_role_switch``), are not sent on:
they answer 404, saying to call each worker at its own address (``GET /kvmesh/workers`` lists
them). Inside an engine, the middleware leaves every one of these paths to that engine: there they
mean that engine alone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import msgspec

from kvmesh._http import ADMIN_TOKEN_HEADER, error_body, route_path, token_matches
from kvmesh.errors import RequestError
from kvmesh.router.asgi import peer_auth
from kvmesh.router.asgi.json_io import read_body, send_error, send_json
from kvmesh.router.mesh.registry import UP, Worker
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.parse import decode_body
from kvmesh.router.upstream.forwarder import UpstreamError, end_to_end_headers

CORPUS_ADD = "/add_external_corpus"
ADAPTER_LOADS = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/load_lora_adapter",
    "/unload_lora_adapter",
)
"""vLLM's and SGLang's run-time LoRA loads (the module docstring): asked with a POST."""
POSTS = (
    "/pause",
    "/resume",
    "/sleep",
    "/wake_up",
    "/release_kv_cache_memory",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/begin_weight_update",
    "/end_weight_update",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/weight_checker",
    "/hicache/storage-backend/clear",
    CORPUS_ADD,
    "/remove_external_corpus",
    *ADAPTER_LOADS,
)
"""Asked with a POST."""
GETS = ("/is_paused", "/is_sleeping", "/weight_info", "/get_world_size", "/list_external_corpora")
"""Asked with a GET."""
EITHER = (
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/start_profile",
    "/stop_profile",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/freeze_gc",
    "/set_trace_level",
    "/configure_logging",
    "/slow_down",
    "/get_weights_by_name",
    "/weights_checker",
)
"""Asked with a GET or a POST (SGLang takes both; vLLM's profiler takes a POST)."""
OTHER_METHODS = {
    "/set_internal_state": ("POST", "PUT"),
    "/hicache/storage-backend": ("GET", "PUT", "DELETE"),
}
"""SGLang's controls asked with other methods: its run-time server arguments, and the attach,
detach and status of its hierarchical cache's storage backend."""
PER_ENGINE = (
    "/init_weight_transfer_engine",
    "/update_weights",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/update_weights_from_tensor",
    "/update_weights_from_ipc",
    "/load_lora_adapter_from_tensors",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance",
    "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info",
    "/pd_role_switch",
)
"""Weight transfers the router does not send on (the module docstring), and one engine's own role
or transfer engine: answered 404, saying why."""

_FLAGS = frozenset(("is_paused", "is_sleeping", "success", "match"))
_CONTROL_TIMEOUT = 600.0
"""Seconds a worker has to answer: a pause in wait mode lasts as long as the longest request in
flight, and a sleep moves the weights off the device."""
_ANSWER_LIMIT = 1 << 20


class FleetControl:
    """An ASGI app serving :data:`POSTS`, :data:`GETS`, :data:`EITHER` and :data:`PER_ENGINE`
    (see the module docstring)."""

    def __init__(self, mesh_of: Callable[[], Mesh]) -> None:
        self._mesh_of = mesh_of  # (the router's mesh exists only once the middleware is built)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        mesh = self._mesh_of()
        settings = mesh.settings
        path = route_path(scope)
        if path in PER_ENGINE:
            message = (
                f"{path} is not sent to the whole fleet: its arguments differ from engine to engine; "
                "call each worker at its own address (GET /kvmesh/workers lists them)"
            )
            await send_error(send, 404, message, None)
            return
        if not token_matches(settings.admin_token, scope["headers"]):
            await send_error(send, 401, "admin token missing or wrong", None)
            return
        try:
            body = await read_body(scope, receive, settings.max_body_bytes, settings.body_read_timeout)
            if body and path == CORPUS_ADD:
                body = one_corpus_id(body)
            elif body:
                decode_body(body)  # (a JSON object, or the client's 400 naming ``body``)
        except RequestError as e:
            await send_error(send, e.status, str(e), e.field)
            return
        if body is None:
            return  # the client left before it asked anything
        await mesh.ensure_started()
        await mesh.wait_ready()
        workers = sorted(
            (w for w in mesh.registry.workers.values() if w.state == UP and w.info is not None),
            key=lambda w: w.worker_id,
        )
        if not workers:
            await send_error(send, 503, "no worker is up", None)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        target = path + "?" + query if query else path
        headers = engine_headers(scope["headers"], settings.admin_token)
        clears = _clears_cache(path, query, body)
        # (shielded: a client that leaves must not leave the fleet half paused)
        asked = asyncio.ensure_future(
            asyncio.gather(*(_ask(mesh, w, scope["method"], target, headers, body, clears) for w in workers))
        )
        answers = await asyncio.shield(asked)
        status, document = merge_answers([w.worker_id for w in workers], answers)
        asked_ids = {w.worker_id for w in workers}
        not_asked = {
            w: worker.state for w, worker in sorted(mesh.registry.workers.items()) if w not in asked_ids
        }
        if not_asked:  # (a worker down now misses the control: the loop should know which)
            document["not_asked"] = not_asked
        await send_json(send, status, msgspec.json.encode(document))


async def _ask(
    mesh: Mesh,
    worker: Worker,
    method: str,
    target: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    clears: bool,
) -> tuple[int, Any]:
    """(status, the decoded answer) from one worker; status 0 and why, when it gave none. With
    ``clears``, a worker that did it has its predicted blocks forgotten."""

    try:
        status, raw = await mesh.forwarder.whole(
            worker.url, method, target, headers, body, timeout=_CONTROL_TIMEOUT, limit=_ANSWER_LIMIT
        )
    except UpstreamError as e:
        return 0, str(e)
    if clears and 200 <= status < 300:
        mesh.router.flushed(worker.worker_id)
    if target.split("?", 1)[0] in ADAPTER_LOADS and 200 <= status < 300:
        await mesh.registry.reread_adapters(worker)  # (its requests route to it from now on)
    try:
        return status, msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError:
        return status, raw[:200].decode("utf-8", "replace")


def merge_answers(worker_ids: list[str], answers: list[tuple[int, Any]]) -> tuple[int, dict[str, Any]]:
    """The fleet's answer from each worker's (status, answer), in the order of ``worker_ids``
    (the module docstring's rules)."""
    by_worker = dict(zip(worker_ids, (a for _, a in answers), strict=True))
    statuses = {status for status, _ in answers}
    if all(200 <= s < 300 for s in statuses):
        return 200, {**_common(list(by_worker.values())), "workers": by_worker}
    if len(statuses) == 1 and 400 <= (only := next(iter(statuses))) < 500:
        first = answers[0][1]
        return only, first if isinstance(first, dict) else error_body(str(first), only, None)
    succeeded = [w for w, (s, _) in zip(worker_ids, answers, strict=True) if 200 <= s < 300]
    failed = {
        w: (f"HTTP {s}: {_short(a)}" if s else str(a))
        for w, (s, a) in zip(worker_ids, answers, strict=True)
        if not 200 <= s < 300
    }
    message = f"{len(failed)} of {len(worker_ids)} workers did not do it"
    return 502, {**error_body(message, 502, None), "succeeded": succeeded, "failed": failed}


def _common(answers: list[Any]) -> dict[str, Any]:
    """The fields of the workers' answers, one value each (the module docstring)."""
    objects = [a for a in answers if isinstance(a, dict)]
    if len(objects) < len(answers):
        return {}  # (an answer that is not an object has no fields to share)
    keys = {k: None for a in objects for k in a}  # (first seen first)
    out: dict[str, Any] = {}
    for key in keys:
        values = [a.get(key) for a in objects]
        if all(v == values[0] for v in values):
            out[key] = values[0]
        elif key in _FLAGS:
            out[key] = all(v is True for v in values)
        else:
            out[key] = None
    return out


def _short(answer: Any) -> str:
    text = answer if isinstance(answer, str) else msgspec.json.encode(answer).decode()
    return text[:200]


def _clears_cache(path: str, query: str, body: bytes) -> bool:
    """Whether the control empties an engine's prefix cache when it succeeds (the module docstring)."""
    args = parse_qs(query)

    def arg(name: str, default: str) -> str:
        return args.get(name, [default])[-1].strip().lower()

    if path == "/pause":
        # (in every mode: vLLM 0.33's engine empties the cache once paused, keep included, although
        # its route's description says keep ignores clear_cache)
        return arg("clear_cache", "true") not in ("false", "0")
    if path == "/sleep":
        return arg("level", "1") in ("1", "2")
    if path in ("/release_kv_cache_memory", "/release_memory_occupation"):
        return True
    if path == "/update_weights_from_disk":
        fields = decode_body(body) if body else {}
        return fields.get("flush_cache", True) is not False
    return False


def one_corpus_id(body: bytes) -> bytes:
    """An external corpus added without an id, given one: each SGLang engine would name it with a
    random id of its own, and no one id would remove it from the fleet (the client's 400 naming
    ``body`` or ``corpus_id`` for what SGLang could not read)."""
    fields = decode_body(body)
    corpus_id = fields.get("corpus_id")
    if corpus_id is not None and not isinstance(corpus_id, str):
        raise RequestError("corpus_id must be a string", status=400, field="corpus_id")
    if corpus_id:
        return body
    return msgspec.json.encode({**fields, "corpus_id": uuid.uuid4().hex})


def engine_headers(headers: list[tuple[bytes, bytes]], admin_token: str | None) -> list[tuple[bytes, bytes]]:
    """The client's headers for an engine: end to end ones, without kvmesh's internal ones, its
    admin token header, or an ``authorization`` that carries the router's admin token (the
    router's own secret is never sent on; the client's own credentials for the engines are)."""
    out = []
    for name, value in peer_auth.strip_internal(end_to_end_headers(headers)):
        if name == ADMIN_TOKEN_HEADER:
            continue
        if name == b"authorization" and admin_token and token_matches(admin_token, [(name, value)]):
            continue
        out.append((name, value))
    return out


__all__ = [
    "ADAPTER_LOADS",
    "CORPUS_ADD",
    "EITHER",
    "GETS",
    "OTHER_METHODS",
    "PER_ENGINE",
    "POSTS",
    "FleetControl",
    "engine_headers",
    "merge_answers",
    "one_corpus_id",
]
