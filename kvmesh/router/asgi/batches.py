"""A batch of prompts served as one request per prompt, answered in the engine's batch shape.

:class:`~kvmesh.router.request.batches.PromptBatch` gives one body per prompt. Each runs through
the routing path as a request of its own (routed on its own prefix, queued, failed over, counted),
on an ASGI call this module makes up: its body is the prompt's, its client leaves when the batch's
client leaves or the batch has failed. The answers are put back together as the engine puts a
batch's answers together:

* ``/generate``: a list of results in prompt order (a prompt with ``n`` samples gives ``n``), or a
  stream whose events carry ``index`` = prompt * samples + sample, as SGLang numbers them;
* ``/v1/completions``: one completion whose ``choices`` are numbered so, with the usage summed;
  a stream's chunks are renumbered and carry one id, and the usage chunk asked for with
  ``stream_options.include_usage`` comes once, summed, before ``[DONE]``;
* vLLM's ``/v1/chat/completions/batch``: each conversation served as a chat request
  (``/v1/chat/completions``), then one chat completion whose choices are numbered conversation by
  conversation, with the usage summed, as vLLM answers the batch.

A prompt the router or its engine refuses fails the batch, as a batch fails in the engine: the
answer is that prompt's error, its field named in the batch's body (``text[2]``), and the other
prompts' requests are stopped. A stream opens only when every prompt's request has been accepted,
so such an error is still an HTTP status rather than an event in a stream already begun.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kvmesh._http import error_body, route_path, sse_data, wait_disconnect
from kvmesh.router.asgi.forwarding import WORKER_ID_HEADER, replace_body
from kvmesh.router.request.batches import CHAT_BATCH_PATH, COMPLETIONS_PATH, PromptBatch

logger = logging.getLogger("kvmesh.router")

Scope = dict[str, Any]
Message = dict[str, Any]
RunOne = Callable[[Scope, Any, Any], Awaitable[None]]
"""Serve one request (scope, receive, send) on the routing path."""

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_DONE = b"data: [DONE]\n\n"
_SKIPPED = (b"content-length", b"content-type", WORKER_ID_HEADER)
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


class _Answer:
    """What one prompt's request has sent back so far."""

    __slots__ = ("body", "complete", "headers", "partial", "status")

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.complete = False
        self.partial = b""  # (a stream's unfinished line)


class BatchAnswer:
    """Serve a :class:`PromptBatch` (one instance per call)."""

    def __init__(
        self,
        run_one: RunOne,
        scope: Scope,
        receive: Any,
        send: Any,
        batch: PromptBatch,
        endpoint: str,
        stream: bool,
    ) -> None:
        self.run_one = run_one
        self.scope = scope
        self.receive = receive
        self.send = send
        self.batch = batch
        self.completions = endpoint in (COMPLETIONS_PATH, CHAT_BATCH_PATH)  # (one merged completion)
        self.unit = "conversation" if endpoint == CHAT_BATCH_PATH else batch.unit  # (what errors name)
        self.item_scope = _on_path(scope, batch.item_path)
        self.stream = stream
        self.answers = [_Answer() for _ in batch.items]
        self.stop = asyncio.Event()
        """The batch's client left, or the batch failed: every prompt's request sees its client leave."""
        self.inbox: asyncio.Queue[tuple[int, Message | None]] = asyncio.Queue(
            maxsize=4 * len(batch.items) + 16
        )
        self.closed = False  # (the batch's answer is settled: what the prompts send now is dropped)
        self.failed: tuple[int, _Answer] | None = None
        self.opened = False
        self.held: list[bytes] = []  # a stream's events before it opens
        self.batch_id: str | None = None  # (completions: the id every chunk carries)
        self.usage: dict[str, Any] | None = None  # (completions: the summed usage chunk)

    async def run(self) -> None:
        watcher = asyncio.ensure_future(self._watch_client())
        tasks = [
            asyncio.ensure_future(self._run_item(i, _encode(item))) for i, item in enumerate(self.batch.items)
        ]
        try:
            await self._collect()
        finally:
            self.stop.set()
            self.closed = True
            watcher.cancel()
            drain = asyncio.ensure_future(self._drain())  # (a request still sending is not held up)
            await asyncio.gather(*tasks, return_exceptions=True)
            drain.cancel()
        if self.failed is not None:
            if not self.opened:
                await self._send_failure(*self.failed)
            else:  # (a prompt's request ended mid-stream: say so, as a stream's error)
                index = self.failed[0]
                event = b"data: " + _error(f"{self.unit} {index} of the batch ended without an answer", None)
                await self.send({"type": "http.response.body", "body": event + b"\n\n", "more_body": False})
        elif self.stream:
            await self._finish_stream()
        else:
            await self._send_whole()

    # ------------------------------------------------------------------ the prompts' requests
    async def _run_item(self, index: int, body: bytes) -> None:
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.stop.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if not self.closed:
                await self.inbox.put((index, message))

        try:
            await self.run_one(replace_body(self.item_scope, body), receive, send)
        except Exception:
            logger.exception("kvmesh: prompt %d of a batch failed in the router", index)
        finally:
            await self.inbox.put((index, None))

    async def _drain(self) -> None:
        while True:
            await self.inbox.get()

    async def _watch_client(self) -> None:
        await wait_disconnect(self.receive)
        self.stop.set()

    async def _collect(self) -> None:
        """Take every message of every prompt's request until each has ended."""
        ended = 0
        total = len(self.answers)
        while ended < total:
            index, message = await self.inbox.get()
            answer = self.answers[index]
            if message is None:
                ended += 1
                if not answer.complete:
                    self._fail(index, answer)
                continue
            if self.failed is not None and self.failed[1] is not answer:
                continue  # (the batch has failed: the rest is moot)
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                answer.headers = list(message.get("headers", ()))
                if self.stream and answer.status == 200 and not self.opened and self._all_accepted():
                    await self._open()
                continue
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            if self.stream and answer.status == 200:
                events = self._events(index, answer, chunk, final=not more)
                if events:
                    if self.opened:
                        await self._forward(events)
                    else:
                        self.held.append(events)
            elif chunk:
                answer.body.append(chunk)
            if not more:
                answer.complete = True
                if answer.status != 200:
                    self._fail(index, answer)

    def _fail(self, index: int, answer: _Answer) -> None:
        if self.failed is None:
            self.failed = (index, answer)
            self.stop.set()

    def _all_accepted(self) -> bool:
        return all(a.status == 200 for a in self.answers)

    # ------------------------------------------------------------------ answers
    def _headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        workers = [v for a in self.answers for k, v in a.headers if k.lower() == WORKER_ID_HEADER]
        headers = [(k, v) for k, v in self.answers[0].headers if k.lower() not in _SKIPPED]
        headers.append((b"content-type", content_type))
        if workers:  # (which worker served each prompt, in order)
            headers.append((WORKER_ID_HEADER, b",".join(workers)))
        return headers

    async def _forward(self, events: bytes) -> None:
        await self.send({"type": "http.response.body", "body": events, "more_body": True})

    async def _open(self) -> None:
        self.opened = True
        headers = self._headers(b"text/event-stream")
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        held, self.held = self.held, []
        if held:
            await self._forward(b"".join(held))

    async def _finish_stream(self) -> None:
        if not self.opened:  # (every prompt's request ended without a word: nothing to merge)
            await self._open()
        tail = b""
        if self.usage is not None:
            tail = b"data: " + _encode(self.usage) + b"\n\n"
        await self.send({"type": "http.response.body", "body": tail + _DONE, "more_body": False})

    async def _send_whole(self) -> None:
        docs = []
        for index, answer in enumerate(self.answers):
            try:
                docs.append(_decode(b"".join(answer.body)))
            except msgspec.DecodeError:
                await self._send_json(
                    502, _error(f"{self.unit} {index} of the batch: its answer is not JSON", None)
                )
                return
        if self.completions:
            merged = merged_completion(docs, self.batch.samples)
            if merged is None:
                await self._send_json(502, _error("an answer of the batch is not a completion", None))
                return
            body = _encode(merged)
        else:
            results: list[Any] = []
            for doc in docs:
                results.extend(doc if isinstance(doc, list) else [doc])
            key = self.batch.answer_key
            body = _encode(results if key is None else {key: results})
        await self._send_json(200, body, self._headers(b"application/json"))

    async def _send_failure(self, index: int, answer: _Answer) -> None:
        """Prompt ``index``'s error is the batch's, its field named as the batch's body has it."""
        raw = b"".join(answer.body)
        if answer.status in (0, 200):  # (its request ended before its answer did)
            await self._send_json(502, _error(f"{self.unit} {index} of the batch got no whole answer", None))
            return
        try:
            doc = _decode(raw)
        except msgspec.DecodeError:
            doc = None
        error = _error_of(doc)
        if error is not None and isinstance(error.get("message"), str):
            error["message"] = f"{self.unit} {index} of the batch: {error['message']}"
            param = error.get("param")
            if isinstance(param, str):
                error["param"] = self.batch.field(param, index)
            raw = _encode(doc)
        headers = [(k, v) for k, v in answer.headers if k.lower() != b"content-length"]
        await self._send_json(answer.status, raw, headers, typed=True)

    async def _send_json(
        self,
        status: int,
        body: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
        *,
        typed: bool = False,
    ) -> None:
        out = list(headers or ())
        if not typed:
            out = [(k, v) for k, v in out if k.lower() != b"content-type"]
            out.append((b"content-type", b"application/json"))
        out.append((b"content-length", str(len(body)).encode()))
        await self.send({"type": "http.response.start", "status": status, "headers": out})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    # ------------------------------------------------------------------ a stream's events
    def _events(self, index: int, answer: _Answer, chunk: bytes, *, final: bool) -> bytes:
        """The whole lines of prompt ``index``'s stream so far, renumbered for the batch."""
        data = answer.partial + chunk
        if final:
            answer.partial = b""
            lines = data.split(b"\n")
        else:
            cut = data.rfind(b"\n") + 1
            answer.partial = data[cut:]
            lines = data[:cut].split(b"\n")
        out = []
        for line in lines:
            line = line.rstrip(b"\r")
            if not line:
                continue
            payload = sse_data(line)
            if payload is None:
                out.append(line + b"\n")  # (an event's other fields stay with its data line)
            elif payload != b"[DONE]":
                event = self._renumbered(index, payload)
                if event is not None:
                    out.append(b"data: " + event + b"\n\n")
        return b"".join(out)

    def _renumbered(self, index: int, payload: bytes) -> bytes | None:
        """A ``data:`` payload with the batch's numbering; None for a completion's usage chunk,
        which comes once, summed, at the end."""
        try:
            doc = _decode(payload)
        except msgspec.DecodeError:
            return payload
        if not isinstance(doc, dict) or "error" in doc or doc.get("object") == "error":
            return payload
        first = index * self.batch.samples
        if not self.completions:
            place = doc.get("index")
            doc["index"] = first + (place if type(place) is int else 0)
            return _encode(doc)
        if self.batch_id is None and isinstance(doc.get("id"), str):
            self.batch_id = doc["id"]
        if self.batch_id is not None:
            doc["id"] = self.batch_id
        choices = doc.get("choices")
        if isinstance(choices, list):
            if not choices and isinstance(doc.get("usage"), dict):
                self._add_usage(doc)
                return None
            _renumber(choices, first)
        return _encode(doc)

    def _add_usage(self, doc: dict[str, Any]) -> None:
        if self.usage is None:
            self.usage = dict(doc)
            self.usage["usage"] = dict(doc["usage"])
            self.usage.pop("metrics", None)  # (one request's timings: none in a batch's answer)
            return
        _sum_usage(self.usage["usage"], doc["usage"])


def _on_path(scope: Scope, item_path: str | None) -> Scope:
    """The scope a prompt's request is served with: the batch's, on ``item_path`` when it has
    one (below the root path the batch's path is under)."""
    if item_path is None:
        return scope
    path = scope["path"]
    root = path[: len(path) - len(route_path(scope))]
    return {**scope, "path": root + item_path, "raw_path": (root + item_path).encode()}


def _renumber(choices: list[Any], first: int) -> None:
    for place, choice in enumerate(choices):
        if isinstance(choice, dict):
            own = choice.get("index")
            choice["index"] = first + (own if type(own) is int else place)


def merged_completion(docs: list[Any], samples: int) -> dict[str, Any] | None:
    """One completion of every prompt's: choices numbered prompt by prompt, usage summed."""
    if not all(isinstance(d, dict) and isinstance(d.get("choices"), list) for d in docs):
        return None
    merged = dict(docs[0])
    choices: list[Any] = []
    usage: dict[str, Any] | None = None
    for index, doc in enumerate(docs):
        part = list(doc["choices"])
        _renumber(part, index * samples)
        choices.extend(part)
        own = doc.get("usage")
        if isinstance(own, dict):
            if usage is None:
                usage = dict(own)
            else:
                _sum_usage(usage, own)
    merged["choices"] = choices
    if merged.get("metrics") is not None:  # (one request's timings: none in a batch's answer)
        merged["metrics"] = None
    if usage is not None:
        merged["usage"] = usage
    return merged


def _sum_usage(total: dict[str, Any], more: dict[str, Any]) -> None:
    for key in _USAGE_COUNTS:
        if _count(total.get(key)) and _count(more.get(key)):
            total[key] += more[key]
    details, extra = total.get("prompt_tokens_details"), more.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(extra, dict):
        details = total["prompt_tokens_details"] = dict(details)
        if _count(details.get("cached_tokens")) and _count(extra.get("cached_tokens")):
            details["cached_tokens"] += extra["cached_tokens"]


def _count(value: Any) -> bool:
    return type(value) is int


def _error_of(doc: Any) -> dict[str, Any] | None:
    """The object of an error answer that holds its ``message`` and ``param``: OpenAI's
    ``{"error": {...}}`` (kvmesh's, vLLM's), or SGLang's OpenAI routes' own, flat
    ``{"object": "error", "message", "param", ...}``."""
    if not isinstance(doc, dict):
        return None
    nested = doc.get("error")
    if isinstance(nested, dict):
        return nested
    return doc if doc.get("object") == "error" else None


def _error(message: str, field: str | None) -> bytes:
    return _encode(error_body(message, 502, field))


__all__ = ["BatchAnswer", "merged_completion"]
