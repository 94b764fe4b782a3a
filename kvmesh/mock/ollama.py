"""Ollama's chat and generate (``POST /api/chat``, ``POST /api/generate``) on the mock engine, as
SGLang 0.5.23 serves them (``sglang/srt/entrypoints/ollama``).

A body is read as the router reads it (:mod:`kvmesh.router.request.ollama_api`): ``/api/chat`` as
a chat request of its messages' roles and contents, ``/api/generate`` as a completion of its
``prompt`` after its ``system`` text. Of ``options``, ``num_predict`` (the answer's length),
``temperature``, ``top_p``, ``seed`` and ``stop`` are taken in their chat names; an error names
the field as the client sent it. Without ``num_predict`` the answer runs to the mock's own end (EOS
or the context), where SGLang stops at 2,048 tokens. ``model`` is required and not read (the
engine serves its own); ``format``, ``keep_alive``, ``think`` and, for generate, ``raw``,
``template``, ``suffix``, ``context`` and ``images`` are taken and change nothing, as in SGLang.
An empty ``/api/generate`` prompt is answered at once, done, with no text (Ollama's clients send
one to load a model). ``GET /api/tags`` lists the served model and ``POST /api/show`` describes
the one it is asked about (its context length), in SGLang's fields.

The answer is SGLang's: a stream (unless ``"stream": false``) of newline-delimited JSON objects
(``application/x-ndjson``), one per piece of the answer (``message.content`` or ``response``),
``"done": false``, then one ``"done": true`` with ``done_reason`` ``"stop"`` and no text; a whole
answer is one object, done, with ``total_duration`` (ns), ``prompt_eval_count`` (the prompt's
tokens) and ``eval_count`` (the answer's). SGLang says ``"stop"`` whatever ended the answer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from kvmesh.errors import RequestError
from kvmesh.mock.config import MockConfig
from kvmesh.mock.protocol import ParsedRequest, in_client_names, parse_generation
from kvmesh.router.request.ollama_api import OLLAMA_CHAT_PATH, streams, view
from kvmesh.router.request.tokenizer import Tokenizer

_OPTIONS = (("num_predict", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
            ("seed", "seed"), ("stop", "stop"))  # fmt: skip
_CLIENT_NAME = {ours: f"options.{theirs}" for theirs, ours in _OPTIONS}
_encode = msgspec.json.Encoder().encode
NDJSON = b"application/x-ndjson"


@dataclasses.dataclass(frozen=True)
class EmptyPrompt:
    """An ``/api/generate`` body with a blank prompt, answered without the engine."""

    stream: bool


def parse_ollama(
    body: Any, path: str, config: MockConfig, tokenizer: Tokenizer, session: str | None
) -> ParsedRequest | EmptyPrompt:
    """Validate an Ollama body and read it as its chat request or completion (a RequestError names
    the field), or as an :class:`EmptyPrompt`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    request = dict(view(body, path))
    chat = path == OLLAMA_CHAT_PATH
    if not chat and not request["prompt"].strip():
        return EmptyPrompt(streams(body))
    options = body.get("options") or {}
    for theirs, ours in _OPTIONS:
        if theirs in options:
            request[ours] = options[theirs]
    request["stream"] = streams(body)
    try:
        return parse_generation(request, "chat" if chat else "completions", config, tokenizer, session)
    except RequestError as e:
        raise in_client_names(e, _CLIENT_NAME) from None


def answer(path: str, model: str, text: str, *, done: bool, counts: dict[str, int] | None = None) -> bytes:
    """One answer object (a whole answer, or a line of a stream) in SGLang's shape, encoded."""
    doc: dict[str, Any] = {"model": model, "created_at": _timestamp()}
    if path == OLLAMA_CHAT_PATH:
        doc["message"] = {"role": "assistant", "content": text, "images": None}
    else:
        doc["response"] = text
    doc["done"] = done
    doc["done_reason"] = "stop" if done else None
    if counts is not None:
        doc.update(counts)
    return _encode(doc)


async def answer_lines(
    path: str, model: str, pieces: AsyncIterator[str], finished: Callable[[], bool]
) -> AsyncIterator[bytes]:
    """SGLang's stream for one answer whose text comes in ``pieces``: a line a piece, then the
    done line, unless ``finished`` says the engine stopped first (the stream ends there)."""
    async for piece in pieces:
        yield answer(path, model, piece, done=False) + b"\n"
    if finished():
        yield answer(path, model, "", done=True) + b"\n"


def counts(prompt_tokens: int, answer_tokens: int, started_ns: int) -> dict[str, int]:
    """A whole answer's figures, in Ollama's names."""
    return {
        "total_duration": time.time_ns() - started_ns,
        "prompt_eval_count": prompt_tokens,
        "eval_count": answer_tokens,
    }


def tags(model: str) -> dict[str, Any]:
    """``GET /api/tags``: the served model, in the fields SGLang fills (no size, a zero digest)."""
    entry = {
        "name": model,
        "model": model,
        "modified_at": _timestamp(),
        "size": 0,
        "digest": "sha256:" + "0" * 64,
        "details": {"format": "kvmesh-mock", "family": _family(model), "parameter_size": "unknown"},
    }
    return {"models": [entry]}


def show(body: Any, context_len: int) -> dict[str, Any]:
    """``POST /api/show``: the model the body names (any: SGLang describes whatever it is asked
    about), with the engine's context length; a 400 naming ``model`` without one."""
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str):
        raise RequestError("'model' is required: a string", field="model")
    family = _family(model)
    return {
        "license": "",
        "modelfile": f"FROM {model}\nPARAMETER num_ctx {context_len}\n",
        "parameters": f"num_ctx {context_len}",
        "template": "",
        "modified_at": _timestamp(),
        "details": {"format": "kvmesh-mock", "family": family, "families": [family]},
        "model_info": {"general.name": model, f"{family}.context_length": context_len},
        "capabilities": ["completion"],
    }


def _family(model: str) -> str:
    return model.rsplit("/", 1)[-1]


def _timestamp() -> str:
    """Now, as Ollama writes it: UTC, milliseconds, ``Z``."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


__all__ = ["NDJSON", "EmptyPrompt", "answer", "answer_lines", "counts", "parse_ollama", "show", "tags"]
