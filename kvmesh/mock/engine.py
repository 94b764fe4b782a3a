"""The simulated engine: an asyncio step loop over the scheduler, the block pool and the publisher.

Each step::

    now = clock(); retention.expire(now)
    out = scheduler.schedule()          # allocations, evictions, newly cached blocks
    publisher <- pool.take_events(); flush()   # one batch per step, before the step "runs"
    sleep until step start + modelled step time (timing.py, divided by --speedup)
    result = scheduler.update(out)      # one token per caught-up request; finished ones freed
    deliver tokens to each request's TokenStream

A paused engine (:mod:`kvmesh.mock.pause`: vLLM's ``/pause`` and ``/sleep``, SGLang's
``/pause_generation``) runs no step its scheduler's pause holds back; a frozen request has no step,
so it makes no progress, and the timeline restarts when steps do.

Events are published right after scheduling, so between steps the pool and the last published
sequence number always agree; that is what makes ``kv_state`` an exact snapshot. Python's own
time inside a step is absorbed by the sleep (the step ends at its modelled deadline unless the
loop itself ran longer), which keeps latencies faithful at high ``--speedup``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TextIO

from kvmesh.errors import ConfigError
from kvmesh.events.nats_discovery import WorkerAnnouncer
from kvmesh.events.nats_link import NatsLink, NatsOptions, parse_event_plane
from kvmesh.events.nats_publisher import NatsBatchPublisher
from kvmesh.events.publisher import KvEventPublisher
from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.mock.block_hash import extend_block_hashes, new_salt
from kvmesh.mock.block_pool import BlockPool, KVBlock
from kvmesh.mock.config import MockConfig
from kvmesh.mock.metrics import EngineMetrics
from kvmesh.mock.pause import EngineControl, GenerationPaused
from kvmesh.mock.request import EngineRequest, RequestStatus
from kvmesh.mock.sampler import OutputSampler, sampler_key
from kvmesh.mock.scheduler import Pause, Scheduler, SchedulerOutput
from kvmesh.mock.timing import profile, step_seconds
from kvmesh.router.request.tokenizer import BuiltinTokenizer, Tokenizer
from kvmesh.worker.advertise import reachable
from kvmesh.worker.block_state import kv_state_answer, rank_state
from kvmesh.worker.retention import Retention

logger = logging.getLogger("kvmesh.mock")

_TIMER_SLACK = 0.002  # seconds a sleep may overshoot and still count as on time


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """One generation request, already tokenized and validated."""

    prompt_token_ids: list[int]
    max_tokens: int | None = None  # None: stop at a natural length (EOS), capped by the model length
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    priority: int = 0
    session_id: str | None = None
    reads_cache: bool = True
    """False: the prompt is computed whole, none of its cached prefix read (vLLM's
    ``skip_reading_prefix_cache``, for a request with prompt logprobs)."""


class TokenStream:
    """A request's output as the engine produces it; the server reads it with :meth:`deltas`."""

    __slots__ = (
        "_waiter",
        "abort_requested",
        "arrival",
        "cached_tokens",
        "finish_reason",
        "first_token_time",
        "prompt_tokens",
        "request_id",
        "scheduled_step",
        "scheduled_time",
        "tokens",
    )

    def __init__(self, request_id: str, prompt_tokens: int, arrival: float) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.tokens: list[int] = []
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.abort_requested = False
        """An abort API stopped it (SGLang's ``/abort_request``, vLLM's ``abort_requests``): its client
        is owed an answer that ends with the abort, unlike one that left or an engine that stopped."""
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None
        """When a step first took it in (its wait in the queue ends there)."""
        self.scheduled_step: int | None = None
        """That step's number (requests taken in by the same step share it)."""
        self._waiter: asyncio.Future[None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped(self) -> bool:
        """Aborted without an abort API asking (the client left, the engine stopped): no answer is
        owed, or none can be made."""
        return self.finish_reason == "abort" and not self.abort_requested

    def _push(self, token: int) -> None:
        self.tokens.append(token)
        self._wake()

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def deltas(self) -> AsyncIterator[list[int]]:
        """New tokens as they come (several at once when the reader lags), until the request ends."""
        pos = 0
        loop = asyncio.get_running_loop()
        while True:
            n = len(self.tokens)
            if pos < n:
                batch = self.tokens[pos:n]
                pos = n
                yield batch
                continue
            if self.finish_reason is not None:
                return
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def wait(self) -> None:
        async for _ in self.deltas():
            pass


class MockEngine:
    """A simulated vLLM-like engine. ``await start()``, ``submit()`` requests, ``await stop()``."""

    backend = "mock"

    def __init__(
        self,
        config: MockConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config = (config or MockConfig()).validate()
        self.tokenizer: Tokenizer = tokenizer or BuiltinTokenizer()
        self.clock = clock
        self.salt = new_salt(config.seed)
        self.engine_id = f"kvmesh-mock-{uuid.uuid4().hex[:12]}"
        self.pool = BlockPool(config.num_blocks, config.block_size)
        # Pins and sessions hold ordinary block references, so the pool never evicts them; past the
        # budget a pin is refused whole (HTTP 409) rather than cut short.
        self.retention: Retention[KVBlock] = Retention(
            int(config.pin_budget * config.num_blocks),
            acquire=self.pool.touch,
            release=self.pool.free,
            on_over_budget="reject",
            total_blocks=config.num_blocks,
            budget_setting="--pin-budget",
        )
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            before_free=self._before_free,
        )
        self.metrics = EngineMetrics(
            config.model,
            cache_config={"block_size": str(config.block_size), "num_gpu_blocks": str(config.num_blocks)},
            num_running=lambda: self.scheduler.num_running,
            num_waiting=lambda: self.scheduler.num_waiting,
            kv_usage=lambda: self.pool.usage,
            num_retained=lambda: self.retention.num_retained,
            modelled_seconds=lambda: self.modelled_seconds,
            busy_seconds=lambda: self.busy_seconds,
        )
        self.publisher: KvEventPublisher | None = None
        self.nats_options: NatsOptions | None = None
        self._announcer: WorkerAnnouncer | None = None
        self._events_endpoint: str | None = None
        self._replay_endpoint: str | None = None
        self._streams: dict[str, TokenStream] = {}
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._idle_waiters: list[asyncio.Future[None]] = []
        self.control = EngineControl(self)
        self._request_log: TextIO | None = None
        # Step time the model asked for vs the wall time steps really took: the loop's overhead.
        self.steps = 0
        self.modelled_seconds = 0.0
        self.busy_seconds = 0.0

    # --- lifecycle -----------------------------------------------------------------------------

    def open_request_log(self) -> None:
        """Open ``--request-log`` for appending (if configured); idempotent. Line-buffered, so
        every ended request's line is on disk even when the engine is stopped by a signal."""
        path = self.config.request_log
        if path is None or self._request_log is not None:
            return
        try:
            self._request_log = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise ConfigError(f"--request-log {path!r} cannot be opened: {e.strerror or e}") from None

    def open_events(self) -> None:
        """Bind the KV-event sockets, if configured (raises ConfigError if they cannot be bound)."""
        cfg = self.config
        servers = parse_event_plane(cfg.event_plane)
        if servers and self.publisher is None:
            # The NATS event plane: batches go to the JetStream stream; routers find the subject
            # in /kvmesh/info (kv_events_endpoints = ["nats:<subject>"]).
            name = cfg.event_name or f"mock-{os.getpid()}-{os.urandom(3).hex()}"
            self.nats_options = NatsOptions(servers)
            sink = NatsBatchPublisher(self.nats_options, name, rank=0)
            self.publisher = KvEventPublisher(block_size=cfg.block_size, data_parallel_rank=0, sink=sink)
            self._events_endpoint = sink.endpoint
            self._replay_endpoint = None
        if cfg.kv_events_endpoint is not None and self.publisher is None:
            # The engine is a server: it binds what it is told, and routers connect to it.
            self.publisher = KvEventPublisher(
                cfg.kv_events_endpoint,
                replay_endpoint=cfg.kv_replay_endpoint,
                block_size=cfg.block_size,
                data_parallel_rank=0,
                bind=True,
            )
            # (bound to every interface, they are told as the host a router on another one dials)
            self._events_endpoint = reachable(self.publisher.endpoint, cfg.advertise_host)
            replay = self.publisher.replay_endpoint
            self._replay_endpoint = None if replay is None else reachable(replay, cfg.advertise_host)

    async def start(self) -> None:
        """Open the event sockets (if configured) and start the step loop; idempotent."""
        if self._task is not None:
            return
        self.open_request_log()
        self.open_events()
        if self.config.advertise_url is not None:
            await self.announce(self.config.advertise_url)
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="kvmesh-mock-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.abort_all()
        self._notify_idle()  # (a pause waiting for the engine to drain: it never will now)
        if self._request_log is not None:
            self._request_log.close()
            self._request_log = None
        if self._announcer is not None:
            await self._announcer.stop()
            await self._announcer.link.close()
            self._announcer = None
        if self.publisher is not None:
            self.publisher.close(timeout=0.2)
            self.publisher = None

    async def announce(self, url: str, *, interval: float = 2.0) -> None:
        """On the NATS event plane: register ``url`` and this engine's info in the worker bucket,
        renewed every ``interval`` seconds until stop(); routers watching the bucket add it."""
        if self.nats_options is None:
            raise ConfigError("announce() needs the NATS event plane (--event-plane nats://...)")
        if self._announcer is None:
            link = NatsLink(self.nats_options, name=f"kvmesh-mock {url}", stream=False)
            link.start()
            self._announcer = WorkerAnnouncer(link, url, url, self.info, interval=interval)
            self._announcer.start()

    def kv_event_sources(self) -> dict[str, Any]:
        """vLLM's ``GET /kv_event_sources`` answer: its ZMQ publisher as bound (a wildcard host
        kept, the port resolved), under its DP rank; {} without one, as vLLM without KV events."""
        publisher = self.publisher
        if publisher is None or self.nats_options is not None:
            return {}
        source = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "topic": "",
        }
        return {"0": source}

    @property
    def events_endpoint(self) -> str | None:
        """Where KV events are published (the bound address, port 0 resolved); kept after stop()."""
        return self._events_endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    # --- requests ------------------------------------------------------------------------------

    def submit(self, params: GenerationParams, request_id: str | None = None) -> TokenStream:
        """Queue a request; its tokens arrive on the returned stream."""
        if self._task is None:
            raise RuntimeError("the engine is not running; await start() first")
        if self.control.refuses_new:
            raise GenerationPaused()
        cfg = self.config
        request_id = request_id or f"req-{next(self._ids)}"
        prompt = params.prompt_token_ids
        room = cfg.model_len - len(prompt)
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens exceeds max_model_len {cfg.model_len}"
            )
        natural = params.max_tokens is None and not params.ignore_eos
        sampler = OutputSampler(
            sampler_key(cfg.seed if params.seed is None else params.seed, prompt), natural_stop=natural
        )
        if sampler.stop_after is not None and sampler.stop_after < params.min_tokens:
            sampler.stop_after = params.min_tokens
        now = self.clock()
        req = EngineRequest(
            request_id=request_id,
            prompt_len=len(prompt),
            token_ids=list(prompt),
            max_tokens=room if params.max_tokens is None else params.max_tokens,
            sampler=sampler,
            salt=self.salt,
            block_size=cfg.block_size,
            arrival=now,
            priority=params.priority,
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
            session_id=params.session_id,
            reads_cache=params.reads_cache,
        )
        stream = TokenStream(request_id, len(prompt), now)
        self.scheduler.add_request(req)
        self._streams[request_id] = stream
        self._wakeup.set()
        return stream

    def abort(self, request_id: str, *, requested: bool = False) -> bool:
        """Stop a request and free its blocks; False if it already ended. ``requested``: an abort
        API asked for it (see :attr:`TokenStream.abort_requested`), not a client that went away."""
        stream = self._streams.pop(request_id, None)
        req = self.scheduler.abort(request_id)
        if stream is not None and not stream.finished:
            stream.abort_requested = requested
            stream._finish("abort")
            self.metrics.finished("abort")
            self._log_request(stream, self.clock())
        if req is not None:
            self._wakeup.set()  # freed blocks may let a waiting request in
        return req is not None

    def abort_all(self, *, requested: bool = False) -> None:
        """Stop every request the engine has, queued or running, whatever API it came by."""
        for request_id in list(self._streams):
            self.abort(request_id, requested=requested)

    # --- worker RPCs ---------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        cfg = self.config
        info: dict[str, Any] = {
            "backend": self.backend,
            "model": cfg.model,
            "block_size": cfg.block_size,
            "dp_size": 1,
            "kv_events_endpoints": [self._events_endpoint] if self._events_endpoint else [],
            "kv_replay_endpoints": [self._replay_endpoint] if self._events_endpoint else [],
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "total_kv_blocks": cfg.num_blocks,
            "priority_polarity": "lower_first" if cfg.scheduling_policy == "priority" else "none",
            "max_model_len": cfg.model_len,
            "role": cfg.role,
            "tokens_api": True,  # (it serves vLLM's /inference/v1/generate: kvmesh.mock.tokens_api)
        }
        if cfg.report_profile:
            info["timing_profile"] = profile(cfg.speedup)
        return info

    # --- disaggregated serving (the KV hand-off, simulated) ----------------------------------------

    def prompt_blocks(self, token_ids: list[int]) -> tuple[list[int], int]:
        """(block hashes of the prompt's full blocks a request would reuse, how many are cached)."""
        hashes: list[int] = []
        # the last prompt token is always recomputed, as the scheduler does
        usable = max(len(token_ids) - 1, 0)
        extend_block_hashes(hashes, token_ids[:usable], self.config.block_size, self.salt)
        return hashes, len(self.pool.cached_prefix(hashes, len(hashes)))

    def transfer_seconds(self, missing_blocks: int) -> float:
        """Simulated time to pull ``missing_blocks`` blocks from a prefill engine."""
        cfg = self.config
        return (cfg.transfer_fixed_ms + cfg.transfer_ms_per_block * missing_blocks) / 1000 / cfg.speedup

    def import_prefix(self, token_ids: list[int]) -> int:
        """Enter a prompt's full blocks into the prefix cache as if their KV had arrived from a
        prefill engine (published as BlockStored, then free and cached, so the request that
        follows finds them as prefix hits); returns how many blocks were new. Blocks that do not
        fit are left for the request to compute."""
        hashes, cached = self.prompt_blocks(token_ids)
        have = self.pool.cached_prefix(hashes, len(hashes))
        missing = min(len(hashes) - cached, self.pool.num_free)
        if missing <= 0:
            return 0
        fresh = self.pool.allocate(missing)
        self.pool.cache_blocks([*have, *fresh], hashes, token_ids, cached, cached + missing)
        self.pool.free(fresh)
        self._publish_events()
        return missing

    def kv_state(self) -> dict[str, Any]:
        """Every cached block plus the last published sequence number, from one instant."""
        last_seq = self.publisher.last_seq if self.publisher else None
        return kv_state_answer(self.config.block_size, [rank_state(0, last_seq, self.pool.snapshot())])

    def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int:
        """Keep the cached blocks of this prefix resident for ``ttl_seconds``; return how many."""
        hashes: list[int] = []
        extend_block_hashes(hashes, token_ids, self.config.block_size, self.salt)
        blocks = self.pool.cached_prefix(hashes, len(hashes))
        pinned = self.retention.pin(blocks, ttl_seconds, self.clock())
        self._wakeup.set()  # the loop re-reads its next deadline
        return pinned

    def open_session(self, session_id: str, timeout: float) -> bool:
        created = self.retention.open_session(session_id, timeout, self.clock())
        self._wakeup.set()
        return created

    def close_session(self, session_id: str) -> bool:
        closed = self.retention.close_session(session_id)
        self._wakeup.set()
        return closed

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (publishes AllBlocksCleared); False while blocks are in use."""
        ok = self.pool.reset_prefix_cache()
        self._publish_events()
        return ok

    # --- pausing (the rules are kvmesh.mock.pause's) ------------------------------------------

    def set_pause(self, pause: Pause) -> None:
        """Hold back what ``pause`` says from the next step on (the step under way ends as planned)."""
        self.scheduler.pause = pause
        self._wakeup.set()  # (an idle loop looks again: resumed requests may run)

    async def until_idle(self) -> None:
        """Return once no step is under way and the scheduler has nothing it would step: the
        moment a pause is complete (drained, or frozen at a step's end)."""
        if self._task is None:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(waiter)
        self._wakeup.set()  # (an idle loop looks again, and finds itself idle)
        await waiter

    def _notify_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # --- the step loop -------------------------------------------------------------------------

    def _before_free(self, req: EngineRequest) -> None:
        if req.session_id is not None and req.status in (
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_STOP,
        ):
            retention = self.retention
            retention.retain_for_session(req.session_id, req.blocks[: req.num_cached_blocks])
            retention.touch_session(req.session_id, self.clock())

    def _publish_events(self) -> None:
        events = self.pool.take_events()
        publisher = self.publisher
        if not events or publisher is None:
            return
        for ev in events:
            if isinstance(ev, BlockStored):
                publisher.stored(ev.block_hashes, ev.token_ids, parent_block_hash=ev.parent_block_hash)  # type: ignore[arg-type]
            elif isinstance(ev, BlockRemoved):
                publisher.removed(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                publisher.cleared()
        publisher.flush()

    async def _idle(self, deadline: float | None) -> None:
        """Sleep until something changes (a request, an abort, a pin) or the next deadline."""
        self._wakeup.clear()
        timeout = None if deadline is None else max(0.0, deadline - self.clock())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout)

    async def _run(self) -> None:
        sched = self.scheduler
        speedup = self.config.speedup
        clock = self.clock
        # Steps are laid end to end on a timeline, so the event loop's timer slack (epoll rounds
        # timeouts up to the next millisecond) does not add up over thousands of short steps at a
        # high --speedup. After an idle period or a real overrun the timeline restarts at "now".
        timeline = last_end = clock()
        try:
            while True:
                start = clock()
                self.retention.expire(start)
                deadline = self.retention.next_expiry()
                if not sched.has_work:
                    if self._idle_waiters:
                        self._notify_idle()
                    await self._idle(deadline)
                    continue
                out = sched.schedule()
                if out.admitted:
                    self._note_admitted(out.admitted, start)
                self._publish_events()
                if out.empty:
                    # Work is waiting but no block can be had (pins/sessions hold the rest):
                    # wait for an abort, an expiry or a change instead of spinning.
                    await self._idle(deadline)
                    continue
                if start - timeline > _TIMER_SLACK:
                    timeline = begin = start  # after idling or an overrun: a fresh timeline
                else:
                    begin = last_end  # back to back: the time between steps belongs to this one
                modelled = step_seconds(out.num_prefill_tokens, out.num_emitting, self.pool.usage, speedup)
                timeline += modelled
                delay = timeline - clock()
                await asyncio.sleep(delay if delay > 0 else 0)
                last_end = clock()
                self._finish_step(out, last_end)
                self.modelled_seconds += modelled
                self.busy_seconds += last_end - begin
                # Let the readers just woken run (and clients submit their next request) before
                # the next step is scheduled, as a real engine takes new arrivals between steps.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - a bug; fail every request loudly instead of hanging them
            logger.exception("mock engine step loop failed")
            self.abort_all()
            raise

    def _note_admitted(self, admitted: list[EngineRequest], start: float) -> None:
        """The queue wait of each request a step takes in for the first time: from its arrival to
        the start of that step. A request that arrived while another's step ran waits for that
        step to end (a burst's later siblings, when they reach the engine after the first one's
        step started); one the cache has no room for waits for memory. A preempted request taken
        in again is not counted twice."""
        streams = self._streams
        queue_time = self.metrics.queue_time
        for req in admitted:
            stream = streams.get(req.request_id)
            if stream is not None and stream.scheduled_time is None:
                stream.scheduled_time = start
                stream.scheduled_step = self.steps
                queue_time.observe(max(start - stream.arrival, 0.0))

    def _log_request(self, stream: TokenStream, now: float) -> None:
        """One line of ``--request-log`` for a request that ended: what the engine itself saw of
        it, so a benchmark can tell the engine's time from the time in front of it."""
        log = self._request_log
        if log is None:
            return
        line = (
            json.dumps(
                {
                    "request_id": stream.request_id,
                    "arrival": stream.arrival,
                    "scheduled": stream.scheduled_time,
                    "step": stream.scheduled_step,
                    "first_token": stream.first_token_time,
                    "finished": now,
                    "prompt_tokens": stream.prompt_tokens,
                    "cached_tokens": stream.cached_tokens,
                    "output_tokens": len(stream.tokens),
                    "finish_reason": stream.finish_reason,
                },
                separators=(",", ":"),
            )
            + "\n"
        )
        try:
            log.write(line)
        except OSError as e:  # a full disk ends the log, not the engine's step loop
            logger.error("--request-log stopped: %s", e)
            self._request_log = None
            with contextlib.suppress(OSError):
                log.close()

    def _finish_step(self, out: SchedulerOutput, now: float) -> None:
        sched = self.scheduler
        result = sched.update(out)
        self.steps += 1
        streams = self._streams
        m = self.metrics
        for req, token in result.tokens:
            stream = streams.get(req.request_id)
            if stream is None:
                continue
            if stream.first_token_time is None:
                stream.first_token_time = now
                stream.cached_tokens = max(req.num_cached_tokens, 0)
                m.ttft.observe(now - stream.arrival)
            stream._push(token)
        for req in result.finished:
            stream = streams.pop(req.request_id, None)
            if stream is None:
                continue
            reason = req.status.value
            stream._finish(reason)
            m.finished(reason)
            m.e2e.observe(now - stream.arrival)
            self._log_request(stream, now)
        m.steps.inc()
        if out.admitted:
            m.prefix_cache_queries.inc(out.prefix_queries)
            m.prefix_cache_hits.inc(out.prefix_hits)
        if out.preempted:
            m.preemptions.inc(len(out.preempted))
        if out.num_prefill_tokens:
            m.prompt_tokens.inc(out.num_prefill_tokens)
        if result.tokens:
            m.generation_tokens.inc(len(result.tokens))
