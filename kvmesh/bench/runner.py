"""Drive a workload against one or more OpenAI-compatible base URLs and record every request.

Requests are streamed (``stream: true`` with usage reporting), so time to first token and the gaps
between chunks are measured on the client, as a user sees them. Several URLs are used
round-robin per session, the way a plain load balancer in front of a fleet spreads clients.

Load models:

* closed loop (``concurrency``): that many sessions run at once; each starts its next step when
  the previous one finished plus a think time. The first starts are spread over ``ramp`` seconds.
* open loop (``rate``): sessions start as a Poisson process at ``rate`` sessions per second,
  whatever the server's state (for single-request workloads: requests per second).

Think times are exponential with mean ``think_time * session.think_scale``, drawn from a generator
seeded by the load seed and the session id, so every run of a workload pauses the same way at the
same steps whatever the server does.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp

from kvmesh._http import SseLines, sse_data
from kvmesh.bench.workloads import Answer, Session
from kvmesh.router.upstream.forwarder import ANSWER_LIMIT


@dataclass(slots=True)
class RequestResult:
    session_id: str
    step: int
    url: str
    start: float  # seconds since the run started
    ttft: float | None = None
    latency: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    output_chunks: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    worker_id: str | None = None
    status: int | None = None
    error: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class RunResult:
    name: str
    results: list[RequestResult]
    duration: float
    sessions: int
    monotonic_start: float = 0.0
    """``time.monotonic()`` as the run started (read with the clock of ``RequestResult.start``):
    a request was sent at this plus its ``start`` on the clock the engines log their arrivals by
    (``kvmesh mock --request-log``)."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    urls: tuple[str, ...]
    model: str | None = None
    concurrency: int | None = 8
    rate: float | None = None
    think_time: float = 0.0
    ramp: float = 0.0
    request_timeout: float = 300.0
    ask_worker_id: bool = True
    headers: tuple[tuple[str, str], ...] = ()
    seed: int = 0


class Progress:
    """A one-line progress bar on stderr (quiet when stderr is not a terminal). It counts
    ``unit`` (requests, with their errors, unless told otherwise), and shows nothing until
    ``delay`` seconds have passed: work that ends sooner leaves no line behind."""

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        *,
        unit: str = "requests",
        delay: float = 0.0,
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.unit = unit
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self.errors = 0
        self._start = time.monotonic()
        self._delay = delay
        self._last_draw = 0.0
        self._drawn = False

    def update(self, ok: bool = True) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        now = time.monotonic()
        if not self.enabled or now - self._start < self._delay:
            return
        if now - self._last_draw > 0.1 or self.done >= self.total:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        width = 30
        filled = min(width, int(width * self.done / self.total))
        bar = "#" * filled + "." * (width - filled)
        errors = f", {self.errors} errors" if self.unit == "requests" else ""
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} {self.unit}{errors}, {now - self._start:5.1f}s"
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.enabled and (self._drawn or self._delay == 0):
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


class NoModel(RuntimeError):
    """The server could not say which model it serves (unreachable, an error, no model listed)."""


async def read_capped(response: aiohttp.ClientResponse, limit: int = ANSWER_LIMIT) -> bytes:
    """A whole answer of at most ``limit`` bytes; ValueError past it, read no further (a URL that
    answers without end, a wrong one, would otherwise be read until the timeout: gigabytes)."""
    if response.content_length is not None and response.content_length > limit:
        raise ValueError(f"answer of {response.content_length} bytes, more than {limit}")
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise ValueError(f"answer larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def discover_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model a server lists at /v1/models; :class:`NoModel` when there is none to be had."""
    try:
        async with session.get(url + "/v1/models") as response:
            response.raise_for_status()
            data = json.loads(await read_capped(response))
        models = data.get("data") or []
        first = str(models[0]["id"]) if models else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise NoModel(f"cannot read {url}/v1/models ({e}); is the server up? (or pass --model)") from None
    if first is None:
        raise NoModel(f"{url}/v1/models lists no model; pass --model")
    return first


async def first_model(url: str, timeout: float = 30.0) -> str:
    """:func:`discover_model` on a connection of its own: what ``kvmesh bench`` asks before it
    makes its workload, so that a server it cannot reach is said at once."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        return await discover_model(http, url)


async def _one_request(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    result: RequestResult,
    t0: float,
    headers: dict[str, str],
) -> None:
    sent = time.perf_counter()
    result.start = sent - t0
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
            result.status = response.status
            worker_header = response.headers.get("x-kvmesh-worker-id")
            if worker_header:
                result.worker_id = worker_header
            if response.status != 200:
                text = (await response.read())[:300].decode("utf-8", "replace")
                result.error = f"HTTP {response.status}: {text}"
                return
            await _read_stream(response, result, sent)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.latency = time.perf_counter() - sent


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult, sent: float) -> None:
    last = None
    parts: list[str] = []
    lines = SseLines()
    async for chunk in response.content.iter_any():
        _, whole, _ = lines.feed(chunk)
        for line in whole.splitlines():
            payload = sse_data(line)
            if payload is None or payload.strip() == b"[DONE]":
                continue
            event = json.loads(payload)
            now = time.perf_counter()
            content = _delta_text(event)
            if content is not None:
                if last is None:
                    result.ttft = now - sent
                else:
                    result.chunk_gaps.append(now - last)
                last = now
                result.output_chunks += 1
                parts.append(content)
            usage = event.get("usage")
            if usage:
                result.prompt_tokens = usage.get("prompt_tokens")
                result.completion_tokens = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens")
            nvext = event.get("nvext")
            if isinstance(nvext, dict) and nvext.get("worker_id") is not None:
                result.worker_id = _decode_worker(nvext["worker_id"])
            if "error" in event:
                result.error = f"stream error: {event['error']}"
    result.text = "".join(parts)


def _decode_worker(worker_id: Any) -> str:
    """The worker that produced the answer: a disaggregated echo names both stages."""
    if isinstance(worker_id, dict):
        return str(worker_id.get("decode_worker_id"))
    return str(worker_id)


def _delta_text(event: dict[str, Any]) -> str | None:
    choices = event.get("choices")
    if not choices:
        return None
    delta = choices[0].get("delta") or {}
    content = delta.get("content")
    if content is None:
        text = choices[0].get("text")  # /v1/completions streams
        return text if isinstance(text, str) and text else None
    return content if content else None


def think_times(seed: int, session_id: str, mean: float) -> Iterator[float]:
    """A session's pauses between steps: exponential with ``mean``, the same for every run."""
    rng = random.Random(f"{seed}:{session_id}")
    while True:
        yield rng.expovariate(1.0 / mean) if mean > 0 else 0.0


async def on_schedule(
    gaps: Sequence[float],
    *,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncIterator[int]:
    """Yield each index ``i`` of ``gaps`` at ``gaps[0] + ... + gaps[i-1]`` after the first.

    The times are kept on one timeline: a step that comes late (the event loop's timer steps by
    the millisecond, and the caller's work takes time) does not push the later ones back. Sleeping
    each gap after each step did: a rate-driven workload was offered about 1% less than the rate
    asked, and ``benchmarks/relay.py``'s sub-millisecond gaps sent a whole answer at once.
    """
    origin = clock()
    due = 0.0
    for i, gap in enumerate(gaps):
        wait = due - (clock() - origin)
        if wait > 0:
            await sleep(wait)
        yield i
        due += gap


async def run_workload(
    name: str,
    sessions: Sequence[Session],
    load: LoadSpec,
    *,
    progress: Progress | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
) -> RunResult:
    """Run ``sessions`` against ``load.urls``; never raises for a failed request (it is recorded)."""
    if not load.urls:
        raise ValueError("at least one URL is needed")
    results: list[RequestResult] = []
    limit = max(64, (load.concurrency or 64) * 8)
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=load.request_timeout)
    headers = dict(load.headers)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        model = load.model or await discover_model(http, load.urls[0])
        t0 = time.perf_counter()
        monotonic0 = time.monotonic()
        rng = random.Random(load.seed)

        async def run_session(index: int, session: Session) -> None:
            url = load.urls[index % len(load.urls)]
            think = think_times(load.seed, session.session_id, load.think_time * session.think_scale)
            previous: list[Answer] | None = None
            while True:
                bodies = session.next_step(previous)
                if bodies is None:
                    return
                step_results = [RequestResult(session.session_id, session.step, url, 0.0) for _ in bodies]
                await asyncio.gather(
                    *(
                        _one_request(http, url, _finish_body(body, model, load.ask_worker_id), r, t0, headers)
                        for body, r in zip(bodies, step_results, strict=True)
                    )
                )
                for r in step_results:
                    results.append(r)
                    if progress is not None:
                        progress.update(r.ok)
                    if on_result is not None:
                        on_result(r)
                previous = [Answer(r.text, r.ok) for r in step_results]
                pause = next(think)
                if pause > 0 and session.steps_left > 0:
                    await asyncio.sleep(pause)

        if load.rate:
            tasks = []
            async for i in on_schedule([rng.expovariate(load.rate) for _ in sessions]):
                tasks.append(asyncio.create_task(run_session(i, sessions[i])))
            await asyncio.gather(*tasks)
        else:
            queue: asyncio.Queue[tuple[int, Session]] = asyncio.Queue()
            for item in enumerate(sessions):
                queue.put_nowait(item)

            users = max(1, load.concurrency or 1)

            async def user(i: int) -> None:
                if load.ramp > 0:
                    await asyncio.sleep(load.ramp * i / users)
                while not queue.empty():
                    await run_session(*queue.get_nowait())

            # Users past the number of sessions would find the queue empty (the first ones take a
            # session each before they wake): they are not made at all. (`--concurrency 99999999`
            # made that many, and took a gigabyte in eight seconds before sending anything.)
            await asyncio.gather(*(user(i) for i in range(min(users, len(sessions)))))
        duration = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    return RunResult(name, results, duration, len(sessions), monotonic0)


def _finish_body(body: dict[str, Any], model: str, ask_worker_id: bool) -> dict[str, Any]:
    out = {**body, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    if ask_worker_id:
        out["nvext"] = {"extra_fields": ["worker_id"]}
    return out
