"""Requests whose engine cache is keyed by more than tokens hash into a namespace of their own."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from kvmesh.router.request.parse import cache_keyed, parse_request
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
        ({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}, "chat_template"),
        ({"documents": [{"title": "a", "text": "rendered by the engine's template"}]}, "documents"),
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
    assert cache_keyed({"chat_template": None, "documents": []}) is None
