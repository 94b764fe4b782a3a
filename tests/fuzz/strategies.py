"""Request bodies and headers for the fuzz suite: built from the OpenAI chat / completions and
``nvext`` schemas, and from the control surfaces' own (the router's admin API, the worker RPCs),
then mutated (wrong types, sizes, encodings, nesting, numbers at every limit).

Bodies are raw bytes, so a case can be what no JSON encoder would write: invalid UTF-8 inside a
string, a lone surrogate escape, an integer literal past every float, nesting near the recursion
limit, a truncated document."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

MODEL = "kvmesh-mock"

# Numbers at the edges: ints around 32/64-bit limits, floats at their limits, huge literals.
EDGE_NUMBERS = st.sampled_from(
    [0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64, 0.5, -0.0,
     1e-308, 5e-324, 1.7976931348623157e308, -1.7976931348623157e308, 1e300, 3.0, 600, 3600.0]
)  # fmt: skip
HUGE_LITERALS = st.sampled_from(
    [b"1" + b"0" * 400, b"-" + b"9" * 5000, b"1e400", b"-1e400", b"NaN", b"Infinity"]
)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    EDGE_NUMBERS,
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(
        ["", "open", "close", "bind", "5m", "1h", "600", "ephemeral", "worker_id", "timing", " "]
    ),
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the schema's own type, sometimes anything at all."""
    return st.one_of(value, value, value, ANY_JSON)


AGENT_HINTS = st.fixed_dictionaries(
    {},
    optional={
        "priority": _maybe(st.one_of(st.integers(-100, 100), EDGE_NUMBERS)),
        "latency_sensitivity": _maybe(st.one_of(st.floats(0, 10), EDGE_NUMBERS)),
        "osl": _maybe(st.one_of(st.integers(1, 512), EDGE_NUMBERS)),
        "speculative_prefill": _maybe(st.booleans()),
        "kv_overlap_score_credit": _maybe(st.one_of(st.floats(0, 1), EDGE_NUMBERS)),
    },
)
SESSION = st.fixed_dictionaries(
    {},
    optional={
        "session_id": _maybe(
            st.one_of(st.text(min_size=1, max_size=20), st.text(min_size=200, max_size=400))
        ),
        "action": _maybe(st.sampled_from(["open", "close", "bind", "OPEN", ""])),
        "timeout": _maybe(st.one_of(st.floats(0.001, 600), EDGE_NUMBERS)),
    },
)
NVEXT = st.fixed_dictionaries(
    {},
    optional={
        "backend_instance_id": _maybe(st.one_of(st.text(max_size=30), st.integers())),
        "prefill_worker_id": _maybe(st.text(max_size=30)),
        "decode_worker_id": _maybe(st.text(max_size=30)),
        "extra_fields": _maybe(st.lists(st.sampled_from(["worker_id", "timing", "other"]), max_size=3)),
        "agent_hints": _maybe(AGENT_HINTS),
        "session_control": _maybe(SESSION),
        "cache_control": _maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "type": _maybe(st.just("ephemeral")),
                    "ttl": _maybe(st.sampled_from(["5m", "1h", "600", 30, "x"])),
                },
            )
        ),
    },
)
TEXT = st.one_of(st.text(min_size=1, max_size=80), st.just("hello " * 40))
CONTENT = st.one_of(
    TEXT,
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
            st.fixed_dictionaries(
                {
                    "type": st.just("image_url"),
                    "image_url": st.fixed_dictionaries({"url": st.just("data:image/png;base64,AAAA")}),
                }
            ),
        ),
        max_size=3,
    ),
)
MESSAGE = st.fixed_dictionaries(
    {"role": _maybe(st.sampled_from(["user", "system", "assistant", "tool"])), "content": _maybe(CONTENT)}
)
COMMON = {
    "model": _maybe(st.just(MODEL)),
    "max_tokens": _maybe(st.integers(1, 8)),
    "stream": _maybe(st.booleans()),
    "temperature": _maybe(st.floats(0, 2)),
    "cache_salt": _maybe(st.text(max_size=10)),
    "chat_template_kwargs": _maybe(st.dictionaries(st.text(max_size=8), st.booleans(), max_size=2)),
    "stream_options": _maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "nvext": _maybe(NVEXT),
}
CHAT = st.fixed_dictionaries({"messages": _maybe(st.lists(MESSAGE, min_size=1, max_size=3))}, optional=COMMON)
CHAT_BATCH = st.fixed_dictionaries(
    {"messages": _maybe(st.lists(_maybe(st.lists(MESSAGE, min_size=1, max_size=2)), max_size=3))},
    optional={**COMMON, "n": _maybe(st.integers(0, 2))},
)
"""vLLM's ``/v1/chat/completions/batch``: a list of conversations (each routed on its own)."""
COMPLETION = st.fixed_dictionaries(
    {
        "prompt": _maybe(
            st.one_of(
                TEXT,
                st.lists(st.integers(-5, 2**40), min_size=1, max_size=20),
                # a batch of prompts: texts, token-id lists, or a mistake among them
                st.lists(st.one_of(TEXT, st.lists(st.integers(-5, 100), max_size=4), st.none()), max_size=3),
            )
        )
    },
    optional={**COMMON, "n": _maybe(st.integers(0, 3))},
)

INPUT_ITEM = st.one_of(
    st.fixed_dictionaries(
        {"role": _maybe(st.sampled_from(["user", "system", "developer", "assistant", "tool"]))},
        optional={
            "type": st.just("message"),
            "status": st.sampled_from(["completed", "in_progress", "incomplete"]),
            "content": _maybe(
                st.one_of(
                    TEXT,
                    st.lists(
                        st.fixed_dictionaries(
                            {
                                "type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": TEXT,
                            }
                        ),
                        max_size=2,
                    ),
                )
            ),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "custom_tool_call"]), "call_id": _maybe(TEXT)},
        optional={"name": _maybe(TEXT), "arguments": _maybe(TEXT), "input": _maybe(TEXT), "namespace": TEXT},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": _maybe(TEXT), "output": _maybe(TEXT)}
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={
            "content": st.lists(
                st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": TEXT}), max_size=2
            ),
            "encrypted_content": TEXT,
        },
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "web_search_call", "mcp_call"])}),
)
RESPONSES = st.fixed_dictionaries(
    {"input": _maybe(st.one_of(TEXT, st.lists(INPUT_ITEM, min_size=1, max_size=4)))},
    optional={
        "model": _maybe(st.just(MODEL)),
        "instructions": _maybe(TEXT),
        "max_output_tokens": _maybe(st.integers(0, 8)),
        "stream": _maybe(st.booleans()),
        "store": _maybe(st.booleans()),
        "background": _maybe(st.booleans()),
        "previous_response_id": _maybe(st.sampled_from(["resp_unknown", ""])),
        "reasoning": _maybe(st.fixed_dictionaries({"effort": _maybe(st.sampled_from(["low", "high"]))})),
        "tools": _maybe(
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["function", "namespace", "web_search_preview"])},
                    optional={"name": _maybe(TEXT), "parameters": _maybe(st.just({"type": "object"}))},
                ),
                max_size=2,
            )
        ),
        "cache_salt": _maybe(st.text(max_size=10)),
        "nvext": _maybe(NVEXT),
    },
)

SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": _maybe(st.integers(-1, 8)),
        "n": _maybe(st.integers(0, 3)),
        "temperature": _maybe(st.floats(0, 2)),
        "ignore_eos": _maybe(st.booleans()),
        "top_k": _maybe(st.integers(-1, 50)),
        "stop": _maybe(st.one_of(TEXT, st.lists(TEXT, max_size=2))),
        "regex": _maybe(TEXT),
    },
)
GENERATE = st.fixed_dictionaries(
    {},
    optional={
        "text": _maybe(st.one_of(TEXT, st.lists(st.one_of(TEXT, st.integers()), max_size=3))),
        "input_ids": _maybe(
            st.one_of(
                st.lists(st.integers(-5, 2**40), max_size=20),
                st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=2),
            )
        ),
        "input_embeds": st.just([[0.1, 0.2]]),
        "sampling_params": _maybe(st.one_of(SAMPLING, st.lists(SAMPLING, max_size=2))),
        "stream": _maybe(st.booleans()),
        "rid": _maybe(st.one_of(TEXT, st.lists(TEXT, max_size=3))),
        "priority": _maybe(st.integers(-10, 10)),
        "session_params": _maybe(st.fixed_dictionaries({"id": TEXT})),
        "bootstrap_room": _maybe(st.integers(0, 10)),
        "lora_path": _maybe(TEXT),
        "cache_salt": _maybe(st.text(max_size=10)),
        "return_logprob": _maybe(st.one_of(st.booleans(), st.lists(st.booleans(), max_size=3))),
        "nvext": _maybe(NVEXT),
    },
)

VLLM_SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": _maybe(st.integers(-1, 8)),
        "n": _maybe(st.integers(0, 3)),
        "temperature": _maybe(st.floats(0, 2)),
        "ignore_eos": _maybe(st.booleans()),
        "min_tokens": _maybe(st.integers(-1, 4)),
        "stop_token_ids": _maybe(st.lists(st.integers(-1, 100), max_size=2)),
        "prompt_logprobs": _maybe(st.integers(-1, 2)),
        "logprobs": _maybe(st.integers(-1, 2)),
        "skip_reading_prefix_cache": _maybe(st.booleans()),
        "detokenize": _maybe(st.booleans()),
    },
)
TOKENS = st.fixed_dictionaries(
    # (what vLLM requires, drawn always: without it nearly every body stops at the first 400)
    {
        "token_ids": st.one_of(
            st.lists(st.integers(0, 500), min_size=1, max_size=40),
            st.lists(st.integers(-5, 2**40), max_size=20),
            st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=2),
        ),
        "sampling_params": st.one_of(VLLM_SAMPLING, st.lists(VLLM_SAMPLING, max_size=2), TEXT),
    },
    optional={
        "request_id": _maybe(TEXT),
        "stream": _maybe(st.booleans()),
        "stream_options": _maybe(
            st.fixed_dictionaries(
                {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
            )
        ),
        "priority": _maybe(st.integers(-10, 10)),
        "output_mode": _maybe(st.sampled_from(["tokens", "text", "derender", "bits"])),
        "cache_salt": _maybe(st.text(max_size=10)),
        "features": _maybe(st.just({"mm_hashes": {"image": ["h"]}, "mm_placeholders": {}})),
        "kv_transfer_params": _maybe(st.just({"do_remote_decode": True})),
        "model": _maybe(TEXT),
        "nvext": _maybe(NVEXT),
    },
)
ABORT = st.fixed_dictionaries(
    {},
    optional={
        "request_ids": _maybe(
            st.one_of(st.lists(TEXT, max_size=3), TEXT, st.lists(st.integers(), max_size=2))
        )
    },
)
SGLANG_ABORT = st.fixed_dictionaries(
    {},
    optional={
        "rid": _maybe(st.one_of(TEXT, st.integers(), st.lists(TEXT, max_size=2))),
        "abort_all": _maybe(st.one_of(st.booleans(), TEXT)),
        "abort_message": _maybe(TEXT),
    },
)

CONTROL = st.fixed_dictionaries(
    {},
    optional={
        "mode": _maybe(st.one_of(st.sampled_from(["abort", "wait", "keep", "retract", "in_place"]), TEXT)),
        "tags": _maybe(st.one_of(st.lists(st.sampled_from(["weights", "kv_cache", "scheduling"])), TEXT)),
        "new_version": _maybe(TEXT),
        "torch_empty_cache": _maybe(SCALARS),
        "model_path": _maybe(TEXT),
        "flush_cache": _maybe(SCALARS),
    },
)
"""The bodies of the engines' training-loop controls (SGLang's ``/pause_generation`` and its kin;
the standalone router sends them to every worker)."""
CONTROL_QUERY = st.lists(
    st.tuples(
        st.sampled_from(["mode", "clear_cache", "level", "tags", "x"]),
        st.one_of(
            st.sampled_from(["abort", "wait", "keep", "true", "false", "0", "1", "2", "3", "-1", "weights"]),
            TEXT,
        ),
    ),
    max_size=3,
)
"""vLLM's query arguments of ``/pause``, ``/sleep`` and ``/wake_up``, and others."""

EMBEDDINGS = st.fixed_dictionaries(
    {
        "input": _maybe(
            st.one_of(
                TEXT,
                st.lists(TEXT, max_size=3),
                st.lists(st.integers(-1, 60000), max_size=40),
                st.lists(st.lists(st.integers(-1, 60000), max_size=20), max_size=3),
            )
        )
    },
    optional={
        "model": _maybe(st.sampled_from([MODEL, "another-model"])),
        "encoding_format": _maybe(st.sampled_from(["float", "base64", "binary"])),
        "dimensions": _maybe(st.one_of(st.integers(-2, 64), EDGE_NUMBERS)),
        "user": _maybe(TEXT),
        "priority": _maybe(st.integers(-5, 5)),
        "truncate_prompt_tokens": _maybe(st.integers(-2, 64)),
    },
)
"""vLLM's ``/v1/embeddings`` body (the standalone router relays it to the least loaded worker)."""

SAGEMAKER_SESSION = st.fixed_dictionaries(
    {"requestType": st.one_of(st.sampled_from(["NEW_SESSION", "CLOSE"]), SCALARS)}
)
INVOCATIONS = st.one_of(CHAT, COMPLETION, EMBEDDINGS, SAGEMAKER_SESSION)
"""SageMaker's ``/invocations`` bodies: a chat request, a completion, an embedding request, or a
stateful session's own request (kvmesh.router.asgi.invocations)."""

OLLAMA_COMMON = {
    "stream": _maybe(st.booleans()),
    "options": _maybe(
        st.fixed_dictionaries(
            {"num_predict": _maybe(st.integers(-1, 6))},
            optional={
                "temperature": _maybe(st.floats(-1, 3)),
                "top_p": _maybe(st.floats(0, 1)),
                "seed": _maybe(st.integers(-3, 2**40)),
                "stop": _maybe(st.lists(TEXT, max_size=2)),
                "mirostat": _maybe(st.integers(0, 2)),
            },
        )
    ),
    "format": _maybe(st.sampled_from(["json", {"type": "object"}])),
    "keep_alive": _maybe(st.sampled_from(["5m", 0, -1])),
    "think": _maybe(st.booleans()),
    "nvext": _maybe(NVEXT),
}
OLLAMA_CHAT = st.fixed_dictionaries(
    {
        "messages": _maybe(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "role": _maybe(st.sampled_from(["user", "system", "assistant"])),
                        "content": _maybe(TEXT),
                    },
                    optional={"images": _maybe(st.lists(st.just("AAAA"), max_size=2))},
                ),
                min_size=1,
                max_size=3,
            )
        ),
        "model": _maybe(st.just(MODEL)),  # (required: its absence is among _maybe's anything)
    },
    optional=OLLAMA_COMMON,
)
"""Ollama's ``/api/chat`` body, as SGLang serves it (kvmesh.router.request.ollama_api)."""
OLLAMA_GENERATE = st.fixed_dictionaries(
    {"prompt": _maybe(st.one_of(TEXT, st.just(""), st.just("   "))), "model": _maybe(st.just(MODEL))},
    optional={
        **OLLAMA_COMMON,
        "system": _maybe(TEXT),
        "raw": _maybe(st.booleans()),
        "template": _maybe(TEXT),
        "context": _maybe(st.lists(st.integers(0, 100), max_size=4)),
    },
)
"""Ollama's ``/api/generate`` body, as SGLang serves it."""

VERTEX_INSTANCE = st.fixed_dictionaries(
    {},
    optional={
        "text": _maybe(st.one_of(TEXT, st.just(""))),
        "input_ids": _maybe(st.lists(st.integers(-5, 2**40), max_size=20)),
        "input_embeds": st.just([[0.1, 0.2]]),
        "image_data": _maybe(st.just("AAAA")),
    },
)
VERTEX = st.fixed_dictionaries(
    {"instances": _maybe(st.lists(_maybe(VERTEX_INSTANCE), max_size=3))},
    optional={
        "parameters": _maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "sampling_params": _maybe(st.one_of(SAMPLING, st.lists(SAMPLING, max_size=3))),
                    "stream": _maybe(st.booleans()),
                    "rid": _maybe(st.one_of(TEXT, st.lists(TEXT, max_size=3))),
                    "lora_path": _maybe(TEXT),
                    "text": _maybe(TEXT),
                    "return_logprob": _maybe(st.booleans()),
                },
            )
        ),
        "nvext": _maybe(NVEXT),
    },
)
"""SGLang's Vertex AI prediction body (kvmesh.router.request.vertex_api)."""

OPEN_SESSION = st.fixed_dictionaries(
    {"capacity_of_str_len": _maybe(st.integers(-1, 1 << 16))},
    optional={
        "session_id": _maybe(st.one_of(TEXT, st.sampled_from(["s-1", "s-2"]))),
        "timeout": _maybe(st.one_of(st.floats(0, 5), EDGE_NUMBERS)),
        "streaming": _maybe(st.booleans()),
    },
)
"""SGLang's ``/open_session`` body (kvmesh.router.asgi.sglang_sessions)."""
CLOSE_SESSION = st.fixed_dictionaries(
    {"session_id": _maybe(st.one_of(TEXT, st.sampled_from(["s-1", "s-2"])))}
)
"""SGLang's ``/close_session`` body."""

BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _maybe(TEXT)}),
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": _maybe(st.fixed_dictionaries({"type": st.just("base64"), "data": TEXT})),
        }
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": _maybe(TEXT)}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": _maybe(TEXT),
            "name": _maybe(TEXT),
            "input": _maybe(st.just({"a": 1})),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": _maybe(TEXT),
            "content": _maybe(
                st.one_of(
                    TEXT,
                    st.lists(
                        st.one_of(
                            st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                            st.fixed_dictionaries(
                                {
                                    "type": st.just("image"),
                                    "source": _maybe(st.just({"type": "url", "url": "u"})),
                                }
                            ),
                            st.fixed_dictionaries(
                                {"type": st.just("tool_reference"), "tool_name": _maybe(TEXT)}
                            ),
                        ),
                        max_size=3,
                    ),
                )
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["tool_addition", "tool_removal"]),
            "tool": _maybe(
                st.one_of(
                    st.fixed_dictionaries({"type": st.just("tool_reference"), "name": _maybe(TEXT)}),
                    st.fixed_dictionaries(
                        {
                            "type": st.just("tool_definition"),
                            "definition": _maybe(
                                st.fixed_dictionaries(
                                    {"name": TEXT, "input_schema": st.just({"type": "object"})}
                                )
                            ),
                        }
                    ),
                    TEXT,
                )
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["redacted_thinking", "tool_reference", "document"])}),
)
MESSAGES = st.fixed_dictionaries(
    {
        "messages": _maybe(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "role": _maybe(st.sampled_from(["user", "user", "assistant", "system", "tool"])),
                        "content": _maybe(st.one_of(TEXT, st.lists(BLOCK, max_size=3))),
                    }
                ),
                min_size=1,
                max_size=3,
            )
        ),
        # (required by every engine's request model: optional, few cases would get past them)
        "model": _maybe(st.just(MODEL)),
        "max_tokens": _maybe(st.integers(-1, 8)),
    },
    optional={
        "system": _maybe(
            st.one_of(
                TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)
            )
        ),
        "stream": _maybe(st.booleans()),
        "temperature": _maybe(st.floats(0, 2)),
        "top_k": _maybe(st.integers(-1, 50)),
        "stop_sequences": _maybe(st.lists(TEXT, max_size=2)),
        "thinking": _maybe(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                optional={"budget_tokens": st.integers(0, 4096)},
            )
        ),
        "tools": _maybe(
            st.lists(
                st.fixed_dictionaries(
                    {"name": _maybe(TEXT)}, optional={"input_schema": _maybe(st.just({"type": "object"}))}
                ),
                max_size=2,
            )
        ),
        "tool_choice": _maybe(
            st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "tool"])})
        ),
        "cache_salt": _maybe(st.text(max_size=10)),
        "nvext": _maybe(NVEXT),
    },
)


@st.composite
def raw_body(draw: st.DrawFn, doc: st.SearchStrategy[dict[str, Any]]) -> bytes:
    """A schema-shaped document, encoded, then perhaps mutated at the byte level."""
    import json

    body = draw(doc)
    data = json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    mutation = draw(
        st.sampled_from(
            ["none"] * 6 + ["bad-utf8", "surrogate", "huge-number", "deep", "truncate", "bom", "not-object"]
        )
    )
    if mutation == "bad-utf8" and b'"' in data:
        cut = data.index(b'"') + 1
        data = (
            data[:cut]
            + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]))
            + data[cut:]
        )
    elif mutation == "surrogate" and b'"' in data:
        cut = data.index(b'"') + 1
        data = data[:cut] + b"\\ud800" + data[cut:]
    elif mutation == "huge-number":
        path = draw(st.sampled_from(["max_tokens", "nvext", "priority", "credit", "timeout"]))
        literal = draw(HUGE_LITERALS)
        inner = {
            "max_tokens": b'"max_tokens":' + literal,
            "nvext": b'"nvext":' + literal,
            "priority": b'"nvext":{"agent_hints":{"priority":' + literal + b"}}",
            "credit": b'"nvext":{"agent_hints":{"kv_overlap_score_credit":' + literal + b"}}",
            "timeout": b'"nvext":{"session_control":{"session_id":"s","timeout":' + literal + b"}}",
        }[path]
        data = b"{" + inner + (b"," + data[1:] if data not in (b"{}",) else b"}")
    elif mutation == "deep":
        depth = draw(st.sampled_from([65, 200, 990, 1000, 5000]))
        key = draw(st.sampled_from([b"metadata", b"nvext", b"messages"]))
        data = b'{"' + key + b'":' + b"[" * depth + b"]" * depth + b"," + data[1:]
    elif mutation == "truncate" and len(data) > 2:
        data = data[: draw(st.integers(1, len(data) - 1))]
    elif mutation == "bom":
        data = b"\xef\xbb\xbf" + data
    elif mutation == "not-object":
        data = draw(st.sampled_from([b"[]", b"null", b"1", b'"x"', b"", b"{", b"[" * 3000]))
    return data


HEADER_VALUES = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40), st.just(" ")
)
HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "x-worker-instance-id": HEADER_VALUES,
        "x-prefill-instance-id": HEADER_VALUES,
        "x-kvmesh-hop": HEADER_VALUES,
        "x-kvmesh-request-id": HEADER_VALUES,
        "x-kvmesh-hop-auth": HEADER_VALUES,
        "x-amzn-sagemaker-session-id": HEADER_VALUES,
        "content-type": st.sampled_from(
            ["application/json", "text/plain", "application/json; charset=latin-1"]
        ),
    },
)


# --- the control surfaces: the router's admin API and the worker RPCs ---------------------------

WORKER_URLS = st.sampled_from(
    ["http://127.0.0.1:1", "http://127.0.0.1:0", "http://[::1]:9", "ftp://x:1", "http://", "127.0.0.1:5",
     "http://127.0.0.1:65536", "http://h\r\nx:1", " ", ""]
)  # fmt: skip
"""Ports nothing listens on and malformed URLs (the fleet's own engines are added by the test)."""
IDS = st.one_of(st.text(max_size=30), st.sampled_from(["w1", " w", "w\r\nx-evil: 1", "\x1f", "a/b"]))
WORKER_SPEC = st.fixed_dictionaries(
    {},
    optional={
        "url": _maybe(WORKER_URLS),
        "id": _maybe(IDS),
        "block_size": _maybe(st.one_of(st.sampled_from([8, 16, 32]), EDGE_NUMBERS)),
        "dp_size": _maybe(st.one_of(st.integers(1, 4), EDGE_NUMBERS)),
        "total_kv_blocks": _maybe(EDGE_NUMBERS),
        "max_num_batched_tokens": _maybe(EDGE_NUMBERS),
        "bootstrap_port": _maybe(EDGE_NUMBERS),
        "backend": _maybe(st.sampled_from(["vllm", "sglang", "trtllm", "mock"])),
        "model": _maybe(st.just(MODEL)),
        "priority_polarity": _maybe(st.sampled_from(["lower_first", "higher_first", "none", "up"])),
        "role": _maybe(st.sampled_from(["aggregated", "prefill", "decode", "both"])),
        "kv_events_endpoints": _maybe(st.lists(st.sampled_from(["tcp://127.0.0.1:1", "x", ""]), max_size=2)),
        "kv_replay_endpoints": _maybe(st.lists(st.sampled_from(["tcp://127.0.0.1:2", "x"]), max_size=2)),
    },
)
THRESHOLDS = st.fixed_dictionaries(
    {},
    optional={
        "model": _maybe(st.sampled_from([MODEL, "other"])),
        "active_decode_blocks_threshold": _maybe(st.one_of(st.floats(0, 1), EDGE_NUMBERS)),
        "active_prefill_tokens_threshold": _maybe(st.one_of(st.integers(0, 10**6), EDGE_NUMBERS)),
        "active_prefill_tokens_threshold_frac": _maybe(st.one_of(st.floats(0, 4), EDGE_NUMBERS)),
    },
)
SESSION_RPC = st.fixed_dictionaries(
    {},
    optional={
        "action": _maybe(st.sampled_from(["open_session", "close_session", "open"])),
        "session_id": _maybe(IDS),
        "timeout": _maybe(st.one_of(st.floats(0.001, 600), EDGE_NUMBERS)),
    },
)
PIN_RPC = st.fixed_dictionaries(
    {},
    optional={
        "token_ids": _maybe(st.lists(st.one_of(st.integers(0, 2**31), EDGE_NUMBERS), max_size=40)),
        "ttl_seconds": _maybe(st.one_of(st.floats(0.001, 5), EDGE_NUMBERS)),
    },
)
