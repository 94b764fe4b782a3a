"""Requests whose engine cache is keyed by more than tokens hash into a namespace of their own."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest

from kvmesh.router.request.parse import ParsedRequest, cache_keyed, parse_request
from kvmesh.router.request.tokenizer import BuiltinTokenizer

TEXT = "The quick brown fox jumps over the lazy dog. " * 20


def _hashes(**extra: Any) -> tuple[list[int], str | None]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": TEXT}], **extra}
    parsed = parse_request(
        msgspec.json.encode(body),
        [],
        "/v1/chat/completions",
        tokenizer=BuiltinTokenizer(),
        block_size=16,
        lora_of=lambda model: None,
        clock=time.perf_counter,
    )
    assert parsed.hashes, "the prompt fills whole blocks"
    return parsed.hashes, parsed.cache_keyed


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"cache_salt": "tenant-a"}, "cache_salt"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ],
)
def test_keyed_requests_share_no_block_with_the_plain_prompt(extra: dict[str, Any], reason: str) -> None:
    plain, none = _hashes()
    keyed, why = _hashes(**extra)
    assert none is None and why == reason
    assert not set(plain) & set(keyed)
    assert _hashes(**extra)[0] == keyed  # the same key: the same cache, the same hashes


def test_two_salts_are_two_caches() -> None:
    assert not set(_hashes(cache_salt="a")[0]) & set(_hashes(cache_salt="b")[0])


def test_media_in_the_messages_is_keyed() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"type": "text", "text": TEXT}, image]
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    assert cache_keyed(body) == "multimodal content"
    assert cache_keyed({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}) is None
    assert cache_keyed({"cache_salt": ""}) is None and cache_keyed({"chat_template_kwargs": {}}) is None


def test_a_long_plain_chat_parsed_with_a_head_is_whole_once_completed() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "words to read later " * 200}]}
    raw = json.dumps(body).encode()
    tok = BuiltinTokenizer()

    def parse(head: int) -> ParsedRequest:
        return parse_request(
            raw,
            [],
            "/v1/chat/completions",
            tokenizer=tok,
            block_size=16,
            lora_of=lambda _: None,
            clock=time.perf_counter,
            head_tokens=head,
        )

    whole = parse(0)
    lazy = parse(256)
    assert lazy.complete_pending and not whole.complete_pending
    assert lazy.isl == whole.isl > 4 * 256
    assert lazy.hashes == whole.hashes[:16]
    assert lazy.complete() == whole.hashes
    assert lazy.tokens == whole.tokens and lazy.isl == whole.isl and not lazy.complete_pending
    # too short to be worth it, or not plain (nvext): hashed whole at once
    assert not parse(whole.isl).complete_pending
    raw = json.dumps({**body, "nvext": {"agent_hints": {"priority": 1}}}).encode()
    assert not parse(256).complete_pending
