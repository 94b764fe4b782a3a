"""kvmesh.router.request.tokenizer: the builtin tokenizer, its chat template and prompt_token_ids."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvmesh.router.request.tokenizer as tokenizer_module
from kvmesh.errors import RequestError
from kvmesh.router.request.tokenizer import (
    IM_END,
    BuiltinTokenizer,
    HfTokenizer,
    Tokenizer,
    prompt_prefix_ids,
    prompt_token_ids,
)

TOK = BuiltinTokenizer()


@given(st.text())
def test_decode_inverts_encode_for_any_text(text: str) -> None:
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert all(256 <= i < 2**31 for i in ids)


@given(st.text(alphabet=st.characters(max_codepoint=127)))
def test_ascii_text_is_cut_into_the_same_pieces_as_by_the_unicode_pattern(text: str) -> None:
    # ASCII text takes the pattern with spelt-out classes; every control character, whitespace
    # (including the separators 28-31, which str.isspace counts) and punctuation mark must fall
    # where the Unicode pattern puts it, or the mock engines and the routers disagree on ids.
    assert tokenizer_module._ASCII_PIECE.findall(text) == tokenizer_module._PIECE.findall(text)


@given(st.text(max_size=14))
def test_a_short_piece_gets_the_ids_of_its_chunks(text: str) -> None:
    """Pieces of up to three chunks are spelt out (a piece-cache miss's cost): the same ids as
    chunking the bytes in a loop, for every length and for characters of 1-4 UTF-8 bytes."""
    assert tokenizer_module._encode_piece(text) == tokenizer_module._encode_chunks(text.encode("utf-8"))


def test_ascii_and_unicode_runs_of_whitespace_and_separators_cut_alike() -> None:
    text = "a \x1c\x1fb  \n\t c_d__e 123456 7.5!!  \x0b\x0c\r\n\x7fz\x00 "
    assert tokenizer_module._ASCII_PIECE.findall(text) == tokenizer_module._PIECE.findall(text)


def test_density_is_close_to_a_real_vocabulary() -> None:
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 20
    ids = TOK.encode(text)
    assert 2.0 <= len(text) / len(ids) <= 4.0


def test_ids_are_the_same_in_another_process() -> None:
    text = "Déjà vu: 12345 tokens, _under_scores_ and emoji 🙂!"
    code = f"from kvmesh.router.request.tokenizer import BuiltinTokenizer; print(BuiltinTokenizer().encode({text!r}))"
    env = {"PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == str(TOK.encode(text))


def test_builtin_is_a_tokenizer() -> None:
    assert isinstance(TOK, Tokenizer)


def test_a_shared_system_prompt_gives_a_shared_prefix() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 30}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    a = TOK.apply_chat_template([system, {"role": "user", "content": "What is 2+2?"}], tools=tools)
    b = TOK.apply_chat_template([system, {"role": "user", "content": "Name a colour."}], tools=tools)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    # Everything up to the user's text is shared: system prompt, tools and the user turn header.
    head = TOK.apply_chat_template([system], tools=tools, add_generation_prompt=False)
    assert common >= len(head) + 2
    assert a[: len(head)] == head


def test_chat_template_renders_roles_tools_and_generation_prompt() -> None:
    ids = TOK.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi "}, {"type": "image_url", "image_url": {}}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "42"},
        ],
        tools=[{"name": "f"}],
    )
    assert TOK.decode(ids) == (
        '<|im_start|>system\nBe brief.\n\n# Tools\n{"name":"f"}<|im_end|>\n'
        "<|im_start|>user\nhi <image_url><|im_end|>\n"
        '<|im_start|>assistant\n\n<tool_call>\n{"name":"f","arguments":"{}"}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tools_without_a_system_prompt_open_a_system_turn() -> None:
    ids = TOK.apply_chat_template(
        [{"role": "user", "content": "x"}], tools=[{"n": 1}], add_generation_prompt=False
    )
    assert (
        TOK.decode(ids) == '<|im_start|>system\n# Tools\n{"n":1}<|im_end|>\n<|im_start|>user\nx<|im_end|>\n'
    )


def test_a_continued_final_message_is_left_open_for_the_answer() -> None:
    """``continue_final_message`` (vLLM, SGLang): the client prefilled the answer's start; the
    engine renders the last message without its end-of-turn marks and no generation prompt."""
    tok = BuiltinTokenizer()
    messages = [{"role": "user", "content": "Give JSON."}, {"role": "assistant", "content": '{"a": '}]
    closed = tok.apply_chat_template(messages, add_generation_prompt=False)
    opened = tok.apply_chat_template(messages, continue_final_message=True)
    assert opened == closed[: len(opened)] and closed[len(opened) :] == [IM_END, *tok.encode("\n")]
    assert tok.decode(opened).endswith('assistant\n{"a": ')
    body = {"messages": messages, "continue_final_message": True}
    assert prompt_token_ids(tok, body, "/v1/chat/completions") == opened
    vllm_way = {**body, "add_generation_prompt": False}  # vLLM refuses the two together
    assert prompt_token_ids(tok, vllm_way, "chat") == opened
    assert prompt_token_ids(tok, {**vllm_way, "continue_final_message": False}, "chat") == closed
    with_tools = tok.apply_chat_template(messages, tools=[{"n": 1}], continue_final_message=True)
    assert tok.decode(with_tools).endswith('assistant\n{"a": ')
    with pytest.raises(RequestError) as info:
        prompt_token_ids(tok, {**body, "continue_final_message": "yes"}, "chat")
    assert info.value.field == "continue_final_message"


def test_a_tokenizer_without_continue_final_message_renders_the_request_closed() -> None:
    """A Tokenizer of the user's own, written before the parameter, still serves the request."""

    class Older:
        def apply_chat_template(
            self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True
        ) -> list[int]:
            return TOK.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert prompt_token_ids(Older(), body, "chat") == TOK.apply_chat_template(
        messages, add_generation_prompt=False
    )  # type: ignore[arg-type]


def test_prompt_token_ids_for_each_endpoint() -> None:
    messages = [{"role": "user", "content": "hello"}]
    assert prompt_token_ids(TOK, {"messages": messages}, "/v1/chat/completions") == TOK.apply_chat_template(
        messages
    )
    assert prompt_token_ids(TOK, {"messages": messages, "add_generation_prompt": False}, "chat") == (
        TOK.apply_chat_template(messages, add_generation_prompt=False)
    )
    assert prompt_token_ids(TOK, {"prompt": "hello"}, "/v1/completions") == TOK.encode("hello")
    assert prompt_token_ids(TOK, {"prompt": ["hello"]}, "completions") == TOK.encode("hello")
    assert prompt_token_ids(TOK, {"prompt": [5, 6, 7]}, "/v1/completions") == [5, 6, 7]
    assert prompt_token_ids(TOK, {"prompt": [[5, 6]]}, "/v1/completions") == [5, 6]
    with pytest.raises(ValueError, match="not an OpenAI generation endpoint"):
        prompt_token_ids(TOK, {"prompt": "x"}, "/v1/models")


@pytest.mark.parametrize(
    ("body", "endpoint", "field", "message"),
    [
        pytest.param({}, "chat", "messages", "'messages' is a required property", id="no-messages"),
        pytest.param({"messages": []}, "chat", "messages", "non-empty list", id="empty-messages"),
        pytest.param(
            {"messages": ["x"]}, "chat", "messages[0]", "must be an object", id="message-not-object"
        ),
        pytest.param(
            {"messages": [{"role": "bot", "content": "x"}]},
            "chat",
            "messages[0].role",
            "must be one of",
            id="role",
        ),
        pytest.param(
            {"messages": [{"role": "user"}]}, "chat", "messages[0].content", "is required", id="no-content"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": 3}]},
            "chat",
            "messages[0].content",
            "string or a list",
            id="content-type",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "chat",
            "messages[0].content[0].text",
            "must be a string",
            id="part-text",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "x"}], "tools": {}},
            "chat",
            "tools",
            "list of objects",
            id="tools",
        ),
        pytest.param({}, "completions", "prompt", "required property", id="no-prompt"),
        pytest.param({"prompt": ""}, "completions", "prompt", "must not be empty", id="empty-prompt"),
        pytest.param({"prompt": ["a", "b"]}, "completions", "prompt", "batched prompts", id="batch"),
        pytest.param({"prompt": [1, -2]}, "completions", "prompt", "token ids must be in", id="negative-id"),
        pytest.param(
            {"prompt": 7}, "completions", "prompt", "string or a list of token ids", id="prompt-type"
        ),
    ],
)
def test_bad_bodies_name_the_field(body: dict, endpoint: str, field: str, message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        prompt_token_ids(TOK, body, endpoint)
    assert info.value.field == field
    assert info.value.status == 400


def test_hf_tokenizer_names_the_extra_when_transformers_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'kvmesh\[hf\]'"):
        HfTokenizer("/nonexistent")


def test_a_conversation_encodes_the_same_when_its_earlier_turns_come_from_the_turn_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tokenizer_module, "_TURN_CACHE_TOKENS", 4000)  # small: evictions happen
    long_turn = "a tool returned these rows: " + " ".join(f"row{i}=é{i * 7}" for i in range(300))
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse. " * 30}]
    tok = BuiltinTokenizer()
    for turn in range(12):
        messages += [
            {"role": "user", "content": f"turn {turn}: {long_turn}"},
            {"role": "assistant", "content": f"answer {turn} " * 40},
        ]
        cached = tok.apply_chat_template(messages)
        assert cached == BuiltinTokenizer().apply_chat_template(messages)
        assert type(cached) is list
    assert 0 < tok._turn_tokens <= 4000  # bounded: the oldest turns were dropped


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"q": "string"}}}]


@given(st.text(min_size=1), st.text(), st.booleans())
def test_a_prompt_s_first_block_read_from_its_beginning_is_the_whole_prompt_s(
    first: str, second: str, with_tools: bool
) -> None:
    # what the router routes a prompt no worker holds on, before tokenizing the rest of it
    chat = {"messages": [{"role": "system", "content": first}, {"role": "user", "content": second}]}
    if with_tools:
        chat["tools"] = TOOLS
    for body, endpoint in ((chat, "/v1/chat/completions"), ({"prompt": first}, "/v1/completions")):
        head = prompt_prefix_ids(BuiltinTokenizer(), body, endpoint, 16)
        whole = prompt_token_ids(BuiltinTokenizer(), body, endpoint)
        if head is not None:
            assert head == whole[:16]
        elif endpoint == "/v1/completions" and len(whole) >= 16 and len(first) <= 96:
            raise AssertionError("a short prompt of 16 tokens or more was not read")


def test_the_first_block_is_not_read_for_a_turn_the_tokenizer_has_cached_or_by_another_tokenizer() -> None:
    tok = BuiltinTokenizer()
    body = {"messages": [{"role": "user", "content": "a long document " * 40}]}
    assert prompt_prefix_ids(tok, body, "/v1/chat/completions", 16) is not None
    prompt_token_ids(tok, body, "/v1/chat/completions")  # now the turn is cached: tokenizing is cheap
    assert prompt_prefix_ids(tok, body, "/v1/chat/completions", 16) is None
    # a Hugging Face tokenizer encodes the rendered prompt as a whole: no exact first block
    assert prompt_prefix_ids(HfTokenizer.__new__(HfTokenizer), body, "/v1/chat/completions", 16) is None


@pytest.mark.parametrize("role", [[], {}, 3])
def test_a_role_of_the_wrong_type_is_the_client_s_400_naming_it(role: object) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": role, "content": "x" * 400}]}
    for read in (prompt_prefix_ids, prompt_token_ids):
        args = (16,) if read is prompt_prefix_ids else ()
        with pytest.raises(RequestError) as e:
            read(BuiltinTokenizer(), body, "/v1/chat/completions", *args)  # type: ignore[operator]
        assert e.value.field == "messages[1].role"
