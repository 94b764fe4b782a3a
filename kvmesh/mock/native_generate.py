"""SGLang's native generation API (``POST /generate``, PUT too) on the mock engine, as SGLang
0.5.23 serves it.

A body of one prompt is read as the completion request it amounts to: the router's
:func:`~kvmesh.router.request.generate_api.completion_view` (the prompt from ``text`` or
``input_ids``; a 400 for ``input_embeds``, for no prompt), with ``sampling_params`` given their
completion names, then checked and tokenized as a completion is
(:func:`~kvmesh.mock.protocol.parse_generation`). A batch (``text`` a list, ``input_ids`` a list of
lists) is cut into such bodies, one per prompt, first (:mod:`kvmesh.mock.batches`). An error names
the field as the client sent it (``sampling_params.max_new_tokens``, not ``max_tokens``).
``max_new_tokens`` left out is SGLang's 128, cut to the room the context leaves, as SGLang cuts it.

The mock honours what it honours for a completion and takes what changes nothing in a simulator
(the sampling temperature and its kin, ``stop`` as completions take it, the logprob options without
``return_logprob``, a disaggregation room an engine that is not disaggregated ignores). What would
change the answer and cannot be simulated is a 400 naming the field: logprobs, hidden states,
constrained decoding, logit bias, beams, media, LoRA adapters, a cache key of the client's own
(``cache_salt``, ``extra_key``), and any sampling key SGLang does not know.

The answer is ``{"text", "output_ids", "meta_info"}``, ``meta_info`` holding ``id`` (``rid``, or
a new hex id), ``finish_reason`` (``{"type": "length", "length": N}`` or ``{"type": "stop",
"matched": <token id>}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (the engine's
prefix-cache hit) and ``e2e_latency`` (seconds). With ``n`` > 1 the answers are a list in sample
order, each with an id of its own (SGLang gives every sample a new one, and no ``index`` outside a
stream). A stream sends, each time an answer grows, its whole text and ``output_ids`` so far (SGLang
streams cumulatively unless started with ``--incremental-streaming-output``), ``finish_reason``
null until its last event, ``index`` when ``n`` > 1; then ``data: [DONE]``.

``POST /abort_request`` stops a request by its ``rid`` (:mod:`kvmesh.mock.sglang_abort`): it is
answered with the tokens made so far and ``{"type": "abort", ...}`` as its finish reason (a stream's
last event), where a request whose client left, or whose engine stopped, gets no answer.
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
from kvmesh.mock.protocol import ParsedRequest, in_client_names, is_number, parse_generation
from kvmesh.mock.sglang_abort import abort_reason, request_rid
from kvmesh.router.request.generate_api import completion_view, sampling_params
from kvmesh.router.request.tokenizer import Tokenizer

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's ``max_new_tokens`` when a request leaves it out."""
# sampling_params keys the mock reads, by the completion field it reads them as.
_AS_COMPLETION = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "n": "n",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "sampling_seed": "seed",
}
# Completion fields back to the name the client sent (in parse_generation's errors).
_CLIENT_NAME = {field: f"sampling_params.{key}" for key, field in _AS_COMPLETION.items()}
# sampling_params keys SGLang knows that change nothing the mock makes: what they must be.
_INERT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "min_p": (lambda v: is_number(v) and 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: is_number(v) and 0.0 < v <= 2.0, "a number in (0, 2]"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "a boolean"),
    "spaces_between_special_tokens": (lambda v: isinstance(v, bool), "a boolean"),
    "stream_interval": (lambda v: type(v) is int and v >= 1, "a positive integer"),
}
# sampling_params keys SGLang knows that the mock cannot honour: the values that ask nothing of it.
_UNHONOURED: dict[str, tuple[Any, ...]] = {
    "stop_token_ids": ([],),
    "stop_regex": ("", []),
    "json_schema": (),
    "regex": (),
    "ebnf": (),
    "structural_tag": (),
    "no_stop_trim": (False,),
    "logit_bias": ({},),
    "custom_params": (),
    "beam_width": (1,),
    "watermark": (),
    "choice": ([],),
}
# Top-level fields whose effect the mock cannot make: refused when they ask for it.
_REFUSED = {
    "return_logprob": "logprobs are not simulated by the mock engine",
    "return_hidden_states": "hidden states are not simulated by the mock engine",
    "return_sampling_mask": "sampling masks are not simulated by the mock engine",
    "custom_logit_processor": "custom logit processors are not run by the mock engine",
    "image_data": "the mock engine takes text prompts only",
    "video_data": "the mock engine takes text prompts only",
    "audio_data": "the mock engine takes text prompts only",
    "lora_path": "the mock engine serves no LoRA adapters",
    "cache_salt": "the mock engine keeps one prefix cache for every request",
    "extra_key": "the mock engine keeps one prefix cache for every request",
}
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A ``/generate`` request as the engine runs it: the completion request it amounts to, and
    what its answer says besides the tokens."""

    completion: ParsedRequest
    rid: str | None
    """The client's ``rid``: ``/abort_request`` names the request by it."""
    answer_ids: tuple[str, ...]
    """Each answer's ``meta_info.id``."""
    prompt_token_ids: bool
    """``return_prompt_token_ids``: each answer carries the prompt's token ids."""


def parse_generate(
    body: Any, config: MockConfig, tokenizer: Tokenizer, session: str | None
) -> GenerateRequest:
    """Validate a ``/generate`` body and read it as its completion request (a RequestError names
    the field); ``session`` is the request's ``X-Session-ID``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    view = completion_view(body)
    prompt_field = "text" if body.get("text") is not None else "input_ids"
    if isinstance(view["prompt"], list) and not all(type(t) is int for t in view["prompt"]):
        raise RequestError("'input_ids' must be a list of token ids", field="input_ids")
    for field, why in _REFUSED.items():
        if body.get(field) not in (None, False, "", [], {}):
            raise RequestError(f"'{field}': {why}", field=field)
    rid = request_rid(body)
    wants_prompt = body.get("return_prompt_token_ids", False)
    if not isinstance(wants_prompt, bool):
        raise RequestError("'return_prompt_token_ids' must be a boolean", field="return_prompt_token_ids")
    params = sampling_params(body)
    completion: dict[str, Any] = {"prompt": view["prompt"]}
    for key, value in params.items():
        _check_sampling(key, value)
        if key in _AS_COMPLETION:
            completion[_AS_COMPLETION[key]] = value
    for key in ("stream", "priority", "session_params"):
        if key in body:
            completion[key] = body[key]
    try:
        parsed = parse_generation(completion, "completions", config, tokenizer, session)
    except RequestError as e:
        raise in_client_names(e, {**_CLIENT_NAME, "prompt": prompt_field}) from None
    if "max_new_tokens" not in params:
        parsed = _default_length(parsed, config)
    n = parsed.n
    ids = (rid or uuid.uuid4().hex,) if n == 1 else tuple(uuid.uuid4().hex for _ in range(n))
    return GenerateRequest(parsed, rid, ids, wants_prompt)


def generate_answer(
    request: GenerateRequest, streams: list[TokenStream], text_of: Callable[[list[int]], str], now: float
) -> Any:
    """The whole answer once every stream has finished: one object, or a list of them for n > 1."""
    answers = [
        _answer(request, i, stream, stream.tokens, text_of(stream.tokens), now)
        for i, stream in enumerate(streams)
    ]
    return answers[0] if len(answers) == 1 else answers


async def generate_events(
    request: GenerateRequest,
    streams: list[TokenStream],
    updates: AsyncIterator[tuple[int, list[int], bool]],
    text_of: Callable[[list[int]], str],
    clock: Callable[[], float],
) -> AsyncIterator[bytes]:
    """SGLang's stream of ``updates`` (``(answer, new tokens, its last)``): each event an answer
    whole so far, then ``[DONE]``; an answer aborted by ``/abort_request`` after its last tokens were
    sent ends with one more event saying so; nothing more once the engine stopped a request."""
    many = len(streams) > 1
    tokens: list[list[int]] = [[] for _ in streams]
    texts = [""] * len(streams)
    ended = [False] * len(streams)

    def event(i: int, last: bool) -> bytes:
        out = _answer(request, i, streams[i], tokens[i], texts[i], clock() if last else None)
        if many:
            out["index"] = i
        return b"data: " + _encode(out) + b"\n\n"

    async for i, batch, last in updates:
        if last and streams[i].stopped:
            return
        tokens[i].extend(batch)
        texts[i] += text_of(batch)
        ended[i] = last
        yield event(i, last)
    if any(stream.stopped for stream in streams):
        return
    for i in range(len(streams)):
        if not ended[i]:
            yield event(i, True)
    yield _DONE


def _answer(
    request: GenerateRequest,
    i: int,
    stream: TokenStream,
    tokens: list[int],
    text: str,
    finished_at: float | None,
) -> dict[str, Any]:
    """Answer ``i`` with ``tokens`` so far; ``finished_at`` (the engine's clock) once it is whole."""
    meta: dict[str, Any] = {
        "id": request.answer_ids[i],
        "finish_reason": None if finished_at is None else _finish_reason(stream, tokens),
        "prompt_tokens": stream.prompt_tokens,
        "completion_tokens": len(tokens),
        "cached_tokens": stream.cached_tokens,
    }
    if finished_at is not None:
        meta["e2e_latency"] = finished_at - stream.arrival
    out: dict[str, Any] = {"text": text, "output_ids": tokens, "meta_info": meta}
    if request.prompt_token_ids:
        out["prompt_token_ids"] = request.completion.params.prompt_token_ids
    return out


def _finish_reason(stream: TokenStream, tokens: list[int]) -> dict[str, Any]:
    if stream.finish_reason == "abort":
        return abort_reason(stream)
    if stream.finish_reason == "stop":  # (the mock stops on its EOS token only)
        return {"type": "stop", "matched": tokens[-1]}
    return {"type": "length", "length": len(tokens)}


def _check_sampling(key: str, value: Any) -> None:
    """A 400 naming ``sampling_params.<key>`` for a key SGLang does not know, one the mock cannot
    honour asking for something, or an inert one of the wrong kind (mapped keys are checked as
    their completion fields are)."""
    if key in _AS_COMPLETION:
        return
    name = f"sampling_params.{key}"
    if key not in _INERT and key not in _UNHONOURED:
        raise RequestError(f"'{name}' is not a sampling parameter SGLang knows", field=name)
    if value is None:
        return
    if key in _INERT:
        ok, what = _INERT[key]
        if not ok(value):
            raise RequestError(f"'{name}' must be {what}, got {value!r}", field=name)
    elif not any(type(value) is type(h) and value == h for h in _UNHONOURED[key]):
        raise RequestError(f"'{name}' is not supported by the mock engine", field=name)


def _default_length(parsed: ParsedRequest, config: MockConfig) -> ParsedRequest:
    """SGLang's default ``max_new_tokens``, cut to the room the prompt leaves in the context."""
    params = parsed.params
    limit = min(DEFAULT_MAX_NEW_TOKENS, config.model_len - len(params.prompt_token_ids))
    if params.min_tokens > limit:
        raise RequestError(
            f"'sampling_params.min_new_tokens' must be at most 'sampling_params.max_new_tokens' "
            f"({limit}, the default), got {params.min_tokens}",
            field="sampling_params.min_new_tokens",
        )
    return dataclasses.replace(parsed, params=dataclasses.replace(params, max_tokens=limit))
