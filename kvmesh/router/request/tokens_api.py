"""vLLM's token-in-token-out API (``POST /inference/v1/generate``) read as the completion request it
amounts to.

vLLM 0.33.0 serves it with ``--enable-scale-out``, or alone with ``--tokens-only``: the GPU servers
of a fleet whose prompts are rendered elsewhere (``vllm launch render``), which send each prompt
as ``token_ids`` with vLLM's own ``sampling_params``. The prompt is therefore hashed as given, as a
completion's token-id prompt is: :func:`completion_view` gives the router that body, and the
engine gets the client's own, unchanged but for what ``nvext`` asks (:func:`engine_fields`).

Its answer is a completion's in all the router reads: ``usage`` in chat's names (on the last
streamed event when ``stream_options.include_usage`` is set), and ``choices`` by ``index``, each
streamed event carrying the new tokens as ``token_ids`` rather than text.

The server's own request ids are ``generate-tokens-`` and the ``request_id`` the client sent (or
``X-Request-Id``); ``POST /inference/v1/abort_requests`` stops them, on the engine that runs them,
which only the router knows (``kvmesh.router.asgi.aborts``).
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import RequestError
from kvmesh.router.request.generate_api import completion_body
from kvmesh.router.request.nvext import write_sampling
from kvmesh.router.request.tokenizer import MAX_TOKEN_ID

TOKENS_PATH = "/inference/v1/generate"
ABORT_PATHS = frozenset(("/inference/v1/abort_requests", "/abort_requests"))
"""Where vLLM stops token-API requests by id (the second: ``--tokens-only``'s unguarded path)."""
# Fields that key vLLM's cache by more than the prompt's tokens, carried into the view (cache_keyed).
_CARRIED = ("cache_salt", "features", "content_parts")
_LENGTHS = (("n", "n"), ("max_tokens", "max_tokens"))


def is_tokens(endpoint: str) -> bool:
    """Whether ``endpoint`` (a request path or its short name) is vLLM's token-in-token-out API."""
    return endpoint == TOKENS_PATH or endpoint == "tokens"


def sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """The request's ``sampling_params``: an object, which vLLM requires."""
    params = body.get("sampling_params")
    if params is None:
        raise RequestError("'sampling_params' is required", field="sampling_params")
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' must be an object", field="sampling_params")
    return params


def completion_view(body: dict[str, Any]) -> dict[str, Any]:
    """The completion body (``prompt``, ``n``, ``max_tokens`` and what keys the cache) this body
    amounts to. A 400 naming the field for a prompt vLLM would refuse."""
    ids = body.get("token_ids")
    if ids is None:
        raise RequestError("'token_ids' is required", field="token_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestError("'token_ids' must be a non-empty list of token ids", field="token_ids")
    for token in ids:
        if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
            raise RequestError(
                f"'token_ids' must hold token ids in [0, {MAX_TOKEN_ID}], not {token!r}",
                field="token_ids",
            )
    return completion_body(ids, sampling_params(body), _LENGTHS, body, _CARRIED)


def abort_ids(body: Any) -> list[str]:
    """The server ids an ``abort_requests`` body names: ``request_ids``, a list of strings or one
    string (vLLM takes either); a 400 naming the field for anything else."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", field="body")
    ids = body.get("request_ids")
    if ids is None:
        raise RequestError("'request_ids' is required", field="request_ids")
    if isinstance(ids, str):
        return [ids]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise RequestError("'request_ids' must be a list of request id strings", field="request_ids")
    return ids


def choices(body: dict[str, Any]) -> int:
    """How many answers the request asks for (``sampling_params.n``; 1 when not a positive int)."""
    params = body.get("sampling_params")
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return n if type(n) is int and n > 0 else 1


def recomputed(body: dict[str, Any]) -> bool:
    """Whether vLLM computes the prompt whole, reading none of its cached prefix: as the request
    says (``skip_reading_prefix_cache``), or, when it does not say, for prompt logprobs (a cached
    block keeps no logits to give them from)."""
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        return False
    skip = params.get("skip_reading_prefix_cache")
    if isinstance(skip, bool):
        return skip
    return params.get("prompt_logprobs") is not None or params.get("prompt_logprob_token_ids") is not None


def engine_fields(
    out: dict[str, Any], sampling: tuple[tuple[str, Any], ...], greedy: bool, thinking_budget: int | None
) -> None:
    """Write what ``nvext`` asks of the engine into a body ``out``, inside ``sampling_params``,
    where vLLM reads every sampling field of this API (the reasoning budget too)."""
    if not (sampling or greedy or thinking_budget is not None):
        return
    params = dict(sampling_params(out))
    write_sampling(params, sampling, greedy)
    if thinking_budget is not None:
        params["thinking_token_budget"] = thinking_budget
    out["sampling_params"] = params
