"""SGLang's Ollama-compatible API (``POST /api/chat``, ``POST /api/generate``) read as the chat
request or completion it amounts to.

SGLang 0.5.23 serves Ollama's chat and generate endpoints (``sglang/srt/entrypoints/ollama``), so
Ollama's clients (Open WebUI, the ``ollama`` libraries, editors' assistants) can talk to it. It
renders them its own way, and the router reads a body the same way:

* ``/api/chat``: each message's ``role`` and ``content`` (its ``images`` are dropped, and the
  request has no tools) go through the model's chat template with the generation prompt, so
  :func:`chat_view` is a plain chat request of those messages;
* ``/api/generate``: the ``prompt``, after the ``system`` text and a blank line when there is
  one, is tokenized as a text prompt (its ``template``, ``raw``, ``suffix`` and ``context`` are
  not read), so :func:`generate_view` is a completion of that text. An empty prompt is answered by
  the engine itself (Ollama's clients send one to load a model); it is routed like any other.

Both ignore the body's ``model`` (the engine serves its own) and stream unless ``"stream":
false``. A streamed answer is newline-delimited JSON, one object a line, the last one ``"done":
true``; :func:`answer_usage` reads an answer's counts in chat's names, where it has them (SGLang's
whole answers do, its streams do not). The engine gets the client's body unchanged.

SGLang serves the two on other paths when ``SGLANG_OLLAMA_CHAT_ROUTE`` or
``SGLANG_OLLAMA_GENERATE_ROUTE`` names one, read when its server starts (and its model list and
description when ``SGLANG_OLLAMA_TAGS_ROUTE``, ``SGLANG_OLLAMA_SHOW_ROUTE`` do): :func:`moved_routes`
reads them so too, and a request on such a path is served as the endpoint it moved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.errors import RequestError

OLLAMA_CHAT_PATH = "/api/chat"
OLLAMA_GENERATE_PATH = "/api/generate"
OLLAMA_PATHS = frozenset((OLLAMA_CHAT_PATH, OLLAMA_GENERATE_PATH))
OLLAMA_TAGS_PATH = "/api/tags"
OLLAMA_SHOW_PATH = "/api/show"
ROUTE_VARIABLES = (
    ("SGLANG_OLLAMA_CHAT_ROUTE", OLLAMA_CHAT_PATH),
    ("SGLANG_OLLAMA_GENERATE_ROUTE", OLLAMA_GENERATE_PATH),
    ("SGLANG_OLLAMA_TAGS_ROUTE", OLLAMA_TAGS_PATH),
    ("SGLANG_OLLAMA_SHOW_ROUTE", OLLAMA_SHOW_PATH),
)
"""Where SGLang moves each of Ollama's paths it serves: the variable, the path by default."""


def moved_routes(environ: Mapping[str, str]) -> dict[str, str]:
    """The path each of the two endpoints is on where SGLang's variables in the server's
    ``environ`` move it (``{path: endpoint}``; an endpoint not moved is not in it)."""
    moved = {}
    for variable, endpoint in ROUTE_VARIABLES:
        path = environ.get(variable, endpoint)
        if path != endpoint and path.startswith("/"):
            moved[path] = endpoint
    return moved


def ollama_route(endpoint: str, environ: Mapping[str, str]) -> str:
    """The path ``endpoint`` is served on (moved or not)."""
    return next((path for path, moved in moved_routes(environ).items() if moved == endpoint), endpoint)


def is_ollama(endpoint: str) -> bool:
    """Whether ``endpoint`` (a request path) is one of Ollama's generation endpoints."""
    return endpoint in OLLAMA_PATHS


def streams(body: dict[str, Any]) -> bool:
    """Whether the answer to this body is a stream: Ollama's default, unless ``"stream": false``."""
    return body.get("stream") is not False


def chat_view(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body SGLang renders an ``/api/chat`` body as; a 400 naming the field for one it
    would refuse."""
    _check_common(body)
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise RequestError("'messages' must be a non-empty list", field="messages")
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"messages[{i}] must be an object", field=f"messages[{i}]")
        role = item.get("role")
        if not isinstance(role, str):
            raise RequestError(f"messages[{i}].role must be a string", field=f"messages[{i}].role")
        content = item.get("content")
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string", field=f"messages[{i}].content")
        messages.append({"role": role, "content": content})
    return {"messages": messages, "add_generation_prompt": True}


def generate_view(body: dict[str, Any]) -> dict[str, Any]:
    """The completion body SGLang serves an ``/api/generate`` body as; a 400 naming the field for
    one it would refuse."""
    _check_common(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string", field="prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise RequestError("'system' must be a string", field="system")
    return {"prompt": f"{system}\n\n{prompt}" if system else prompt}


def view(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """:func:`chat_view` or :func:`generate_view`, by ``endpoint``."""
    return chat_view(body) if endpoint == OLLAMA_CHAT_PATH else generate_view(body)


def answer_text(doc: dict[str, Any]) -> str:
    """The text an answer (or a streamed line) carries: a chat message's content, or a generate
    answer's ``response``."""
    message = doc.get("message")
    text = message.get("content") if isinstance(message, dict) else doc.get("response")
    return text if isinstance(text, str) else ""


def answer_usage(doc: dict[str, Any]) -> dict[str, Any] | None:
    """An answer's token counts in chat's names (``prompt_eval_count`` is the prompt's,
    ``eval_count`` the answer's; no cached count), or None where it has none."""
    prompt = doc.get("prompt_eval_count")
    answer = doc.get("eval_count")
    if type(prompt) is not int or type(answer) is not int:
        return None
    return {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": prompt + answer}


def _check_common(body: dict[str, Any]) -> None:
    """The fields both requests must have in SGLang's types: a string ``model`` (required, though
    the engine serves its own), a boolean ``stream``, an object ``options``."""
    if not isinstance(body.get("model"), str):
        raise RequestError("'model' is required: a string", field="model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise RequestError("'stream' must be a boolean", field="stream")
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'options' must be an object", field="options")


__all__ = [
    "OLLAMA_CHAT_PATH",
    "OLLAMA_GENERATE_PATH",
    "OLLAMA_PATHS",
    "OLLAMA_SHOW_PATH",
    "OLLAMA_TAGS_PATH",
    "ROUTE_VARIABLES",
    "answer_text",
    "answer_usage",
    "chat_view",
    "generate_view",
    "is_ollama",
    "moved_routes",
    "ollama_route",
    "streams",
    "view",
]
