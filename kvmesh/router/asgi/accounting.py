"""What a response tells the router while it streams: load accounting and, for routed requests,
metrics, the cached-tokens reconciliation and the ``nvext`` echo.

Both classes are the :class:`~kvmesh.router.asgi.tap.Observer` of one response. :class:`LoadAccount`
is all a hop (a request another replica routed here) needs: prefill done at the first event, output
growth in tokens (the engine's ``usage`` reconciles the count of streamed events), and the request's
blocks freed at the end. :class:`RoutedAccount` adds what the replica that made the decision
reports: TTFT / ITL / OSL, the engine's ``cached_tokens`` against the prediction, the echo the
client asked for, and what follows a finished turn: the ``cache_control`` pin of prompt + answer on
the worker that served it, the ``speculative_prefill`` warm-up of the next turn, the session
``close``. A non-streaming answer never shows its first token: its prefill load is released at the
estimated end of prefill (:meth:`RoutedAccount.watch_prefill`) instead of with the whole answer.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

from kvmesh._types import WorkerKey
from kvmesh.hashing import block_hashes
from kvmesh.router.asgi.peer_auth import hop_header_map
from kvmesh.router.core.load import prefill_seconds
from kvmesh.router.core.route_types import Decision
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.answer_echo import UNKNOWN, answer_echo
from kvmesh.router.request.generate_api import is_generate
from kvmesh.router.request.messages_api import is_messages
from kvmesh.router.request.nvext import Nvext
from kvmesh.router.request.parse import ParsedRequest
from kvmesh.router.request.responses_api import is_responses

# Reasoning a model writes inline; the reference strips it from a warm-up's assistant turn.
_THINKING = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def add_tool_call_pieces(calls: dict[int, dict[str, Any]], pieces: list[Any]) -> None:
    """Put an answer's tool calls together in ``calls`` (by their ``index``): whole ones (a JSON
    answer's ``message.tool_calls``), or a stream's pieces, where the first of a call names its
    ``id`` and function and the rest carry more of its ``arguments``."""
    for place, piece in enumerate(pieces):
        if not isinstance(piece, dict):
            continue
        index = piece.get("index")
        call = calls.setdefault(
            index if type(index) is int else place,
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if isinstance(piece.get("id"), str):
            call["id"] = piece["id"]
        if isinstance(piece.get("type"), str):
            call["type"] = piece["type"]
        function = piece.get("function")
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments")
            if isinstance(name, str) and not call["function"]["name"]:
                call["function"]["name"] = name
            if isinstance(arguments, str):
                call["function"]["arguments"] += arguments


def _includes_usage(parsed: ParsedRequest) -> bool:
    """The stream ends with a ``usage`` event: the client asked for one (``stream_options``), or
    it is a stream that always carries its counts: the Responses API's (its last event), the
    Messages API's (``message_delta``), SGLang's ``/generate`` (every event's ``meta_info``)."""
    endpoint = parsed.endpoint
    if is_responses(endpoint) or is_messages(endpoint) or is_generate(endpoint):
        return True
    options = parsed.body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class LoadAccount:
    """The router's load view of one request while it runs on a worker."""

    __slots__ = ("generated", "mesh", "request_id")

    def __init__(self, mesh: Mesh, request_id: str) -> None:
        self.mesh = mesh
        self.request_id = request_id
        self.generated = 0

    def first_event(self, streamed: bool = True) -> None:
        self.mesh.router.first_token(self.request_id, time.monotonic(), timed=streamed)

    def events(self, n: int) -> None:
        """``n`` more SSE events: one token each, unless a subclass counts their text."""
        self.grow(n)

    def grow(self, n: int) -> None:
        """``n`` more output tokens (fewer when negative: a reconciliation)."""
        self.generated += n
        self.mesh.router.output_tokens(self.request_id, n, time.monotonic())

    def usage(self, usage: dict[str, Any]) -> None:
        # Output blocks count tokens: an event may carry several (or none), a JSON answer all of
        # them. The engine's count replaces the router's, whichever way it errs.
        completion = usage.get("completion_tokens")
        if not isinstance(completion, int) or isinstance(completion, bool) or completion < 0:
            return
        if completion != self.generated:
            self.grow(completion - self.generated)

    def echo(self) -> dict[str, Any] | None:
        return None

    def end(self, complete: bool) -> None:
        now = time.monotonic()
        if complete:
            sample = self.mesh.router.finished(self.request_id, now)
            if sample is not None:  # one of this replica's decisions: the latency model's check
                self.mesh.record_ttft_prediction(sample)
        else:
            self.mesh.router.cancel(self.request_id, now)
        self.mesh.pump(now)


class RoutedAccount(LoadAccount):
    """A request this replica routed: its load, its metrics, its echo and its session close."""

    __slots__ = (
        "answer",
        "answer_calls",
        "answer_ids",
        "before_first",
        "counts_text",
        "decided_at",
        "decision",
        "echo_text",
        "last_event",
        "nvext",
        "out_events",
        "parsed",
        "prefill_timer",
        "prefill_worker",
        "reported_cached",
        "routed_at",
        "streamed_tokens",
        "streaming_choices",
        "t0",
        "t_first",
        "wall0",
        "worker_id",
    )

    def __init__(self, mesh: Mesh, request_id: str, parsed: ParsedRequest, t0: float, wall0: float) -> None:
        super().__init__(mesh, request_id)
        self.parsed = parsed
        self.nvext: Nvext = parsed.nvext
        self.t0 = t0
        self.wall0 = wall0
        self.routed_at = 0.0
        self.decided_at = 0.0
        """When the decision was in hand (dispatch began), until the request was written."""
        self.before_first: Callable[[], None] | None = None
        """Counts a prompt routed before it was tokenized, if that has not run by the first token
        (its count is of no use after it)."""
        self.decision: Decision | None = None
        self.worker_id = ""
        self.prefill_worker: WorkerKey | None = None
        """(worker, dp rank) that ran the prefill stage of a disaggregated request."""
        self.t_first = 0.0
        self.last_event = 0.0
        self.out_events = 0
        self.answer: list[str] = []
        """The first choice's answer (of ``n``: the one a next turn most likely carries)."""
        self.answer_ids: list[int] | None = None
        self.answer_calls: dict[int, dict[str, Any]] | None = None
        """The first choice's tool calls by their index, put together from a stream's pieces."""
        self.echo_text = answer_echo(parsed.body, parsed.endpoint)
        """What each choice's answer begins with (``echo``), which is not output."""
        self.streaming_choices: set[int] | None = None if self.echo_text is None else set()
        """With an echo: the choices whose text has begun (the echo leads a choice's first piece)."""
        self.prefill_timer: asyncio.TimerHandle | None = None
        self.counts_text = parsed.stream and mesh.kv_mode and not _includes_usage(parsed)
        """A stream that will carry no ``usage``: its output is counted by tokenizing each event's
        text (an event may carry several tokens), as no engine count will correct it later."""
        self.streamed_tokens = 0
        self.reported_cached: int | None = None
        """The engine's ``cached_tokens`` for the prompt, when its answer carried usage."""

    @property
    def pins(self) -> bool:
        mesh = self.mesh
        return self.nvext.cache_ttl is not None and mesh.config.enable_cache_control and mesh.kv_mode

    @property
    def warms(self) -> bool:
        return self.nvext.hints.speculative_prefill and self.mesh.kv_mode

    @property
    def wants_content(self) -> bool:
        """The answer's text is needed after the turn (a pin of it, or a warm-up with it)."""
        return self.pins or self.warms

    def dispatched(self, decision: Decision, isl: int) -> None:
        """The request goes to ``decision.worker`` now (again, after a failover)."""
        self.decision = decision
        self.worker_id = decision.worker[0]
        if isl:
            self.mesh.metrics.kv_hit_rate.observe(min(1.0, decision.cached_tokens / isl))
        if not self.parsed.stream and self.mesh.config.router_track_prefill_tokens:
            self.watch_prefill(decision, isl)

    def forwarding(self) -> None:
        """Dispatch begins with the decision in hand. Stamped once: a request sent again after a
        failover is timed from its first decision, and one already written is not timed again."""
        if not self.decided_at:
            self.decided_at = time.perf_counter()

    def written(self) -> None:
        """The request is written to its worker (or handed to the local engine): the ``forward``
        phase, from the decision in hand to here, once."""
        if self.decided_at > 0.0:
            self.mesh.metrics.phase["forward"].observe(time.perf_counter() - self.decided_at)
            self.decided_at = -1.0

    def relayed_first(self, seconds: float) -> None:
        """The first token's bytes took ``seconds`` from their arrival from the worker to their
        hand-off to the client (the ``relay_first`` phase)."""
        self.mesh.metrics.phase["relay_first"].observe(seconds)

    def watch_prefill(self, decision: Decision, isl: int) -> None:
        """Release the prompt's prefill load when its prefill should be over, not with the answer."""
        if self.prefill_timer is not None:
            self.prefill_timer.cancel()
        w = self.mesh.registry.get(decision.worker[0])
        profile = w.info.prefill_profile if w is not None and w.info is not None else None
        delay = prefill_seconds(max(isl - decision.cached_tokens, 0), profile)
        self.prefill_timer = asyncio.get_running_loop().call_later(delay, self._prefill_over)

    def _prefill_over(self) -> None:
        self.prefill_timer = None
        LoadAccount.first_event(self, streamed=False)  # an estimate: no TTFT to learn from

    def content(
        self, index: int, text: str, token_ids: list[int] | None, tool_calls: list[Any] | None = None
    ) -> None:
        """A piece of choice ``index``'s answer (thinking excluded), with its token ids when the
        engine gave them and its tool calls; only the first choice's is kept."""
        if index != 0:
            return
        if text:
            self.answer.append(text)
        if token_ids is not None:
            if self.answer_ids is None:
                self.answer_ids = []
            self.answer_ids.extend(token_ids)
        if tool_calls:
            if self.answer_calls is None:
                self.answer_calls = {}
            add_tool_call_pieces(self.answer_calls, tool_calls)

    def first_event(self, streamed: bool = True) -> None:
        now = time.perf_counter()
        self.t_first = self.last_event = now
        if self.prefill_timer is not None:  # the answer is whole before the estimate ran out
            self.prefill_timer.cancel()
            self.prefill_timer = None
        if self.before_first is not None:
            self.before_first()
            self.before_first = None
        super().first_event(streamed)
        if self.parsed.stream:  # a whole JSON answer's arrival is no first token
            self.mesh.metrics.ttft.observe(now - self.t0)

    def streamed_text(self, index: int, text: str, tokens: int = 0) -> None:
        """What one streamed event generated for choice ``index`` (the tap's ``text`` hook, when
        ``counts_text``), the echo that leads the choice's first piece left out. (An echo of token
        ids, which the router cannot spell as the engine does, is counted.) ``tokens``: an event
        that gave its tokens as ids alone, counted as they are."""
        if tokens:
            self.streamed_tokens += tokens
            return
        begun = self.streaming_choices
        if begun is not None and index not in begun:
            begun.add(index)
            echo = self.echo_text
            if echo is not None and text.startswith(echo):
                text = text[len(echo) :]
        if text:
            self.streamed_tokens += len(self.mesh.tokenizer.encode(text))

    def events(self, n: int) -> None:
        now = time.perf_counter()
        if self.out_events and self.parsed.stream:
            self.mesh.metrics.itl.observe(now - self.last_event)
        self.last_event = now
        self.out_events += n
        if self.counts_text:
            n, self.streamed_tokens = self.streamed_tokens, 0
            if not n:
                return
        self.grow(n)

    def usage(self, usage: dict[str, Any]) -> None:
        super().usage(usage)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool) and self.decision is not None:
            self.reported_cached = cached
            self.mesh.record_cached(self.worker_id, self.decision.cached_tokens, cached)
            self.mesh.router.reported_cached(self.request_id, cached)

    def echo(self) -> dict[str, Any] | None:
        nv = self.nvext
        if not nv.wants_echo:
            return None
        out: dict[str, Any] = {}
        decision = self.decision
        if nv.want_worker_id:
            # The reference's shape: an aggregated worker does both phases; a disaggregated
            # request names the prefill worker that ran its first stage.
            rank = decision.worker[1] if decision is not None else None
            worker = self.worker_id or None
            prefill = self.prefill_worker
            out["worker_id"] = {
                "prefill_worker_id": prefill[0] if prefill is not None else worker,
                "prefill_dp_rank": prefill[1] if prefill is not None else rank,
                "decode_worker_id": worker,
                "decode_dp_rank": rank,
            }
        if nv.want_timing:
            now = time.perf_counter()
            streamed = self.parsed.stream and self.t_first
            out["timing"] = {
                "request_received_ms": round(self.wall0 * 1000, 3),
                "routing_ms": round((self.routed_at - self.t0) * 1000, 3),
                "ttft_ms": round((self.t_first - self.t0) * 1000, 3) if streamed else None,
                "itl_ms": round((self.last_event - self.t_first) * 1000 / (self.generated - 1), 3)
                if streamed and self.generated > 1
                else None,
                "total_ms": round((now - self.t0) * 1000, 3),
                "queue_ms": round(decision.waited * 1000, 3) if decision else 0.0,
                "cached_tokens_predicted": decision.cached_tokens if decision else 0,
            }
        return out

    def end(self, complete: bool) -> None:
        mesh = self.mesh
        if self.prefill_timer is not None:
            self.prefill_timer.cancel()
            self.prefill_timer = None
        if complete:
            mesh.metrics.osl.observe(self.generated)
            if self.worker_id and (self.answer or self.answer_ids or self.answer_calls):
                if self.pins:
                    self.parsed.complete()  # (a prompt sent as another's twin is tokenized only now)
                    tokens = self.parsed.tokens + (self._answer_tokens() or [])
                    mesh.spawn(mesh.pin_answer(self.worker_id, tokens, self.nvext.cache_ttl or 300.0))
                if self.warms:
                    self._warm_next_turn()
        session = self.nvext.session
        if session is not None and session.action == "close" and self.worker_id:
            mesh.spawn(mesh.close_session(self.worker_id, session.session_id))
        super().end(complete)

    # ---------------------------------------------------------------- after the turn
    def _answer_text(self) -> str | None:
        """The first choice's answer, its echo left out; None where the echo cannot be told from
        it (token ids echoed in the engine's own spelling, or an echo missing where expected)."""
        text = "".join(self.answer)
        echo = self.echo_text
        if echo is None:
            return text
        if echo != UNKNOWN and text.startswith(echo):
            return text[len(echo) :]
        return None

    def _answer_tokens(self) -> list[int] | None:
        """The answer as the engine cached it: its own token ids when it sent them (never the
        echo's), else its text through the router's tokenizer (exact for the builtin one)."""
        if self.answer_ids is not None:
            return self.answer_ids
        text = self._answer_text()
        return None if text is None else self.mesh.tokenizer.encode(text)

    def _warm_next_turn(self) -> None:
        """The conversation so far, answer included (thinking removed), as a ``max_tokens: 1``
        request on the same worker: the next turn finds its prefix computed."""
        parsed = self.parsed
        decision = self.decision
        assert decision is not None
        # one choice, no echo, no logprobs: a warm-up's own answer is never read (and vLLM computes
        # a prompt with prompt logprobs whole, reading none of the cache the warm-up extends)
        drop = (
            "nvext",
            "stream",
            "stream_options",
            "n",
            "echo",
            "prompt_logprobs",
            "logprobs",
            "top_logprobs",
        )
        body = {k: v for k, v in parsed.body.items() if k not in drop}
        if parsed.endpoint.endswith("chat/completions"):
            answer = self._answer_text()
            if answer is None:
                return
            text = _THINKING.sub("", answer)
            messages = list(parsed.body.get("messages", []))
            said: dict[str, Any] = {"role": "assistant", "content": text}
            if parsed.body.get("continue_final_message") is True:  # the answer goes on its text
                opened = messages.pop()
                if not isinstance(opened.get("content"), str):
                    return
                said = {**opened, "content": opened["content"] + text}
            if self.answer_calls:  # as a client sends the answer back: no text is null content
                said["content"] = said["content"] or None
                said["tool_calls"] = [self.answer_calls[i] for i in sorted(self.answer_calls)]
            messages.append(said)
            body["messages"] = messages
            # a closed history and the next turn's generation prompt, as the next turn renders
            body.pop("continue_final_message", None)
            body.pop("add_generation_prompt", None)
            body.pop("max_completion_tokens", None)
            tools = body.get("tools")
            tokens = self.mesh.tokenizer.apply_chat_template(messages, tools=tools)
        else:
            answer_ids = self._answer_tokens()
            if answer_ids is None:
                return
            parsed.complete()
            tokens = parsed.tokens + answer_ids
            body["prompt"] = tokens
        body["max_tokens"] = 1
        mesh = self.mesh
        hashes = block_hashes(tokens, mesh.registry.block_size or 16, parsed.lora)
        request_id = mesh.next_request_id()
        # marked as routed already, with the proof where replicas share a secret: a peer that
        # routed it again would count it as a client's request and might send it elsewhere
        hop = hop_header_map(mesh.settings.mesh_secret, mesh.replica, request_id)
        mesh.start_warmup(
            request_id,
            decision.worker,
            parsed.endpoint,
            body,
            hop,
            tuple(parsed.hashes),
            hashes,
            len(tokens),
            len(parsed.hashes),
        )
