"""The mock engine's Responses API (``POST /v1/responses``), as vLLM 0.33.0 serves it with its store
on (``VLLM_ENABLE_RESPONSES_API_STORE=1``).

A request is turned into the chat request vLLM renders it as (``instructions`` as a system message,
``input`` items as messages, function ``tools``: :func:`~kvmesh.router.request.responses_api.chat_view`)
and generated like one. ``previous_response_id`` puts the stored conversation first: the earlier
request's messages without its system message (instructions do not carry over), then its answer.
A response is stored unless ``store`` is false; an id this engine does not hold is a 404, as
vLLM's. The stream is vLLM's event sequence: ``response.created`` and ``response.in_progress`` at
once, the output item and its text deltas as tokens come, ``response.completed`` with ``usage``
last, and no ``[DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.errors import RequestError
from kvmesh.mock.config import MockConfig
from kvmesh.mock.protocol import ParsedRequest, parse_generation
from kvmesh.router.request.responses_api import chat_view, previous_response_id
from kvmesh.router.request.tokenizer import Tokenizer

STORED_RESPONSES = 10_000
"""Responses one mock engine keeps for ``previous_response_id`` (the oldest is dropped)."""
# Fields of a Responses body that mean the same in a chat body (the rest are the engine's own).
# (vLLM's Responses request has these of its chat request's own too: ignore_eos, top_k, stop, ...)
_SAME_AS_CHAT = (
    "model",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "priority",
    "seed",
    "stop",
    "ignore_eos",
    "thinking_token_budget",
    "user",
)
_encode = msgspec.json.encode


class ResponseNotFound(RequestError):
    status = 404


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A Responses request as the engine runs it: the chat request it renders as, and the
    conversation it extends (kept with its answer when the response is stored)."""

    chat: ParsedRequest
    messages: list[dict[str, Any]]
    store: bool
    previous_response_id: str | None


class ResponseStore:
    """Stored responses by id, each with its conversation (the request's messages and the
    answer), the newest :data:`STORED_RESPONSES` kept."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self._capacity = capacity
        self._stored: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        stored = self._stored.get(response_id)
        return stored[0] if stored is not None else None

    def response(self, response_id: str) -> dict[str, Any] | None:
        stored = self._stored.get(response_id)
        return stored[1] if stored is not None else None

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        self._stored[response_id] = (messages, response)
        while len(self._stored) > self._capacity:
            self._stored.popitem(last=False)


def parse_responses(
    body: Any, config: MockConfig, tokenizer: Tokenizer, store: ResponseStore, session: str | None
) -> ResponsesRequest:
    """Validate a Responses body and render it as its chat request (a RequestError names the field)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    view = chat_view(body)
    messages = view["messages"]
    earlier = previous_response_id(body)
    if earlier is not None:
        history = store.conversation(earlier)
        if history is None:
            raise ResponseNotFound(not_found(earlier), field="previous_response_id")
        head = messages[:1] if messages[0].get("role") == "system" and body.get("instructions") else []
        rest = messages[len(head) :]
        messages = [*head, *(m for m in history if m.get("role") != "system"), *rest]
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise RequestError("'store' must be a boolean", field="store")
    chat_body = {**view, "messages": messages}
    for key in _SAME_AS_CHAT:
        if key in body:
            chat_body[key] = body[key]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if type(limit) is not int or limit < 1:
            raise RequestError("'max_output_tokens' must be an integer >= 1", field="max_output_tokens")
        chat_body["max_tokens"] = limit
    if body.get("stream") is True:
        chat_body["stream_options"] = {"include_usage": True}
    chat = parse_generation(chat_body, "chat", config, tokenizer, session)
    return ResponsesRequest(chat, messages, store_it, earlier)


def not_found(response_id: str) -> str:
    return f"Response with id '{response_id}' not found."


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def response_object(
    request: ResponsesRequest,
    response_id: str,
    created_at: int,
    *,
    text: str | None,
    usage: dict[str, Any] | None,
    status: str,
) -> dict[str, Any]:
    """The ``response`` object: whole at the end, or with no output yet (``text`` None)."""
    output = [] if text is None else [_message_item(response_id, text, "completed")]
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "model": request.chat.model,
        "output": output,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "usage": usage,
    }


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat ``usage`` in the Responses API's names."""
    prompt = chat_usage["prompt_tokens"]
    completion = chat_usage["completion_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def remember(store: ResponseStore, request: ResponsesRequest, response: dict[str, Any]) -> None:
    """Keep a finished response and its conversation (for ``GET /v1/responses/{id}`` and a later
    ``previous_response_id``), if the request asked for it."""
    if request.store:
        answer = response["output"][0]["content"][0]["text"]
        conversation = [*request.messages, {"role": "assistant", "content": answer}]
        store.put(response["id"], conversation, response)


async def response_events(
    request: ResponsesRequest,
    response_id: str,
    pieces: AsyncIterator[str],
    finished: Callable[[], dict[str, Any] | None],
    completed: Callable[[dict[str, Any]], None],
) -> AsyncIterator[bytes]:
    """vLLM's event stream for one answer whose text comes in ``pieces``; ``finished`` gives the
    chat usage once they are all out, or None when the engine stopped first (no completion then);
    ``completed`` hears the finished response before its last event goes out."""
    created_at = int(time.time())
    sequence = 0
    item_id = f"msg_{response_id.removeprefix('resp_')}"

    def event(kind: str, fields: dict[str, Any]) -> bytes:
        nonlocal sequence
        doc = {"type": kind, **fields, "sequence_number": sequence}
        sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(doc) + b"\n\n"

    opened = response_object(request, response_id, created_at, text=None, usage=None, status="in_progress")
    yield event("response.created", {"response": opened})
    yield event("response.in_progress", {"response": opened})
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    text = ""
    started = False
    async for piece in pieces:
        if not started:
            started = True
            yield event(
                "response.output_item.added",
                {"output_index": 0, "item": _message_item(response_id, "", "in_progress")},
            )
            yield event("response.content_part.added", {**where, "part": _text_part("")})
        text += piece
        if piece:
            yield event("response.output_text.delta", {**where, "delta": piece, "logprobs": []})
    usage = finished()
    if usage is None:
        return
    if not started:
        yield event(
            "response.output_item.added",
            {"output_index": 0, "item": _message_item(response_id, "", "in_progress")},
        )
        yield event("response.content_part.added", {**where, "part": _text_part("")})
    yield event("response.output_text.done", {**where, "text": text, "logprobs": []})
    yield event("response.content_part.done", {**where, "part": _text_part(text)})
    yield event(
        "response.output_item.done",
        {"output_index": 0, "item": _message_item(response_id, text, "completed")},
    )
    done = response_object(
        request, response_id, created_at, text=text, usage=responses_usage(usage), status="completed"
    )
    completed(done)
    yield event("response.completed", {"response": done})


def _message_item(response_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": f"msg_{response_id.removeprefix('resp_')}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)] if text or status == "completed" else [],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
