"""Anthropic's Messages API (``POST /v1/messages``) read as the chat request an engine renders it as.

vLLM and SGLang serve ``/v1/messages`` (Claude Code and the Anthropic SDKs send it) by converting
the body into a chat completion request and serving that; NVIDIA Dynamo's frontend routes it the
same way. :func:`chat_view` converts it as vLLM 0.33.0 does
(``AnthropicServingMessages.to_chat_completion_request``): the ``system`` text first (Claude
Code's per-request billing header left out, as vLLM leaves it out), then each message, its
``tool_use`` blocks as tool calls, a user's ``tool_result`` blocks as tool messages before it (their
images in a user message, the tools they reference in a tool message of their own), its
``thinking`` as reasoning, and the ``tools`` as function tools. Inside an engine the adapter's
tokenizer converts with the engine's own code instead (``messages_as_chat``: vLLM's classmethod,
SGLang's serving), which also knows what only the engine knows: whether its chat template needs
inline system messages merged into the first one. The engine gets the client's body unchanged.

The answer is read in its own names (:func:`messages_usage`): Anthropic's ``input_tokens``
exclude the cached ones, which are ``cache_read_input_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.errors import RequestError
from kvmesh.router.request.responses_api import engine_rendering

MESSAGES_PATH = "/v1/messages"
_ROLES = frozenset(("user", "assistant", "system"))
_BILLING_HEADER = "x-anthropic-billing-header"  # (Claude Code's: a per-request hash, never cached)
# The request fields that key the engine's cache or template, carried into the chat view.
_CARRIED = ("model", "cache_salt", "chat_template_kwargs")


def is_messages(endpoint: str) -> bool:
    """Whether ``endpoint`` (a request path or its short name) is Anthropic's Messages API."""
    return endpoint == MESSAGES_PATH or endpoint == "messages"


def chat_view(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body (``messages``, ``tools``, what keys the cache) vLLM renders this Messages
    body as; a 400 naming the field for what no engine would take."""
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or max_tokens <= 0:
        raise RequestError("'max_tokens' is required: a positive integer", field="max_tokens")
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise RequestError("'messages' must be a non-empty list", field="messages")
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
    for i, item in enumerate(items):
        _add_message(messages, item, f"messages[{i}]")
    view: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
    tools = _tools(_tools_in_effect(body.get("tools"), items))
    if tools is not None:
        view["tools"] = tools
    for key in _CARRIED:
        if key in body:
            view[key] = body[key]
    kwargs = view.get("chat_template_kwargs")
    arguments = template_arguments(kwargs if isinstance(kwargs, dict) else None, _reasoning_effort(body))
    if arguments:  # (the effort is a template argument: it keys the cache as chat_template_kwargs do)
        view["chat_template_kwargs"] = arguments
    return view


def template_arguments(kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any]:
    """A chat request's template arguments with its reasoning effort among them, as the engines'
    chat paths hand it to the template."""
    out = dict(kwargs or {})
    if effort is not None:
        out["reasoning_effort"] = effort
    return out


def rendered_as_chat(body: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """The chat body the serving engine renders a Messages body as: :func:`chat_view`, or, where
    the engine's tokenizer converts Messages bodies itself (``messages_as_chat``), that."""
    view = chat_view(body)
    rendered = engine_rendering(getattr(tokenizer, "messages_as_chat", None), body, "messages")
    return view if rendered is None else rendered


def messages_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic ``usage`` in chat's names, which the router's accounting reads: the prompt is
    ``input_tokens`` plus the cached and cache-written tokens, the cached ones
    ``cache_read_input_tokens``."""
    parts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
    prompt = sum(p for p in parts if type(p) is int)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": usage.get("output_tokens")}
    cached = usage.get("cache_read_input_tokens")
    if type(cached) is int:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def is_anthropic_usage(usage: dict[str, Any]) -> bool:
    """Whether a ``usage`` is in Anthropic's names (cache fields of its own) rather than the
    Responses API's (``input_tokens_details``)."""
    return "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage


# ---------------------------------------------------------------------- messages
def _system_text(system: Any, field: str) -> str:
    """The text of a ``system`` field (a string or text blocks), billing headers left out."""
    if system is None or system == "":
        return ""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise RequestError(f"'{field}' must be a string or a list of text blocks", field=field)
    parts = []
    for j, block in enumerate(system):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"'{field}[{j}]' must be an object with a 'type'", field=f"{field}[{j}]")
        text = block.get("text")
        if (
            block["type"] == "text"
            and isinstance(text, str)
            and text
            and not text.startswith(_BILLING_HEADER)
        ):
            parts.append(text)
    return "".join(parts)


def _add_message(messages: list[dict[str, Any]], item: Any, field: str) -> None:
    if not isinstance(item, dict):
        raise RequestError(f"'{field}' must be an object", field=field)
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise RequestError(
            f"'{field}.role' must be one of {sorted(_ROLES)}, got {role!r}", field=f"{field}.role"
        )
    content = item.get("content")
    if role == "system":
        text = content if isinstance(content, str) else _system_text(content, f"{field}.content")
        if text and not text.startswith(_BILLING_HEADER):
            messages.append({"role": "system", "content": text})
        return
    message: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        message["content"] = content
    elif isinstance(content, list):
        _add_blocks(messages, message, content, f"{field}.content")
    else:
        raise RequestError(
            f"'{field}.content' must be a string or a list of blocks", field=f"{field}.content"
        )
    if not (role == "user" and "content" not in message):
        messages.append(message)


def _add_blocks(
    messages: list[dict[str, Any]], message: dict[str, Any], blocks: list[Any], field: str
) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        where = f"{field}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"'{where}' must be an object with a 'type'", field=where)
        kind = block["type"]
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str) and text:
                parts.append({"type": "text", "text": text})
        elif kind == "image":
            source = block.get("source")
            if isinstance(source, dict) and source:
                parts.append({"type": "image_url", "image_url": {"url": _image_url(source)}})
        elif kind == "thinking":
            thinking = block.get("thinking")
            if isinstance(thinking, str):
                reasoning.append(thinking)
        elif kind == "tool_use":
            name = block.get("name")
            calls.append(
                {
                    "id": block.get("id") or "call_0",
                    "type": "function",
                    "function": {"name": name or "", "arguments": json.dumps(block.get("input") or {})},
                }
            )
        elif kind == "tool_result":
            if message["role"] == "user":
                messages.extend(_result_messages(block))
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {result if result else ''}"})
        # (redacted thinking is opaque, a tool reference outside a result renders as nothing, and
        # changes to the tool list are read with the tools: _tools_in_effect)
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        message["content"] = parts[0]["text"] if only_text else parts


def _result_messages(block: dict[str, Any]) -> list[dict[str, Any]]:
    """A user's ``tool_result`` as the messages vLLM makes of it: a tool message of its text, then
    a user message of its images (a chat template shows no image in a tool message), then a tool
    message of the tools it references, when it has either."""
    call_id = block.get("tool_use_id") or ""
    content = block.get("content")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text" and isinstance(item.get("text", ""), str):
                texts.append(item.get("text", ""))
            elif kind == "image":
                source = item.get("source")
                url = _image_url(source if isinstance(source, dict) else {})
                if url:
                    images.append({"type": "image_url", "image_url": {"url": url}})
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": "\n".join(texts)}]
    if images:
        out.append({"role": "user", "content": images})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tools_in_effect(tools: Any, items: list[Any]) -> Any:
    """The tools once the conversation's ``tool_addition`` / ``tool_removal`` blocks are applied,
    in order, as vLLM applies them (a chat template sees one list): a tool added by value is
    declared, one added by name is no longer deferred, one removed is dropped. A change that names
    no declared tool is a 400 naming the block, as vLLM refuses it."""
    changes = [
        (f"messages[{i}].content[{j}]", block)
        for i, item in enumerate(items)
        if isinstance(item, dict) and isinstance(item.get("content"), list)
        for j, block in enumerate(item["content"])
        if isinstance(block, dict) and block.get("type") in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return tools
    _tools(tools)  # (the declared tools are checked as they are without changes, naming 'tools[i]')
    declared = {t["name"]: t for t in tools or ()}
    removed: set[str] = set()
    for where, block in changes:
        change: dict[str, Any] = block["tool"] if isinstance(block.get("tool"), dict) else {}
        kind = change.get("type")
        definition: Any = change.get("definition")
        if kind == "tool_definition" and block["type"] == "tool_addition" and isinstance(definition, dict):
            _function(definition, f"{where}.tool.definition")
            name = definition["name"]
            declared[name] = definition
        elif kind == "tool_reference" and isinstance(change.get("name"), str):
            name = change["name"]
            if name not in declared:
                raise RequestError(
                    f"'{where}' names the tool {name!r}, which 'tools' does not declare",
                    field=f"{where}.tool",
                )
            if block["type"] == "tool_addition":
                declared[name] = {**declared[name], "defer_loading": None}
        else:
            raise RequestError(
                f"'{where}.tool' must be a tool_reference with a 'name'"
                + (" or a tool_definition" if block["type"] == "tool_addition" else ""),
                field=f"{where}.tool",
            )
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in declared.items() if name not in removed]


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", field="tools")
    return [{"type": "function", "function": _function(tool, f"tools[{i}]")} for i, tool in enumerate(tools)]


def _function(tool: Any, where: str) -> dict[str, Any]:
    """An Anthropic tool (at ``where`` in the body) as the chat function vLLM makes of it; a 400
    naming the field for one without a name or an object schema."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise RequestError(f"'{where}' must be an object with a 'name'", field=where)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise RequestError(f"'{where}.input_schema' must be an object", field=f"{where}.input_schema")
    function = {
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": schema if "type" in schema else {**schema, "type": "object"},
    }
    for key in ("strict", "defer_loading"):  # (vLLM's tool keeps these only when sent)
        if tool.get(key) is not None:
            function[key] = tool[key]
    return function


def _reasoning_effort(body: dict[str, Any]) -> str | None:
    """The reasoning effort vLLM renders the request with: ``output_config.effort``, or, for
    thinking turned off, the effort that turns it off (vLLM works out which for its model; the
    router only needs the prompts so keyed kept apart from the others)."""
    effort: str | None = None
    config = body.get("output_config")
    if isinstance(config, dict) and isinstance(config.get("effort"), str):
        effort = config["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = "none"
    return effort
