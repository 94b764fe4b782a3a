"""kvmesh's router embedded in SGLang's own HTTP server (mounted by the launcher, see :mod:`.app`).

The engine-agnostic :class:`kvmesh.router.asgi.middleware.KvMeshMiddleware` with SGLang's glue:

* the tokenizer defaults to SGLang's own (``KVMESH_TOKENIZER=engine``), bound on the first request
  to the objects SGLang's lifespan created (:mod:`.tokenizer`);
* a request SGLang caches in another namespace, one with a ``cache_salt``, a ``lora_path`` or a
  ``model`` of the form ``base:adapter`` (SGLang keys such pages by salt or adapter as well as by
  tokens), is routed with ``nvext.agent_hints.kv_overlap_score_credit = 0``: the router's index
  knows prefixes by tokens only, so such a request must not be credited with an unsalted,
  base-model prefix. It is still routed by load, and its hashes still count as its load.

Priority polarity needs no glue here: the middleware rewrites ``nvext.agent_hints.priority`` per
the serving worker's ``/kvmesh/info`` ``priority_polarity`` (``higher_first`` for SGLang, or
``lower_first`` with ``--schedule-low-priority-values-first``), and strips ``nvext``.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from kvmesh._http import route_path
from kvmesh.adapters.sglang.tokenizer import SglangTokenizer
from kvmesh.router.asgi.forwarding import HOP_HEADER
from kvmesh.router.asgi.middleware import WITH_GENERATE, routes
from kvmesh.router.asgi.middleware import KvMeshMiddleware as _CoreMiddleware
from kvmesh.router.mesh.settings import MeshSettings
from kvmesh.router.request.ollama_api import is_ollama


class _Namespace(msgspec.Struct):
    """The only fields that decide a request's cache namespace (a typed decode skips the rest)."""

    model: Any = None
    cache_salt: Any = None
    lora_path: Any = None
    parameters: Any = None  # (Vertex AI's: the /generate fields of its instances)


class KvMeshMiddleware(_CoreMiddleware):
    """kvmesh's routing middleware for SGLang's FastAPI app."""

    def __init__(self, app: Any, *, settings: MeshSettings | None = None) -> None:
        if settings is None:
            settings = MeshSettings.load()
            if "KVMESH_TOKENIZER" not in os.environ and not os.environ.get("KVMESH_CONFIG"):
                settings = settings.replace(tokenizer="engine")
        self.engine_tokenizer = SglangTokenizer()
        super().__init__(
            app, settings=settings, tokenizer=self.engine_tokenizer, generation_paths=WITH_GENERATE
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if not self.engine_tokenizer.bound and "app" in scope:
                self.engine_tokenizer.bind_from_app(scope["app"])
            path = route_path(scope)
            if (
                routes(self.generation_paths, path, scope["method"])
                and not is_ollama(self.endpoints.get(path, path))
                and not any(name == HOP_HEADER for name, _ in scope["headers"])
            ):
                # A hop (a peer forwarded it) was routed already and its nvext stripped by the
                # sender: a credit added here would reach SGLang as an nvext field. An Ollama
                # request is served by the base model whatever its "model" says (Ollama's names
                # have a ":" in them, as SGLang's adapter names do: "llama3:8b").
                scope, receive = await _uncredit_namespaced(scope, receive, self.settings.max_body_bytes)
        await super().__call__(scope, receive, send)


_namespace_decoder = msgspec.json.Decoder(_Namespace)


def cached_in_own_namespace(body: Any) -> bool:
    """Whether SGLang caches this request's pages apart from plain base-model prefixes."""
    if not isinstance(body, dict):
        return False
    if body.get("cache_salt") or body.get("lora_path"):
        return True
    parameters = body.get("parameters")
    if isinstance(parameters, dict) and (parameters.get("cache_salt") or parameters.get("lora_path")):
        return True
    model = body.get("model")
    return isinstance(model, str) and ":" in model


async def _uncredit_namespaced(scope: dict[str, Any], receive: Any, limit: int) -> tuple[dict[str, Any], Any]:
    """Read the body; for a salted or LoRA request, set the overlap credit to 0 in its nvext.
    Any other body is replayed unchanged (kvmesh's own checks answer malformed ones)."""
    declared = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            declared = value
    if declared is None or not declared.isdigit() or int(declared) > limit:
        return scope, receive
    messages: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    raw = b"".join(chunks)
    if messages[-1]["type"] == "http.request":
        rewritten = _without_credit(raw)
        if rewritten is not None:
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            headers.append((b"content-length", str(len(rewritten)).encode()))
            messages = [{"type": "http.request", "body": rewritten, "more_body": False}]
            scope = {**scope, "headers": headers}
    pending = iter(messages)

    async def replay() -> dict[str, Any]:
        for message in pending:
            return message
        return await receive()  # type: ignore[no-any-return]

    return scope, replay


def _without_credit(raw: bytes) -> bytes | None:
    try:
        fields = _namespace_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not cached_in_own_namespace(msgspec.structs.asdict(fields)):
        return None
    body = msgspec.json.decode(raw)
    nvext = body.get("nvext")
    if nvext is None:
        nvext = body["nvext"] = {}
    if not isinstance(nvext, dict):
        return None  # kvmesh answers the malformed nvext itself
    hints = nvext.get("agent_hints")
    if hints is None:
        hints = nvext["agent_hints"] = {}
    if not isinstance(hints, dict):
        return None
    hints["kv_overlap_score_credit"] = 0.0
    return msgspec.json.encode(body)
