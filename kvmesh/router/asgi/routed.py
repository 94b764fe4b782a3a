"""One routed generation request, phase by phase: read, parse, route (or queue), dispatch.

Each phase has its own object: the body is parsed once into a frozen
:class:`~kvmesh.router.request.parse.ParsedRequest`; the router's answer is settled here (a decision
now, a wait in the admission queue, or a refusal with its status); :class:`~.forwarding.Dispatch`
serves it with failover; :class:`~.accounting.RoutedAccount` turns the response into load, metrics
and the ``nvext`` echo. A session ``open`` completes at the chosen worker (typed worker-RPC
client) before the turn is sent, so the turn is held by the session it opens; a failed open is the
client's error naming ``nvext.session_control``. ``cache_control`` pins and ``speculative_prefill``
warm-ups follow the finished answer (see :mod:`~.accounting`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from kvmesh._http import replay_body, route_path, wait_disconnect
from kvmesh.errors import RequestError
from kvmesh.router.asgi.accounting import RoutedAccount
from kvmesh.router.asgi.batches import BatchAnswer
from kvmesh.router.asgi.disagg import TwoStage
from kvmesh.router.asgi.forwarding import Dispatch, replace_body, session_header
from kvmesh.router.asgi.invocations import lora_reading
from kvmesh.router.asgi.json_io import read_body, send_error, send_json
from kvmesh.router.asgi.prefix_copy import start_prefix_copy
from kvmesh.router.asgi.request_log import log_request
from kvmesh.router.asgi.sglang_sessions import find_home as find_session_home
from kvmesh.router.asgi.stored_responses import find_home
from kvmesh.router.core.route_types import Decision, Queued, Rejected, RouteRequest, RouteResult
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.batches import PromptBatch
from kvmesh.router.request.generate_api import SERVED_BY, bound_to_engine, choices, is_generate, session_named
from kvmesh.router.request.invocations import INVOCATIONS_PATH, SESSION_HEADER, session_id
from kvmesh.router.request.messages_api import is_messages
from kvmesh.router.request.nvext import PREFILL_HEADER, WORKER_HEADER, Nvext
from kvmesh.router.request.ollama_api import OLLAMA_GENERATE_PATH, is_ollama
from kvmesh.router.request.parse import ParsedRequest, parse_request, prompt_recomputed
from kvmesh.router.request.responses_api import is_responses, previous_response_id
from kvmesh.router.request.tokens_api import TOKENS_PATH, is_tokens
from kvmesh.router.upstream.forwarder import ConnectFailed

logger = logging.getLogger("kvmesh.router")

ASGIApp = Any
Scope = dict[str, Any]
_QUEUE_TIMEOUT = 120.0
# kvmesh_requests_total children by (counter, endpoint, route, status): labels() costs more than inc().
_REQUEST_COUNTERS: dict[tuple[Any, str, str, int], Any] = {}
_REJECT_STATUS = {
    "busy": 503,
    "queue_full": 429,
    "unknown_worker": 400,
    "no_workers": 503,
    "no_target": 503,
    "session_limit": 429,
}


def check_worker_ids(mesh: Mesh, nv: Nvext, headers: dict[str, str] | None) -> None:
    """Every worker id the request names must be registered: 400 naming the field that carried it."""
    registry = mesh.registry
    for worker_id, header, key in (
        (nv.backend_instance_id, WORKER_HEADER, "nvext.backend_instance_id"),
        (nv.decode_worker_id, None, "nvext.decode_worker_id"),
        (nv.prefill_worker_id, PREFILL_HEADER, "nvext.prefill_worker_id"),
    ):
        if worker_id is not None and registry.get(worker_id) is None:
            field = header if header is not None and headers and header in headers else key
            raise RequestError(f"unknown worker id {worker_id!r}", field=field)


class RoutedRequest:
    """Parse, route and serve one client request (one instance per call)."""

    __slots__ = (
        "account",
        "app",
        "endpoint",
        "mesh",
        "path",
        "receive",
        "refusal",
        "scope",
        "send",
        "t0",
        "wall0",
    )

    def __init__(
        self, mesh: Mesh, app: ASGIApp, scope: Scope, receive: Any, send: Any, endpoint: str | None = None
    ) -> None:
        self.mesh = mesh
        self.app = app
        self.scope = scope
        self.receive = receive
        self.send = send
        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.path = route_path(scope)
        """The client's path: the one it goes on to the engine by, and its metrics' ``endpoint``."""
        self.endpoint = endpoint or self.path
        """What the request is served as: its path, or for SageMaker's ``/invocations`` the
        generation its body is."""
        self.account: RoutedAccount | None = None
        """Its account once routed (what its log line reads: ``--log-requests``)."""
        self.refusal: tuple[str, str | None] | None = None
        """The message and field of the router's own error, for its log line."""

    async def run(self) -> None:
        mesh = self.mesh
        try:
            settings = mesh.settings
            raw = await read_body(
                self.scope, self.receive, settings.max_body_bytes, settings.body_read_timeout
            )
            if raw is None:
                return
            # Discovery first: parsing reads the fleet's block size and routable workers.
            if not mesh.registry.ready.is_set():
                await mesh.wait_ready()
            try:
                parsed = self._parse(raw)
            except PromptBatch as batch:  # (one request per prompt, answered as one)
                await self._serve_batch(batch)
                return
            if (
                is_generate(self.endpoint)
                and (bound := bound_to_engine(parsed.body)) is not None
                # (a session's request goes to the engine that opened it, _home, where that is
                # known and not this one)
                and (bound != "session_params" or not await self._session_elsewhere(parsed))
            ):
                await self._serve_bound(parsed, bound)
                return
            if mesh.local_app is not None and not mesh.registry.routable:
                # Peers not known yet (or all gone): this engine can always serve its own requests.
                parsed.complete()
                await self._serve_local_untracked(parsed)
                return
            mesh.cancel_warmups(parsed.hashes)  # the next turn is here: its warm-up is moot
            if is_responses(self.endpoint) and len(mesh.registry.routable) > 1:
                continued = previous_response_id(parsed.body)
                if continued is not None:  # (only its engine holds it: find it if no one said)
                    await find_home(mesh, continued, self.scope)
            account = RoutedAccount(mesh, mesh.next_request_id(), parsed, self.t0, self.wall0)
            self.account = account
            request = self._route_request(parsed, account.request_id)
            if mesh.registry.prefill_routable and not (
                is_responses(self.endpoint)
                or is_generate(self.endpoint)
                or is_messages(self.endpoint)
                or is_tokens(self.endpoint)
                or is_ollama(self.endpoint)
            ):
                # (a Responses, Messages, /generate, token-API or Ollama request is served
                # aggregated: the hand-off fields are chat's and completions')
                await TwoStage(self, parsed, account, request).run()
                return
            result = self.route(request, account)
            # The common case, a decision right away, skips the coroutine that waits in the queue.
            decision = result if isinstance(result, Decision) else await self.settle(result, request, account)
            if decision is None:
                return
            await self.dispatch(decision, parsed, account, request)
        except RequestError as e:
            self.refusal = (str(e), e.field)
            self._count("rejected", e.status)
            await send_error(self.send, e.status, str(e), e.field)

    # ------------------------------------------------------------------ parse + route
    def _parse(self, raw: bytes) -> ParsedRequest:
        mesh = self.mesh
        registry = mesh.registry
        early = (
            mesh.kv_mode
            and mesh.config.router_cost_model == "latency"  # (Dynamo's cost counts as Dynamo does)
            and mesh.sync is None
            and not registry.prefill_routable
        )
        parsed = parse_request(
            raw,
            self.scope["headers"],
            self.endpoint,
            tokenizer=mesh.tokenizer if mesh.kv_mode else None,
            block_size=registry.block_size or 16,
            lora_of=lora_reading(registry, self.path, self.scope["headers"]),
            clock=time.perf_counter,
            limits=mesh.nvext_limits,
            # a prompt no worker holds is routed on its first block, a conversation's later turn on
            # its earlier turn's blocks (replicas tell each other a decision's blocks as it is made,
            # and a two-stage request routes twice: not those)
            held=mesh.held_first if early else None,
            tokens_per_byte=mesh.tokens_per_byte,
            memo=mesh.turn_memo if early else None,
        )
        nv = parsed.nvext
        if nv.pinned_worker is not None:
            check_worker_ids(mesh, nv, parsed.override_headers)
        if is_responses(self.endpoint):
            _check_answer_nvext(nv, parsed.stream, "/v1/responses")
        elif is_generate(self.endpoint):
            _check_answer_nvext(nv, parsed.stream or choices(parsed.body) > 1, "/generate")
        elif is_messages(self.endpoint):
            _check_answer_nvext(nv, parsed.stream, "/v1/messages")
            _check_messages_nvext(nv)
        elif is_tokens(self.endpoint):
            _check_answer_nvext(nv, False, TOKENS_PATH)
        elif is_ollama(self.endpoint):
            _check_answer_nvext(nv, True, self.endpoint)
            _check_ollama_nvext(nv, self.endpoint)
        if nv.cache_ttl is not None:
            if not mesh.config.enable_cache_control:
                raise RequestError(
                    "nvext.cache_control is off on this router (start it with --enable-cache-control)",
                    field="nvext.cache_control",
                )
            if not mesh.kv_mode:
                raise RequestError(
                    "nvext.cache_control needs --router-mode kv (the router pins the prompt's tokens)",
                    field="nvext.cache_control",
                )
        if nv.hints.speculative_prefill and not mesh.kv_mode:
            raise RequestError(
                "nvext.agent_hints.speculative_prefill needs --router-mode kv",
                field="nvext.agent_hints.speculative_prefill",
            )
        hints = nv.hints
        if (hints.prefill_load_scale is not None or hints.kv_overlap_score_credit is not None) and (
            mesh.config.router_mode in ("round-robin", "random")
        ):
            # (no cost to tilt: read and ignored, the field would change nothing)
            name = (
                "kv_overlap_score_weight"
                if hints.prefill_load_scale is not None
                else "kv_overlap_score_credit"
            )
            raise RequestError(
                f"nvext.agent_hints.{name} tilts the KV cost; this router picks workers "
                f"{mesh.config.router_mode} (--router-mode kv has the cost)",
                field=f"nvext.agent_hints.{name}",
            )
        if mesh.kv_mode and parsed.deferred is None:
            metrics = mesh.metrics
            metrics.phase["tokenize"].observe(parsed.tokenize_secs)
            metrics.phase["hashing"].observe(parsed.hash_secs)
            metrics.isl.observe(parsed.isl)
            mesh.learn_tokens_per_byte(parsed.isl, len(raw))
            if parsed.turn_key is not None:
                mesh.turn_memo.remember(parsed.turn_key, parsed.hashes, parsed.isl, len(raw))
        return parsed

    def _sent(
        self, parsed: ParsedRequest, request: RouteRequest, account: RoutedAccount, count_in_s: float
    ) -> None:
        """The request is on its way to its worker: work out a deferred prompt's tokens, and count
        them where it went (``KvRouter.amend``).

        A prompt routed on its conversation's earlier turn is counted behind the work already due
        on the event loop, so that requests sent with it (parallel tool calls, read and waiting
        their turn) are routed and on their way first. They share no more of it than that earlier
        turn, which it already counts. Counted at once, it made each of them wait for its
        tokenizing and amend (0.5 ms of CPU a request on the suite's ``siblings``, 1.5 ms on
        ``agent-long``'s 5,000-token prompts, with the built-in tokenizer). A request with the same
        messages as one waiting to be counted counts it first (the turn memo's
        :meth:`~.TurnMemo.defer`), and is routed on all of its blocks.

        A prompt routed on its first block alone (no worker held it) is counted ``count_in_s``
        later (:func:`_count_in_s`: midway to its predicted first token), or when a request that
        begins with the same block asks whether any worker holds it (:meth:`Mesh.held_first`: a
        sibling sharing its context is then routed beside it, on all of its blocks), or at its first
        token, whichever comes first. Counted at once, its tokenizing took the CPU from the engine
        just as the engine read the same prompt."""
        request_id = account.request_id
        deferred = parsed.deferred
        if deferred is None or deferred.exact or (not deferred.earlier_turn and not count_in_s):
            self._count_sent(parsed, request, request_id)
            return
        loop = asyncio.get_running_loop()
        if not deferred.earlier_turn:
            key = deferred.first_hash
            assert key is not None
            cold = self.mesh.cold_counts
            count = functools.partial(self._count_sent, parsed, request, request_id)
            cold.defer(key, count)
            loop.call_later(count_in_s, cold.settle, key, count)
            account.before_first = functools.partial(cold.settle, key, count)
            return
        key = parsed.turn_key
        if key is None:  # (no generation prompt: nothing sends its messages again as a prompt)
            loop.call_soon(self._count_sent, parsed, request, request_id)
            return
        memo = self.mesh.turn_memo
        memo.defer(key, functools.partial(self._count_sent, parsed, request, request_id))
        loop.call_soon(memo.settle, key)

    def _count_sent(self, parsed: ParsedRequest, request: RouteRequest, request_id: str) -> None:
        # The worker has the request: a failure here is logged, not raised into the forward,
        # which would drop a request being served.
        try:
            self._count_deferred(parsed, request, request_id)
        except Exception:
            logger.exception("kvmesh: counting a prompt routed before it was tokenized failed")

    def _count_deferred(self, parsed: ParsedRequest, request: RouteRequest, request_id: str) -> None:
        deferred = parsed.deferred
        assert deferred is not None
        if deferred.exact:  # routed on all of its blocks and its length already: nothing to amend
            request.estimated_blocks = 0
            self.mesh.metrics.isl.observe(parsed.isl)  # (a request like any other in the lengths seen)
            return
        if not parsed.complete():
            return
        mesh = self.mesh
        request.isl_tokens = parsed.isl  # a failover routes it again, on its whole prompt
        request.estimated_blocks = 0
        if not deferred.earlier_turn:
            mesh.deferred_prompts += 1
        elif not deferred.matched:
            mesh.turn_memo.stop(f"request {request_id}'s prompt did not begin with its earlier turn's blocks")
            logger.warning(
                "kvmesh: a chat prompt did not begin with its earlier turn's blocks (the chat "
                "template does not render conversations turn by turn): later turns are tokenized "
                "before they are routed from now on"
            )
        if parsed.turn_key is not None:
            mesh.turn_memo.remember(parsed.turn_key, parsed.hashes, parsed.isl, len(parsed.raw_body))
        mesh.router.amend(
            request_id,
            parsed.hashes,
            parsed.isl,
            time.monotonic(),
            request.osl,
            overlap_score_credit=request.overlap_score_credit,
            reads_no_cache=request.reads_no_cache,
        )
        metrics = mesh.metrics
        metrics.phase["tokenize"].observe(deferred.tokenize_secs)
        metrics.phase["hashing"].observe(deferred.hash_secs)
        metrics.isl.observe(parsed.isl)
        mesh.learn_tokens_per_byte(parsed.isl, len(parsed.raw_body))

    def _route_request(self, parsed: ParsedRequest, request_id: str) -> RouteRequest:
        registry = self.mesh.registry
        nv = parsed.nvext
        hints = nv.hints
        session = nv.session
        home = self._home(parsed)
        allowed = self._allowed(parsed)
        if (self.mesh.refusing or registry.paused) and home is None:
            allowed = self.mesh.taking_requests(allowed)  # (refusing or paused now: passed over a while)
        return RouteRequest(
            request_id=request_id,
            local_hashes=parsed.hashes,
            isl_tokens=parsed.isl,
            arrival=time.monotonic(),
            backend_instance_id=home,
            priority=hints.priority,
            latency_sensitivity=hints.latency_sensitivity,
            osl=hints.osl,
            overlap_score_credit=hints.kv_overlap_score_credit,
            prefill_load_scale=hints.prefill_load_scale,
            reads_no_cache=prompt_recomputed(parsed.body, parsed.endpoint),
            session_id=session.session_id if session else None,
            session_action=session.action if session else None,
            session_timeout=session.timeout if session else None,
            allowed_workers=allowed,
            lora_name=parsed.lora,
            client=_client(self.scope),
            estimated_blocks=parsed.isl // (registry.block_size or 16) if parsed.deferred is not None else 0,
            # a copy by token ids reproduces the prefix only where the tokens key the cache; a
            # prompt routed before it was tokenized has no tokens to copy until it is counted
            copies_in_background=(
                self.mesh.background_copies
                and parsed.cache_keyed is None
                and not registry.prefill_routable
                and (parsed.deferred is None or parsed.deferred.exact)
            ),
        )

    def _allowed(self, parsed: ParsedRequest) -> frozenset[str]:
        """The workers that can serve it: those with its adapter, those whose server has the path."""
        registry = self.mesh.registry
        allowed = registry.routable if parsed.lora is None else registry.adapters[parsed.lora]
        if is_generate(parsed.endpoint) or is_ollama(parsed.endpoint):
            # (SGLang's own APIs: another engine's server answers 404)
            allowed = registry.described(allowed, lambda info: info.backend in SERVED_BY)
            missing = (
                "/generate (SGLang's native API); send the request to /v1/completions"
                if is_generate(parsed.endpoint)
                else f"{parsed.endpoint} (Ollama's API, as SGLang serves it)"
            )
        elif is_tokens(parsed.endpoint):  # (vLLM serves it when started to: --enable-scale-out)
            allowed = registry.described(allowed, lambda info: info.tokens_api)
            missing = (
                f"{TOKENS_PATH} (vLLM's token-in-token-out API: start vLLM with --enable-scale-out "
                "or --tokens-only, or set tokens_api in the worker's entry)"
            )
        else:
            return allowed
        if not allowed:
            raise RequestError(f"no worker serves {missing}", field="path", status=404)
        return allowed

    def _home(self, parsed: ParsedRequest) -> str | None:
        """The worker the request must go to: the one it names, or the one holding what it
        continues that only one engine has: the stored response of ``previous_response_id``, or
        a SageMaker stateful session (:mod:`.invocations`). Unknown to this router, a stored
        response is left to the engine the request is routed to; so is a session, except inside an
        engine, where it is that engine's (SageMaker's sticky routing sent the request there)."""
        nv = parsed.nvext
        mesh = self.mesh
        if self.path == INVOCATIONS_PATH and (session := session_id(self.scope["headers"])):
            home = mesh.session_homes.home(session)
            if (home is None or mesh.registry.get(home) is None) and mesh.local_app is not None:
                home = mesh.settings.self_worker_id
            return self._held_by(home, f"session {session!r}", SESSION_HEADER.decode(), nv.pinned_worker)
        if is_generate(parsed.endpoint) and (session := session_named(parsed.body)) is not None:
            if nv.session is not None:  # (kvmesh's sessions are another thing: one or the other)
                raise RequestError(
                    "nvext.session_control does not apply to a request of an SGLang session "
                    "('session_params'): the session holds its history already",
                    field="nvext.session_control",
                )
            home = mesh.sglang_session_homes.home(session)
            if home is None:
                raise RequestError(
                    f"session {session!r} was not opened through this router (POST /open_session "
                    "here opens one where its requests can follow it)",
                    field="session_params.id",
                )
            return self._held_by(home, f"session {session!r}", "session_params.id", nv.pinned_worker)
        if not is_responses(parsed.endpoint):
            return nv.pinned_worker
        continued = previous_response_id(parsed.body)
        home = mesh.response_homes.home(continued) if continued is not None else None
        what = f"previous_response_id {continued!r}"
        return self._held_by(home, what, "previous_response_id", nv.pinned_worker)

    def _held_by(self, home: str | None, what: str, field: str, pinned: str | None) -> str | None:
        """``home``, the worker holding ``what`` (None or unregistered: none known, and the request
        goes where ``pinned`` says or where it is routed); a 400 naming ``field`` when the request
        names another worker, a 503 when ``home`` is down (no other engine has it: nothing to fail
        over to)."""
        registry = self.mesh.registry
        if home is None or registry.get(home) is None:
            return pinned
        if pinned is not None and pinned != home:
            raise RequestError(
                f"{what} is held by worker {home!r}, and the request names worker {pinned!r}", field=field
            )
        if home not in registry.routable:
            raise RequestError(f"worker {home!r}, which holds {what}, is down", field=field, status=503)
        return home

    async def dispatch(
        self, decision: Decision, parsed: ParsedRequest, account: RoutedAccount, request: RouteRequest
    ) -> None:
        """Serve on the decided worker (its session opened first), failing over if it is gone."""
        mesh = self.mesh
        ttl = parsed.nvext.cache_ttl
        if ttl is not None and mesh.kv_mode and not mesh.take_pin(decision.worker[0], ttl, time.monotonic()):
            mesh.router.cancel(account.request_id, time.monotonic())
            raise RequestError(
                f"worker {decision.worker[0]!r} holds its maximum of "
                f"{mesh.config.router_max_pins_per_worker} cache_control pins",
                field="nvext.cache_control",
                status=429,
            )
        if decision.copy is not None:  # (counted before anything else is routed: nothing awaited yet)
            start_prefix_copy(mesh, decision.copy, parsed)
        if not await self._open_session(decision, parsed, account):
            return

        servers = request.allowed_workers

        async def reroute(allowed: frozenset[str]) -> Decision | None:
            # (the workers left of those that could serve it: an adapter's, a path's)
            request.allowed_workers = allowed if servers is None else allowed & servers
            return await self.settle(self.route(request, account), request, account)

        dispatch = Dispatch(
            self.mesh,
            self.app,
            self.scope,
            self.receive,
            self.send,
            parsed,
            account,
            reroute=reroute,
            error=self._error_reply,
            count=self._count,
        )
        if parsed.deferred is not None:
            dispatch.sent = functools.partial(self._sent, parsed, request, account, _count_in_s(decision))
        await dispatch.run(decision, pinned=request.backend_instance_id is not None)

    def route(self, request: RouteRequest, account: RoutedAccount) -> RouteResult:
        router = self.mesh.router
        t = time.perf_counter()
        result = router.route(request, time.monotonic())
        account.routed_at = done = time.perf_counter()
        self.mesh.metrics.observe_routing(done - t, router.last_find_matches, done - self.t0)
        return result

    async def settle(
        self, result: RouteResult, request: RouteRequest, account: RoutedAccount
    ) -> Decision | None:
        """Turn a route result into a decision: wait out the queue, refuse with a status."""
        if isinstance(result, Decision):
            return result
        if isinstance(result, Rejected):
            await self._reject(result, account.nvext)
            return None
        assert isinstance(result, Queued)
        mesh = self.mesh
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        mesh.waiters[request.request_id] = fut
        mesh.pump(time.monotonic())  # capacity may have freed since route()
        gone = asyncio.ensure_future(wait_disconnect(self.receive))
        try:
            done, _ = await asyncio.wait(
                (fut, gone), timeout=_QUEUE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            gone.cancel()
        if fut in done and not fut.cancelled():
            return fut.result()
        mesh.waiters.pop(request.request_id, None)
        mesh.router.cancel(request.request_id, time.monotonic())
        if fut.done() and not fut.cancelled():  # released in the same instant: free it again
            mesh.router.cancel(request.request_id, time.monotonic())
        if gone in done:
            self._count("disconnected", 499)
            return None
        await self._error_reply(
            503,
            f"request waited {_QUEUE_TIMEOUT:.0f}s in the admission queue",
            mesh.config.busy_retry_after_secs,
        )
        return None

    async def _reject(self, rejected: Rejected, nv: Nvext) -> None:
        pinned = nv.pinned_worker
        mesh = self.mesh
        if (
            rejected.reason == "unknown_worker"
            and pinned is not None
            and mesh.registry.get(pinned) is not None
        ):
            # Registered (``_parse`` checked), just not routable now: the client may retry.
            await self._error_reply(
                503, f"worker {pinned!r} is down or not yet discovered", mesh.config.busy_retry_after_secs
            )
            return
        status = _REJECT_STATUS.get(rejected.reason, 503)
        field = {"unknown_worker": "nvext.backend_instance_id", "session_limit": "nvext.session_control"}.get(
            rejected.reason
        )
        retry = rejected.retry_after
        if retry is None and status != 400:
            retry = mesh.config.busy_retry_after_secs
        await self._error_reply(status, rejected.message, retry, field)

    async def _error_reply(
        self, status: int, message: str, retry_after: float | None, field: str | None = None
    ) -> None:
        self.refusal = (message, field)
        self._count("rejected", status)
        headers = []
        if retry_after is not None:
            headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
        await send_error(self.send, status, message, field, headers=headers)

    def _count(self, route: str, status: int) -> None:
        counter = self.mesh.metrics.requests
        key = (counter, self.path, route, status)
        child = _REQUEST_COUNTERS.get(key)
        if child is None:
            child = counter.labels(self.path, route, str(status))
            if len(_REQUEST_COUNTERS) < 4096:
                _REQUEST_COUNTERS[key] = child
        child.inc()
        if self.mesh.log_requests:
            log_request(self.scope["method"], self.path, route, status, self.t0, self.account, self.refusal)

    # ------------------------------------------------------------------ the session a turn opens
    async def _open_session(self, decision: Decision, parsed: ParsedRequest, account: RoutedAccount) -> bool:
        """``open``: the engine session exists before its first turn is sent. False when it could
        not be opened (the client has its answer, the load is released)."""
        session = parsed.nvext.session
        if session is None or session.action != "open":
            return True
        mesh = self.mesh
        worker_id = decision.worker[0]
        # the worker holds the session's blocks as long as the router keeps it bound
        timeout = mesh.config.router_session_timeout_secs if session.timeout is None else session.timeout
        try:
            await mesh.open_session(worker_id, session.session_id, timeout)
        except ConnectFailed as e:
            mesh.router.cancel(account.request_id, time.monotonic())
            mesh.router.apply_session(session.session_id, None, timeout, time.monotonic())
            self._count("rejected", 502)
            await send_error(
                self.send,
                502,
                f"nvext.session_control: worker {worker_id!r} could not open session "
                f"{session.session_id!r}: {e}",
                "nvext.session_control",
            )
            return False
        return True

    async def _serve_batch(self, batch: PromptBatch) -> None:
        """Each prompt of the batch as a routed request of its own, the answers merged
        (:mod:`.batches`)."""
        mesh, app = self.mesh, self.app
        # (a prompt is served as the batch is, on the batch's path: a completion batch sent to
        # /invocations stays a completion batch; a chat batch's conversations go on as chats)
        endpoint = self.endpoint if batch.item_path is None else None

        async def run_one(scope: Scope, receive: Any, send: Any) -> None:
            await RoutedRequest(mesh, app, scope, receive, send, endpoint).run()

        if not batch.items:  # (a Vertex AI body of no instances: SGLang answers an empty list)
            await send_json(self.send, 200, b"[]")
            return
        stream = batch.items[0].get("stream") is True
        await BatchAnswer(run_one, self.scope, self.receive, self.send, batch, self.endpoint, stream).run()

    async def _session_elsewhere(self, parsed: ParsedRequest) -> bool:
        """Whether an SGLang session's request is routed to its home (:meth:`_home`): always from
        the standalone router; inside an engine, when a peer opened the session (asked of the
        peers when this router does not know it: ``sglang_sessions.find_home``)."""
        mesh = self.mesh
        if mesh.local_app is None:
            return True
        session = session_named(parsed.body)
        if session is None:
            return False
        home = await find_session_home(mesh, session)
        return home is not None and home != mesh.settings.self_worker_id

    async def _serve_bound(self, parsed: ParsedRequest, field: str) -> None:
        """A /generate request that belongs to the engine it reached (``generate_api.bound_to_engine``):
        served there, as the engine alone would have served it; with no engine of its own, this
        router cannot tell which engine it belongs to (400 naming the field)."""
        if self.mesh.local_app is None:
            raise RequestError(
                f"'{field}' ties the request to one SGLang engine (a session opened there, or its "
                "prefill/decode hand-off); send it to that engine, not through the router",
                field=field,
            )
        nv = parsed.nvext
        for asked, name in (
            (nv.pinned_worker is not None, "nvext.backend_instance_id"),
            (nv.wants_echo, "nvext.extra_fields"),
            (nv.session is not None, "nvext.session_control"),
            (nv.cache_ttl is not None, "nvext.cache_control"),
            (nv.hints.speculative_prefill, "nvext.agent_hints.speculative_prefill"),
        ):
            if asked:  # (the router takes no part in such a request: it would change nothing)
                raise RequestError(
                    f"{name} does not apply to a request '{field}' ties to this engine", field=name
                )
        await self._serve_local_untracked(parsed)

    async def _serve_local_untracked(self, parsed: ParsedRequest) -> None:
        registry = self.mesh.registry
        me = registry.get(registry.settings.self_worker_id or "")
        info = me.info if me is not None else None
        body = parsed.engine_body(
            info.priority_polarity if info is not None else "none", info.backend if info is not None else ""
        )
        scope = self.scope if body is parsed.raw_body else replace_body(self.scope, body)
        tag = session_header(parsed, scope["headers"])
        if tag is not None:
            scope = {**scope, "headers": [*scope["headers"], tag]}
        self._count("local", 0)
        await self.app(scope, replay_body(body, self.receive), self.send)


def _check_answer_nvext(nv: Nvext, echo_unwritable: bool, path: str) -> None:
    """Refuse what the router does only with chat and completions answers (400 naming the field):
    it reads their text to pin it or warm the next turn, and writes its extra events in their
    shape (``echo_unwritable``: a stream, or a /generate answer that is a list of answers)."""
    for asked, field in (
        (nv.cache_ttl is not None, "nvext.cache_control"),
        (nv.hints.speculative_prefill, "nvext.agent_hints.speculative_prefill"),
        (bool(nv.annotations), "nvext.annotations"),
        (echo_unwritable and nv.wants_echo, "nvext.extra_fields"),
    ):
        if asked:
            raise RequestError(
                f"{field} is not available on {path}; send the request to {_openai_twin(path)}",
                field=field,
            )


def _check_messages_nvext(nv: Nvext) -> None:
    """Refuse what Anthropic's request has no field for (400 naming it): nvext's sampling fields
    other than top_k, and a thinking budget (it has its own: ``thinking.budget_tokens``)."""
    for name, _ in nv.sampling:
        if name != "top_k":
            raise RequestError(
                f"nvext.{name}: the Messages API has no such parameter; send the request to "
                "/v1/chat/completions",
                field=f"nvext.{name}",
            )
    if nv.max_thinking_tokens is not None:
        raise RequestError(
            'nvext.max_thinking_tokens: send "thinking": {"type": "enabled", "budget_tokens": N}',
            field="nvext.max_thinking_tokens",
        )


_COMPLETION_PATHS = frozenset(("/generate", TOKENS_PATH, OLLAMA_GENERATE_PATH))


def _check_ollama_nvext(nv: Nvext, path: str) -> None:
    """Refuse what the router would write into the body in OpenAI's or SGLang's names, which
    Ollama's request does not read (400 naming the field): nvext's sampling, greedy decoding, a
    thinking budget, a pre-tokenized or raw prompt. (Its own sampling goes in ``options``.)"""
    asked = [f"nvext.{name}" for name, _ in nv.sampling]
    for wanted, field in (
        (nv.greedy, "nvext.greed_sampling"),
        (nv.max_thinking_tokens is not None, "nvext.max_thinking_tokens"),
        (nv.token_data is not None, "nvext.token_data"),
        (nv.use_raw_prompt, "nvext.use_raw_prompt"),
    ):
        if wanted:
            asked.append(field)
    if asked:
        raise RequestError(
            f"{asked[0]} is not available on {path} (Ollama's request takes its sampling in "
            f"'options'); send the request to {_openai_twin(path)}",
            field=asked[0],
        )


def _openai_twin(path: str) -> str:
    """The OpenAI path serving what a request on ``path`` asks: a completion for a prompt of
    text or tokens (SGLang's ``/generate``, vLLM's token API, Ollama's generate), else chat."""
    return "/v1/completions" if path in _COMPLETION_PATHS else "/v1/chat/completions"


def _count_in_s(decision: Decision) -> float:
    """When to count a prompt routed on a first block no worker held, once it is sent: midway to
    its predicted first token (0: at once, with no prediction). By then the engine has read the
    prompt and is computing it, and its first token is still ahead (until then the router counts
    its estimated length). Counted at once, tokenizing a long prompt took the CPU from the engine
    just as it read the same prompt: on two cores that added 0.6-1.0 ms to a 2,850-token cold
    prompt's time to first token (``benchmarks/front_latency.py``)."""
    for score in decision.breakdown:
        if score.worker == decision.worker:
            predicted = score.predicted_ttft_ms
            return predicted / 2000.0 if predicted is not None and predicted > 0.0 else 0.0
    return 0.0


def _client(scope: Scope) -> str | None:
    """The client's address (host only: one client may use many ports)."""
    client = scope.get("client")
    return str(client[0]) if client else None
