"""One OpenAI request body, parsed once into what every later phase reads: :class:`ParsedRequest`.

Pure: the caller passes the tokenizer, the fleet's block size, the LoRA resolver and a clock (for
the tokenize / hash phase timings the metrics report), so the same function serves the routed path,
the hop path and tests without a running fleet. A problem the client can fix is a
:class:`~kvmesh.errors.RequestError` naming the field; a tokenizer that is not ready
(:class:`~kvmesh.errors.ConfigError`) stays a server error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.errors import ConfigError, RequestError
from kvmesh.hashing import block_hashes
from kvmesh.router.request.nvext import EMPTY, PREFILL_HEADER, WORKER_HEADER, Nvext, parse_nvext
from kvmesh.router.request.tokenizer import Tokenizer, prompt_token_ids

_WORKER_HEADER_B = WORKER_HEADER.encode()
_PREFILL_HEADER_B = PREFILL_HEADER.encode()
_decode = msgspec.json.decode
_encode = msgspec.json.encode

Polarity = str
"""A worker's priority polarity: ``lower_first`` | ``higher_first`` | ``none``."""
# Backends whose OpenAI server takes a reasoning budget, and the parameter's name there.
_THINKING_BUDGET = {"vllm": "thinking_token_budget", "mock": "thinking_token_budget"}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A generation request as the router understands it. Frozen: later phases only read it."""

    endpoint: str
    raw_body: bytes
    body: dict[str, Any]
    nvext: Nvext
    override_headers: dict[str, str] | None
    """The routing override headers the client sent (``x-worker-instance-id``, ...), if any."""
    tokens: list[int]
    hashes: list[int]
    lora: str | None
    tokenize_secs: float = 0.0
    hash_secs: float = 0.0

    @property
    def isl(self) -> int:
        return len(self.tokens)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def engine_body(self, polarity: Polarity, backend: str = "") -> bytes:
        """The body the engine sees: ``nvext`` stripped, and what the reference forwards to the
        engine in the engine's own parameters: the priority in the engine's polarity (the API says
        higher = more important), greedy sampling, a pre-tokenized prompt, the thinking budget.
        A field this engine has no parameter for is the client's 400, never silently dropped."""
        body = self.body
        nv = self.nvext
        priority = nv.hints.priority
        if "nvext" not in body and priority is None:
            return self.raw_body
        out = {k: v for k, v in body.items() if k != "nvext"}
        if priority is not None:
            if polarity == "lower_first":
                out["priority"] = -priority
            elif polarity == "higher_first":
                out["priority"] = priority
        out.update(nv.sampling)
        if nv.greedy:  # the reference's greedy: whatever sampling the body asked for
            out["temperature"] = 0.0
            out["top_k"] = 1
            out.pop("top_p", None)
        if nv.token_data is not None:
            out["prompt"] = list(nv.token_data)
        if nv.max_thinking_tokens is not None:
            name = _THINKING_BUDGET.get(backend)
            if name is None:
                raise RequestError(
                    f"nvext.max_thinking_tokens: the serving worker's engine ({backend or 'unknown'}) "
                    "takes no thinking budget",
                    field="nvext.max_thinking_tokens",
                )
            out[name] = nv.max_thinking_tokens
        return _encode(out)


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; a 400 for anything else."""
    try:
        body = _decode(raw)
    except msgspec.DecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def override_headers(headers: Sequence[tuple[bytes, bytes]]) -> dict[str, str] | None:
    found: dict[str, str] | None = None
    for name, value in headers:
        if name in (_WORKER_HEADER_B, _PREFILL_HEADER_B):
            found = found or {}
            found[name.decode()] = value.decode("latin-1")
    return found


def parse_request(
    raw: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    endpoint: str,
    *,
    tokenizer: Tokenizer | None,
    block_size: int,
    lora_of: Callable[[Any], str | None],
    clock: Callable[[], float],
) -> ParsedRequest:
    """Decode, validate ``nvext``, and (when ``tokenizer`` is given: KV mode) tokenize and hash."""
    body = decode_body(raw)
    overrides = override_headers(headers)
    nv = parse_nvext(body, overrides) if ("nvext" in body or overrides) else EMPTY
    if nv is not EMPTY:
        check_engine_fields(nv, body, endpoint, tokenizing=tokenizer is not None)
    lora = lora_of(body.get("model"))
    tokens: list[int] = []
    hashes: list[int] = []
    tokenize_secs = hash_secs = 0.0
    if tokenizer is not None:
        t0 = clock()
        # A pre-tokenized prompt is hashed as given: the router never tokenizes it again.
        tokens = (
            list(nv.token_data) if nv.token_data is not None else prompt_tokens(tokenizer, body, endpoint)
        )
        t1 = clock()
        hashes = block_hashes(tokens, block_size, lora)
        tokenize_secs, hash_secs = t1 - t0, clock() - t1
    return ParsedRequest(endpoint, raw, body, nv, overrides, tokens, hashes, lora, tokenize_secs, hash_secs)


def check_engine_fields(nv: Nvext, body: dict[str, Any], endpoint: str, *, tokenizing: bool) -> None:
    """Refuse the ``nvext`` fields that cannot take effect on this request (400 naming them)."""
    chat = endpoint.endswith("chat/completions")
    if nv.token_data is not None and chat:
        raise RequestError(
            "nvext.token_data is a pre-tokenized prompt: send it to /v1/completions "
            "(a chat request has no token-id prompt an engine would take)",
            field="nvext.token_data",
        )
    if nv.use_raw_prompt and chat:
        raise RequestError(
            "nvext.use_raw_prompt: a chat request is always rendered with the chat template; "
            "send a raw prompt to /v1/completions",
            field="nvext.use_raw_prompt",
        )
    if nv.annotations:
        if body.get("stream") is not True:
            raise RequestError(
                'nvext.annotations are SSE events: they need "stream": true', field="nvext.annotations"
            )
        if not tokenizing:
            raise RequestError(
                "nvext.annotations need the router to tokenize the prompt (--router-mode kv)",
                field="nvext.annotations",
            )


def prompt_tokens(tokenizer: Tokenizer, body: dict[str, Any], endpoint: str) -> list[int]:
    """The prompt's token ids. A body the tokenizer or its chat template cannot render (a template
    that raises on role order, a tool call of the wrong shape) is the client's 400, as the engine
    would answer it; a tokenizer that is not ready (ConfigError) stays a server error."""
    try:
        return prompt_token_ids(tokenizer, body, endpoint)
    except (RequestError, ConfigError):
        raise
    except Exception as e:
        field = "messages" if endpoint.endswith("chat/completions") else "prompt"
        raise RequestError(f"the prompt could not be tokenized: {e!r}", field=field) from None
