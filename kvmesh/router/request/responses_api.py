"""OpenAI's Responses API (``POST /v1/responses``) read as the chat request an engine renders it as.

vLLM, SGLang and TensorRT-LLM serve ``/v1/responses`` by turning its ``instructions``, ``input``
items and function ``tools`` into chat messages and tool definitions, then rendering them with the
chat template, as for ``/v1/chat/completions``. :func:`chat_view` does that turning the way vLLM
0.33.0 does it (``construct_input_messages``, ``construct_tool_dicts``, ``build_chat_params``), so
a Responses prompt hashes to the blocks the engine caches, and a conversation held as Responses
items shares its prefix with the same conversation sent as chat messages. The engine gets the
client's body unchanged.

What the router cannot follow is refused here, naming the field (a 400 the client can fix):
``background`` (the engine answers at once and works on; nobody would wait for that work, so its
load would never be counted) and an encrypted reasoning item (vLLM refuses it as well).

``previous_response_id`` names a response an engine stored (vLLM with
``VLLM_ENABLE_RESPONSES_API_STORE=1``, SGLang with ``--enable-response-store``). Only that engine
has it, so such a request goes there (:class:`ResponseHomes`, kept by the mesh; the routing is
``RoutedRequest._home`` in :mod:`kvmesh.router.asgi.routed`); its prompt here is only what it adds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvmesh.errors import ConfigError, RequestError
from kvmesh.router.request.tokenizer import TEXT_PARTS

RESPONSES_PATH = "/v1/responses"
_MESSAGE_ROLES = frozenset(("user", "system", "developer", "assistant"))
# Items that continue an assistant answer the client prefilled (vLLM's should_continue_final_message).
_OPEN_STATUSES = frozenset(("in_progress", "incomplete"))
_NAMESPACE_SEPARATOR = "__"  # vLLM's flat name of a namespaced function tool
_CUSTOM_INPUT_KEY = "input"  # vLLM renders a custom tool call's input as {"input": ...}
# The request fields the engine renders or keys its cache with, carried into the chat view.
_CARRIED = ("model", "cache_salt", "chat_template_kwargs")


def is_responses(endpoint: str) -> bool:
    """Whether ``endpoint`` (a request path or its short name) is the Responses API."""
    return endpoint.endswith("/responses") or endpoint == "responses"


def chat_view(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body (``messages``, ``tools``, ``add_generation_prompt``,
    ``continue_final_message``, and what keys the cache) an engine renders this Responses body as.
    A 400 naming the field for what no engine would render."""
    if body.get("background") is True:
        raise RequestError(
            "'background': a background response keeps the engine working after the answer is "
            "sent, which a router cannot count; send it without background (or poll the engine "
            "directly)",
            field="background",
        )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string", field="instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        continued = False
    elif isinstance(items, list) and items:
        for i, item in enumerate(items):
            _add_item(messages, item, i)
        continued = _continues(items[-1])
    elif items is None:
        raise RequestError("'input' is a required property", field="input")
    else:
        raise RequestError("'input' must be a string or a non-empty list of items", field="input")
    view: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": not continued,
        "continue_final_message": continued,
    }
    tools = _function_tools(body.get("tools"))
    if tools:
        view["tools"] = tools
    for key in _CARRIED:
        if key in body:
            view[key] = body[key]
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:  # a template argument: it keys the cache as chat_template_kwargs do
        kwargs = view.get("chat_template_kwargs")
        view["chat_template_kwargs"] = {
            **(kwargs if isinstance(kwargs, dict) else {}),
            "reasoning_effort": effort,
        }
    return view


def rendered_as_chat(body: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """The chat body the serving engine renders a Responses body as: :func:`chat_view` (vLLM's
    way, and the checks every engine makes), or, where the engine's tokenizer renders Responses
    bodies its own way (``responses_as_chat``, SGLang's), that, with what keys the cache kept."""
    view = chat_view(body)
    rendered = engine_rendering(getattr(tokenizer, "responses_as_chat", None), body, "input")
    if rendered is None:
        return view
    return {**{k: view[k] for k in _CARRIED if k in view}, **rendered}


def engine_rendering(own: Any, body: dict[str, Any], field: str) -> dict[str, Any] | None:
    """What an engine's own conversion ``own`` (a tokenizer's hook) makes of ``body``; None with
    no hook, or where the hook has nothing to say. What the engine's validation refuses is the
    client's 400, naming the top-level field it is about (``field`` when it names none)."""
    if own is None:
        return None
    try:
        rendered: dict[str, Any] | None = own(body)
    except (RequestError, ConfigError):
        raise
    except Exception as e:  # (the engine's own validation: a body it would refuse)
        named = _invalid_field(e) or field
        raise RequestError(f"'{named}' is not one the engine takes: {e}", field=named) from None
    return rendered


def _invalid_field(error: Exception) -> str | None:
    """The top-level field a validation error (pydantic's, as the engines' request models raise)
    is about, or None. (Deeper parts of its location name the union member tried, not the
    client's keys.)"""
    errors = getattr(error, "errors", None)
    try:
        loc = errors()[0]["loc"] if callable(errors) else None
    except Exception:
        return None
    return loc[0] if loc and isinstance(loc[0], str) else None


def previous_response_id(body: dict[str, Any]) -> str | None:
    """The stored response this request continues, or None (a 400 when it is not a string)."""
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError("'previous_response_id' must be a non-empty string", field="previous_response_id")
    return value


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A Responses ``usage`` (``input_tokens``, ``output_tokens``,
    ``input_tokens_details.cached_tokens``) in chat's names, which the router's accounting reads."""
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    out: dict[str, Any] = {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


# ---------------------------------------------------------------------- items
def _add_item(messages: list[dict[str, Any]], item: Any, i: int) -> None:
    """Append the message ``item`` becomes, or fold it into the assistant message before it (a
    reasoning item, the answer text and the tool calls of one assistant turn arrive as separate
    items and render as one message)."""
    field = f"input[{i}]"
    if not isinstance(item, dict):
        raise RequestError(f"'{field}' must be an object", field=field)
    kind = item.get("type")
    last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item, kind, field)
        if last is not None:
            calls = last.get("tool_calls")
            if calls is None:
                last["tool_calls"] = [call]
                return
            if isinstance(calls, list):
                calls.append(call)
                return
        messages.append({"role": "assistant", "tool_calls": [call]})
        return
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise RequestError(
                f"'{field}.encrypted_content' is not supported", field=f"{field}.encrypted_content"
            )
        text = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
        if last is not None and last.get("reasoning") is None:
            last["reasoning"] = text
            return
        messages.append({"role": "assistant", "reasoning": text})
        return
    if kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("output"), (str, list)):
            raise RequestError(
                f"'{field}.output' must be a string or a list of parts", field=f"{field}.output"
            )
        messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        return
    role = item.get("role")
    if role is None:
        raise RequestError(
            f"'{field}.type' {kind!r} is not an input item an engine renders", field=f"{field}.type"
        )
    if not isinstance(role, str) or role not in _MESSAGE_ROLES:
        raise RequestError(
            f"'{field}.role' must be one of {sorted(_MESSAGE_ROLES)}, got {role!r}", field=f"{field}.role"
        )
    content = item.get("content")
    if not isinstance(content, (str, list)):
        raise RequestError(f"'{field}.content' must be a string or a list of parts", field=f"{field}.content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(
                    f"'{field}.content[{j}]' must be an object with a 'type'", field=f"{field}.content[{j}]"
                )
            if part["type"] in TEXT_PARTS and not isinstance(part.get("text"), str):
                where = f"{field}.content[{j}].text"
                raise RequestError(f"'{where}' must be a string", field=where)
    if role == "assistant":
        # An answer sent back: its first part's text, as the engine reads it.
        said = content if isinstance(content, str) else (content[0].get("text") if content else None)
        if isinstance(said, str):
            if last is not None and last.get("content") is None:
                last["content"] = said
                return
            messages.append({"role": "assistant", "content": said})
            return
    messages.append(dict(item))  # the engine renders the item itself (its parts, its "type")


def _tool_call(item: dict[str, Any], kind: str, field: str) -> dict[str, Any]:
    names = ("call_id", "name", "arguments" if kind == "function_call" else "input")
    for name in names:
        if not isinstance(item.get(name), str):
            raise RequestError(f"'{field}.{name}' must be a string", field=f"{field}.{name}")
    name = item["name"]
    namespace = item.get("namespace")
    if kind == "function_call" and namespace:
        name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
    if kind == "function_call":
        arguments = item["arguments"]
    else:
        arguments = json.dumps({_CUSTOM_INPUT_KEY: item["input"]}, ensure_ascii=False)
    return {"id": item["call_id"], "function": {"name": name, "arguments": arguments}, "type": "function"}


def _first_text(parts: Any) -> str | None:
    if isinstance(parts, list) and parts and isinstance(parts[0], dict):
        text = parts[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _continues(item: Any) -> bool:
    """Whether the last item is an assistant message or reasoning the client left open."""
    return (
        isinstance(item, dict)
        and item.get("type", "message") in ("message", "reasoning")
        and isinstance(status := item.get("status"), str)
        and status in _OPEN_STATUSES
    )


def _function_tools(tools: Any) -> list[dict[str, Any]]:
    """The function tools as chat tool definitions, the way vLLM renders them (``description``
    and ``parameters`` always present, ``strict`` when given). Other tool types (web search, MCP,
    file search) are the engine's own and are not rendered into the prompt."""
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("'tools' must be a list of objects", field="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, tool.get("name"), f"tools[{i}]"))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    name = f"{tool.get('name')}{_NAMESPACE_SEPARATOR}{inner.get('name')}"
                    out.append(_function(inner, name, f"tools[{i}]"))
    return out


def _function(tool: dict[str, Any], name: Any, field: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise RequestError(f"'{field}.name' must be a non-empty string", field=f"{field}.name")
    function: dict[str, Any] = {
        "name": name,
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
    }
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _reasoning_effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise RequestError("'reasoning' must be an object", field="reasoning")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise RequestError("'reasoning.effort' must be a string", field="reasoning.effort")
    return effort


class ResponseHomes:
    """Which worker holds each thing only one engine has, newest ``capacity`` kept: a stored
    response this router relayed (a request naming it as ``previous_response_id`` can only be
    served there: the engine keeps the response, and its history, in its own memory), or a
    session opened through it. ``on_change(key, worker or None)`` hears what this router learns
    and forgets itself (replica sync tells the other replicas); what a peer said is taken with
    :meth:`learn` and :meth:`unlearn`, which tell no one."""

    __slots__ = ("_capacity", "_homes", "on_change")

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._homes: dict[str, str] = {}
        self.on_change: Callable[[str, str | None], None] | None = None

    def remember(self, response_id: str, worker_id: str) -> None:
        self.learn(response_id, worker_id)
        if self.on_change is not None:
            self.on_change(response_id, worker_id)

    def learn(self, response_id: str, worker_id: str) -> None:
        homes = self._homes
        homes.pop(response_id, None)  # (a re-insert makes it the newest)
        homes[response_id] = worker_id
        if len(homes) > self._capacity:
            del homes[next(iter(homes))]

    def home(self, response_id: str) -> str | None:
        return self._homes.get(response_id)

    def forget(self, response_id: str) -> None:
        if self._homes.pop(response_id, None) is not None and self.on_change is not None:
            self.on_change(response_id, None)

    def unlearn(self, response_id: str) -> None:
        self._homes.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._homes)
