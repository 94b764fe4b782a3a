"""Continuous-batching scheduler in the image of vLLM v1's: pure step logic, no clock, no I/O.

One engine step is ``schedule()`` -> (the model runs; the engine sleeps the modelled time) ->
``update(output)``:

* ``schedule`` spends a token budget (``max_num_batched_tokens``) first on running requests
  (one token for a decoding request, the next chunk for a request still in prefill), then, if no
  request had to be preempted, admits waiting requests while ``max_num_seqs`` allows. A waiting
  request starts from its longest cached prefix (full blocks only, and never the whole prompt:
  the last token is always recomputed, as in vLLM). Long prompts are prefilled in chunks that fit
  the remaining budget.
* A running request that cannot get a block preempts another running request: the most recently
  admitted one (fcfs), or the one with the largest ``(priority, arrival)`` (priority policy,
  where lower values are more important - vLLM's polarity). The victim frees its blocks and goes
  back to the front of the waiting queue; its cached blocks make resuming it cheap.
* Blocks are entered into the prefix cache as soon as the step that computes them is scheduled.
* ``update`` appends one sampled token to every request whose computed tokens caught up with its
  tokens, and frees the blocks of requests that finished.
* A paused scheduler (:class:`Pause`, vLLM's pause states) takes no waiting request in, and under
  ``Pause.ALL`` schedules nothing at all; :meth:`Scheduler.retract_running` sends the running
  requests back to the queue (a cache reset of a frozen engine, SGLang's ``retract``).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from kvmesh.mock.block_pool import BlockPool, KVBlock
from kvmesh.mock.request import EngineRequest, RequestStatus

SchedulingPolicy = Literal["fcfs", "priority"]


class Pause(enum.Enum):
    """What a paused scheduler still runs (the pause states of vLLM's scheduler)."""

    NONE = "none"
    """Not paused."""
    NEW = "new"
    """The running requests go on to their end; no waiting request is taken in."""
    ALL = "all"
    """Nothing runs: the running requests keep their blocks and their place until resumed."""


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes."""

    scheduled: list[tuple[EngineRequest, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0  # new tokens of requests that are not simply decoding
    num_emitting: int = 0  # requests that produce a token at the end of this step
    preempted: list[EngineRequest] = field(default_factory=list)
    admitted: list[EngineRequest] = field(default_factory=list)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache by admitted requests
    prefix_hits: int = 0  # of which were found

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepResult:
    """What one step produced: ``(request, token)`` pairs and the requests that finished."""

    tokens: list[tuple[EngineRequest, int]] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)


class WaitingQueue:
    """Waiting requests: FIFO (fcfs) or a heap on ``(priority, arrival)`` (priority)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._fifo: deque[EngineRequest] = deque()
        self._heap: list[tuple[int, float, int, EngineRequest]] = []
        self._counter = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, req: EngineRequest) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.arrival, next(self._counter), req))
        else:
            self._fifo.append(req)
        self._len += 1

    def prepend(self, req: EngineRequest) -> None:
        """A preempted request: first in line (fcfs), or by its key (priority)."""
        if self.policy == "priority":
            self.add(req)
            return
        self._fifo.appendleft(req)
        self._len += 1

    def peek(self) -> EngineRequest | None:
        if self.policy == "priority":
            heap = self._heap
            while heap and heap[0][3].status.finished:  # lazily drop aborted entries
                heapq.heappop(heap)
            return heap[0][3] if heap else None
        return self._fifo[0] if self._fifo else None

    def pop(self) -> EngineRequest:
        req = self.peek()
        assert req is not None, "pop from an empty waiting queue"
        if self.policy == "priority":
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        self._len -= 1
        return req

    def remove(self, req: EngineRequest) -> None:
        """Remove a request that is about to be marked finished (aborted)."""
        if self.policy == "fcfs":
            self._fifo.remove(req)
        # priority: the heap entry is skipped once the request's status is finished
        self._len -= 1

    def __iter__(self) -> Iterator[EngineRequest]:
        if self.policy == "priority":
            return (e[3] for e in sorted(self._heap) if not e[3].status.finished)
        return iter(self._fifo)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: SchedulingPolicy = "fcfs",
        before_free: Callable[[EngineRequest], None] | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        # Called with a finished request just before its blocks are released (session retention).
        self._before_free = before_free
        self.num_preemptions = 0
        self.pause = Pause.NONE

    # --- requests in and out -----------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def abort(self, request_id: str) -> EngineRequest | None:
        """Stop a request wherever it is and free its blocks; None if it is unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self._free(req)
        return req

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything (a paused scheduler leaves some requests where they are)."""
        pause = self.pause
        if pause is Pause.NONE:
            return bool(self.running) or len(self.waiting) > 0
        return pause is Pause.NEW and bool(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.pause is Pause.ALL:
            return out
        budget = self.max_num_batched_tokens
        bs = self.block_size
        scheduled: dict[EngineRequest, int] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            total = req.num_computed_tokens + n
            if total <= len(req.blocks) * bs and total // bs <= req.num_cached_blocks:
                # the common decode step: room in the last block and no block completes
                scheduled[req] = n
                budget -= n
                i += 1
                continue
            while not self._allocate(req, n):
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                if victim in scheduled:  # already scheduled this step: give its budget back
                    budget += scheduled.pop(victim)
                if victim_index < i:
                    i -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # preempted itself: nothing smaller can run either
            scheduled[req] = n
            budget -= n
            i += 1

        if not out.preempted and self.pause is Pause.NONE:
            while budget > 0 and len(self.running) < self.max_num_seqs:
                head = self.waiting.peek()
                if head is None:
                    break
                req = head
                # A waiting request (new or preempted) has nothing computed; it starts from its
                # longest cached prefix, never the whole sequence: the last token is recomputed.
                hits = (
                    self.pool.cached_prefix(req.block_hashes, (req.num_tokens - 1) // self.block_size)
                    if req.reads_cache
                    else []
                )
                num_hit_tokens = len(hits) * self.block_size
                n = min(req.num_tokens - num_hit_tokens, budget)
                if not self._allocate(req, n, hits):
                    break
                self.waiting.pop()
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit_tokens
                out.admitted.append(req)
                out.prefix_queries += req.num_tokens
                out.prefix_hits += num_hit_tokens
                scheduled[req] = n
                budget -= n

        for req, n in scheduled.items():
            decoding = n == 1 and req.num_computed_tokens == req.num_tokens - 1 and req.num_output_tokens > 0
            if not decoding:
                out.num_prefill_tokens += n
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                out.num_emitting += 1
            out.scheduled.append((req, n))
        return out

    def update(self, out: SchedulerOutput) -> StepResult:
        """Apply a step's results: sample tokens for requests that caught up, finish the done ones."""
        result = StepResult()
        for req, _ in out.scheduled:
            if req.status != RequestStatus.RUNNING or req.num_computed_tokens < req.num_tokens:
                continue  # aborted meanwhile, or a prefill chunk that does not end the prompt
            token = req.sampler.next_token()
            result.tokens.append((req, token))
            finished = req.append_output(token)
            if finished is not None:
                req.status = finished
                self.running.remove(req)
                del self.requests[req.request_id]
                self._free(req)
                result.finished.append(req)
        return result

    def retract_running(self) -> list[EngineRequest]:
        """Send every running request back to the front of the queue with its blocks freed (they
        stay in the prefix cache until evicted or reset); each recomputes its tokens so far when it
        is taken in again. Only between steps. Taken in reverse, so they come back in the order
        they ran."""
        retracted = self.running[::-1]
        self.running.clear()
        for req in retracted:
            self._preempt(req)
        return retracted

    # --- internals ---------------------------------------------------------------------------

    def _allocate(self, req: EngineRequest, n: int, hits: list[KVBlock] | None = None) -> bool:
        """Give ``req`` blocks for ``n`` more tokens (after the prefix ``hits``); cache full blocks."""
        pool = self.pool
        bs = self.block_size
        if hits:
            num_computed = len(hits) * bs
            held = len(hits)
            # cached hits that are free now leave the free queue when touched
            reclaim = sum(1 for b in hits if b.ref_cnt == 0)
        else:
            num_computed = req.num_computed_tokens
            held = len(req.blocks)
            reclaim = 0
        total = num_computed + n
        need = -(-total // bs) - held
        if need > pool.num_free - reclaim:
            return False
        if hits:
            pool.touch(hits)
            req.blocks.extend(hits)
            req.num_cached_blocks = len(hits)
            req.num_computed_tokens = num_computed
        if need > 0:
            req.blocks.extend(pool.allocate(need))
        num_full = min(total // bs, len(req.block_hashes))
        if num_full > req.num_cached_blocks:
            pool.cache_blocks(req.blocks, req.block_hashes, req.token_ids, req.num_cached_blocks, num_full)
            req.num_cached_blocks = num_full
        return True

    def _pick_victim(self) -> EngineRequest:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    def _preempt(self, req: EngineRequest) -> None:
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def _free(self, req: EngineRequest) -> None:
        if self._before_free is not None and req.blocks:
            self._before_free(req)
        self._free_blocks(req)

    def _free_blocks(self, req: EngineRequest) -> None:
        # Tail blocks first, so they are evicted before the (more shared) head of the sequence.
        self.pool.free(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0
