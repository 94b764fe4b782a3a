"""Anthropic's Messages API (``POST /v1/messages``) on the mock engine, as vLLM 0.33.0 serves it.

A body is read as the chat request vLLM renders it as: the router's
:func:`~kvmesh.router.request.messages_api.chat_view` (the ``system`` text first, each message,
``tool_use`` blocks as tool calls, a user's ``tool_result`` blocks as tool messages, the ``tools``
as function tools), with ``max_tokens``, ``stop_sequences`` (as ``stop``), ``temperature``,
``top_p`` and ``top_k`` given their chat names and ``thinking.budget_tokens`` as the chat
``thinking_token_budget``; then it is checked, tokenized and generated as a chat request is
(:func:`~kvmesh.mock.protocol.parse_generation`). An error names the field as the client sent it
(``stop_sequences``, not ``stop``).

Checked as vLLM's request model checks them: ``model`` and ``max_tokens`` (a positive integer) are
required; the roles, the block types, ``stop_sequences`` (a list of at most 4 strings, vLLM's
default ``VLLM_MAX_STOP_STRINGS``), ``thinking`` (``enabled`` with ``budget_tokens`` >= 1024 and
below ``max_tokens``, ``disabled``, ``adaptive``), ``tool_choice`` (``auto``, ``any``, ``none``,
``tool`` with a ``name``), ``output_config.effort``. Taken and changing nothing the mock makes:
``metadata``, ``tool_choice`` (the mock never calls a tool, as its chat path never does),
``thinking`` (the mock does not reason; the effort a template would get changes nothing in the
mock's template), ``chat_template_kwargs``, and fields vLLM's model does not know. Refused with a
400 naming the field, as what the mock cannot honour: ``cache_salt`` (the mock keeps one prefix
cache for every request), ``output_config.format`` with a schema (constrained decoding),
``watermarking``, a disaggregated hand-off (``kv_transfer_params``, ``ec_transfer_params``: the
mock serves ``/v1/messages`` aggregated, as the router sends it). ``tool_addition`` /
``tool_removal`` blocks change the tools as vLLM changes them (the chat view applies them), in a
message with role ``system`` only, as vLLM takes them; one that names an undeclared tool is a 400.

The answer is vLLM's (``messages_full_converter``, dumped without its null fields): ``id``
(``chatcmpl-`` and the ``X-Request-Id`` or a new hex id, the id of the chat answer it is made from),
``type`` ``"message"``, ``role``, ``content`` (one text block, empty text when nothing was
generated), ``model``, ``stop_reason`` (``max_tokens`` for a length stop, ``end_turn`` for EOS)
and ``usage``: ``input_tokens`` the prompt less ``cache_read_input_tokens`` (the engine's real
prefix-cache hit, what a chat answer reports as ``cached_tokens``), ``output_tokens``. The mock
ends an answer at EOS only when no ``max_tokens`` is given, which a Messages request always gives,
so its answers stop at ``max_tokens``.

The stream is vLLM's (``message_stream_converter``), each event ``event: <type>`` then
``data: <json>``, with no ``[DONE]``: ``message_start`` with the first tokens (its message has no
content yet, a null ``stop_reason`` and ``stop_sequence``, and the usage of vLLM's first chat
chunk: the whole prompt as ``input_tokens``, ``output_tokens`` 0 and no cache field), then
``content_block_start`` (a text block, index 0) once there is text, a ``content_block_delta``
(``text_delta``) each time the answer grows, ``content_block_stop``, ``message_delta`` (the
``stop_reason`` and ``stop_sequence``, and the final usage as the whole answer has it) and
``message_stop``. A request the engine stops early ends its stream there, as the mock's other
streams do.

Errors keep the mock's shape, ``{"error": {"message", "type", "param", "code"}}`` with the field in
``param`` (every 4xx kvmesh answers names its field), where vLLM answers Anthropic's
``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from kvmesh.errors import RequestError
from kvmesh.mock.config import MockConfig
from kvmesh.mock.protocol import ParsedRequest, in_client_names, parse_generation
from kvmesh.router.request.messages_api import chat_view
from kvmesh.router.request.tokenizer import Tokenizer

MAX_STOP_SEQUENCES = 4
"""vLLM's default ``VLLM_MAX_STOP_STRINGS``: the most ``stop_sequences`` one request may give."""
MIN_THINKING_BUDGET = 1024
"""The least ``thinking.budget_tokens`` vLLM's request model takes."""
# Block types vLLM's request model knows; chat_view reads the ones that render.
_BLOCK_TYPES = frozenset(
    (
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    )
)
_TOOL_CHANGES = frozenset(("tool_addition", "tool_removal"))
_TOOL_CHOICES = frozenset(("auto", "any", "tool", "none"))
_THINKING = frozenset(("enabled", "disabled", "adaptive"))
_THINKING_DISPLAY = frozenset(("summarized", "omitted", "updates"))
_EFFORTS = frozenset(("low", "medium", "high", "xhigh", "max"))
# Messages fields that mean the same in a chat body.
_SAME_AS_CHAT = ("model", "stream", "max_tokens", "temperature", "top_p", "top_k")
# Chat fields back to the name the client sent (in parse_generation's errors).
_CLIENT_NAME = {"stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens"}
# Fields whose effect the mock cannot make: refused when they ask for it.
_REFUSED = {
    "cache_salt": "the mock engine keeps one prefix cache for every request",
    "kv_transfer_params": (
        "the mock engine serves /v1/messages aggregated; send a disaggregated hand-off to "
        "/v1/chat/completions"
    ),
    "ec_transfer_params": "the mock engine has no encoder cache to hand off",
    "watermarking": "the mock engine has no watermark",
}
_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}
_encode = msgspec.json.Encoder().encode


def parse_messages(body: Any, config: MockConfig, tokenizer: Tokenizer, session: str | None) -> ParsedRequest:
    """Validate a Messages body and read it as its chat request (a RequestError names the field);
    ``session`` is the request's ``X-Session-ID``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    view = chat_view(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required: the name of the served model", field="model")
    for field, why in _REFUSED.items():
        if body.get(field) not in (None, False, {}):
            raise RequestError(f"'{field}': {why}", field=field)
    _check_blocks(body)
    _check_optional_object(body, "metadata")
    _check_optional_object(body, "chat_template_kwargs")
    _check_tool_choice(body.get("tool_choice"))
    _check_output_config(body.get("output_config"))
    chat_body = dict(view)  # (its cache_salt, if any, was refused above)
    for key in _SAME_AS_CHAT:
        if key in body:
            chat_body[key] = body[key]
    stop = _stop_sequences(body.get("stop_sequences"))
    if stop is not None:
        chat_body["stop"] = stop
    budget = _thinking_budget(body.get("thinking"), body["max_tokens"])
    if budget is not None:
        chat_body["thinking_token_budget"] = budget
    if body.get("stream") is True:
        chat_body["stream_options"] = {"include_usage": True}
    try:
        return parse_generation(chat_body, "chat", config, tokenizer, session)
    except RequestError as e:
        raise in_client_names(e, _CLIENT_NAME) from None


def stop_reason(finish_reason: str | None) -> str | None:
    """vLLM's Anthropic ``stop_reason`` for a chat ``finish_reason`` (no tool calls, no stop
    string matched: the mock makes neither)."""
    return _STOP_REASONS.get(finish_reason or "")


def anthropic_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat ``usage`` in Anthropic's names, as vLLM builds it: the cached tokens are
    ``cache_read_input_tokens`` and not ``input_tokens``."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": max(0, chat_usage["prompt_tokens"] - cached),
        "output_tokens": chat_usage["completion_tokens"],
        "cache_read_input_tokens": cached,
    }


def message_object(
    request: ParsedRequest, message_id: str, text: str, finish_reason: str | None, chat_usage: dict[str, Any]
) -> dict[str, Any]:
    """The whole answer (vLLM's, its null fields left out: ``stop_sequence`` among them)."""
    out: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": request.model,
    }
    reason = stop_reason(finish_reason)
    if reason is not None:
        out["stop_reason"] = reason
    out["usage"] = anthropic_usage(chat_usage)
    return out


async def message_events(
    request: ParsedRequest,
    message_id: str,
    pieces: AsyncIterator[str],
    finished: Callable[[], tuple[str | None, dict[str, Any]] | None],
) -> AsyncIterator[bytes]:
    """vLLM's event stream for one answer whose text comes in ``pieces``; ``finished`` gives the
    finish reason and the chat usage once they are all out, or None when the engine stopped
    first (the stream ends there)."""
    opened = False
    block = False

    def start() -> bytes:
        message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": request.model,
            "stop_reason": None,
            "stop_sequence": None,
            # (vLLM's first chat chunk: the prompt's size, no cache details yet)
            "usage": {"input_tokens": len(request.params.prompt_token_ids), "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message})

    async for piece in pieces:
        if not opened:
            opened = True
            yield start()
        if not piece:
            continue
        if not block:
            block = True
            yield _event(
                "content_block_start",
                {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0},
            )
        yield _event(
            "content_block_delta",
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": piece}, "index": 0},
        )
    end = finished()
    if end is None:
        return
    if not opened:
        yield start()
    if block:
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    finish_reason, chat_usage = end
    delta = {"stop_reason": stop_reason(finish_reason), "stop_sequence": None}
    yield _event(
        "message_delta", {"type": "message_delta", "delta": delta, "usage": anthropic_usage(chat_usage)}
    )
    yield _event("message_stop", {"type": "message_stop"})


def _event(kind: str, doc: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode(doc) + b"\n\n"


# ---------------------------------------------------------------------- checks
def _check_blocks(body: dict[str, Any]) -> None:
    """Every block of a known type; tool changes in system messages only, as vLLM takes them
    (chat_view has checked the shapes, and applied the changes to the tools)."""
    lists: list[tuple[str, Any, bool]] = [("system", body.get("system"), False)]
    lists += [
        (f"messages[{i}].content", m.get("content"), m.get("role") == "system")
        for i, m in enumerate(body["messages"])
    ]
    for field, blocks, changes_tools in lists:
        if not isinstance(blocks, list):
            continue
        for j, block in enumerate(blocks):
            kind = block["type"]
            where = f"{field}[{j}].type"
            if kind not in _BLOCK_TYPES:
                raise RequestError(
                    f"'{where}' must be one of {sorted(_BLOCK_TYPES)}, got {kind!r}", field=where
                )
            if kind in _TOOL_CHANGES and not changes_tools:
                raise RequestError(
                    f"'{where}': {kind} blocks are only allowed in messages with role 'system'", field=where
                )


def _check_optional_object(body: dict[str, Any], field: str) -> None:
    if body.get(field) is not None and not isinstance(body[field], dict):
        raise RequestError(f"'{field}' must be an object", field=field)


def _check_tool_choice(choice: Any) -> None:
    if choice is None:
        return
    if not isinstance(choice, dict):
        raise RequestError("'tool_choice' must be an object with a 'type'", field="tool_choice")
    kind = choice.get("type")
    if kind not in _TOOL_CHOICES:
        raise RequestError(
            f"'tool_choice.type' must be one of {sorted(_TOOL_CHOICES)}, got {kind!r}",
            field="tool_choice.type",
        )
    name = choice.get("name")
    if kind == "tool" and not (isinstance(name, str) and name):
        raise RequestError("'tool_choice.name' is required when its type is 'tool'", field="tool_choice.name")
    if name is not None and not isinstance(name, str):
        raise RequestError("'tool_choice.name' must be a string", field="tool_choice.name")
    single = choice.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise RequestError(
            "'tool_choice.disable_parallel_tool_use' must be a boolean",
            field="tool_choice.disable_parallel_tool_use",
        )


def _check_output_config(config: Any) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise RequestError("'output_config' must be an object", field="output_config")
    effort = config.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise RequestError(
            f"'output_config.effort' must be one of {sorted(_EFFORTS)}, got {effort!r}",
            field="output_config.effort",
        )
    form = config.get("format")
    if form is None:
        return
    if not isinstance(form, dict) or form.get("type", "json_schema") != "json_schema":
        raise RequestError(
            "'output_config.format' must be an object of type 'json_schema'", field="output_config.format"
        )
    if form.get("schema"):
        raise RequestError(
            "'output_config.format': structured output (constrained decoding) is not simulated by "
            "the mock engine",
            field="output_config.format",
        )


def _stop_sequences(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop_sequences' must be a list of strings", field="stop_sequences")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise RequestError(
            f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} strings, got {len(stop)}",
            field="stop_sequences",
        )
    return stop


def _thinking_budget(thinking: Any, max_tokens: int) -> int | None:
    """The chat ``thinking_token_budget`` of a ``thinking`` config (None: no budget)."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise RequestError("'thinking' must be an object with a 'type'", field="thinking")
    kind = thinking.get("type")
    if kind not in _THINKING:
        raise RequestError(
            f"'thinking.type' must be one of {sorted(_THINKING)}, got {kind!r}", field="thinking.type"
        )
    display = thinking.get("display")
    if kind != "disabled" and display is not None and display not in _THINKING_DISPLAY:
        raise RequestError(
            f"'thinking.display' must be one of {sorted(_THINKING_DISPLAY)}, got {display!r}",
            field="thinking.display",
        )
    if kind != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < MIN_THINKING_BUDGET:
        raise RequestError(
            f"'thinking.budget_tokens' must be an integer >= {MIN_THINKING_BUDGET}, got {budget!r}",
            field="thinking.budget_tokens",
        )
    if budget >= max_tokens:
        raise RequestError(
            f"'thinking.budget_tokens' must be less than 'max_tokens' ({max_tokens}), got {budget}",
            field="thinking.budget_tokens",
        )
    return budget
