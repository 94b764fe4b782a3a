"""vLLM's embeddings endpoint, ``POST /v1/embeddings``, on the mock engine, answered as vLLM 0.33.0
answers it for an embedding model.

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists; each
string is tokenized as a completion's prompt is, token ids are taken as given. Each input costs the
engine a prefill of its tokens: it runs as an engine request of its own (:func:`prefill_only`), so
it queues, batches, hits the prefix cache (vLLM reads the cache for an ``embed`` task too) and
shows in ``/metrics`` as a completion's prompt does, its time divided by ``--speedup``.

The vector is made from the input's token ids alone (:func:`embedding_of`): a keyed hash spread
over :data:`EMBEDDING_SIZE` numbers, then unit length, as embedding models normalise by default.
Every mock engine, whatever its seed, answers the same input with the same vector, so answers can
be compared across engines. The numbers are float32 values, as vLLM's tensors hold them, so the
``float`` list and the ``base64`` bytes carry exactly the same vector.

Honoured: ``model`` (null is the served model; another name is the chat path's 404), ``input``,
``encoding_format`` (``float``, the default, or ``base64``: float32 bytes in the byte order
``endianness`` names, the machine's by default), ``dimensions`` (the mock's model takes any size
up to its own, as a Matryoshka model does: the vector is cut, then normalised), ``use_activation``
(false: the vector is not normalised), ``truncate_prompt_tokens`` (-1 is ``max_model_len``) with
``truncation_side`` (``right``, the default, keeps the first tokens), ``priority`` (as on
completions) and ``request_id`` (the answer's id when no ``X-Request-Id`` header gives one).
Type-checked and otherwise unused: ``user``, ``add_special_tokens`` (the mock's tokenizer adds no
special token). Unknown fields are ignored, as on the mock's other endpoints and in vLLM.

Refused with a 400 naming the field: what the mock cannot simulate (the ``bytes`` encodings,
``embed_dtype`` other than float32, chat-style input in ``messages`` or ``input``, a client's own
``cache_salt``), ``normalize`` (vLLM removed it for ``use_activation``), a wrong type, an empty
input, a token id out of range, and an input longer than ``max_model_len`` after truncation.

Where the mock shows its engine-request form: ``/metrics`` counts one generated token and one
finished request per input (see :func:`prefill_only`), and an input that an abort API or a
stopping engine ends fails the whole request (a 503), as there is no vector to give for it.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import RequestError
from kvmesh.mock.config import MockConfig
from kvmesh.mock.engine import GenerationParams
from kvmesh.mock.protocol import ModelNotFound, bool_field
from kvmesh.router.request.tokenizer import MAX_TOKEN_ID, Tokenizer

EMBEDDING_SIZE = 32
"""Numbers in the mock model's vector (its ``embedding_size``): small, since nothing reads them
but tests and routers comparing answers."""

# The hash's key is fixed, not the engine's seed: every mock engine gives an input one vector.
_PERSON = b"kvmesh-embed-v1"
# ``struct``'s byte order for each ``endianness`` (vLLM's ``native`` is its machine's).
_ENDIANNESS = {"native": "<" if sys.byteorder == "little" else ">", "little": "<", "big": ">"}


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """A checked ``/v1/embeddings`` body."""

    inputs: list[list[int]]
    """Each input's token ids, truncated as asked, in the body's order."""
    as_base64: bool
    byte_order: str
    """``struct``'s byte order of the base64 float32s: ``<`` or ``>``."""
    dimensions: int | None
    normalised: bool
    priority: int
    request_id: str | None


def parse_embeddings(body: Any, config: MockConfig, tokenizer: Tokenizer) -> EmbeddingsRequest:
    """Read a body, or raise :class:`RequestError` naming the field at fault."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    model = body.get("model")
    if model is not None and model != config.model:
        raise ModelNotFound(f"The model `{model}` does not exist.", field="model")
    _refuse_unsimulated(body)
    fmt = body.get("encoding_format", "float")
    if fmt in ("bytes", "bytes_only"):
        raise RequestError(
            f"'encoding_format' {fmt!r} is not supported by the mock engine; use float or base64",
            field="encoding_format",
        )
    if fmt not in (None, "float", "base64"):
        raise RequestError(
            f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", field="encoding_format"
        )
    endianness = body.get("endianness", "native")
    if endianness is not None and (not isinstance(endianness, str) or endianness not in _ENDIANNESS):
        raise RequestError(
            f"'endianness' must be one of {sorted(_ENDIANNESS)}, got {endianness!r}", field="endianness"
        )
    dimensions = _int_field(body, "dimensions", 1)
    if dimensions is not None and dimensions > EMBEDDING_SIZE:
        raise RequestError(
            f"'dimensions' must be in [1, {EMBEDDING_SIZE}] for model {config.model!r}, got {dimensions}",
            field="dimensions",
        )
    normalised = bool_field(body, "use_activation", True)
    bool_field(body, "add_special_tokens", True)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"'user' must be a string, got {user!r}", field="user")
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"'request_id' must be a string, got {request_id!r}", field="request_id")
    priority = _int_field(body, "priority", -(2**63)) or 0
    if priority != 0 and config.scheduling_policy != "priority":
        raise RequestError(
            "'priority' can only be set when the engine runs with --scheduling-policy priority",
            field="priority",
        )
    limit, keep_last = _truncation(body, config.model_len)
    inputs = [
        _checked_length(_truncated(ids, limit, keep_last), i, config.model_len)
        for i, ids in enumerate(_tokens(body, tokenizer))
    ]
    return EmbeddingsRequest(
        inputs=inputs,
        as_base64=fmt == "base64",
        byte_order=_ENDIANNESS[endianness or "native"],
        dimensions=dimensions,
        normalised=normalised,
        priority=priority,
        request_id=request_id,
    )


def prefill_only(token_ids: list[int], priority: int, model_len: int) -> GenerationParams:
    """The engine request that costs what embedding ``token_ids`` costs: its prefill.

    The engine's requests all sample at least one token, so it asks for one; that token ends the
    request in the very step that finishes the prefill (no decode step follows) and is thrown
    away. An input of exactly ``max_model_len`` tokens, which vLLM embeds (a pooling request has no
    output), runs one token short, leaving the engine the room it keeps for that token."""
    return GenerationParams(prompt_token_ids=token_ids[: model_len - 1], max_tokens=1, priority=priority)


def embedding_of(
    token_ids: Sequence[int], dimensions: int | None = None, *, normalised: bool = True
) -> list[float]:
    """The mock model's vector for ``token_ids``, ``dimensions`` long (all of it by default):
    blake2b of the ids (each a little-endian uint32) gives 32 two-byte numbers, each mapped to
    (-1, 1); the vector is cut to ``dimensions``, then made unit length unless ``normalised`` is
    False; each number is then rounded to float32."""
    digest = hashlib.blake2b(
        struct.pack(f"<{len(token_ids)}I", *token_ids), digest_size=2 * EMBEDDING_SIZE, person=_PERSON
    ).digest()
    half = 32767.5
    vector = [(n - half) / half for n in struct.unpack(f"<{EMBEDDING_SIZE}H", digest)]
    vector = vector[: dimensions or EMBEDDING_SIZE]
    if normalised:
        norm = math.sqrt(sum(x * x for x in vector))
        vector = [x / norm for x in vector]
    return list(struct.unpack(f"<{len(vector)}f", struct.pack(f"<{len(vector)}f", *vector)))


def embeddings_answer(
    parsed: EmbeddingsRequest, model: str, response_id: str, created: int
) -> dict[str, Any]:
    """The JSON answer, the inputs' vectors in input order, with vLLM's usage fields."""
    data = []
    for index, ids in enumerate(parsed.inputs):
        vector = embedding_of(ids, parsed.dimensions, normalised=parsed.normalised)
        encoded: list[float] | str = vector
        if parsed.as_base64:
            raw = struct.pack(f"{parsed.byte_order}{len(vector)}f", *vector)
            encoded = base64.b64encode(raw).decode("ascii")
        data.append({"index": index, "object": "embedding", "embedding": encoded})
    prompt_tokens = sum(len(ids) for ids in parsed.inputs)
    return {
        "id": response_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }


def _refuse_unsimulated(body: Mapping[str, Any]) -> None:
    if "normalize" in body:
        raise RequestError(
            "'normalize' was removed from vLLM's pooling API; use 'use_activation'", field="normalize"
        )
    if body.get("messages") is not None:
        raise RequestError(
            "chat-style embedding requests are not supported by the mock engine", field="messages"
        )
    dtype = body.get("embed_dtype")
    if dtype not in (None, "float32"):
        raise RequestError(
            f"'embed_dtype' {dtype!r} is not supported by the mock engine; use float32", field="embed_dtype"
        )
    if body.get("cache_salt") is not None:
        # (the mock's prefix cache has no per-client key: hits would be reported vLLM would not make)
        raise RequestError("'cache_salt' is not supported by the mock engine", field="cache_salt")


def _tokens(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[list[int]]:
    """Each input's token ids; a 400 naming ``input`` for any shape but vLLM's four."""
    raw = body.get("input")
    if raw is None:
        raise RequestError("'input' is a required property", field="input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(type(t) is int for t in raw)):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
        items = raw
    elif isinstance(raw, list) and raw and all(isinstance(x, dict) for x in raw):
        raise RequestError(
            "chat-style embedding requests are not supported by the mock engine", field="input"
        )
    else:
        raise RequestError(
            "'input' must be a non-empty string, list of strings, list of token ids or list of token-id lists",
            field="input",
        )
    if len({type(x) for x in items}) > 1:
        raise RequestError("'input' must not mix strings and token-id lists", field="input")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = tokenizer.encode(item)
        elif all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in item):
            ids = list(item)
        else:
            raise RequestError(f"'input' item {i} must hold token ids in [0, {MAX_TOKEN_ID}]", field="input")
        if not ids:
            raise RequestError(f"'input' item {i} is empty", field="input")
        out.append(ids)
    return out


def _truncation(body: Mapping[str, Any], model_len: int) -> tuple[int | None, bool]:
    """How many tokens ``truncate_prompt_tokens`` keeps of an input (None: all; -1 is
    ``max_model_len``), and whether ``truncation_side`` keeps the last of them (``left``)."""
    limit = _int_field(body, "truncate_prompt_tokens", -1)
    side = body.get("truncation_side")
    if side is None:
        side = "right"  # (what a Hugging Face tokenizer truncates by default)
    if side not in ("left", "right"):
        raise RequestError(
            f"'truncation_side' must be 'left' or 'right', got {side!r}", field="truncation_side"
        )
    if limit == -1:
        limit = model_len
    if limit == 0:
        raise RequestError(
            "'truncate_prompt_tokens' 0 leaves no token to embed", field="truncate_prompt_tokens"
        )
    if limit is not None and limit > model_len:
        raise RequestError(
            f"'truncate_prompt_tokens' must be at most max_model_len ({model_len}), got {limit}",
            field="truncate_prompt_tokens",
        )
    return limit, side == "left"


def _truncated(ids: list[int], limit: int | None, keep_last: bool) -> list[int]:
    if limit is None or len(ids) <= limit:
        return ids
    return ids[-limit:] if keep_last else ids[:limit]


def _checked_length(ids: list[int], index: int, model_len: int) -> list[int]:
    if len(ids) > model_len:
        raise RequestError(
            f"This model's maximum context length is {model_len} tokens, and 'input' item {index} has "
            f"{len(ids)}; shorten it or set 'truncate_prompt_tokens'.",
            field="input",
        )
    return ids


def _int_field(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    """``body[name]`` as an integer of at least ``minimum`` (None when absent or null); the mock's
    other endpoints take no float for an integer, nor a boolean."""
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not minimum <= value < 2**63:
        raise RequestError(f"'{name}' must be an integer of at least {minimum}, got {value!r}", field=name)
    return value
