"""SGLang's native generation API (``POST /generate``) read as the completion request it amounts to.

SGLang serves ``/v1/completions`` by turning the body into a ``/generate`` request
(``text=prompt``, or ``input_ids`` for a token-id prompt), so a ``/generate`` prompt is tokenized
exactly as a completion prompt is: :func:`completion_view` gives the router that body, and the
engine gets the client's own, unchanged. RL rollouts and most SGLang-native clients send this API;
sglang-router routes it too.

The view is of one prompt: a batch (``text`` as a list, ``input_ids`` as a list of lists) is cut
into one request per prompt before it gets here (:mod:`.batches`). What the router cannot follow is
refused here, naming the field (a 400 the client can fix): a prompt of embeddings
(``input_embeds``: SGLang caches none of it), and a list of sampling parameters beside one prompt.

Two kinds of request belong to the engine they were sent to and are never moved to another one
(:func:`bound_to_engine`): one that continues an SGLang session opened there
(``session_params``: its history lives in that engine), and one of SGLang's own prefill/decode
hand-off (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``: a peer waits for it there).
"""

from __future__ import annotations

import math
from typing import Any

from kvmesh.errors import RequestError
from kvmesh.router.request.nvext import write_sampling

GENERATE_PATH = "/generate"
ABORT_PATH = "/abort_request"
"""SGLang's abort: of the request whose ``rid`` (or a longer one) it names, or of all of them."""
SERVED_BY = frozenset(("sglang", "mock"))
"""The backends (``/kvmesh/info`` ``backend``) whose server answers ``/generate`` (and Ollama's API)."""
# Fields that bind a request to the engine it reached (see the module docstring).
_BOUND = ("session_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
# Fields that key SGLang's cache by more than the prompt's tokens, carried into the view (cache_keyed).
_CARRIED = ("cache_salt", "lora_path", "extra_key", "image_data", "video_data", "audio_data")
# sampling_params keys the view takes, by their completion name.
_LENGTHS = (("n", "n"), ("max_new_tokens", "max_tokens"))


def is_generate(endpoint: str) -> bool:
    """Whether ``endpoint`` (a request path or its short name) is SGLang's ``/generate``."""
    return endpoint == GENERATE_PATH or endpoint == "generate"


def bound_to_engine(body: dict[str, Any]) -> str | None:
    """The field that ties this request to the engine it was sent to, or None."""
    for field in _BOUND:
        if body.get(field) is not None:
            return field
    return None


def session_named(body: dict[str, Any]) -> str | None:
    """The SGLang session a request continues (``session_params.id``), or None; a 400 naming
    the field for one that is not a string."""
    params = body.get("session_params")
    if params is None:
        return None
    if not isinstance(params, dict) or not isinstance(params.get("id"), str):
        raise RequestError(
            "'session_params.id' must be the session's id, a string", field="session_params.id"
        )
    return str(params["id"])


def opened_session(body: dict[str, Any]) -> str | None:
    """The id an ``/open_session`` body asks for (None: the engine makes one), its fields checked
    as SGLang's ``OpenSessionReqInput`` reads them (a 400 naming the field)."""
    capacity = body.get("capacity_of_str_len")
    if type(capacity) is not int:
        raise RequestError("'capacity_of_str_len' must be an integer", field="capacity_of_str_len")
    timeout = body.get("timeout")
    if timeout is not None and not (type(timeout) in (int, float) and math.isfinite(timeout)):
        raise RequestError("'timeout' must be a number of seconds", field="timeout")
    if body.get("streaming") is not None and not isinstance(body["streaming"], bool):
        raise RequestError("'streaming' must be a boolean", field="streaming")
    session = body.get("session_id")
    if session is not None and not isinstance(session, str):
        raise RequestError("'session_id' must be a string", field="session_id")
    return session


def closed_session(body: dict[str, Any]) -> str:
    """The id a ``/close_session`` body names (a 400 naming it for one that is not a string)."""
    session = body.get("session_id")
    if not isinstance(session, str):
        raise RequestError("'session_id' must be the session's id, a string", field="session_id")
    return session


def abort_body(body: Any) -> dict[str, Any]:
    """An ``/abort_request`` body, checked as SGLang's ``AbortReq`` reads it: an object whose
    ``rid`` is a string (or null) and whose ``abort_all`` is a boolean; a 400 naming the field for
    anything else. Returned whole: its other fields (``abort_message`` ...) are the engine's."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", field="body")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("'rid' must be a request id string", field="rid")
    if not isinstance(body.get("abort_all", False), bool):
        raise RequestError("'abort_all' must be a boolean", field="abort_all")
    return body


def sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """The request's ``sampling_params`` (an object; a 400 for a list, which is a batch's)."""
    params = body.get("sampling_params")
    if params is None:
        return {}
    if isinstance(params, list):
        raise RequestError(
            "'sampling_params' as a list is for a batch of prompts ('text' or 'input_ids' as a "
            "list), not for one prompt",
            field="sampling_params",
        )
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' must be an object", field="sampling_params")
    return params


def completion_view(body: dict[str, Any]) -> dict[str, Any]:
    """The completion body (``prompt``, ``n``, ``max_tokens`` and what keys the cache) this
    ``/generate`` body amounts to. A 400 naming the field for what is not routed."""
    if body.get("input_embeds") is not None:
        raise RequestError(
            "'input_embeds': a prompt of embeddings is not routed (SGLang caches none of it); "
            "send it to an engine directly",
            field="input_embeds",
        )
    text = body.get("text")
    if text is not None:  # (SGLang reads text before input_ids when both are sent)
        if isinstance(text, list):
            raise RequestError(
                "'text' as a list is a batch of prompts; one prompt is read here",
                field="text",
            )
        if not isinstance(text, str) or not text:
            raise RequestError("'text' must be a non-empty string", field="text")
        prompt: Any = text
    else:
        ids = body.get("input_ids")
        if ids is None:
            raise RequestError("'text' or 'input_ids' is required", field="text")
        if not isinstance(ids, list) or not ids:
            raise RequestError("'input_ids' must be a non-empty list of token ids", field="input_ids")
        if isinstance(ids[0], list):
            raise RequestError(
                "'input_ids' as a list of lists is a batch of prompts; one prompt is read here",
                field="input_ids",
            )
        prompt = ids
    return completion_body(prompt, sampling_params(body), _LENGTHS, body, _CARRIED)


def completion_body(
    prompt: Any,
    params: dict[str, Any],
    names: tuple[tuple[str, str], ...],
    body: dict[str, Any],
    carried: tuple[str, ...],
) -> dict[str, Any]:
    """The completion body an engine's native request amounts to: its ``prompt``, the sampling
    ``params`` it names (``names``: their key there, their completion name), and the fields of
    ``body`` that key the engine's cache (``carried``)."""
    view: dict[str, Any] = {"prompt": prompt}
    for source, name in names:
        if source in params:
            view[name] = params[source]
    for key in carried:
        if key in body:
            view[key] = body[key]
    return view


def choices(body: dict[str, Any]) -> int:
    """How many answers the request asks for (``sampling_params.n``; 1 when not a positive int)."""
    n = sampling_params(body).get("n", 1)
    return n if type(n) is int and n > 0 else 1


def engine_fields(
    out: dict[str, Any], sampling: tuple[tuple[str, Any], ...], greedy: bool, thinking_budget: int | None
) -> None:
    """Write what ``nvext`` asks of the engine into a ``/generate`` body ``out``, in SGLang's own
    places: sampling inside ``sampling_params``, the reasoning budget at the top."""
    if sampling or greedy:
        params = dict(sampling_params(out))
        write_sampling(params, sampling, greedy)
        out["sampling_params"] = params
    if thinking_budget is not None:
        out["max_thinking_tokens"] = thinking_budget


def meta_usage(metas: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The ``meta_info`` of each answer (by its ``index``; the last one streamed) in chat's usage
    names, which the router's accounting reads: the prompt and its cached tokens once (every answer
    reports the same prompt), the answers' tokens summed. None without a count to read."""
    if not metas:
        return None
    first = metas[min(metas)]
    completion = 0
    for meta in metas.values():
        tokens = meta.get("completion_tokens")
        if type(tokens) is not int:
            return None
        completion += tokens
    usage: dict[str, Any] = {"prompt_tokens": first.get("prompt_tokens"), "completion_tokens": completion}
    cached = first.get("cached_tokens")
    if type(cached) is int:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage
