"""Tokenizers: how a router (and the mock engine) turn an OpenAI request into token ids.

A router must compute the same token ids as the engine it routes to, or its block hashes never
match the engine's cache. Three implementations stand behind one small protocol:

* :class:`BuiltinTokenizer` - deterministic, no download, used by the mock engine *and* by routers
  in front of a mock fleet. Text is cut into word-like pieces and each piece's UTF-8 bytes into
  chunks of up to three bytes; a chunk's id *is* its bytes (plus a length tag), so encoding is
  exactly invertible, identical in every process, and averages about three characters per token,
  close to a real BPE vocabulary's density.
* :class:`HfTokenizer` - a Hugging Face tokenizer from a local path (``pip install 'kvmesh[hf]'``).
* an engine's own tokenizer, adapted by the engine adapters.

:func:`prompt_token_ids` applies one of them to an OpenAI ``/v1/chat/completions`` or
``/v1/completions`` body the way vLLM does.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import msgspec

from kvmesh.errors import RequestError

__all__ = [
    "BuiltinTokenizer",
    "HfTokenizer",
    "Tokenizer",
    "prompt_prefix_ids",
    "prompt_token_ids",
]

MAX_TOKEN_ID = 2**31 - 1


@runtime_checkable
class Tokenizer(Protocol):
    """What kvmesh needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt, as the engine encodes it."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a rendered chat conversation; ``continue_final_message``: the last message
        left open, to be continued (asked for only when true, so a tokenizer written before it
        still serves every other request), with ``add_generation_prompt`` as the client sent it
        (vLLM refuses both; SGLang wants the generation prompt to open the continued turn)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


# --- the built-in tokenizer -------------------------------------------------------------------

# Special tokens occupy ids 0..255; text chunks start at 256.
PAD, BOS, EOS, IM_START, IM_END = 0, 1, 2, 3, 4
_SPECIAL_TEXT = {
    PAD: "<|pad|>",
    BOS: "<|bos|>",
    EOS: "<|eos|>",
    IM_START: "<|im_start|>",
    IM_END: "<|im_end|>",
}
_CHUNK_BASE = 256
_CHUNK_BYTES = 3  # (_encode_piece spells out pieces of up to three such chunks: change both)
# id = _CHUNK_BASE + (n - 1) * 2**24 + big-endian value of the n bytes, so ids stay below 2**26.
_LEN_SHIFT = 24
_LEN_OFFSET = (0, _CHUNK_BASE, _CHUNK_BASE + (1 << _LEN_SHIFT), _CHUNK_BASE + (2 << _LEN_SHIFT))
# Word-like pieces, in the spirit of GPT-2's pre-tokenizer: an optional leading space glued to a
# run of letters, of up to three digits or of punctuation; runs of whitespace on their own. The
# alternatives cover every character, so the pieces concatenate back to the text.
_PIECE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")
_WS = r"\t-\r\x1c-\x20"
_ASCII_PIECE = re.compile(rf" ?[A-Za-z]+| ?[0-9]{{1,3}}| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+")
"""The same pieces as ``_PIECE`` for ASCII text, its classes spelt out (whitespace is what
``str.isspace`` says of ASCII: 9-13 and 28-32): the Unicode class lookups were nearly two fifths of the
pattern's time (120 against 195 us for a 9.5k-character tool output), and most prompts are ASCII."""
_PIECE_CACHE_LIMIT = 1 << 16
_TURN_CACHE_TOKENS = 1 << 20
"""Tokens of rendered turns kept (8 MB of tuple slots, plus their texts; the ids themselves are
mostly the piece cache's own int objects): a multi-turn conversation's earlier turns are encoded
once, not once per turn. Tuples rather than int arrays, because a request's ids are copied out of
the cache into a list, and copying an array boxes every id again (about 30 ns a token)."""
_TURN_CACHE_MIN_CHARS = 256
"""Shorter turns are encoded directly: cheaper than keeping them."""
_PREFIX_CHARS = (96, 512)
"""Characters a prompt's first block is read from, the second only where the first was too few
(a block of 16 tokens is about 50 characters of text)."""


class BuiltinTokenizer:
    """Deterministic, download-free, exactly invertible tokenizer with a ChatML-style template.

    >>> tok = BuiltinTokenizer()
    >>> tok.decode(tok.encode("Hello, world!"))
    'Hello, world!'

    Messages render as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; tools are listed inside
    the first system turn after its content, so conversations that share a system prompt (and
    tools) share a token prefix.
    """

    name = "builtin"
    eos_token_id = EOS

    def __init__(self) -> None:
        # Prompts repeat their words; caching a piece's ids roughly halves encoding time.
        self._piece_cache: dict[str, tuple[int, ...]] = {}
        # Each turn encodes on its own (the template never merges tokens across turns), so a
        # conversation's next request re-encodes only its new turns. (The router tokenizes on its
        # event loop thread; this cache is not for sharing across threads.)
        self._turns: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._turn_tokens = 0

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        extend = out.extend
        cache = self._piece_cache
        for piece in (_ASCII_PIECE if text.isascii() else _PIECE).findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = _encode_piece(piece)
                if len(cache) < _PIECE_CACHE_LIMIT:
                    cache[piece] = ids
            extend(ids)
        return out

    def encode_prefix(self, text: str, max_chars: int) -> list[int]:
        """The ids that begin ``encode(text)``, from at most its first ``max_chars`` characters:
        the pieces wholly inside them, the last one (which the cut may have split) left out."""
        head = text[:max_chars]
        pieces = (_ASCII_PIECE if head.isascii() else _PIECE).findall(head)
        if len(text) > max_chars and pieces:
            pieces.pop()
        return self.encode("".join(pieces))

    def chat_prefix(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, n: int
    ) -> list[int] | None:
        """The first ``n`` ids of ``apply_chat_template(messages, tools=tools)``, read from the
        beginning of its first turn (each turn encodes on its own); None where that turn holds
        fewer, or where it is in the turn cache: then the whole prompt tokenizes in a few
        microseconds (a conversation's earlier turns are cached), less than this would take."""
        if tools:
            role, text, _ = _tools_turn(messages, tools)
        else:
            role, text = str(messages[0].get("role")), _render_content(messages[0])
        turn = f"{role}\n{text}"
        if turn in self._turns:
            return None
        for chars in _PREFIX_CHARS:
            ids = self.encode_prefix(turn, chars)
            if len(ids) + 1 >= n:
                return [IM_START, *ids][:n]
            if len(turn) <= chars:
                break
        return None

    def decode(self, ids: Sequence[int]) -> str:
        buf = bytearray()
        for i in ids:
            if i < _CHUNK_BASE:
                buf += _SPECIAL_TEXT.get(i, f"<|special_{i}|>").encode()
                continue
            rel = i - _CHUNK_BASE
            n = (rel >> _LEN_SHIFT) + 1
            if n > _CHUNK_BYTES:
                raise ValueError(f"token id {i} is outside the builtin vocabulary")
            buf += (rel & 0xFFFFFF).to_bytes(n, "big")
        return buf.decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        out: list[int] = []
        start = 0
        if tools:
            role, text, start = _tools_turn(messages, tools)
            self._turn(out, role, text)
        open_at = len(messages) - 1 if continue_final_message else -1
        for i in range(start, len(messages)):
            message = messages[i]
            if i == open_at:  # its end-of-turn marks left off: the answer continues its text
                out.append(IM_START)
                out += self._encode_turn(f"{message.get('role')}\n{_render_content(message)}")
            else:
                self._turn(out, str(message.get("role")), _render_content(message))
        if add_generation_prompt and not continue_final_message:
            out.append(IM_START)
            out += self.encode("assistant\n")
        return out

    def _turn(self, out: list[int], role: str, text: str) -> None:
        out.append(IM_START)
        out += self._encode_turn(f"{role}\n{text}")
        out.append(IM_END)
        out += self.encode("\n")

    def _encode_turn(self, text: str) -> Sequence[int]:
        if len(text) < _TURN_CACHE_MIN_CHARS:
            return self.encode(text)
        turns = self._turns
        ids = turns.get(text)
        if ids is not None:
            turns.move_to_end(text)
            return ids
        ids = tuple(self.encode(text))
        if len(ids) > _TURN_CACHE_TOKENS // 4:  # one huge turn would flush everything else
            return ids
        turns[text] = ids
        self._turn_tokens += len(ids)
        while self._turn_tokens > _TURN_CACHE_TOKENS:
            _, old = turns.popitem(last=False)
            self._turn_tokens -= len(old)
        return ids


def _encode_piece(piece: str) -> tuple[int, ...]:
    """A piece's ids: its UTF-8 bytes in chunks of ``_CHUNK_BYTES``. Pieces of up to three chunks
    (nearly every word) are spelt out, twice as fast as the loop (290 against 580 ns a piece):
    this runs for every piece a prompt of words the router has not seen misses in the piece
    cache (a cold synthetic 2,850-token prompt: 7% less time to tokenize)."""
    data = piece.encode("utf-8")
    n = len(data)
    if n <= 3:
        return (_LEN_OFFSET[n] + int.from_bytes(data, "big"),) if n else ()
    whole = _LEN_OFFSET[3]
    if n <= 6:
        return (whole + int.from_bytes(data[:3], "big"), _LEN_OFFSET[n - 3] + int.from_bytes(data[3:], "big"))
    if n <= 9:
        return (
            whole + int.from_bytes(data[:3], "big"),
            whole + int.from_bytes(data[3:6], "big"),
            _LEN_OFFSET[n - 6] + int.from_bytes(data[6:], "big"),
        )
    return _encode_chunks(data)


def _encode_chunks(data: bytes) -> tuple[int, ...]:
    ids = []
    for i in range(0, len(data), _CHUNK_BYTES):
        chunk = data[i : i + _CHUNK_BYTES]
        ids.append(_LEN_OFFSET[len(chunk)] + int.from_bytes(chunk, "big"))
    return tuple(ids)


def _tools_turn(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[str, str, int]:
    """The first turn where there are tools: they join the leading system turn (or open one),
    after the system prompt. Returns its role, its text and how many messages it took in."""
    system = messages[0] if messages and messages[0].get("role") == "system" else None
    body = _render_content(system) if system is not None else ""
    tools_text = _render_tools(tools)
    return "system", f"{body}\n\n{tools_text}" if body else tools_text, 1 if system is not None else 0


_RENDERED_TOOLS: OrderedDict[bytes, str] = OrderedDict()
_RENDERED_TOOLS_LIMIT = 256
"""Tool lists rendered lately, by their JSON: an agent sends the same tools with every turn, and
``json.dumps`` of each one costs more than encoding them as a key (25 against 6 us for six)."""


def _render_tools(tools: list[dict[str, Any]]) -> str:
    try:
        key = msgspec.json.encode(tools)
    except (TypeError, msgspec.EncodeError):
        return _render_tools_now(tools)
    text = _RENDERED_TOOLS.get(key)
    if text is None:
        text = _RENDERED_TOOLS[key] = _render_tools_now(tools)
        if len(_RENDERED_TOOLS) > _RENDERED_TOOLS_LIMIT:
            _RENDERED_TOOLS.popitem(last=False)
    return text


def _render_tools_now(tools: list[dict[str, Any]]) -> str:
    lines = ["# Tools"]
    lines.extend(json.dumps(tool, separators=(",", ":"), ensure_ascii=False) for tool in tools)
    return "\n".join(lines)


def _render_content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for part in content:
            kind = part.get("type")
            parts.append(part.get("text", "") if kind in TEXT_PARTS else f"<{kind}>")
        text = "".join(parts)
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        payload = {"name": function.get("name"), "arguments": function.get("arguments")}
        text += (
            "\n<tool_call>\n"
            + json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
            + "\n</tool_call>"
        )
    return text


# --- Hugging Face ---------------------------------------------------------------------------


class HfTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloads).

    Encodes like vLLM: completion prompts with the tokenizer's special tokens (BOS), chat
    conversations rendered by the model's chat template and then encoded without adding them again.
    """

    def __init__(self, path: str, *, trust_remote_code: bool = False) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError("HfTokenizer needs transformers: pip install 'kvmesh[hf]'") from e
        self.name = path
        self._tok = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        extra = {"continue_final_message": True} if continue_final_message else {}
        text = self._tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            tokenize=False,
            **extra,
        )
        return list(self._tok.encode(text, add_special_tokens=False))


# --- OpenAI request bodies ------------------------------------------------------------------

_ROLES = frozenset(("system", "developer", "user", "assistant", "tool", "function"))
# Content parts that are text: chat's, and the Responses API's input text (an engine renders both).
TEXT_PARTS = frozenset(("text", "input_text"))


def is_chat(endpoint: str) -> bool:
    """Whether ``endpoint`` (a request path or its short name) takes chat messages."""
    return endpoint.endswith("chat/completions") or endpoint == "chat"


def prompt_token_ids(tokenizer: Tokenizer, body: Mapping[str, Any], endpoint: str) -> list[int]:
    """The prompt token ids an engine computes for an OpenAI request body.

    ``endpoint`` is the request path (``/v1/chat/completions``, ``/v1/completions``) or its short
    name (``chat``, ``completions``). Raises :class:`RequestError` naming the offending field.
    """
    if is_chat(endpoint):
        messages, tools, add_generation_prompt = chat_fields(body)
        if continues_final_message(body):  # (the generation prompt as asked: engines differ)
            try:
                return tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=True,
                )
            except TypeError as e:
                if "continue_final_message" not in str(e):
                    raise
                # a tokenizer of the user's own, written before the parameter: rendered closed,
                # as kvmesh always had (its last blocks miss; the request is served all the same)
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )
    if endpoint.endswith("completions") or endpoint == "completions":
        return _completion_prompt(tokenizer, body.get("prompt"))
    raise ValueError(f"not an OpenAI generation endpoint: {endpoint!r}")


def prompt_prefix_ids(
    tokenizer: Tokenizer, body: Mapping[str, Any], endpoint: str, n: int
) -> list[int] | None:
    """The first ``n`` prompt token ids of an OpenAI request body, exactly as
    :func:`prompt_token_ids` would begin, read from its beginning alone; None where this tokenizer
    cannot tell them without the whole prompt (only the built-in one can: an engine's own or a Hugging
    Face tokenizer encodes the rendered prompt as a whole), or the beginning holds fewer than ``n``.
    Validates the body as :func:`prompt_token_ids` does."""
    if not isinstance(tokenizer, BuiltinTokenizer):
        return None
    if is_chat(endpoint):
        messages, tools, _ = chat_fields(body)
        return tokenizer.chat_prefix(messages, tools, n)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        return None  # token ids, batches and mistakes take the whole path
    for chars in _PREFIX_CHARS:
        ids = tokenizer.encode_prefix(prompt, chars)
        if len(ids) >= n:
            return ids[:n]
        if len(prompt) <= chars:
            break
    return None


def continues_final_message(body: Mapping[str, Any]) -> bool:
    """Whether a chat body asks that its last message be continued (``continue_final_message``,
    vLLM's and SGLang's: an answer prefilled by the client, left open); a 400 naming the field
    when it is not a boolean."""
    value = body.get("continue_final_message", False)
    if not isinstance(value, bool):
        raise RequestError("'continue_final_message' must be a boolean", field="continue_final_message")
    return value


def chat_fields(
    body: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]:
    """A chat body's ``messages``, ``tools`` and ``add_generation_prompt``, checked (a 400 naming
    the field otherwise)."""
    messages = body.get("messages")
    _check_messages(messages)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("'tools' must be a list of objects", field="tools")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise RequestError("'add_generation_prompt' must be a boolean", field="add_generation_prompt")
    return cast("list[dict[str, Any]]", messages), tools, add_generation_prompt


def _completion_prompt(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is just a prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' must not be empty", field="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise RequestError(f"'prompt' token ids must be in [0, {MAX_TOKEN_ID}]", field="prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("batched prompts are not supported; send one prompt per request", field="prompt")
    if prompt is None:
        raise RequestError("'prompt' is a required property", field="prompt")
    raise RequestError("'prompt' must be a string or a list of token ids", field="prompt")


def _check_messages(messages: Any) -> None:
    if messages is None:
        raise RequestError("'messages' is a required property", field="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", field="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"'messages[{i}]' must be an object", field=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise RequestError(
                f"'messages[{i}].role' must be one of {sorted(_ROLES)}, got {role!r}",
                field=f"messages[{i}].role",
            )
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise RequestError(f"'messages[{i}].content' is required", field=f"messages[{i}].content")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise RequestError(
                        f"'messages[{i}].content[{j}]' must be an object with a 'type'",
                        field=f"messages[{i}].content[{j}]",
                    )
                if part["type"] in TEXT_PARTS and not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"'messages[{i}].content[{j}].text' must be a string",
                        field=f"messages[{i}].content[{j}].text",
                    )
        elif not isinstance(content, str):
            raise RequestError(
                f"'messages[{i}].content' must be a string or a list of parts", field=f"messages[{i}].content"
            )
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not (
            isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)
        ):
            raise RequestError(
                f"'messages[{i}].tool_calls' must be a list of objects", field=f"messages[{i}].tool_calls"
            )
