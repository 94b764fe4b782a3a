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
from typing import Any, TypeVar

import msgspec

from kvmesh.errors import ConfigError, RequestError
from kvmesh.hashing import block_hashes
from kvmesh.router.request.batches import CHAT_BATCH_PATH, split_batch
from kvmesh.router.request.continuation import TurnMemo
from kvmesh.router.request.generate_api import (
    bound_to_engine,
    completion_view,
    engine_fields,
    is_generate,
)
from kvmesh.router.request.messages_api import is_messages
from kvmesh.router.request.messages_api import rendered_as_chat as messages_as_chat
from kvmesh.router.request.nvext import (
    DEFAULT_LIMITS,
    EMPTY,
    PREFILL_HEADER,
    WORKER_HEADER,
    Nvext,
    NvextLimits,
    parse_nvext,
    write_sampling,
)
from kvmesh.router.request.ollama_api import is_ollama
from kvmesh.router.request.ollama_api import view as ollama_view
from kvmesh.router.request.responses_api import is_responses, rendered_as_chat
from kvmesh.router.request.tokenizer import (
    TEXT_PARTS,
    Tokenizer,
    chat_fields,
    is_chat,
    prompt_prefix_ids,
    prompt_token_ids,
)
from kvmesh.router.request.tokens_api import completion_view as tokens_view
from kvmesh.router.request.tokens_api import engine_fields as tokens_engine_fields
from kvmesh.router.request.tokens_api import is_tokens
from kvmesh.router.request.tokens_api import recomputed as tokens_recomputed
from kvmesh.router.request.vertex_api import is_vertex, vertex_batch

_WORKER_HEADER_B = WORKER_HEADER.encode()
_PREFILL_HEADER_B = PREFILL_HEADER.encode()
_T = TypeVar("_T")
_decode = msgspec.json.decode
_encode = msgspec.json.encode

Polarity = str
"""A worker's priority polarity: ``lower_first`` | ``higher_first`` | ``none``."""
# Backends whose OpenAI server takes a reasoning budget, and the parameter's name there.
_THINKING_BUDGET = {"vllm": "thinking_token_budget", "mock": "thinking_token_budget"}


@dataclass(slots=True)
class DeferredPrompt:
    """A prompt routed before it was tokenized, its tokens worked out after the request has been
    sent (:meth:`ParsedRequest.complete`): on its first block alone, because no worker held that
    block (its tokens cannot change where it goes, only what the router counts there), or on the
    blocks of the conversation's earlier turn it begins with (:mod:`.continuation`)."""

    tokenize: Callable[[], tuple[list[int], list[int], float, float]]
    """The prompt's tokens and block hashes, and the seconds each took."""
    estimated_isl: int
    """Its length until then, from the body's size (see ``Mesh.tokens_per_byte``)."""
    done: bool = False
    tokenize_secs: float = 0.0
    hash_secs: float = 0.0
    earlier_turn: bool = False
    """Routed on its earlier turn's blocks (``ParsedRequest.hashes`` held them until complete)."""
    exact: bool = False
    """Its messages, tools and adapter are those of a prompt routed a moment before (a best-of-n
    sibling, a retry), which rendered to the blocks and length it was routed on: they are all of
    its own, so it is neither tokenized nor counted again once sent; its tokens are worked out only
    if something asks for them (:meth:`ParsedRequest.complete`: a pin of the answer, a warm-up)."""
    matched: bool = True
    """Once complete: whether the prompt began with the blocks it was routed on."""
    first_hash: int | None = None
    """Routed on its first block alone: that block's hash (a request beginning with it has this
    one counted first, ``Mesh.held_first``)."""


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
    cache_keyed: str | None = None
    """Why the engine keys this prompt's cache by more than its tokens, or None. Then ``hashes``
    live in a namespace of their own (:func:`cache_namespace`): they match only requests with the
    same salt, media or template arguments, never the plain prefix with equal tokens."""
    deferred: DeferredPrompt | None = None
    """Set when the prompt was routed before it was tokenized: ``tokens`` stay empty until
    :meth:`complete`, and ``hashes`` too, or hold the earlier turn's blocks it was routed on."""
    turn_key: int | None = None
    """The fingerprint of the chat messages it was rendered from, with its generation prompt: the
    key a later turn finds its blocks by (:class:`~.continuation.TurnMemo`); None otherwise."""

    @property
    def isl(self) -> int:
        deferred = self.deferred
        if deferred is not None and not deferred.done:
            return deferred.estimated_isl
        return len(self.tokens)

    def complete(self) -> bool:
        """Work out a deferred prompt's tokens and hashes (in place); True the first time. A body
        the tokenizer then refuses leaves them empty: the engine has the request and answers it."""
        deferred = self.deferred
        if deferred is None or deferred.done:
            return False
        deferred.done = True
        try:
            tokens, hashes, deferred.tokenize_secs, deferred.hash_secs = deferred.tokenize()
        except RequestError:
            return False
        self.tokens.extend(tokens)
        routed_on = self.hashes
        deferred.matched = hashes[: len(routed_on)] == routed_on
        routed_on[:] = hashes  # (in place: the route request holds this list)
        return True

    @property
    def stream(self) -> bool:
        stream = self.body.get("stream")
        # (Ollama's API streams unless told not to)
        return stream is True or (stream is None and is_ollama(self.endpoint))

    @property
    def stores_response(self) -> bool:
        """A Responses API request whose answer its engine may keep, for a later request to name
        as ``previous_response_id`` (``store``, true unless sent false)."""
        return is_responses(self.endpoint) and self.body.get("store") is not False

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
        if is_ollama(self.endpoint):
            # Ollama's request has no priority field, and no sampling in nvext's names (refused as
            # the request is routed): nvext is stripped, no more.
            return _encode(out)
        if is_messages(self.endpoint):
            # Anthropic's request has no priority field (the engines would drop it: there the
            # priority orders the router's own queue only), and of nvext's sampling fields only
            # top_k (the others are refused as the request is parsed).
            write_sampling(out, nv.sampling, nv.greedy)
            return _encode(out)
        if priority is not None:
            if polarity == "lower_first":
                out["priority"] = -priority
            elif polarity == "higher_first":
                out["priority"] = priority
        if is_generate(self.endpoint):  # (SGLang's own API: its own places for these)
            engine_fields(out, nv.sampling, nv.greedy, nv.max_thinking_tokens)
            return _encode(out)
        if is_tokens(self.endpoint):  # (vLLM's token API: sampling inside sampling_params)
            tokens_engine_fields(out, nv.sampling, nv.greedy, nv.max_thinking_tokens)
            return _encode(out)
        write_sampling(out, nv.sampling, nv.greedy)
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


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have. OpenAI bodies (messages, content
parts, tool schemas) stay well under it; a body nested near Python's recursion limit would pass the
decoder and then blow the stack of whatever walks it next (a chat template, a re-encode)."""


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; a 400 for anything else (malformed JSON, invalid UTF-8
    inside a string, nesting deeper than :data:`MAX_JSON_DEPTH`)."""
    try:
        body = _decode(raw)
    except msgspec.DecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e}", field="body") from None
    except UnicodeDecodeError as e:  # msgspec validates UTF-8 inside strings with the codec's error
        raise RequestError(
            f"request body is not valid UTF-8: {e.reason} at byte {e.start}", field="body"
        ) from None
    except RecursionError:
        raise RequestError(
            f"request body is nested deeper than {MAX_JSON_DEPTH} levels", field="body"
        ) from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", field="body")
    path = too_deep(body, MAX_JSON_DEPTH)
    if path is not None:
        raise RequestError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", field=path)
    return body


def too_deep(doc: Any, limit: int) -> str | None:
    """The top-level key under which ``doc`` nests more than ``limit`` containers deep, else None.
    Iterative (a recursive walk is what this guards against) and touches containers only."""
    stack: list[tuple[Any, int, str]] = [(doc, 1, "body")]
    while stack:
        node, depth, top = stack.pop()
        if depth > limit:
            return top
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(value, (dict, list)):
                    stack.append((value, depth + 1, key if depth == 1 else top))
        else:
            for value in node:
                if isinstance(value, (dict, list)):
                    stack.append((value, depth + 1, top))
    return None


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
    limits: NvextLimits = DEFAULT_LIMITS,
    held: Callable[[int], bool] | None = None,
    tokens_per_byte: float = 0.0,
    memo: TurnMemo | None = None,
) -> ParsedRequest:
    """Decode, validate ``nvext``, and (when ``tokenizer`` is given: KV mode) tokenize and hash.
    A body with a batch of prompts raises :class:`~.batches.PromptBatch`: one request per prompt.

    ``held`` tells whether any worker holds a block hash (asked for a text prompt keyed by its
    tokens alone, without ``nvext.annotations``, which stream the prompt's tokens). Where none
    holds the prompt's first block, none holds any of it (block hashes chain), and the prompt is
    returned :class:`DeferredPrompt`, its length estimated at ``tokens_per_byte`` of the body:
    tokenizing a long prompt no one holds (a new document, a cold prefix) would only delay the
    request by the time it takes. So is a chat prompt whose messages continue a conversation's
    earlier turn that ``memo`` keeps (asked under the same conditions): it is routed on that
    turn's blocks, its new messages estimated from the body's growth."""
    body = decode_body(raw)
    overrides = override_headers(headers)
    # What the engine renders: the body itself, the chat request a Responses or an Anthropic
    # Messages body becomes, or the completion request a /generate or token-API body is.
    if is_vertex(endpoint):  # (a batch of /generate requests, whatever its size)
        raise vertex_batch(body)
    if is_responses(endpoint):
        rendered, rendered_as = rendered_as_chat(body, tokenizer), CHAT_ENDPOINT
    elif is_messages(endpoint):
        rendered, rendered_as = messages_as_chat(body, tokenizer), CHAT_ENDPOINT
    elif is_generate(endpoint):
        if bound_to_engine(body) is not None:  # (served where it is: its prompt decides nothing)
            return _unhashed(endpoint, raw, body, overrides, limits)
        if (batch := split_batch(body, endpoint)) is not None:
            raise batch
        rendered, rendered_as = completion_view(body), COMPLETIONS_ENDPOINT
    elif is_tokens(endpoint):
        rendered, rendered_as = tokens_view(body), COMPLETIONS_ENDPOINT
    elif is_ollama(endpoint):
        rendered = ollama_view(body, endpoint)
        rendered_as = CHAT_ENDPOINT if "messages" in rendered else COMPLETIONS_ENDPOINT
        if rendered_as == COMPLETIONS_ENDPOINT and not rendered["prompt"].strip():
            # (a blank prompt: the engine answers it at once, without its model; nothing to hash)
            return _unhashed(endpoint, raw, body, overrides, limits)
    else:
        if endpoint in BATCH_ENDPOINTS and (batch := split_batch(body, endpoint)) is not None:
            raise batch
        rendered, rendered_as = body, endpoint
    nv = parse_nvext(body, overrides, limits) if ("nvext" in body or overrides) else EMPTY
    if nv is not EMPTY:
        check_engine_fields(nv, body, rendered_as, tokenizing=tokenizer is not None)
        if nv.token_data is not None and (is_generate(endpoint) or is_tokens(endpoint)):
            name = "input_ids" if is_generate(endpoint) else "token_ids"
            raise RequestError(
                f"nvext.token_data: {endpoint} takes a token-id prompt as {name!r}",
                field="nvext.token_data",
            )
    lora = lora_of(body.get("model")) if not is_ollama(endpoint) else None  # (served by the base model)
    tokens: list[int] = []
    hashes: list[int] = []
    tokenize_secs = hash_secs = 0.0
    keyed: str | None = cache_keyed(rendered)  # (annotated: mypyc's inference reads None here)
    turn_key: int | None = None
    if (
        tokenizer is not None
        and held is not None
        and keyed is None
        and nv.token_data is None
        and not nv.annotations  # SSE events that carry the prompt's tokens
        and tokens_per_byte > 0
    ):
        t0 = clock()

        def tokenize() -> tuple[list[int], list[int], float, float]:
            t1 = clock()
            ids = prompt_tokens(tokenizer, rendered, rendered_as)
            t2 = clock()
            return ids, block_hashes(ids, block_size, lora), t2 - t1, clock() - t2

        if memo is not None and is_chat(rendered_as):
            messages, tools, generation_prompt = chat_fields(rendered)  # (a RequestError names the field)
            keys = memo.fingerprints(messages, tools, lora)
            if keys is not None:
                turn_key = keys[-1] if generation_prompt else None
                found = memo.find(keys, messages, generation_prompt)
                if found is not None:
                    earlier, whole = found
                    grown = 0 if whole else max(len(raw) - earlier.body_bytes, 0)
                    deferred = DeferredPrompt(
                        tokenize, earlier.isl + round(tokens_per_byte * grown), earlier_turn=True, exact=whole
                    )
                    return ParsedRequest(
                        endpoint, raw, body, nv, overrides, [], list(earlier.hashes), lora,
                        clock() - t0, 0.0, keyed, deferred, turn_key,
                    )  # fmt: skip
        first = _guarded(prompt_prefix_ids, tokenizer, rendered, rendered_as, block_size)
        first_hash = block_hashes(first, block_size, lora)[0] if first is not None else None
        if first_hash is not None and not held(first_hash):
            deferred = DeferredPrompt(
                tokenize, max(1, round(tokens_per_byte * len(raw))), first_hash=first_hash
            )
            return ParsedRequest(
                endpoint, raw, body, nv, overrides, [], [], lora, clock() - t0, 0.0, keyed, deferred, turn_key
            )
    if tokenizer is not None:
        t0 = clock()
        # A pre-tokenized prompt is hashed as given: the router never tokenizes it again.
        tokens = (
            list(nv.token_data)
            if nv.token_data is not None
            else prompt_tokens(tokenizer, rendered, rendered_as)
        )
        t1 = clock()
        namespace = lora if keyed is None else cache_namespace(rendered, keyed, lora)
        hashes = block_hashes(tokens, block_size, namespace)
        tokenize_secs, hash_secs = t1 - t0, clock() - t1
    return ParsedRequest(
        endpoint,
        raw,
        body,
        nv,
        overrides,
        tokens,
        hashes,
        lora,
        tokenize_secs,
        hash_secs,
        keyed,
        None,
        turn_key,
    )


CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
BATCH_ENDPOINTS = frozenset((COMPLETIONS_ENDPOINT, CHAT_BATCH_PATH))
"""Where a body may carry a batch of prompts or conversations (SGLang's /generate is read apart)."""


_KEYED_BY = (
    "multi_modal_data",
    "mm_processor_kwargs",
    "prompt_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "extra_key",
    "features",
    "content_parts",
)


def _unhashed(
    endpoint: str, raw: bytes, body: dict[str, Any], overrides: dict[str, str] | None, limits: NvextLimits
) -> ParsedRequest:
    """A request whose prompt decides nothing (no tokens, no hashes), its ``nvext`` read."""
    nv = parse_nvext(body, overrides, limits) if ("nvext" in body or overrides) else EMPTY
    return ParsedRequest(endpoint, raw, body, nv, overrides, [], [], None)


def cache_keyed(body: dict[str, Any]) -> str | None:
    """Why this request's KV blocks are keyed by more than the token ids the router hashes, else
    None: a ``cache_salt`` (vLLM and SGLang give the salted prompt a cache of its own), media in
    the messages (vLLM keys those blocks by the media hash), or ``chat_template_kwargs``, a
    ``chat_template`` or ``documents`` of the request's own (the engine renders the prompt with
    them, the router's tokenizer does not), or SGLang's own keys (``lora_path``, an
    ``extra_key``, media as ``image_data`` and its kin), or media given to vLLM's token API
    (``features``, hashed already, or ``content_parts``). The engine's events
    for such blocks are not indexed (``BlockStored.keyed_from``), so these requests get prefix
    credit only from what the router itself predicts (approximate mode, predict-on-route), and
    only among requests keyed the same way."""
    salt = body.get("cache_salt")
    if salt is not None and salt != "":
        return "cache_salt"
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and kwargs != {}:
        return "chat_template_kwargs"
    for key in ("chat_template", "documents"):  # (vLLM's: a template, or what it renders, of its own)
        value = body.get(key)
        if value is not None and value != "" and value != []:
            return key
    # (media, embeddings, and SGLang's own keys: an adapter's and an extra key of the client's)
    for key in _KEYED_BY:
        if body.get(key) is not None:
            return key
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                for part in content:
                    # (other parts are media: the engine keys their blocks by the media's hash too)
                    if isinstance(part, dict) and part.get("type", "text") not in TEXT_PARTS:
                        return "multimodal content"
    return None


def prompt_recomputed(body: dict[str, Any], endpoint: str) -> bool:
    """Whether the engine computes this prompt whole, reading none of its cached prefix: vLLM does
    for a request with prompt logprobs (a cached block keeps no logits to give them from), which
    ``prompt_logprobs`` asks for, and ``echo`` too where logprobs are on (a chat's ``top_logprobs``,
    0 unless sent as null; a completion's ``logprobs``). The blocks it computes are cached all
    the same. (SGLang has no ``prompt_logprobs`` and no chat ``echo``.) vLLM's token API asks
    inside ``sampling_params`` (:func:`~.tokens_api.recomputed`)."""
    if is_tokens(endpoint):
        return tokens_recomputed(body)
    if body.get("prompt_logprobs") is not None:
        return True
    if body.get("echo") is not True:
        return False
    if is_chat(endpoint):
        return body.get("top_logprobs", 0) is not None
    return body.get("logprobs") is not None


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
    return _guarded(prompt_token_ids, tokenizer, body, endpoint)


def _guarded(
    tokenize: Callable[..., _T], tokenizer: Tokenizer, body: dict[str, Any], endpoint: str, *args: Any
) -> _T:
    """``tokenize(tokenizer, body, endpoint, *args)``, with what it raises made the client's 400
    (see :func:`prompt_tokens`)."""
    try:
        return tokenize(tokenizer, body, endpoint, *args)
    except (RequestError, ConfigError):
        raise
    except Exception as e:
        field = "messages" if endpoint.endswith("chat/completions") else "prompt"
        raise RequestError(f"the prompt could not be tokenized: {e!r}", field=field) from None


def cache_namespace(body: dict[str, Any], reason: str, lora: str | None) -> str:
    """The hash namespace of a request keyed by more than its tokens: the adapter name (the seed
    of every block hash) extended with what keys the cache, so equal tokens under another salt,
    other media or other template arguments never share a block hash."""
    if reason == "cache_salt":
        material: Any = body.get("cache_salt")
    elif reason == "multimodal content":
        material = [m.get("content") for m in body.get("messages", ()) if isinstance(m, dict)]
    else:
        material = body.get(reason)
    key = material if isinstance(material, str) else _encode_sorted(material).decode()
    return f"{lora or ''}\x1f{reason}\x1f{key}"


def _encode_sorted(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")
