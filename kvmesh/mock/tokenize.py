"""The utility endpoints of vLLM's server on the mock engine, answered as vLLM 0.33.0 answers them:
``POST /v1/messages/count_tokens`` (Anthropic's), ``POST /tokenize`` and ``POST /detokenize``.

Each prompt is read as the generation request it would be, with the same checks and the same
tokens: ``count_tokens`` as a Messages body (``max_tokens`` is not asked for), ``/tokenize`` as a
chat body when it has ``messages``, else as a completion's ``prompt``. So a prompt's count is the
``prompt_tokens`` its generation request reports.

- ``count_tokens``: ``{"input_tokens": N}``.
- ``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs": null}``.
- ``/detokenize``: ``{"prompt"}`` for ``{"tokens": [...]}``, each id within the vocabulary.
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import RequestError
from kvmesh.mock.config import MockConfig
from kvmesh.mock.messages import parse_messages
from kvmesh.mock.protocol import Endpoint, parse_generation
from kvmesh.router.request.tokenizer import MAX_TOKEN_ID, Tokenizer


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    return body


def count_tokens(body: Any, config: MockConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """Anthropic's count of a Messages body's input tokens."""
    asked = {**_object(body), "max_tokens": 1, "stream": False}  # (a count asks no answer)
    parsed = parse_messages(asked, config, tokenizer, None)
    return {"input_tokens": len(parsed.params.prompt_token_ids)}


def tokenize(body: Any, config: MockConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """A chat body's or a prompt's tokens, as its generation request would have them."""
    body = _object(body)
    endpoint: Endpoint = "chat" if "messages" in body else "completions"
    kept = {
        k: v
        for k, v in body.items()
        if k in ("model", "messages", "prompt", "tools", "add_generation_prompt")
    }
    parsed = parse_generation({**kept, "max_tokens": 1}, endpoint, config, tokenizer)
    ids = list(parsed.params.prompt_token_ids)
    return {"count": len(ids), "max_model_len": config.model_len, "tokens": ids, "token_strs": None}


def detokenize(body: Any, tokenizer: Tokenizer) -> dict[str, Any]:
    """The text of ``tokens``."""
    tokens = _object(body).get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens):
        raise RequestError("'tokens' must be a list of token ids", field="tokens")
    return {"prompt": tokenizer.decode(tokens)}
