"""What an engine puts before each choice's answer when a request asks for ``echo``.

vLLM and SGLang echo a completion's prompt: its text leads each choice's first piece of text
(streamed or whole). vLLM's chat echoes the last message when the answer continues it: the message's
role is the answer's (``assistant``, or the last message's own role without a generation prompt);
the echo is an event of its own in a stream, or the head of ``message.content``. The router's
reading of an answer (the text a pin or a warm-up feeds back, the tokens a stream without ``usage``
is counted in) must leave the echo out: it is the prompt again, not output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.router.request.tokenizer import is_chat

UNKNOWN = "\x00unknown echo"
"""The echo of a prompt given as token ids: the engine's own decoding of them, which the router
cannot reproduce (SGLang leaves special tokens out, vLLM sends none or an error)."""


def answer_echo(body: Mapping[str, Any], endpoint: str) -> str | None:
    """The text each choice's answer will begin with, :data:`UNKNOWN`, or None when the answer
    carries no echo. ``endpoint`` is the request path or its short name (``chat``,
    ``completions``)."""
    if body.get("echo") is not True:
        return None
    if not is_chat(endpoint):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else UNKNOWN
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    role = "assistant" if body.get("add_generation_prompt", True) is not False else last.get("role")
    content = last.get("content")
    if last.get("role") != role or not content:
        return None
    if isinstance(content, list):  # (vLLM joins a message's text parts with a newline)
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p)
    return content if isinstance(content, str) else None
