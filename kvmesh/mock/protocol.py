"""OpenAI request validation and response shapes for the mock engine, as vLLM serves them.

:func:`parse_generation` turns a ``/v1/chat/completions`` or ``/v1/completions`` body into
:class:`GenerationParams` or raises :class:`RequestError` naming the field. The ``*_chunk`` and
``*_response`` helpers build the JSON objects of the streaming and non-streaming answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvmesh._http import error_body as shared_error_body
from kvmesh.errors import RequestError
from kvmesh.mock.config import MockConfig
from kvmesh.mock.engine import GenerationParams
from kvmesh.router.request.answer_echo import UNKNOWN, answer_echo
from kvmesh.router.request.parse import prompt_recomputed
from kvmesh.router.request.tokenizer import Tokenizer, continues_final_message, prompt_token_ids

Endpoint = Literal["chat", "completions"]


MAX_CHOICES = 64
"""The most choices (``n``) one request may ask for."""


class ModelNotFound(RequestError):
    status = 404


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str
    params: GenerationParams
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's disaggregation hand-off: ``do_remote_decode`` (prefill here) or ``do_remote_prefill``
    (the KV comes from a prefill engine)."""
    n: int = 1
    """Choices to generate for the prompt (``n``), each one an engine request of its own."""
    echo: str = ""
    """What each choice's answer begins with (``echo``): the prompt of a completion, or the last
    message of a chat when the answer continues it, as vLLM echoes them."""


def parse_generation(
    body: Any, endpoint: Endpoint, config: MockConfig, tokenizer: Tokenizer, session_header: str | None = None
) -> ParsedRequest:
    """``session_header``: the request's ``X-Session-ID`` (vLLM's way of naming a turn's session)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    model = body.get("model", config.model)
    if model != config.model:
        raise ModelNotFound(f"The model `{model}` does not exist.", field="model")
    stream = bool_field(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError("'stream_options' must be an object", field="stream_options")
        if not stream:
            raise RequestError(
                "Stream options can only be defined when `stream=True`.", field="stream_options"
            )
        include_usage = bool_field(options, "include_usage", False, prefix="stream_options.")
    n = _opt_int(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise RequestError(
            f"'n' must be at most {MAX_CHOICES}: the mock engine runs each choice as a request", field="n"
        )
    echo = bool_field(body, "echo", False)
    for name, lo, hi in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        _number(body, name, lo, hi)
    logprobs = body.get("logprobs")
    if logprobs not in (None, False, 0):
        raise RequestError("'logprobs' are not supported by the mock engine", field="logprobs")
    if body.get("prompt_logprobs") is not None:
        raise RequestError("'prompt_logprobs' are not supported by the mock engine", field="prompt_logprobs")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise RequestError("'stop' must be a string or a list of strings", field="stop")

    max_field = "max_tokens"
    max_tokens = _opt_int(body, "max_tokens", 1)
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        max_field = "max_completion_tokens"
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
    min_tokens = _opt_int(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise RequestError(
            f"'min_tokens' must be at most '{max_field}' ({max_tokens}), got {min_tokens}", field="min_tokens"
        )
    ignore_eos = bool_field(body, "ignore_eos", False)
    seed = _opt_int(body, "seed", -(2**63))
    priority = _opt_int(body, "priority", -(2**63)) or 0
    _opt_int(body, "thinking_token_budget", 0)  # vLLM's reasoning budget: the mock does not reason
    top_k = body.get("top_k")
    if top_k is not None and (type(top_k) is not int or top_k < -1):
        raise RequestError(f"'top_k' must be an integer >= -1, got {top_k!r}", field="top_k")
    if priority != 0 and config.scheduling_policy != "priority":
        raise RequestError(
            "'priority' can only be set when the engine runs with --scheduling-policy priority",
            field="priority",
        )

    if endpoint == "chat" and continues_final_message(body) and body.get("add_generation_prompt", True):
        # (vLLM: its template refuses the default generation prompt beside the continuation too)
        raise RequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            field="continue_final_message",
        )
    prompt = prompt_token_ids(tokenizer, body, endpoint)
    prompt_field = "messages" if endpoint == "chat" else "prompt"
    limit = config.model_len
    if len(prompt) >= limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{len(prompt)} input tokens. Please reduce the length of the input.",
            field=prompt_field,
        )
    if max_tokens is not None and len(prompt) + max_tokens > limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the input, {max_tokens} in the completion). "
            "Please reduce the length of the input or completion.",
            field=max_field,
        )
    params = GenerationParams(
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        seed=seed,
        priority=priority,
        session_id=session_header or _session_id(body),
        # (a chat echo asks vLLM for prompt logprobs, top_logprobs being 0: it reads no cache)
        reads_cache=not prompt_recomputed(body, endpoint),
    )
    transfer = body.get("kv_transfer_params")
    if transfer is not None and not isinstance(transfer, dict):
        raise RequestError("'kv_transfer_params' must be an object", field="kv_transfer_params")
    if transfer is not None and n > 1:
        raise RequestError("'n' must be 1 for a disaggregated hand-off (kv_transfer_params)", field="n")
    echoed = _echo_text(body, endpoint, prompt, tokenizer) if echo else ""
    return ParsedRequest(endpoint, config.model, params, stream, include_usage, transfer, n, echoed)


def _echo_text(body: Mapping[str, Any], endpoint: Endpoint, prompt: list[int], tokenizer: Tokenizer) -> str:
    """What vLLM puts before each choice's answer for ``echo``; a prompt of token ids is echoed as
    this tokenizer decodes it."""
    echo = answer_echo(body, endpoint)
    if echo == UNKNOWN:
        return tokenizer.decode(prompt)
    return echo or ""


def _session_id(body: Mapping[str, Any]) -> str | None:
    """The engine session a request belongs to, from the body: SGLang's ``session_params.id`` or
    kvmesh's nvext (a client talking to the mock directly)."""
    params = body.get("session_params")
    if params is not None:
        if not isinstance(params, dict) or not isinstance(params.get("id"), str):
            raise RequestError("'session_params.id' must be a string", field="session_params.id")
        return str(params["id"])
    nvext = body.get("nvext")
    if isinstance(nvext, dict):
        control = nvext.get("session_control")
        if isinstance(control, dict) and isinstance(control.get("session_id"), str):
            return str(control["session_id"])
    return None


def is_number(value: Any) -> bool:
    """A finite JSON number (not a boolean)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def bool_field(body: Mapping[str, Any], name: str, default: bool, *, prefix: str = "") -> bool:
    """``body[name]``, a boolean (``default`` when absent or null); a 400 naming ``prefix + name``
    for anything else."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{prefix}{name}' must be a boolean, got {value!r}", field=prefix + name)
    return value


def _opt_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        bound = (
            "a positive integer"
            if minimum == 1
            else ("a non-negative integer" if minimum == 0 else "an integer")
        )
        raise RequestError(f"'{name}' must be {bound}, got {value!r}", field=name)
    return value


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        raise RequestError(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {value!r}", field=name)


# --- responses --------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def in_client_names(error: RequestError, names: Mapping[str, str]) -> RequestError:
    """``error``, raised reading a body as another API's, with each field it names as the client
    sent it (``names``: that API's name to the client's)."""
    message = str(error)
    for ours, theirs in names.items():
        message = message.replace(f"'{ours}'", f"'{theirs}'")
    field = names.get(error.field, error.field) if error.field is not None else None
    return RequestError(message, field=field, status=error.status)


def error_body(message: str, *, status: int, field: str | None) -> dict[str, Any]:
    return shared_error_body(message, status, field)
