"""kvmesh/router/asgi/tap.py with a raw ASGI recorder: message boundaries, not just content."""

from __future__ import annotations

import json
from typing import Any

from kvmesh.router.asgi.tap import ResponseTap


class Recorder:
    def __init__(self, echo: dict[str, Any] | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.calls: list[str] = []
        self._echo = echo

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def first_event(self, streamed: bool = True) -> None:
        self.calls.append("first")

    def events(self, n: int) -> None:
        self.calls.append(f"events:{n}")

    def usage(self, usage: dict[str, Any]) -> None:
        self.calls.append(f"cached:{usage['prompt_tokens_details']['cached_tokens']}")

    def echo(self) -> dict[str, Any] | None:
        return self._echo

    def end(self, complete: bool) -> None:
        self.calls.append(f"end:{complete}")


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


SSE_HEAD = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream")],
}


async def test_sse_goes_out_message_by_message_with_nvext_before_done() -> None:
    rec = Recorder(echo={"worker_id": "w1"})
    tap = ResponseTap(rec.send, rec, extra_headers=[(b"x-kvmesh-worker-id", b"w1")])
    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"delta": {"content": "a"}}],
    }
    usage = {
        "id": "c1",
        "choices": [],
        "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    await tap(SSE_HEAD)
    assert rec.sent[0]["headers"][-1] == (b"x-kvmesh-worker-id", b"w1")  # the head is not held back
    await tap({"type": "http.response.body", "body": _event(chunk), "more_body": True})
    await tap({"type": "http.response.body", "body": _event(chunk), "more_body": True})
    assert [m.get("more_body") for m in rec.sent[1:]] == [True, True]  # each chunk went out at once
    await tap({"type": "http.response.body", "body": _event(usage) + b"data: [DONE]\n\n", "more_body": False})
    assert [m.get("more_body") for m in rec.sent[1:]] == [True, True, False]
    last = rec.sent[-1]["body"].split(b"\n\n")
    assert last[0] == _event(usage).rstrip()
    echoed = json.loads(last[1][len(b"data: ") :])
    assert echoed == {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [],
        "nvext": {"worker_id": "w1"},
    }
    assert last[2] == b"data: [DONE]"
    assert rec.calls == ["first", "events:1", "events:1", "events:1", "cached:4", "end:True"]
    assert tap.complete


async def test_json_answer_gets_nvext_and_a_correct_content_length() -> None:
    rec = Recorder(echo={"worker_id": "w2"})
    tap = ResponseTap(rec.send, rec)
    body = json.dumps(
        {"id": "x", "usage": {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 7}}}
    )
    await tap(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    assert rec.sent == []  # held until the body is complete: its length changes
    await tap({"type": "http.response.body", "body": body[:10].encode(), "more_body": True})
    await tap({"type": "http.response.body", "body": body[10:].encode(), "more_body": False})
    start, message = rec.sent
    doc = json.loads(message["body"])
    assert doc["nvext"] == {"worker_id": "w2"}
    assert dict(start["headers"])[b"content-length"] == str(len(message["body"])).encode()
    # completion_tokens reach the account through usage(): it counts them as output tokens
    assert rec.calls == ["first", "cached:7", "end:True"]


async def test_errors_and_other_content_types_pass_through_untouched() -> None:
    rec = Recorder(echo={"worker_id": "w3"})
    tap = ResponseTap(rec.send, rec)
    head = {"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]}
    await tap(head)
    await tap({"type": "http.response.body", "body": b'{"error": "bad"}', "more_body": False})
    assert rec.sent == [head, {"type": "http.response.body", "body": b'{"error": "bad"}', "more_body": False}]


async def test_an_unfinished_stream_is_not_complete() -> None:
    rec = Recorder()
    tap = ResponseTap(rec.send, rec)
    await tap(SSE_HEAD)
    await tap({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    assert not tap.complete and "end:True" not in rec.calls


async def test_text_that_looks_like_sse_inside_an_event_is_content_not_structure() -> None:
    """A model that writes 'metadata:' or 'data: [DONE]' must not be miscounted, and the echo must
    never be spliced into the middle of its JSON (the client's stream stays byte-exact)."""
    rec = Recorder(echo={"worker_id": "w1"})
    tap = ResponseTap(rec.send, rec)
    tricky = {
        "id": "c1",
        "choices": [{"delta": {"content": 'metadata: x\ndata: [DONE]\n"usage": {"cached_tokens": 99}'}}],
    }
    await tap(SSE_HEAD)
    first = _event(tricky)
    await tap({"type": "http.response.body", "body": first, "more_body": True})
    await tap({"type": "http.response.body", "body": first + b"data: [DONE]\n\n", "more_body": False})
    assert rec.sent[1]["body"] == first  # passed on untouched
    events = [e for e in rec.sent[2]["body"].split(b"\n\n") if e]
    assert events[0] == first.rstrip()
    assert json.loads(events[1][len(b"data: ") :])["nvext"] == {"worker_id": "w1"}
    assert events[2] == b"data: [DONE]"
    assert rec.calls == ["first", "events:1", "events:1", "end:True"]


async def test_a_data_line_split_anywhere_is_read_whole_and_crlf_lines_count() -> None:
    rec = Recorder()
    tap = ResponseTap(rec.send, rec)
    stream = b'data: {"a":1}\r\n\r\ndata: {"a":2}\r\n\r\ndata: [DONE]\r\n\r\n'
    await tap(SSE_HEAD)
    for i in range(0, len(stream), 7):
        await tap({"type": "http.response.body", "body": stream[i : i + 7], "more_body": True})
    await tap({"type": "http.response.body", "body": b"", "more_body": False})
    assert b"".join(m["body"] for m in rec.sent[1:]) == stream
    assert rec.calls == ["first", "events:1", "events:1", "end:True"]


async def test_a_role_announcement_is_not_the_first_token() -> None:
    """Some servers (the simulated engine among them) announce the assistant role before the
    engine has produced anything; prefill is done at the first chunk that carries output, and the
    announcement is passed through untouched. A first chunk with the role *and* content (vLLM's
    shape) is the first token."""
    rec = Recorder()
    tap = ResponseTap(rec.send, rec)
    role = {"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    token = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    await tap(SSE_HEAD)
    await tap({"type": "http.response.body", "body": _event(role), "more_body": True})
    assert rec.calls == [] and rec.sent[-1]["body"] == _event(role)
    await tap({"type": "http.response.body", "body": _event(token), "more_body": True})
    await tap({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    assert rec.calls == ["first", "events:1", "end:True"]

    rec = Recorder()
    tap = ResponseTap(rec.send, rec)
    both = {"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]}
    await tap(SSE_HEAD)
    await tap({"type": "http.response.body", "body": _event(both) + b"data: [DONE]\n\n", "more_body": False})
    assert rec.calls == ["first", "events:1", "end:True"]


async def test_a_usage_key_that_is_not_the_events_own_is_not_usage() -> None:
    """The bytes ``"usage"`` only make the tap decode the event; a ``usage`` nested in a tool call
    or a logprob is not the event's usage (a substring match took it for one)."""
    rec = Recorder()
    tap = ResponseTap(rec.send, rec)
    nested = {
        "id": "c1",
        "choices": [
            {
                "delta": {
                    "tool_calls": [{"function": {"usage": {"prompt_tokens_details": {"cached_tokens": 5}}}}]
                }
            }
        ],
    }
    await tap(SSE_HEAD)
    await tap(
        {"type": "http.response.body", "body": _event(nested) + b"data: [DONE]\n\n", "more_body": False}
    )
    assert not any(c.startswith("cached:") for c in rec.calls)


async def test_only_the_usage_event_is_decoded_for_usage(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With ``include_usage`` every chunk carries ``"usage": null``; only the last event's numbers
    are usage, and only events that may carry them are decoded for it."""
    import kvmesh.router.asgi.tap as tap_module

    decoded: list[bytes] = []
    real = tap_module._json_decode

    def counting(payload: bytes) -> Any:
        decoded.append(payload)
        return real(payload)

    monkeypatch.setattr(tap_module, "_json_decode", counting)
    rec = Recorder()
    tap = ResponseTap(rec.send, rec)
    chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "x"}}], "usage": None}
    spaced = b'data: {"id": "c1", "choices": [{"index": 0, "delta": {"content": "y"}}], "usage": null}\n\n'
    # a tool call's arguments naming usage as well: decoded, and still not the event's usage
    nested = {
        "id": "c1",
        "choices": [{"delta": {"tool_calls": [{"function": {"usage": {}}}]}}],
        "usage": None,
    }
    last = {
        "id": "c1",
        "choices": [],
        "usage": {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 7}},
    }
    second = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "z"}}], "usage": None}
    body = _event(chunk) + _event(second) + spaced + _event(nested) + _event(last) + b"data: [DONE]\n\n"
    await tap(SSE_HEAD)
    await tap({"type": "http.response.body", "body": body, "more_body": False})
    assert [c for c in rec.calls if c.startswith("cached:")] == ["cached:7"]
    # the first event is read for the stream's id and model; after it, only the nested and the last
    assert [real(p).get("choices") for p in decoded[1:]] == [nested["choices"], []]
    assert b'"z"' not in b"".join(decoded) and b'"y"' not in b"".join(decoded)


class OrderRecorder(Recorder):
    """Records sends and observer calls on one timeline."""

    async def send(self, message: dict[str, Any]) -> None:
        await super().send(message)
        if message["type"] == "http.response.body":
            self.calls.append("sent")


async def test_a_token_goes_to_the_client_before_the_router_reads_it() -> None:
    # The first token and every later one: the client's bytes first, the router's bookkeeping
    # (the first token's time, the counts) after, off the token's way out.
    rec = OrderRecorder()
    tap = ResponseTap(rec.send, rec)
    chunk = {"id": "c1", "choices": [{"delta": {"content": "a"}}]}
    await tap(SSE_HEAD)
    await tap({"type": "http.response.body", "body": _event(chunk), "more_body": True})
    assert rec.calls == ["sent", "first", "events:1"]
    await tap({"type": "http.response.body", "body": _event(chunk) * 2, "more_body": True})
    assert rec.calls == ["sent", "first", "events:1", "sent", "events:2"]
    assert [m["body"] for m in rec.sent[1:]] == [_event(chunk), _event(chunk) * 2]


async def test_what_must_be_spliced_in_is_read_before_it_goes_out() -> None:
    # A [DONE] with an echo due, and the annotations' preamble: the router reads the events first,
    # since what it adds depends on them or goes ahead of them.
    rec = OrderRecorder(echo={"worker_id": "w1"})
    tap = ResponseTap(rec.send, rec, preamble=b"event: token_ids\n: [1]\n\n")
    chunk = {"id": "c1", "choices": [{"delta": {"content": "a"}}]}
    await tap(SSE_HEAD)
    await tap({"type": "http.response.body", "body": _event(chunk), "more_body": True})
    assert rec.calls == ["first", "events:1", "sent"]
    assert rec.sent[1]["body"].startswith(b"event: token_ids\n")
    await tap({"type": "http.response.body", "body": _event(chunk) + b"data: [DONE]\n\n", "more_body": True})
    assert rec.calls[3:] == ["events:1", "sent"]
    assert b'"nvext"' in rec.sent[2]["body"]
    # An unfinished line is held back, so the bytes that go out are not the chunk: read first too.
    await tap({"type": "http.response.body", "body": b'data: {"choices": [', "more_body": True})
    assert rec.calls[5:] == []
    await tap({"type": "http.response.body", "body": b"]}\n\n", "more_body": False})
    assert rec.calls[5:] == ["events:1", "sent", "end:True"]


async def test_the_moment_the_first_token_goes_out_is_kept_on_either_path() -> None:
    role = {"id": "c1", "choices": [{"delta": {"role": "assistant", "content": ""}}]}
    token = {"id": "c1", "choices": [{"delta": {"content": "a"}}]}
    for preamble in (b"", b"event: token_ids\n: [1]\n\n"):  # sent first / read first
        rec = Recorder()
        tap = ResponseTap(rec.send, rec, preamble=preamble)
        await tap(SSE_HEAD)
        await tap({"type": "http.response.body", "body": _event(role), "more_body": True})
        assert tap.first_sent_at == 0.0  # a role announcement is no token
        await tap({"type": "http.response.body", "body": _event(token), "more_body": True})
        first = tap.first_sent_at
        assert first > 0.0
        await tap({"type": "http.response.body", "body": _event(token), "more_body": True})
        assert tap.first_sent_at == first


def _named(kind: str, fields: dict[str, Any]) -> bytes:
    """A Responses API event as vLLM writes it: an ``event:`` line, then its data."""
    return f"event: {kind}\n".encode() + _event({"type": kind, **fields})


async def test_a_responses_stream_starts_at_its_first_output_and_ends_with_its_usage() -> None:
    rec = Recorder()
    ids: list[str] = []
    tap = ResponseTap(rec.send, rec, identified=ids.append)
    opened = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "usage": None}
    await tap(SSE_HEAD)
    await tap(
        {
            "type": "http.response.body",
            "body": _named("response.created", {"response": opened})
            + _named("response.in_progress", {"response": opened}),
            "more_body": True,
        }
    )
    assert rec.calls == []  # the engine has produced nothing yet
    assert ids == ["resp_1"]
    delta = _named("response.output_text.delta", {"item_id": "m", "delta": "Hi"})
    await tap({"type": "http.response.body", "body": delta, "more_body": True})
    assert rec.calls == ["first", "events:1"]
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 1}
    done = _named("response.completed", {"response": {**opened, "status": "completed", "usage": usage}})
    await tap({"type": "http.response.body", "body": done, "more_body": False})
    assert rec.calls[-2:] == ["cached:32", "end:True"]
    assert b"".join(m.get("body", b"") for m in rec.sent[1:]).endswith(done)  # passed on unchanged


async def test_a_whole_responses_answer_is_read_in_its_own_names() -> None:
    rec = Recorder()
    ids: list[str] = []
    tap = ResponseTap(rec.send, rec, identified=ids.append)
    answer = {
        "id": "resp_2",
        "object": "response",
        "output": [],
        "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3},
    }
    await tap(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await tap({"type": "http.response.body", "body": json.dumps(answer).encode(), "more_body": False})
    assert rec.calls == ["first", "cached:0", "end:True"]
    assert ids == ["resp_2"]


class UsageRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.usages: list[dict[str, Any]] = []

    def usage(self, usage: dict[str, Any]) -> None:
        self.usages.append(usage)
        super().usage(usage)


def _meta(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {"id": "r1", "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}


async def test_a_generate_stream_is_counted_once_from_its_last_meta_info() -> None:
    rec = UsageRecorder()
    tap = ResponseTap(rec.send, rec)
    await tap(SSE_HEAD)
    for n in (1, 2, 3):  # SGLang's running counts, one event a token
        event = _event({"text": "ab"[: n % 3], "output_ids": [5] * n, "meta_info": _meta(40, 32, n)})
        await tap({"type": "http.response.body", "body": event, "more_body": True})
    assert rec.calls == ["first", "events:1", "events:1", "events:1"]  # counts only at the end
    await tap({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    assert rec.usages == [
        {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}
    ]
    assert rec.calls[-1] == "end:True"


async def test_a_generate_answer_of_n_samples_sums_their_tokens_and_counts_the_prompt_once() -> None:
    rec = UsageRecorder()
    tap = ResponseTap(rec.send, rec)
    answers = [  # (SGLang 0.5.23 gives a whole answer's samples no index: their place is theirs)
        {"text": "x", "meta_info": _meta(40, 16, 4)},
        {"text": "y", "meta_info": _meta(40, 16, 6)},
    ]
    await tap(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await tap({"type": "http.response.body", "body": json.dumps(answers).encode(), "more_body": False})
    assert rec.usages == [
        {"prompt_tokens": 40, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 16}}
    ]
    assert rec.calls == ["first", "cached:16", "end:True"]
    assert json.loads(b"".join(m.get("body", b"") for m in rec.sent[1:])) == answers  # unchanged


async def test_a_whole_generate_answer_keeps_its_shape_with_the_echo_merged() -> None:
    rec = UsageRecorder()
    rec._echo = {"worker_id": "w2"}
    tap = ResponseTap(rec.send, rec)
    answer = {"text": "hi", "output_ids": [1, 2], "meta_info": _meta(20, 0, 2)}
    await tap(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await tap({"type": "http.response.body", "body": json.dumps(answer).encode(), "more_body": False})
    assert rec.usages[0]["completion_tokens"] == 2
    assert json.loads(rec.sent[-1]["body"]) == {**answer, "nvext": {"worker_id": "w2"}}


def _anthropic(kind: str, fields: dict[str, Any]) -> bytes:
    """A Messages API event as vLLM writes it: an ``event:`` line, then its data."""
    return f"event: {kind}\n".encode() + _event({"type": kind, **fields})


async def test_a_messages_stream_starts_at_its_first_delta_and_is_counted_once_at_its_end() -> None:
    rec = UsageRecorder()
    tap = ResponseTap(rec.send, rec)
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m"}
    opening = _anthropic(
        "message_start",
        {
            "message": {
                **message,
                "usage": {"input_tokens": 8, "cache_read_input_tokens": 32, "output_tokens": 0},
            }
        },
    ) + _anthropic("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    await tap(SSE_HEAD)
    await tap({"type": "http.response.body", "body": opening + _anthropic("ping", {}), "more_body": True})
    assert rec.calls == []  # nothing generated yet
    delta = _anthropic("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hi"}})
    await tap({"type": "http.response.body", "body": delta, "more_body": True})
    assert rec.calls == ["first", "events:1"]
    closing = (
        _anthropic("content_block_stop", {"index": 0})
        + _anthropic("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}})
        + _anthropic("message_stop", {})
    )
    await tap({"type": "http.response.body", "body": closing, "more_body": False})
    assert rec.usages == [
        {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
    ]
    assert rec.calls[-1] == "end:True"


async def test_a_whole_messages_answer_is_read_in_its_own_names() -> None:
    rec = UsageRecorder()
    tap = ResponseTap(rec.send, rec)
    answer = {
        "id": "msg_2",
        "type": "message",
        "content": [{"type": "text", "text": "ok"}],
        "usage": {"input_tokens": 5, "cache_read_input_tokens": 16, "output_tokens": 3},
    }
    await tap(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await tap({"type": "http.response.body", "body": json.dumps(answer).encode(), "more_body": False})
    assert rec.usages == [
        {"prompt_tokens": 21, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 16}}
    ]


async def test_a_messages_stream_cut_short_before_its_message_delta_reports_no_count() -> None:
    rec = UsageRecorder()
    tap = ResponseTap(rec.send, rec)
    start = {"message": {"id": "m", "usage": {"input_tokens": 30, "output_tokens": 0}}}
    delta = _anthropic("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "a"}})
    error = _anthropic("error", {"error": {"type": "api_error", "message": "engine stopped"}})
    await tap(SSE_HEAD)
    await tap(
        {"type": "http.response.body", "body": _anthropic("message_start", start) + delta, "more_body": True}
    )
    await tap({"type": "http.response.body", "body": error, "more_body": False})
    assert rec.usages == []  # (message_start's output_tokens 0 is not the answer's count)


async def test_a_token_api_stream_is_heard_as_its_number_of_tokens_per_choice() -> None:
    """vLLM's token API streams token ids and no text: a stream without usage is counted by them
    (an event may carry several tokens), where reading its text counted none."""
    rec = Recorder()
    heard: list[tuple[int, str, int]] = []
    tap = ResponseTap(rec.send, rec, text=lambda index, text, tokens: heard.append((index, text, tokens)))
    await tap(SSE_HEAD)
    events = [
        {
            "request_id": "generate-tokens-r",
            "choices": [{"index": 0, "token_ids": [5, 6, 7], "finish_reason": None}],
        },
        {
            "request_id": "generate-tokens-r",
            "choices": [{"index": 1, "token_ids": [8], "finish_reason": None}],
        },
        {
            "request_id": "generate-tokens-r",
            "choices": [{"index": 0, "token_ids": [], "finish_reason": "abort"}],
        },
        {"choices": [{"index": 0, "text": "hi", "token_ids": [9]}]},  # (text mode: its text is read)
    ]
    body = b"".join(_event(e) for e in events) + b"data: [DONE]\n\n"
    await tap({"type": "http.response.body", "body": body, "more_body": False})
    assert heard == [(0, "", 3), (1, "", 1), (0, "hi", 0)]
    assert rec.calls == ["first", "events:4", "end:True"]
