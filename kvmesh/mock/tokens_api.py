"""vLLM's token-in-token-out API (``POST /inference/v1/generate``) on the mock engine, and the abort
that goes with it (``POST /inference/v1/abort_requests``, and ``POST /abort_requests``), as vLLM
0.33.0 serves them.

A body is read as the completion request it amounts to: the router's
:func:`~kvmesh.router.request.tokens_api.completion_view` (``token_ids`` is the prompt, taken as it
is; a 400 when it is missing, empty or holds anything but non-negative integers, or when
``sampling_params`` is not an object), with the sampling fields the mock reads given to
:func:`~kvmesh.mock.protocol.parse_generation` under the same names. An error names the field as the
client sent it (``sampling_params.max_tokens``, ``token_ids``). ``max_tokens`` left out is the room
the context leaves, as vLLM defaults it on this API (not ``SamplingParams``' 16), and as the mock's
completions take it.

Honoured: ``n`` (at most the engine's ``max_num_seqs``, and 1 for greedy sampling, as vLLM
checks; at most 64, as on the mock's completions), ``max_tokens``, ``min_tokens``, ``ignore_eos``,
``seed`` (-1 is none), ``priority``, ``stream`` and ``stream_options`` (``include_usage``,
``continuous_usage_stats``; taken without ``stream`` too, as vLLM takes them),
``return_token_ids``, ``skip_reading_prefix_cache`` (true: the prompt is computed whole),
``kv_transfer_params`` (the mock's simulated hand-off, as on its completions), ``X-Session-ID``,
and ``output_mode`` ``"tokens"`` or ``"text"`` (each choice then carries its text too; it needs
``detokenize``, as vLLM's does). Taken, changing nothing in a
simulator: the temperature and the other sampling knobs, ``stop`` (as completions take it), the
detokenizer's options, ``stream_interval``, ``extra_args``, and the render step's fields that only
``derender`` reads. A ``sampling_params`` key vLLM does not know is ignored, as vLLM's
``SamplingParams`` ignores it; one that must not be null is a 400.

Refused with a 400 naming the field, for what would change the answer and cannot be simulated:
logprobs of every kind, structured outputs, ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
``stop_token_ids``, repetition detection, forced decode tokens, media (``features``,
``content_parts``, ``ec_transfer_params``), a cache key of the client's own (``cache_salt``), and
``output_mode`` ``"derender"`` (a chat parser's work).

The server's request id is ``generate-tokens-`` and the ``X-Request-Id`` header, else the body's
``request_id``, else a new uuid. An answer is ``{"request_id", "model", "created", "usage",
"output_mode", "choices", ...}`` with vLLM's null fields; each choice ``{"index", "finish_reason",
"stop_reason", "token_ids", "logprobs", ...}``; ``usage`` always reports
``prompt_tokens_details.cached_tokens`` (the engine's prefix-cache hit; vLLM only with
``--enable-prompt-tokens-details``). A stream sends, per choice and engine step with new tokens, an
event carrying those tokens only, ``finish_reason`` null until the choice's last; then, with
``include_usage``, an event with no choices and the whole ``usage``; then ``data: [DONE]``.

``abort_requests`` takes ``{"request_ids": [...]}`` (one id as a string too), the server's ids as
the answers carry them; unknown ids are ignored. An aborted request stops in the engine (its blocks
freed) and ends as vLLM ends it: its stream with an event ``finish_reason: "abort"`` (then the
usage, then ``[DONE]``), a whole answer with that finish reason and the tokens made so far.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.errors import RequestError
from kvmesh.mock.config import MockConfig
from kvmesh.mock.engine import TokenStream
from kvmesh.mock.protocol import (
    ParsedRequest,
    bool_field,
    in_client_names,
    is_number,
    parse_generation,
    usage,
)
from kvmesh.router.request.tokenizer import Tokenizer
from kvmesh.router.request.tokens_api import completion_view, sampling_params

REQUEST_ID_PREFIX = "generate-tokens-"
# sampling_params keys the mock reads, under the completion field of the same name.
_AS_COMPLETION = (
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "ignore_eos",
    "seed",
    "thinking_token_budget",
)
# Completion fields (and the prompt) back to the name the client sent (in parse_generation's errors).
_CLIENT_NAME = {"prompt": "token_ids", **{key: f"sampling_params.{key}" for key in _AS_COMPLETION}}
# SamplingParams fields whose type admits no null (the others take null as "not set").
_NOT_NULL = frozenset(
    (
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "ignore_eos",
        "min_tokens",
        "flat_logprobs",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "output_kind",
        "skip_clone",
        "output_text_buffer_length",
        "routed_experts_prompt_start",
    )
)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


# SamplingParams fields that change nothing the mock makes: what they must be.
_INERT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "min_p": (lambda v: is_number(v) and 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: is_number(v) and v > 0.0, "a number greater than 0"),
    "watermarking": (_is_bool, "a boolean"),
    "flat_logprobs": (_is_bool, "a boolean"),
    "detokenize": (_is_bool, "a boolean"),
    "skip_special_tokens": (_is_bool, "a boolean"),
    "spaces_between_special_tokens": (_is_bool, "a boolean"),
    "include_stop_str_in_output": (_is_bool, "a boolean"),
    "skip_clone": (_is_bool, "a boolean"),
    "skip_reading_prefix_cache": (_is_bool, "a boolean"),  # (honoured: read in parse_tokens)
    "output_kind": (lambda v: _is_int(v) and 0 <= v <= 2, "0, 1 or 2"),  # (the server sets its own)
    "stream_interval": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "output_text_buffer_length": (_is_int, "an integer"),
    "routed_experts_prompt_start": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "prompt_logprob_start": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "extra_args": (lambda v: isinstance(v, dict), "an object"),
}
# SamplingParams fields the mock cannot honour: the values besides null that ask nothing of it.
_UNHONOURED: dict[str, tuple[Any, ...]] = {
    "logprobs": (),
    "prompt_logprobs": (),
    "prompt_logprob_token_ids": (),
    "logprob_token_ids": ([],),
    "structured_outputs": (),
    "logit_bias": ({},),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "stop_token_ids": ([],),
    "repetition_detection": (),
    "trace_decode_token_ids": (),
}
# Top-level fields whose effect the mock cannot make: refused when they ask for it.
_REFUSED = {
    "features": "the mock engine takes token prompts without media",
    "content_parts": "the mock engine takes token prompts without media",
    "ec_transfer_params": "the mock engine has no encoder cache to hand off",
    "cache_salt": "the mock engine keeps one prefix cache for every request",
}
_OUTPUT_MODES = ("tokens", "text", "derender")
_GREEDY = 1e-5
"""A temperature below this is greedy sampling (vLLM's)."""
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class TokensRequest:
    """A token-API request as the engine runs it: the completion request it amounts to, and what
    its answer says besides the tokens."""

    completion: ParsedRequest
    request_id: str
    """The server's id (``generate-tokens-...``): the answers carry it, abort_requests names it."""
    output_mode: str
    """``tokens`` or ``text`` (each choice carries its text too)."""
    include_usage: bool
    continuous_usage: bool
    """Every event carries the usage so far (of its choice), as ``continuous_usage_stats`` asks."""
    return_token_ids: bool
    """The answer (a stream's first event) carries the prompt's token ids."""


def parse_tokens(
    body: Any,
    config: MockConfig,
    tokenizer: Tokenizer,
    session: str | None,
    header_id: str | None = None,
) -> TokensRequest:
    """Validate a token-API body and read it as its completion request (a RequestError names the
    field); ``session`` is the request's ``X-Session-ID``, ``header_id`` its ``X-Request-Id``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    view = completion_view(body)
    params = sampling_params(body)
    for field, why in _REFUSED.items():
        if body.get(field) not in (None, [], {}):
            raise RequestError(f"'{field}': {why}", field=field)
    client_id = body.get("request_id")
    if client_id is not None and not isinstance(client_id, str):
        raise RequestError("'request_id' must be a string", field="request_id")
    output_mode = body.get("output_mode", "tokens")
    if output_mode not in _OUTPUT_MODES:
        raise RequestError(
            f"'output_mode' must be one of {list(_OUTPUT_MODES)}, got {output_mode!r}", field="output_mode"
        )
    if output_mode == "derender":
        raise RequestError(
            "'output_mode': 'derender' (a parsed assistant message) is not simulated by the mock "
            "engine; use 'tokens' or 'text'",
            field="output_mode",
        )
    if output_mode != "tokens" and params.get("detokenize") is False:
        raise RequestError(
            f"output_mode={output_mode!r} requires sampling_params.detokenize to be true", field="output_mode"
        )
    include_usage, continuous = _stream_options(body.get("stream_options"))
    wants_prompt = bool_field(body, "return_token_ids", False)

    completion: dict[str, Any] = {"prompt": view["prompt"]}
    for key, value in params.items():
        _check_sampling(key, value)
        if key in _AS_COMPLETION and value is not None:
            completion[key] = value
    if completion.get("seed") == -1:  # (vLLM's "no seed")
        del completion["seed"]
    if completion.get("thinking_token_budget") == -1:  # (vLLM's "unlimited")
        del completion["thinking_token_budget"]
    top_p = completion.get("top_p")
    if top_p is not None and is_number(top_p) and top_p <= 0:
        raise RequestError(
            f"'sampling_params.top_p' must be in (0, 1], got {top_p}", field="sampling_params.top_p"
        )
    if params.get("stop") and params.get("detokenize") is False:
        raise RequestError(
            "'sampling_params.stop': stop strings are only supported when detokenize is true",
            field="sampling_params.stop",
        )
    for key in ("stream", "priority", "kv_transfer_params"):
        if key in body:
            completion[key] = body[key]
    if body.get("model") is not None:
        completion["model"] = body["model"]
    try:
        parsed = parse_generation(completion, "completions", config, tokenizer, session)
    except RequestError as e:
        raise in_client_names(e, _CLIENT_NAME) from None
    _check_choices(parsed.n, completion.get("temperature"), config)
    skip_cache = params.get("skip_reading_prefix_cache")
    if skip_cache is not None:
        parsed = dataclasses.replace(
            parsed, params=dataclasses.replace(parsed.params, reads_cache=not skip_cache)
        )
    request_id = REQUEST_ID_PREFIX + (header_id or client_id or uuid.uuid4().hex)
    return TokensRequest(parsed, request_id, output_mode, include_usage, continuous, wants_prompt)


def tokens_answer(
    request: TokensRequest,
    streams: list[TokenStream],
    text_of: Callable[[list[int]], str],
    created: int,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole answer once every choice's stream has ended (an aborted one too)."""
    choices = []
    for i, stream in enumerate(streams):
        choice = _choice(request, i, stream.finish_reason or "stop", stream.tokens, text_of)
        choices.append(choice)
    first = streams[0]
    return {
        "request_id": request.request_id,
        "model": request.completion.model,
        "created": created,
        "usage": usage(first.prompt_tokens, sum(len(s.tokens) for s in streams), first.cached_tokens),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": request.completion.params.prompt_token_ids if request.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "output_mode": request.output_mode,
        "choices": choices,
    }


async def tokens_events(
    request: TokensRequest,
    streams: list[TokenStream],
    updates: AsyncIterator[tuple[int, list[int], bool]],
    text_of: Callable[[list[int]], str],
) -> AsyncIterator[bytes]:
    """vLLM's stream of ``updates`` (``(choice, new tokens, its last)``): an event per choice and
    batch of new tokens; an aborted choice's last event says so (with the tokens it still had, or
    none); then the usage event if asked, then ``[DONE]``."""
    prompt_ids = request.completion.params.prompt_token_ids if request.return_token_ids else None
    counts = [0] * len(streams)
    ended = [False] * len(streams)

    def event(i: int, batch: list[int], reason: str | None) -> bytes:
        nonlocal prompt_ids
        counts[i] += len(batch)
        out: dict[str, Any] = {"request_id": request.request_id, "usage": None}
        if request.continuous_usage:
            stream = streams[i]
            out["usage"] = usage(stream.prompt_tokens, counts[i], stream.cached_tokens)
        if prompt_ids is not None:  # (the first event only)
            out["prompt_token_ids"] = prompt_ids
            prompt_ids = None
        out["output_mode"] = request.output_mode
        out["choices"] = [_choice(request, i, reason, batch, text_of)]
        return b"data: " + _encode(out) + b"\n\n"

    async for i, batch, last in updates:
        reason = streams[i].finish_reason if last else None
        ended[i] = last
        yield event(i, batch, reason)
    for i, stream in enumerate(streams):
        if not ended[i]:  # (stopped by an abort after its last tokens were sent)
            yield event(i, [], stream.finish_reason or "abort")
    if request.include_usage:
        first = streams[0]
        total = usage(first.prompt_tokens, sum(counts), first.cached_tokens)
        last_event = {
            "request_id": request.request_id,
            "usage": total,
            "output_mode": request.output_mode,
            "choices": [],
        }
        yield b"data: " + _encode(last_event) + b"\n\n"
    yield _DONE


def _choice(
    request: TokensRequest,
    index: int,
    finish_reason: str | None,
    tokens: list[int],
    text_of: Callable[[list[int]], str],
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "finish_reason": finish_reason,
        "stop_reason": None,  # (the mock stops on its EOS token only: vLLM gives none for it)
        "token_ids": tokens,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None,
    }
    if request.output_mode == "text":
        choice["text"] = text_of(tokens)
    choice["logprobs"] = None
    return choice


def _check_sampling(key: str, value: Any) -> None:
    """A 400 naming ``sampling_params.<key>`` for a null where vLLM takes none, a field the mock
    cannot honour asking for something, or an inert one of the wrong kind (the fields read as a
    completion's are checked as those are; keys vLLM does not know are ignored, as vLLM does)."""
    name = f"sampling_params.{key}"
    if value is None:
        if key in _NOT_NULL:
            raise RequestError(f"'{name}' must not be null", field=name)
        return
    if key in _INERT:
        ok, what = _INERT[key]
        if not ok(value):
            raise RequestError(f"'{name}' must be {what}, got {value!r}", field=name)
    elif key in _UNHONOURED and not any(type(v) is type(value) and v == value for v in _UNHONOURED[key]):
        raise RequestError(f"'{name}' is not supported by the mock engine", field=name)


def _check_choices(n: int, temperature: Any, config: MockConfig) -> None:
    """vLLM's bounds on ``n``: the engine's ``max_num_seqs``, and one answer for greedy sampling."""
    if n > config.max_num_seqs:
        raise RequestError(
            f"sampling_params.n must be at most the server's max_num_seqs ({config.max_num_seqs}), got {n}.",
            field="sampling_params.n",
        )
    if n > 1 and temperature is not None and temperature < _GREEDY:
        raise RequestError(
            f"'sampling_params.n' must be 1 when using greedy sampling, got {n}", field="sampling_params.n"
        )


def _stream_options(options: Any) -> tuple[bool, bool]:
    """(``include_usage``, ``continuous_usage_stats``) of ``stream_options``; the second only with
    the first, as vLLM reads them."""
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", field="stream_options")
    include = bool_field(options, "include_usage", False, prefix="stream_options.")
    continuous = bool_field(options, "continuous_usage_stats", False, prefix="stream_options.")
    return include, include and continuous
