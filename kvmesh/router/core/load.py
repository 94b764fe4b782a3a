"""Active sequences: the router's own view of each (worker, dp_rank)'s load.

Per worker it tracks
* **active prefill tokens**: prompt tokens not served from cache, of requests still in prefill
  (``max(ISL - overlap * block_size, 0)``), dropped at the request's first token;
* **active decode blocks**: KV blocks held by in-flight requests. Prefix blocks shared by several
  requests count once (``assume_kv_reuse``); a trailing partial block is always the request's own;
* **prefill order** (for Dynamo's ``aic`` prefill-load model): the requests still in prefill, oldest
  first, each with its predicted prefill duration. Only the oldest (the anchor) decays, linearly
  from the moment it became the anchor over its predicted duration; the others count in full until
  they reach the front. ``prefill_tokens_at(worker, now)`` is that decayed view;
* **releases**: when each request there is expected to finish and the blocks that gives back
  (``releases``), for the wait of a request that does not fit in the worker's KV cache;
* **unseen load**: what the engine itself reports running and queueing beyond the requests this
  router sent there (:meth:`ActiveSequences.set_unseen`): the load that other routers put on it (the
  other replicas of a mesh without replica sync) or clients that call the engine directly. It
  counts in the latency cost's view of the worker (:meth:`ActiveSequences.candidate_view`) as that
  many requests the size of those this router has in flight;
* **output blocks**: a request that declared an ``osl`` (expected output tokens) counts the blocks
  its answer will hold, ``ceil(max(osl, generated) / block_size)``, from the moment it is routed,
  weighted by ``max(0, 1 - generated / osl)`` (nearly done = about to free them), so a worker
  running long answers looks busier to the requests routed after it. Without an ``osl`` and with
  output tracking on, one placeholder block per ``block_size`` generated tokens.

A non-streaming request never shows its first token, so the caller releases its prefill load at
an estimate (:func:`prefill_seconds`: the reference mocker's fitted curve, or the worker's own).

Shared-block dedup works on *prefix identities*: full chunks of ``chunk`` blocks are one identity
(weight ``chunk``), the blocks of a trailing partial chunk one identity each. An identity names the
whole prefix up to it, so the identities active on a worker are prefix-closed and "how many of
this request's blocks are already active here" is a binary search. Two requests that share a prefix
ending inside a chunk that only one of them completes are deduplicated up to the chunk boundary
(at most ``chunk - 1`` blocks counted twice) - the price of not hashing every block per request.
A chunk spans :data:`CHUNK_TOKENS` tokens whatever the block size (:func:`chunk_blocks`), so that
price is the same share of a cache of so many tokens on any engine. (A chunk of 16 blocks on
32-token blocks double-counted twice the tokens: a `mixed` workload's shared system prompts looked
like more of each cache than they were, and turns moved off their homes for evictions that were
not coming. Same-seed runs of the routing-quality suite on 32-token blocks: `mixed` hits lower on
6 of 8 seeds, `chat-fits` on 5 of 6; see docs/routing-quality-rounds.md, stops 71 and 72.)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from itertools import compress

from kvmesh._types import WorkerKey

CHUNK_TOKENS = 256
"""Tokens a prefix identity spans (a chunk of blocks): 16 blocks of 16 tokens."""
CHUNK = 16
"""Blocks a chunk spans on 16-token blocks (:func:`chunk_blocks`), the default where none is given."""


def chunk_blocks(block_size: int) -> int:
    """Blocks of ``block_size`` tokens in a chunk of :data:`CHUNK_TOKENS` (at least one)."""
    return max(CHUNK_TOKENS // max(block_size, 1), 1)


_SIZES_EVERY_S = 0.5
"""How often the size of an unseen request is measured again (it sums over every worker, and
health checks report every worker at about the same moment)."""
# Milliseconds to prefill T uncached tokens: a2*T^2 + a1*T + a0 (the reference mocker's fit).
PREFILL_MS = (4.209989e-07, 1.518344e-02, 16.50142)


def prefill_seconds(uncached_tokens: int, profile: Sequence[float] | None = None) -> float:
    """Estimated prefill time of ``uncached_tokens`` on an idle worker (``profile`` = (a2, a1, a0)
    in ms, from the worker's ``/kvmesh/info`` when it reports one)."""
    if uncached_tokens <= 0:
        return 0.0
    a2, a1, a0 = profile if profile is not None else PREFILL_MS
    t = float(uncached_tokens)
    return (a2 * t * t + a1 * t + a0) / 1000.0


def output_blocks(osl: int | None, generated: int, block_size: int) -> float:
    """Decode blocks a request with expected output ``osl`` holds for its answer (0 without)."""
    if not osl:
        return 0.0
    return math.ceil(max(osl, generated) / block_size) * max(0.0, 1.0 - generated / osl)


class PromptBlocks:
    """A prompt's block identities, computed once per request (shared by every candidate)."""

    __slots__ = ("chunk", "ids", "n_anchors", "n_blocks")

    def __init__(self, local_hashes: Sequence[int], chunk: int = CHUNK) -> None:
        n = len(local_hashes)
        prev = 0
        full = n - n % chunk
        # zip over one iterator ``chunk`` times: each whole chunk as a tuple, built in C; each
        # identity chains the one before (the comprehension leaves the last in ``prev``)
        ids = [prev := hash((prev, part)) for part in zip(*[iter(local_hashes)] * chunk, strict=False)]
        self.n_anchors = len(ids)
        if full < n:  # each block of the last, partial chunk: chained to the identity before it
            ids += [prev := hash((prev, h)) for h in local_hashes[full:]]
        self.ids = ids
        self.n_blocks = n
        self.chunk = chunk

    @classmethod
    def estimated(cls, known: Sequence[int], n_blocks: int, salt: int, chunk: int = CHUNK) -> PromptBlocks:
        """A prompt of about ``n_blocks`` blocks routed before all its hashes are known: the whole
        chunks of its ``known`` first blocks (a later turn's earlier turn; none for a prompt no
        worker held) as they are, every block after them an identity of its own (``salt`` tells
        one request's from another's), which counts as new wherever it goes and matches nothing."""
        p = cls((), chunk)  # (fields set below; mypyc compiles no bare __new__)
        anchors = n_blocks // chunk
        held = min(len(known) // chunk, anchors)
        ids = cls(known[: held * chunk], chunk).ids if held else []
        p.ids = ids + [hash((salt, i)) for i in range(held, anchors + n_blocks % chunk)]
        p.n_anchors = anchors
        p.n_blocks = n_blocks
        p.chunk = chunk
        return p

    def weight(self, i: int) -> int:
        return self.chunk if i < self.n_anchors else 1

    def chunk_prefix(self, depth_blocks: int) -> tuple[int, int] | None:
        """``(identity, blocks)`` of the longest run of whole chunks within the prompt's first
        ``depth_blocks`` blocks, the prefix other prompts share the identity of (None: shorter than
        a chunk)."""
        n = min(depth_blocks // self.chunk, self.n_anchors)
        if n <= 0:
            return None
        return self.ids[n - 1], n * self.chunk


def hold_prefix(refs: Counter[int], ids: Sequence[int], anchors: int, chunk: int, start: int = 0) -> int:
    """Count the prefix identities ``ids[start:]`` as held once more in ``refs``; returns the
    blocks no one held before (an identity of a whole chunk is ``chunk`` blocks, one after the
    last whole chunk (``anchors`` of them) a single block). Counting is left to ``Counter``'s C
    loop: this runs for every routed request."""
    added = 0
    for lo, hi, weight in ((start, anchors, chunk), (max(start, anchors), len(ids), 1)):
        if lo < hi:
            before = len(refs)
            refs.update(ids if lo == 0 and hi == len(ids) else ids[lo:hi])
            added += (len(refs) - before) * weight
    return added


def release_prefix(refs: Counter[int], ids: Sequence[int], anchors: int, chunk: int, start: int = 0) -> int:
    """Undo :func:`hold_prefix`; returns the blocks no one holds any more."""
    freed = 0
    for lo, hi, weight in ((start, anchors, chunk), (max(start, anchors), len(ids), 1)):
        if lo < hi:
            part = ids if lo == 0 and hi == len(ids) else ids[lo:hi]
            counts = list(map(refs.pop, part))  # popped; the ones others hold go back
            gone = counts.count(1)
            if gone < len(part):
                back = compress(zip(part, counts, strict=True), map(_MORE_THAN_ONE, counts))
                dict.update(refs, ((ident, c - 1) for ident, c in back))
            freed += gone * weight
    return freed


_MORE_THAN_ONE = (1).__lt__


class _WorkerLoad:
    __slots__ = (
        "active",
        "anchor_since",
        "blocks",
        "in_prefill",
        "output",
        "prefill_tokens",
        "refs",
        "requests",
        "streamed_at",
        "unseen",
        "unseen_blocks",
        "unseen_queued",
        "unseen_running",
        "unseen_waiting",
    )

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.blocks = 0
        self.output = 0.0
        self.requests = 0
        self.refs: Counter[int] = Counter()
        self.in_prefill: dict[str, _Active] = {}
        """Requests before their first token, oldest first (dicts keep insertion order)."""
        self.active: dict[str, _Active] = {}
        """Every request in flight here."""
        self.anchor_since = 0.0
        self.streamed_at = -math.inf
        """When tokens last came from a request here: the end of the engine's last step."""
        self.unseen = 0.0
        """Requests the engine reports beyond this router's (:meth:`ActiveSequences.set_unseen`):
        the two below together, kept so the load view tests one attribute per candidate."""
        self.unseen_running = 0.0
        """... those of them in its batch."""
        self.unseen_waiting = 0.0
        """... and in its waiting queue."""
        self.unseen_blocks = 0.0
        """KV blocks the unseen requests are taken to hold (the waiting ones, once they run)."""
        self.unseen_queued = 0
        """Prompt tokens the unseen waiting requests are taken to queue."""


class _Active:
    __slots__ = (
        "anchors",
        "chunk",
        "expected",
        "first_block",
        "first_token_at",
        "generated",
        "ids",
        "last_seen",
        "osl",
        "output",
        "prefill",
        "routed_at",
        "unique",
        "worker",
    )

    def __init__(
        self,
        worker: WorkerKey,
        ids: list[int] | None,
        anchors: int,
        unique: int,
        prefill: int,
        osl: int | None,
        now: float,
        chunk: int = CHUNK,
    ) -> None:
        self.worker = worker
        self.ids = ids
        self.anchors = anchors
        self.chunk = chunk
        self.unique = unique
        self.prefill = prefill
        self.osl = osl
        self.generated = 0
        self.output = 0.0
        self.last_seen = now
        self.expected = 0.0
        self.routed_at = now
        self.first_token_at: float | None = None
        self.first_block: int | None = None


def _step(w: _WorkerLoad, now: float) -> tuple[float, int]:
    """:meth:`ActiveSequences.step_in_progress` of one worker's load."""
    if not w.in_prefill:
        return 0.0, 0
    anchor = next(iter(w.in_prefill.values()))
    if anchor.expected <= 0:
        return 0.0, w.prefill_tokens
    return max(w.anchor_since + anchor.expected - now, 0.0), w.prefill_tokens - anchor.prefill


class ActiveSequences:
    """Load per (worker, dp_rank) from the requests the router has sent and not yet seen finish."""

    def __init__(
        self,
        *,
        block_size: int,
        assume_kv_reuse: bool = True,
        track_prefill_tokens: bool = True,
        track_active_blocks: bool = True,
        track_output_blocks: bool = False,
    ) -> None:
        self.block_size = self.chunk = 0
        self.set_block_size(block_size)
        self.assume_kv_reuse = assume_kv_reuse
        self.track_prefill_tokens = track_prefill_tokens
        self.track_active_blocks = track_active_blocks
        self.track_output_blocks = track_output_blocks
        self._workers: dict[WorkerKey, _WorkerLoad] = {}
        self._requests: dict[str, _Active] = {}
        self._first_blocks: dict[int, int] = {}
        """The first block hash of each request in flight (``carries_first``)."""
        self._sizes = (0.0, 0.0)
        """What an unseen request is taken to hold (KV blocks) and queue (uncached prompt tokens)."""
        self._sizes_at: float | None = None

    def set_block_size(self, block_size: int) -> None:
        """The fleet's block size (a router learns it from its first worker), and with it
        ``chunk``: the blocks in a prefix identity's chunk (:func:`chunk_blocks`)."""
        self.block_size = block_size
        self.chunk = chunk_blocks(block_size)

    def prompt_of(self, local_hashes: Sequence[int]) -> PromptBlocks:
        """A prompt's identities as this load counts them: in this fleet's chunks, or none when
        shared blocks are not deduplicated (``assume_kv_reuse`` off)."""
        if self.assume_kv_reuse:
            return PromptBlocks(local_hashes, self.chunk)
        p = PromptBlocks((), 1)
        p.n_blocks = len(local_hashes)
        return p

    # ------------------------------------------------------------------ views
    def add_worker(self, worker: WorkerKey) -> None:
        self._workers.setdefault(worker, _WorkerLoad())

    def prefill_tokens(self, worker: WorkerKey) -> int:
        w = self._workers.get(worker)
        return w.prefill_tokens if w is not None else 0

    def decode_blocks(self, worker: WorkerKey) -> float:
        w = self._workers.get(worker)
        return (w.blocks + w.output) if w is not None else 0.0

    def requests(self, worker: WorkerKey) -> int:
        w = self._workers.get(worker)
        return w.requests if w is not None else 0

    def holding(self, workers: Sequence[WorkerKey], identity: int) -> list[int]:
        """For each of ``workers``, the requests in flight there whose prompt has the prefix named
        ``identity`` (one call for a decision's candidates)."""
        out = []
        every = self._workers
        for worker in workers:
            w = every.get(worker)
            out.append(w.refs.get(identity, 0) if w is not None else 0)
        return out

    def decoding(self, worker: WorkerKey) -> int:
        """Requests past their first token (generating) on ``worker``."""
        w = self._workers.get(worker)
        return (w.requests - len(w.in_prefill)) if w is not None else 0

    def prefill_tokens_at(self, worker: WorkerKey, now: float) -> float:
        """Active prefill tokens with the oldest request's share decayed over its predicted
        duration (Dynamo's ``aic`` prefill-load model); equal to ``prefill_tokens`` without one."""
        w = self._workers.get(worker)
        if w is None or not w.prefill_tokens:
            return 0.0
        for anchor in w.in_prefill.values():
            if anchor.expected <= 0 or not anchor.prefill:
                return float(w.prefill_tokens)
            done = min(max(now - w.anchor_since, 0.0) / anchor.expected, 1.0)
            return w.prefill_tokens - anchor.prefill * done
        return float(w.prefill_tokens)

    def step_in_progress(self, worker: WorkerKey, now: float) -> tuple[float, int]:
        """``(seconds left, tokens queued behind it)``: the oldest request in prefill is taken to be
        in the engine step running now, which nothing can join (engines admit work at step
        boundaries); what is left of it is its predicted duration less the time since it became
        the oldest. The other requests in prefill wait for the next step, which a request sent now
        joins. ``(0, all prefill tokens)`` when the oldest has no predicted duration (the caller
        then sees every prefill token as joinable, as before). (A request routed a moment after
        the oldest can still reach the engine before its step starts: how often it does, the
        latency cost learns, :mod:`~kvmesh.router.core.joins`.)"""
        w = self._workers.get(worker)
        if w is None:
            return 0.0, 0
        return _step(w, now)

    def anchor(self, worker: WorkerKey) -> tuple[str, float, int] | None:
        """The request taken to be in the step running on ``worker`` (:meth:`step_in_progress`):
        ``(its id, since when, its uncached prompt tokens)``; None when nothing is in prefill."""
        w = self._workers.get(worker)
        if w is None or not w.in_prefill:
            return None
        rid, r = next(iter(w.in_prefill.items()))
        return rid, w.anchor_since, r.prefill

    def candidate_view(self, worker: WorkerKey, now: float) -> tuple[float, int, float, int, int]:
        """What the latency cost reads of ``worker``, in one lookup (it runs for every candidate of
        every decision): ``(seconds left of the step in progress, prefill tokens queued behind it,
        decode blocks, requests in flight, requests generating)``, as :meth:`step_in_progress`,
        :meth:`decode_blocks`, :meth:`requests` and :meth:`decoding` give them, plus the unseen
        load the engine last reported (:meth:`set_unseen`), which those four leave out (Dynamo's
        cost and the busy thresholds read them, and keep Dynamo's meaning)."""
        w = self._workers.get(worker)
        if w is None:
            return 0.0, 0, 0.0, 0, 0
        left, queued = _step(w, now)
        if w.unseen:  # requests the engine reports and this router did not send (see set_unseen)
            return (
                left,
                queued + w.unseen_queued,
                w.blocks + w.output + w.unseen_blocks,
                w.requests + math.ceil(w.unseen),
                w.requests - len(w.in_prefill) + math.ceil(w.unseen_running),
            )
        return left, queued, w.blocks + w.output, w.requests, w.requests - len(w.in_prefill)

    def since_streamed_ms(self, worker: WorkerKey, now: float) -> float:
        """Milliseconds since tokens last came from a request on ``worker`` (inf: none yet)."""
        w = self._workers.get(worker)
        return 1000.0 * (now - w.streamed_at) if w is not None else math.inf

    def set_unseen(self, workers: Sequence[WorkerKey], running: float, waiting: float, now: float) -> None:
        """The engine behind ``workers`` (one worker's ranks) reports ``running`` requests in its
        batch and ``waiting`` in its queue: what it holds beyond the requests this router has in
        flight there is load it cannot see otherwise, spread evenly over the ranks (the engine's
        gauges are summed over them). Its waiting requests beyond this router's that have not
        shown a first token are unseen queued prefills; the rest run. Zero for both clears it.

        An unseen request is taken to be the size of those this router has in flight: it holds the
        KV blocks they hold on average (a waiting one, by the time a request queued behind it
        runs, as the router counts its own), and a waiting one queues the uncached prompt tokens
        of those still in prefill. Both are averages over the requests present at one
        moment, as the engine's counts are, not over the requests routed: a long prefill is more
        often among the requests waiting than among those arriving. With none of its own in
        flight (or in prefill), it has no size to give them, and they count as requests only.

        (In a mesh without replica sync each replica counts every request on its own engine, the
        hops included, but only its own on the others, so it sent long prefills onto peers whose
        queues other replicas had filled: ``make demo``'s TTFT p90 was 359-1048 ms over 14 runs,
        and 292-558 ms over 7 with the engines' own counts filling in the rest.)"""
        loads = [w for w in (self._workers.get(k) for k in workers) if w is not None]
        if not loads:
            return
        if self._sizes_at is None or now - self._sizes_at >= _SIZES_EVERY_S:
            self._measure_sizes(now)
        blocks_each, queued_each = self._sizes
        seen = sum(w.requests for w in loads)
        seen_waiting = sum(len(w.in_prefill) for w in loads)
        unseen = max(running + waiting - seen, 0.0)
        unseen_waiting = min(max(waiting - seen_waiting, 0.0), unseen)
        share = 1.0 / len(loads)
        for w in loads:
            w.unseen_running = (unseen - unseen_waiting) * share
            w.unseen_waiting = unseen_waiting * share
            w.unseen = unseen * share
            w.unseen_blocks = (w.unseen_running + w.unseen_waiting) * blocks_each
            w.unseen_queued = int(w.unseen_waiting * queued_each)

    def _measure_sizes(self, now: float) -> None:
        """The size of an unseen request (:meth:`set_unseen`), from the requests in flight now;
        none where there are none to measure."""
        requests = blocks = in_prefill = queued = 0.0
        for w in self._workers.values():
            requests += w.requests
            blocks += w.blocks + w.output
            in_prefill += len(w.in_prefill)
            queued += w.prefill_tokens
        self._sizes_at = now
        self._sizes = (blocks / requests if requests else 0.0, queued / in_prefill if in_prefill else 0.0)

    def unseen_requests(self, worker: WorkerKey) -> float:
        """Requests the engine last reported beyond this router's (:meth:`set_unseen`)."""
        w = self._workers.get(worker)
        return w.unseen if w is not None else 0.0

    def releases(
        self,
        worker: WorkerKey,
        now: float,
        stay_s: float,
        out_tokens: float,
    ) -> list[tuple[float, float]]:
        """When the worker gets its blocks back: ``[(seconds from now, blocks free by then)]``,
        one entry per request in flight there, soonest first, the blocks
        cumulative. An engine frees a request's blocks when it finishes, not gradually, so a
        request that does not fit waits for whole requests to end.

        A request generating has its ``osl`` (or the ``out_tokens`` a request typically
        generates) less what it generated still to go, at the pace it has kept so far: on a
        worker short of memory every request slows, and a time since the first token measured
        against the usual ``stay_s`` took requests with half a second left for finished. One
        still in prefill finishes its predicted prefill after it was routed, then ``stay_s``
        later. A prefix shared by several requests comes back with the last of them."""
        w = self._workers.get(worker)
        if w is None or not w.active:
            return []
        ends = []
        for r in w.active.values():
            if r.first_token_at is not None:
                expect = r.osl or out_tokens
                if expect <= 0:
                    left = max(stay_s - (now - r.first_token_at), 0.0)
                else:
                    gaps = r.generated - 1
                    pace = (now - r.first_token_at) / gaps if gaps >= 2 else stay_s / expect
                    left = max(expect - r.generated, 1.0) * pace
            else:
                left = max(r.expected - (now - r.routed_at), 0.0) + stay_s
            ends.append((left, r))
        ends.sort(key=lambda e: e[0])
        released: dict[int, int] = {}
        refs = w.refs
        freed = 0.0
        out = []
        for left, r in ends:
            freed += r.unique + r.output
            if r.ids is not None:
                for i, ident in enumerate(r.ids):
                    n = released.get(ident, 0) + 1
                    released[ident] = n
                    if n == refs[ident]:
                        freed += r.chunk if i < r.anchors else 1
            out.append((left, freed))
        return out

    def generated_tokens(self, request_id: str) -> int:
        """Output tokens counted so far for a request in flight (0 when unknown)."""
        r = self._requests.get(request_id)
        return r.generated if r is not None else 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def worker_of(self, request_id: str) -> WorkerKey | None:
        r = self._requests.get(request_id)
        return r.worker if r is not None else None

    def carries_first(self, block_hash: int) -> bool:
        """Some request in flight has a prompt that begins with this block."""
        return block_hash in self._first_blocks

    def prefilling(self, request_id: str) -> bool:
        """The request is counted and has shown no first token yet."""
        r = self._requests.get(request_id)
        return r is not None and r.first_token_at is None

    def new_blocks(self, worker: WorkerKey, prompt: PromptBlocks, isl_tokens: int) -> int:
        """Blocks this request would add to ``worker``'s decode load (0 when not tracking)."""
        if not self.track_active_blocks:
            return 0
        total = prompt.n_blocks + (1 if isl_tokens > prompt.n_blocks * self.block_size else 0)
        w = self._workers.get(worker)
        if not self.assume_kv_reuse or w is None or not w.refs:
            return total
        return total - _active_weight(w.refs, prompt)

    def carried_by_others(self, request_id: str, prompt: PromptBlocks, isl_tokens: int) -> int:
        """Blocks of ``prompt`` that the other requests in flight on ``request_id``'s worker carry:
        cached there by the time it is prefilled, as a decision counts them (0 when not tracking
        them, or the request is gone)."""
        r = self._requests.get(request_id)
        if r is None or not self.track_active_blocks or not self.assume_kv_reuse:
            return 0
        refs = self._workers[r.worker].refs
        if r.ids is not None:
            release_prefix(refs, r.ids, r.anchors, r.chunk)  # (its own identities are not another's)
        try:
            new = self.new_blocks(r.worker, prompt, isl_tokens)
        finally:
            if r.ids is not None:
                hold_prefix(refs, r.ids, r.anchors, r.chunk)
        return prompt.n_blocks + (1 if isl_tokens > prompt.n_blocks * self.block_size else 0) - new

    # ------------------------------------------------------------------ lifecycle
    def add(
        self,
        request_id: str,
        worker: WorkerKey,
        prompt: PromptBlocks,
        isl_tokens: int,
        overlap_blocks: int,
        now: float,
        *,
        osl: int | None = None,
        expected_prefill: float = 0.0,
        first_block: int | None = None,
    ) -> None:
        """Count a routed request on ``worker`` (replaces an earlier entry with the same id).
        ``expected_prefill``: its predicted prefill seconds (the ``aic`` decay; 0 = unknown);
        ``first_block``: its prompt's first block hash (None: shorter than a block)."""
        place: tuple[int, float] | None = None  # a replaced request's place in its worker's queue
        old = self._requests.get(request_id)
        if old is not None:
            queue = self._workers[old.worker].in_prefill
            if old.worker == worker and request_id in queue:
                place = (list(queue).index(request_id), self._workers[worker].anchor_since)
            self.free(request_id, now)
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _WorkerLoad()
        prefill = max(isl_tokens - overlap_blocks * self.block_size, 0) if self.track_prefill_tokens else 0
        ids: list[int] | None = None
        unique = 0
        if self.track_active_blocks:
            unique = 1 if isl_tokens > prompt.n_blocks * self.block_size else 0
            if self.assume_kv_reuse:
                ids = prompt.ids
                w.blocks += hold_prefix(w.refs, ids, prompt.n_anchors, prompt.chunk)
            else:
                unique += prompt.n_blocks
            w.blocks += unique
        w.prefill_tokens += prefill
        w.requests += 1
        r = _Active(worker, ids, prompt.n_anchors, unique, prefill, osl, now, prompt.chunk)
        r.expected = expected_prefill
        if first_block is not None:
            r.first_block = first_block
            firsts = self._first_blocks
            firsts[first_block] = firsts.get(first_block, 0) + 1
        if not w.in_prefill:
            w.anchor_since = now
        w.in_prefill[request_id] = r
        if place is not None:
            # A replacement (``KvRouter.amend``) keeps its place in the queue: the engine has had
            # the request since it was routed, and the step it started (the anchor's) goes on.
            at, since = place
            if at < len(w.in_prefill) - 1:
                items = list(w.in_prefill.items())
                items.insert(at, items.pop())
                w.in_prefill = dict(items)
            if at == 0:
                w.anchor_since = since
        w.active[request_id] = r
        self._requests[request_id] = r
        if osl and self.track_active_blocks:
            r.output = output_blocks(osl, 0, self.block_size)
            w.output += r.output

    def prefill_done(self, request_id: str, now: float) -> None:
        r = self._requests.get(request_id)
        if r is None:
            return
        r.last_seen = now
        if r.first_token_at is None:
            r.first_token_at = now
        w = self._workers[r.worker]
        if now > w.streamed_at:
            w.streamed_at = now
        if r.prefill:
            w.prefill_tokens -= r.prefill
            r.prefill = 0
        self._leave_prefill(w, request_id, now)

    @staticmethod
    def _leave_prefill(w: _WorkerLoad, request_id: str, now: float) -> None:
        if not w.in_prefill:
            return
        was_anchor = next(iter(w.in_prefill)) == request_id
        if w.in_prefill.pop(request_id, None) is not None and was_anchor:
            w.anchor_since = now  # the next oldest starts to decay now

    def generated(self, request_id: str, n: int, now: float) -> None:
        r = self._requests.get(request_id)
        if r is None:
            return
        r.last_seen = now
        r.generated += n
        w = self._workers[r.worker]
        if now > w.streamed_at:
            w.streamed_at = now
        if r.osl and self.track_active_blocks:
            value = output_blocks(r.osl, r.generated, self.block_size)
        elif self.track_output_blocks:
            value = float(r.generated // self.block_size)
        else:
            return
        if value != r.output:
            self._workers[r.worker].output += value - r.output
            r.output = value

    def free(self, request_id: str, now: float | None = None) -> bool:
        r = self._requests.pop(request_id, None)
        if r is None:
            return False
        first = r.first_block
        if first is not None:
            firsts = self._first_blocks
            n = firsts.pop(first)
            if n > 1:
                firsts[first] = n - 1
        w = self._workers[r.worker]
        self._leave_prefill(w, request_id, r.last_seen if now is None else now)
        del w.active[request_id]
        w.prefill_tokens -= r.prefill
        w.blocks -= r.unique
        if r.ids is not None:
            w.blocks -= release_prefix(w.refs, r.ids, r.anchors, r.chunk)
        w.requests -= 1
        if w.requests == 0:
            w.output = 0.0  # exact zero, whatever float rounding accumulated
        else:
            w.output -= r.output
        return True

    def expire(self, now: float, timeout: float) -> list[str]:
        """Free requests not heard of for ``timeout`` seconds (their finish never arrived)."""
        stale = [rid for rid, r in self._requests.items() if now - r.last_seen > timeout]
        for rid in stale:
            self.free(rid, now)
        return stale

    def remove_worker(self, worker: WorkerKey) -> list[str]:
        gone = [rid for rid, r in self._requests.items() if r.worker == worker]
        for rid in gone:
            self.free(rid)
        self._workers.pop(worker, None)
        return gone

    def request_ids(self) -> list[str]:
        return list(self._requests)


def _active_weight(refs: Counter[int], prompt: PromptBlocks) -> int:
    """Weight of the prompt's identities already active: they are prefix-closed, so bisect."""
    ids = prompt.ids
    n_anchors = prompt.n_anchors
    lo, hi = 0, n_anchors  # count of leading anchors active
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if ids[mid - 1] in refs:
            lo = mid
        else:
            hi = mid - 1
    weight = lo * prompt.chunk
    if lo < n_anchors:
        return weight
    lo, hi = n_anchors, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if ids[mid - 1] in refs:
            lo = mid
        else:
            hi = mid - 1
    return weight + lo - n_anchors
