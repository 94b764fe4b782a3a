"""Watch a response on its way to the client: feed the router, echo ``nvext``, never buffer SSE.

:class:`ResponseTap` is an ASGI ``send`` wrapper. It serves both paths the same way: the local
pass-through (the wrapped engine app calls it as its ``send``) and the forwarded path (the proxy
turns the worker's response into the same messages).

* ``text/event-stream``: every body message goes out as soon as it comes in (an unfinished last
  line waits for the rest of itself, so an event split across reads is handled whole). The tap
  reads the stream line by line, as SSE defines it: a line that *starts* with ``data:`` is an event
  (the first one that carries output means prefill is done; a chunk that only announces the
  assistant role, which some servers send at once, does not), ``data: [DONE]`` alone on its line ends the stream, and
  ``usage`` is read from a decoded event's own ``usage`` key. Text inside an event's JSON (a model
  that writes "data: [DONE]" or "metadata:") is never taken for structure. When the client asked
  for ``nvext.extra_fields``, one more data event carrying ``nvext`` goes out just before the
  ``[DONE]`` line (or at the end of a stream without one), always at a line boundary.
* ``application/json`` (a 200 answer to a non-streaming request): buffered up to a limit, since it
  is small and complete only at the end; ``usage`` is read and ``nvext`` merged into the object.
* ``application/x-ndjson`` (Ollama's API, streamed: a JSON object a line): every body message goes
  out as it comes, and the router reads its whole lines after it: the first one is the first
  token, and a line that is ``"done"`` may carry the counts (``ollama_api.answer_usage``). A whole
  JSON answer of Ollama's has its counts read the same way.
* anything else passes through untouched.

Two options for a routed request: ``content`` hears the answer's text (``delta.content`` /
``text`` / ``message.content``; reasoning fields are left out), its ``tool_calls`` (whole, or the
pieces a stream carries) and its ``token_ids`` when the engine sends them, which costs one JSON
decode per event and is only asked for when a pin or a warm-up needs the answer; ``preamble``
(the ``nvext.annotations`` events) goes out ahead of the first event; ``text`` hears everything each event generated (reasoning included) before the batch's ``events``
call, so a stream that will carry no ``usage`` can be counted in tokens (an event of vLLM's token
API, token ids and no text, is heard as its number of tokens). Both hear each choice
with its ``index``: a request for ``n`` choices gets them interleaved, one choice an event (vLLM,
SGLang).

A Responses API answer (``/v1/responses``) is read the same way, in its own names: its lifecycle
events (``response.created``, ``response.in_progress``, ``response.queued``), sent before the engine
has produced anything, are not the first token; its ``usage`` (top level in a JSON answer, inside
``response`` in the ``response.completed`` event) is read in chat's names; ``identified`` hears the
answer's id (a later request names it as ``previous_response_id``).

An Anthropic Messages answer (``/v1/messages``) is read in its names too: ``message_start``,
``content_block_start`` and ``ping`` are not the first token; the usage of ``message_start`` (the
prompt's) and of ``message_delta`` (the answer's) is read once the stream ends, together (none
from a stream cut short before its ``message_delta``).

SGLang's ``/generate`` answers carry no ``usage``: each answer's ``meta_info`` has its counts, the
running ones in each streamed event. The last ``meta_info`` of each answer (by its ``index``) is
read once the response ends, in chat's names (``generate_api.meta_usage``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from kvmesh._http import SseLines, sse_data
from kvmesh.router.request.generate_api import meta_usage
from kvmesh.router.request.messages_api import is_anthropic_usage, messages_usage
from kvmesh.router.request.ollama_api import answer_text, answer_usage
from kvmesh.router.request.responses_api import chat_usage

_DONE = b"[DONE]"
# An unfinished SSE line longer than this is passed on as it is rather than held back.
_MAX_PARTIAL_LINE = 64 * 1024
_json_decode = msgspec.json.decode
_json_encode = msgspec.json.encode

Send = Callable[[dict[str, Any]], Awaitable[None]]
Content = Callable[[int, str, "list[int] | None", "list[Any] | None"], None]
"""(choice index, a piece of its answer's text, its token ids when the engine sent them, its tool
calls or pieces of them)"""
Text = Callable[[int, str, int], None]
"""(choice index, all the text an event generated for that choice, and how many tokens it
generated when the event gives them as token ids alone: vLLM's token API)"""
# Responses and Messages API events an engine sends before it has produced anything.
_LIFECYCLE_TYPES = frozenset(
    (
        "response.created",
        "response.in_progress",
        "response.queued",
        "message_start",
        "content_block_start",
        "ping",
    )
)
_LIFECYCLE_MARKS = (b'"response.', b"message_start", b"content_block_start", b'"ping"')


class Observer(Protocol):
    """What the tap reports, in order: first_event once, events repeatedly, usage, then end."""

    def first_event(self, streamed: bool = True) -> None:
        """Prefill is done. ``streamed=False``: a whole JSON answer, so this moment is the end of
        the request, not its first token (it must not be taken for a time to first token)."""

    def events(self, n: int) -> None: ...
    def usage(self, usage: dict[str, Any]) -> None: ...
    def echo(self) -> dict[str, Any] | None: ...
    def end(self, complete: bool) -> None: ...


class ResponseTap:
    """A ``send`` wrapper for one response (one instance per request)."""

    __slots__ = (
        "_anthropic",
        "_anthropic_start",
        "_awaiting_output",
        "_buffer",
        "_buffered",
        "_content",
        "_echoed",
        "_extra_headers",
        "_identified",
        "_json_limit",
        "_lines",
        "_metas",
        "_mode",
        "_observer",
        "_preamble",
        "_seen_events",
        "_send",
        "_start",
        "_stream_meta",
        "_text",
        "complete",
        "first_sent_at",
        "started",
        "status",
    )

    def __init__(
        self,
        send: Send,
        observer: Observer,
        *,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
        json_limit: int = 64 * 1024 * 1024,
        content: Content | None = None,
        preamble: bytes = b"",
        text: Text | None = None,
        identified: Callable[[str], None] | None = None,
    ) -> None:
        self._send = send
        self._identified = identified
        self._content = content
        self._text = text
        self._preamble = preamble
        self._observer = observer
        self._extra_headers = extra_headers or []
        self._json_limit = json_limit
        self._mode = 0  # 0 raw, 1 sse, 2 json, 3 ndjson
        self._start: dict[str, Any] | None = None
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._seen_events = 0
        self._awaiting_output = True
        self._lines = SseLines(_MAX_PARTIAL_LINE)
        self._echoed = False
        self._stream_meta: dict[str, Any] | None = None
        self._metas: dict[int, dict[str, Any]] = {}
        self._anthropic: dict[str, Any] = {}
        self._anthropic_start: dict[str, Any] = {}
        self.status = 0
        self.started = False  # the client has received the response head
        self.complete = False  # the last body message went out
        self.first_sent_at = 0.0
        """``time.perf_counter()`` as the bytes carrying the first token were handed to ``send``."""

    async def __call__(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            await self._on_start(message)
        elif kind == "http.response.body":
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if self._mode == 1:
                await self._sse(body, more)
            elif self._mode == 2:
                await self._json(body, more)
            elif self._mode == 3:
                await self._ndjson(body, more)
            else:
                await self._send(message)
                if not more:
                    self._finish()
        else:
            await self._send(message)

    async def _on_start(self, message: dict[str, Any]) -> None:
        self.status = message["status"]
        headers = message.get("headers", [])
        content_type = b""
        for k, v in headers:
            if k.lower() == b"content-type":
                content_type = v
                break
        if self._extra_headers:
            headers = [*headers, *self._extra_headers]
        if content_type.startswith(b"text/event-stream"):
            self._mode = 1
        elif content_type.startswith(b"application/x-ndjson"):
            self._mode = 3
        elif self.status == 200 and content_type.startswith(b"application/json"):
            self._mode = 2
            # content-length changes when nvext is merged in: hold the head back until the end.
            self._start = {"type": "http.response.start", "status": self.status, "headers": headers}
            return
        self.started = True
        await self._send({"type": "http.response.start", "status": self.status, "headers": headers})

    # ---------------------------------------------------------------- SSE
    async def _sse(self, body: bytes, more: bool) -> None:
        # Only whole lines are interpreted: a line the worker split across two writes
        # ("data: [DO" + "NE]") waits for its end. A partial event is of no use to the client
        # before its end arrives anyway.
        before, lines, after = self._lines.feed(body, final=not more)
        awaiting = self._awaiting_output
        if more and lines and not before and not after and not self._preamble and _DONE not in lines:
            # Whole events with nothing to splice in (no preamble due, no [DONE] for an echo): the
            # client's bytes go out first, and the router's reading of them (the first token,
            # its counts and timings) follows, off the token's way to the client.
            at = time.perf_counter() if awaiting else 0.0
            await self._send({"type": "http.response.body", "body": lines, "more_body": True})
            self._read_lines(lines)
            if awaiting and not self._awaiting_output:
                self.first_sent_at = at
            return
        if lines:
            lines = self._read_lines(lines)
        out = before + lines + after if (before or after) else lines
        if self._preamble and out:
            out = self._preamble + out
            self._preamble = b""
        if not more and not self._echoed and self._seen_events:
            # A stream that ends without [DONE]: the echo goes at its very end.
            self._echoed = True
            echo = self._observer.echo()
            if echo is not None:
                out += (b"" if not out or out.endswith(b"\n") else b"\n\n") + self._echo_event(echo)
        if not out and more:
            return
        if awaiting and not self._awaiting_output:
            self.first_sent_at = time.perf_counter()
        await self._send({"type": "http.response.body", "body": out, "more_body": more})
        if not more:
            self._finish()

    # ---------------------------------------------------------------- NDJSON
    async def _ndjson(self, body: bytes, more: bool) -> None:
        # Nothing is spliced into such a stream (no echo, no preamble): the bytes go out first,
        # and the router's reading of them follows.
        awaiting = self._awaiting_output
        at = time.perf_counter() if awaiting else 0.0
        await self._send({"type": "http.response.body", "body": body, "more_body": more})
        _, lines, _ = self._lines.feed(body, final=not more)  # (a line too long is not read)
        if lines:
            self._read_ndjson(lines)
            if awaiting and not self._awaiting_output:
                self.first_sent_at = at
        if not more:
            self._finish()

    def _read_ndjson(self, data: bytes) -> None:
        observer = self._observer
        events = 0
        usage: dict[str, Any] | None = None
        for line in data.splitlines():
            doc = _json_object(line)
            if doc is None:
                continue
            if self._awaiting_output:
                self._awaiting_output = False
                observer.first_event()
            events += 1
            text = answer_text(doc)
            if text:
                if self._text is not None:
                    self._text(0, text, 0)
                if self._content is not None:
                    self._content(0, text, None, None)
            if doc.get("done") is True:
                usage = answer_usage(doc)
        if events:
            self._seen_events += events
            observer.events(events)
        if usage is not None:
            observer.usage(usage)

    # ---------------------------------------------------------------- relayed by someone else
    def takes_as_is(self, body: bytes) -> bool:
        """Whether the stream's next bytes ``body`` would go to the client unchanged, leaving the
        tap only its reading of them: past the first token, whole SSE lines after whole lines, no
        ``[DONE]`` (an echo may be due before it) and no preamble due. Such bytes may be written to
        the client by the caller, then handed to :meth:`read_as_is`."""
        return (
            self._mode == 1
            and not self._awaiting_output
            and not self._preamble
            and body.endswith(b"\n")
            and not self._lines.waiting
            and _DONE not in body
        )

    def read_as_is(self, body: bytes) -> None:
        """Hear ``body``, already with the client (:meth:`takes_as_is` said it could be)."""
        self._read_lines(body)

    def _read_lines(self, data: bytes) -> bytes:
        """Report the events in ``data`` (whole lines); return it, with the echo spliced in
        before the ``[DONE]`` line when one is due."""
        observer = self._observer
        events = 0
        offset = 0
        done_at = -1
        usages: list[bytes] = []
        for line in data.splitlines(keepends=True):
            payload = sse_data(line)
            if payload is not None:
                if payload.strip() == _DONE:
                    if done_at < 0:
                        done_at = offset
                elif self._awaiting_output and (_announces_role_only(payload) or _lifecycle_only(payload)):
                    # The role announcement some servers send before the engine has produced
                    # anything: neither prefill done nor a token.
                    if self._seen_events == 0:
                        self._remember_meta(payload)
                    if b'"message_start"' in payload:
                        self._read_anthropic(payload)
                    self._seen_events += 1
                else:
                    if self._awaiting_output:
                        self._awaiting_output = False
                        observer.first_event()
                        if self._seen_events == 0:
                            self._remember_meta(payload)
                    events += 1
                    if self._content is not None or self._text is not None:
                        self._read_content(payload)
                    if b'"message_delta"' in payload and self._read_anthropic(payload):
                        pass  # (counted as the stream ends, with message_start's)
                    elif _may_carry_usage(payload):
                        usages.append(payload)
                    elif b'"meta_info"' in payload:
                        self._read_meta(payload)
            offset += len(line)
        if events:
            self._seen_events += events
            observer.events(events)
        for payload in usages:
            self._read_usage(payload)
        if done_at >= 0 and not self._echoed:
            self._echoed = True
            echo = observer.echo()
            if echo is not None:
                data = data[:done_at] + self._echo_event(echo) + data[done_at:]
        return data

    def _remember_meta(self, payload: bytes) -> None:
        # id / model of the first event, so the extra nvext event looks like the stream's own.
        try:
            first = _json_decode(payload)
        except msgspec.DecodeError:
            return
        if isinstance(first, dict):
            self._stream_meta = {k: first[k] for k in ("id", "object", "created", "model") if k in first}
            if self._identified is not None:
                response = first.get("response")
                _report_id(response if isinstance(response, dict) else first, self._identified)

    def _read_content(self, payload: bytes) -> None:
        try:
            event = _json_decode(payload)
        except msgspec.DecodeError:
            return
        _report_content(event, self._content)
        if self._text is not None:
            for index, generated, tokens in _generated(event):
                self._text(index, generated, tokens)

    def _read_anthropic(self, payload: bytes) -> bool:
        """Keep the usage of a Messages stream's ``message_start`` or ``message_delta``; whether
        the event was one of them."""
        event = _decoded_with(payload, b'"message_')
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "message_start":
            message = event.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self._anthropic_start = usage
        elif kind == "message_delta":
            # (counted only once this comes: a stream cut short before it has no answer's count,
            # and the prompt's alone would take the tokens counted so far back to none)
            usage = event.get("usage")
            if isinstance(usage, dict):
                self._anthropic = {**self._anthropic_start, **usage}
        else:
            return False
        return True

    def _read_meta(self, payload: bytes) -> None:
        _keep_meta(_decoded_with(payload, b'"meta_info"'), self._metas)

    def _read_usage(self, payload: bytes) -> None:
        try:
            event = _json_decode(payload)
        except msgspec.DecodeError:
            return
        usage = _usage_of(event)
        if usage is not None:
            self._observer.usage(usage)

    def _echo_event(self, echo: dict[str, Any]) -> bytes:
        event: dict[str, Any] = dict(self._stream_meta or {})
        event["choices"] = []
        event["nvext"] = echo
        return b"data: " + _json_encode(event) + b"\n\n"

    # ---------------------------------------------------------------- JSON
    async def _json(self, body: bytes, more: bool) -> None:
        if body:
            self._buffer.append(body)
            self._buffered += len(body)
        if self._buffered > self._json_limit:
            # Too large to rewrite: give up on the echo and stream the rest through.
            self._mode = 0
            await self._flush_start(None)
            data = b"".join(self._buffer)
            self._buffer.clear()
            await self._send({"type": "http.response.body", "body": data, "more_body": more})
            if not more:
                self._finish()
            return
        if more:
            return
        data = b"".join(self._buffer) if len(self._buffer) != 1 else self._buffer[0]
        self._buffer.clear()
        observer = self._observer
        observer.first_event(streamed=False)
        echo = observer.echo()
        if echo is None:
            # Nothing to merge: the answer goes out as it came, and usage is read once it is gone.
            await self._flush_start(len(data))
            await self._send({"type": "http.response.body", "body": data, "more_body": False})
            doc = _json_object(data, answers=True)
            if isinstance(doc, list):  # (/generate's answers to one prompt's n samples)
                for place, answer in enumerate(doc):
                    _keep_meta(answer, self._metas, place)
            else:
                self._account(doc)
        else:
            doc = _json_object(data)
            self._account(doc)
            if doc is not None:
                doc["nvext"] = {**doc["nvext"], **echo} if isinstance(doc.get("nvext"), dict) else echo
                data = _json_encode(doc)
            await self._flush_start(len(data))
            await self._send({"type": "http.response.body", "body": data, "more_body": False})
        self._finish()

    def _account(self, doc: dict[str, Any] | None) -> None:
        """Report a whole JSON answer's ``usage`` (cached prompt tokens, completion tokens: the
        observer counts them as output) and, when asked, its text."""
        if doc is None:
            return
        if "meta_info" in doc:  # (read with the other answers at the end: _finish)
            _keep_meta(doc, self._metas)
            return
        if self._content is not None:
            _report_content(doc, self._content)
        if self._identified is not None:
            _report_id(doc, self._identified)
        usage = _usage_of(doc)
        if usage is None and "prompt_eval_count" in doc:  # (Ollama's API)
            usage = answer_usage(doc)
        if usage is not None:
            self._observer.usage(usage)

    async def _flush_start(self, length: int | None) -> None:
        start = self._start
        if start is None:
            return
        self._start = None
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        start["headers"] = headers
        self.started = True
        await self._send(start)

    def _finish(self) -> None:
        self.complete = True
        usage = messages_usage(self._anthropic) if self._anthropic else meta_usage(self._metas)
        if usage is not None:
            self._observer.usage(usage)
        self._observer.end(True)


def _may_carry_usage(payload: bytes) -> bool:
    """Whether an event may carry the stream's usage, a prefilter (the decoded event decides). Once
    a client asks for usage (``stream_options.include_usage``), every chunk carries ``"usage":
    null`` and only the last one the numbers, as in OpenAI's API and vLLM's: decoding each chunk to
    find the null cost ~5 µs a token. The key once, as null, is not usage; twice, one of them may be
    (a tool call's arguments can name it too)."""
    n = payload.count(b'"usage"')
    if n == 0:
        return False
    return n > 1 or (b'"usage":null' not in payload and b'"usage": null' not in payload)


def _decoded_with(payload: bytes, *markers: bytes) -> Any:
    """The decoded event, if its bytes hold one of ``markers`` (only a prefilter: the decoded
    event decides) and it decodes; else None."""
    if not any(marker in payload for marker in markers):
        return None
    try:
        return _json_decode(payload)
    except msgspec.DecodeError:
        return None


def _announces_role_only(payload: bytes) -> bool:
    """A chat chunk whose every choice only names the role (``{"role": "assistant"}``, empty
    content, no finish): what the simulated engine, and servers like it, send before prefill ends.
    vLLM and SGLang send theirs with the first token, so for them nothing changes."""
    doc = _decoded_with(payload, b'"role"')
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or "role" not in delta or choice.get("finish_reason"):
            return False
        if any(v for k, v in delta.items() if k != "role"):
            return False
    return True


def _lifecycle_only(payload: bytes) -> bool:
    """A Responses API event that only tells the response exists or waits (created, in progress,
    queued), or a Messages API one that opens the message or a block, or pings: sent before
    prefill ends, or with its first token, neither prefill done nor a token."""
    doc = _decoded_with(payload, *_LIFECYCLE_MARKS)
    kind = doc.get("type") if isinstance(doc, dict) else None
    return isinstance(kind, str) and kind in _LIFECYCLE_TYPES


def _usage_of(doc: Any) -> dict[str, Any] | None:
    """An event's or a whole answer's ``usage`` in chat's names: its own (chat, completions, a
    Responses JSON answer), or its ``response``'s (the Responses API's last event)."""
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        response = doc.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(usage, dict):
            return None
    if "prompt_tokens" not in usage and "input_tokens" in usage:
        return messages_usage(usage) if is_anthropic_usage(usage) else chat_usage(usage)
    return usage


def _report_id(doc: dict[str, Any], identified: Callable[[str], None]) -> None:
    answer_id = doc.get("id")
    if isinstance(answer_id, str) and answer_id:
        identified(answer_id)


def _choices(doc: Any) -> list[tuple[int, dict[str, Any]]]:
    """An event's or a whole answer's choices, each with its ``index`` (its place when it has none)."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list):
        return []
    out = []
    for place, choice in enumerate(choices):
        if isinstance(choice, dict):
            index = choice.get("index")
            out.append((index if type(index) is int else place, choice))
    return out


def _report_content(doc: Any, content: Content | None) -> None:
    """Each choice's answer text (never its reasoning), token ids and tool calls, from an SSE event
    or a whole JSON answer."""
    if content is None:
        return
    for index, choice in _choices(doc):
        part = choice.get("delta")
        if not isinstance(part, dict):
            part = choice.get("message")
        text = part.get("content") if isinstance(part, dict) else choice.get("text")
        ids = choice.get("token_ids")
        good_ids = ids if isinstance(ids, list) and all(type(t) is int for t in ids) else None
        calls = part.get("tool_calls") if isinstance(part, dict) else None
        content(
            index, text if isinstance(text, str) else "", good_ids, calls if isinstance(calls, list) else None
        )


def _generated(event: Any) -> list[tuple[int, str, int]]:
    """What an SSE event generated, choice by choice: content and reasoning (chat) or text, or the
    number of tokens a choice of token ids alone holds (vLLM's token API streams no text)."""
    out = []
    for index, choice in _choices(event):
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = "".join(
                value
                for key in ("reasoning_content", "reasoning", "content")
                if isinstance(value := delta.get(key), str)
            )
        elif "text" in choice:
            text = choice["text"] if isinstance(choice["text"], str) else ""
        else:
            ids = choice.get("token_ids")
            if isinstance(ids, list) and ids:
                out.append((index, "", len(ids)))
            continue
        if text:
            out.append((index, text, 0))
    return out


def _json_object(data: bytes, *, answers: bool = False) -> Any:
    """The answer's JSON object (or, with ``answers``, a list of them), else None."""
    try:
        doc = _json_decode(data)
    except msgspec.DecodeError:
        return None
    return doc if isinstance(doc, dict) or (answers and isinstance(doc, list)) else None


def _keep_meta(answer: Any, metas: dict[int, dict[str, Any]], place: int = 0) -> None:
    """Keep an SGLang ``/generate`` answer's ``meta_info`` (the latest, in a stream) by its index:
    a streamed event's ``index``, or its ``place`` in a whole answer's list (SGLang 0.5.23 numbers
    only the streamed ones)."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if isinstance(meta, dict):
        index = answer.get("index")
        metas[index if type(index) is int else place] = meta
