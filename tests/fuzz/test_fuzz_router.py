"""Fuzz the routing path over real loopback HTTP, standalone and embedded: whatever the body and
headers, kvmesh answers no 5xx, every 4xx is an OpenAI error that names the field, and afterwards
the router is healthy, its load is back to 0 and nothing runs on the engines.

``make test`` runs a bounded number of cases; ``make fuzz`` sets ``KVMESH_FUZZ_EXAMPLES`` high and
``KVMESH_FUZZ_REPORT`` to a file that receives the figures (docs/RELIABILITY.md)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from tests.fuzz.harness import FUZZ, Target, check_answer, reported
from tests.fuzz.strategies import (
    ABORT,
    CHAT,
    CHAT_BATCH,
    CLOSE_SESSION,
    COMPLETION,
    EMBEDDINGS,
    GENERATE,
    HEADERS,
    INVOCATIONS,
    MESSAGES,
    OLLAMA_CHAT,
    OLLAMA_GENERATE,
    OPEN_SESSION,
    RESPONSES,
    SGLANG_ABORT,
    TOKENS,
    VERTEX,
    raw_body,
)


@pytest.mark.parametrize(
    ("path", "doc"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETION),
        ("/v1/responses", RESPONSES),
        ("/generate", GENERATE),
        ("/v1/messages", MESSAGES),
        ("/inference/v1/generate", TOKENS),
        ("/inference/v1/abort_requests", ABORT),
        ("/v1/messages/count_tokens", MESSAGES),
        ("/abort_request", SGLANG_ABORT),
        ("/v1/embeddings", EMBEDDINGS),
        ("/v1/chat/completions/batch", CHAT_BATCH),
        ("/invocations", INVOCATIONS),
        ("/api/chat", OLLAMA_CHAT),
        ("/api/generate", OLLAMA_GENERATE),
        ("/vertex_generate", VERTEX),
        ("/open_session", OPEN_SESSION),
        ("/close_session", CLOSE_SESSION),
    ],
    ids=[
        *("chat", "completions", "responses", "generate", "messages", "tokens", "abort"),
        *("count_tokens", "abort_request", "embeddings", "chat_batch", "invocations"),
        *("ollama_chat", "ollama_generate", "vertex", "open_session", "close_session"),
    ],
)
def test_no_5xx_and_every_4xx_names_its_field(target: Target, path: str, doc: Any) -> None:
    @FUZZ
    @given(body=raw_body(doc), headers=HEADERS)
    def case(body: bytes, headers: dict[str, str]) -> None:
        status, data = target.post(path, body, headers)
        check_answer(status, data, repr(body))

    with reported(target, path):
        case()
        target.settled()
        assert target.get_json("/kvmesh/workers")["workers"]
