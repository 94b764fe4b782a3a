"""The latency cost's prices: what placing a request on a worker costs in milliseconds, beyond
its own predicted time to first token there.

:meth:`KvRouter._decide <kvmesh.router.core.kv_router.KvRouter._decide>` runs the per-candidate
loop: the predicted time to first token from the worker's fitted curve (the prefill work there once
this request is added, behind what is left of the step running there). It asks this object for the
rest, each term a method below and a field of :class:`~kvmesh.router.core.route_types.CandidateScore`:

* the wait for KV memory (:meth:`memory_wait_ms`) and the chance of joining the step in progress
  (:meth:`joining_ttft_ms`), both part of the predicted time to first token;
* the delay to the requests arriving there meanwhile (:meth:`delay_to_arrivals_ms`);
* cache evicted: once (:meth:`eviction_ms`), by the conversation's growth
  (:meth:`growth_eviction_ms`), and the live conversations' histories pushed out
  (:meth:`pushed_out_ms`), or, on the worker a conversation would leave, pushed out by its
  staying (:meth:`held_overflow_ms`); a conversation's turns meeting those living there
  (:meth:`turns_overlap_ms`);
* the credit for copying a shared prefix (:meth:`copy_credit`);

and the choice (:meth:`pick_saving_work`): no request sent beyond the tail of the best times to
first token on offer where another candidate keeps it within (:mod:`~kvmesh.router.core.tail`),
and the tie rule between candidates the model cannot tell apart.

It owns none of the state it reads: the load, the timing models, the conversations, the joins and
the learned stays are the router's, shared by reference. Pure, as the whole core is: time is an
argument and randomness the router's generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh._types import WorkerKey
from kvmesh.router.core.chain_trie import TierDepths
from kvmesh.router.core.copies import copy_saving_ms
from kvmesh.router.core.load import PromptBlocks
from kvmesh.router.core.route_types import CandidateScore
from kvmesh.router.core.router_state import ReadsState, RouterState
from kvmesh.router.core.timing import Predictor, WorkerTiming

if TYPE_CHECKING:
    import random

NO_TIERS = TierDepths(0, 0, 0)


class LatencyCost(ReadsState):
    """The prices above, over the router's shared state (see the module docstring)."""

    def __init__(self, state: RouterState, rng: random.Random) -> None:
        super().__init__(state)
        self._rng = rng
        self._released: tuple[WorkerKey, float, float, list[tuple[float, float]]] | None = None
        """The last worker's releases worked out in this decision (:meth:`time_to_free_s`)."""

    def begin_decision(self) -> None:
        """Forget what the last decision worked out: the load has moved since."""
        self._released = None

    def joining_ttft_ms(
        self, key: WorkerKey, curve: Predictor, ttft: float, wait_ms: float, own: float, now: float
    ) -> float:
        """``ttft`` (behind the prefill step in progress on ``key``) with the chance that the
        request gets to the engine before that step starts (:class:`~kvmesh.router.core.joins.Joins`,
        by how soon after the step's request it is routed): then its first token comes with that
        step's, which its tokens make a little longer, and it runs no step of its own."""
        anchor = self._load.anchor(key)
        if anchor is None:
            return ttft
        p = self._joins.share(key, now - anchor[1])
        if p <= 0.0:
            return ttft
        joined = curve.overhead_ms() + wait_ms + curve.added_prefill_ms(float(anchor[2]), own)
        return ttft - p * max(ttft - joined, 0.0)

    def copy_credit(
        self,
        prompt: PromptBlocks,
        candidates: Sequence[WorkerKey],
        overlaps: dict[WorkerKey, TierDepths],
        isl_tokens: int,
        now: float,
    ) -> tuple[set[WorkerKey], float, int] | None:
        """``(candidates holding the prompt's deepest cached prefix, what a copy of it on any
        other is worth, its length in blocks)``, or None when nothing is worth copying.

        The prefix is the whole chunks of the deepest one cached on a candidate. A candidate holds
        it when it is cached there or a request in flight there carries it (cached by the time this
        one would be prefilled). Its demand is the requests in flight carrying it, over a request's
        stay; the wait one more copy saves them is :func:`copy_saving_ms` over the time the prefix
        has been shared so far. A conversation's own history is carried by no other request in
        flight, so a turn is never credited for leaving it."""
        deepest = max([d.device for d in overlaps.values()])
        found = prompt.chunk_prefix(deepest)
        stay_s = self._stays.fleet_stay(now)
        if found is None or stay_s <= 0.0:
            return None
        identity, depth = found
        load = self._load
        carried = 0
        holders: set[WorkerKey] = set()
        first: WorkerKey | None = None  # in candidate order: a set's order varies by process
        for key, n in zip(candidates, load.holding(candidates, identity), strict=True):
            carried += n
            if n or overlaps.get(key, NO_TIERS).device >= depth:
                holders.add(key)
                first = first or key
        if not carried or first is None:
            return None
        age = self._shared.age(identity, now, stay_s)  # every worker may hold it: it still ages
        if len(holders) == len(candidates):
            return None
        suffix = isl_tokens - depth * self.block_size
        step_ms = self._timing[first].added_prefill_ms(0.0, suffix)
        return holders, copy_saving_ms(carried / stay_s, step_ms, len(holders), age), depth

    def pick_saving_work(
        self,
        candidates: Sequence[WorkerKey],
        own_tokens: Sequence[float],
        costs: Sequence[float],
        trees: Sequence[int],
        scores: Sequence[CandidateScore],
        effect_variances: Sequence[float],
        waited: bool = False,
        again: bool = False,
    ) -> int:
        """The cheapest candidate, except that costs closer than the best one's prediction
        uncertainty are a tie the model cannot resolve: among those, the one where this request
        adds the least prefill work wins (a sibling joins the prefill of the one sent a moment ago,
        rather than recomputing it on an idle worker at about the same predicted time), and the
        capacity saved serves whatever comes next. Where that is the same and some of them hold
        the prompt's prefix, the one whose step in progress ends soonest wins (``step_wait_ms``):
        that wait is read off the worker's state, not fitted, and it is most of what tells
        candidates holding the same prefix apart. (Without it, a hot prefix's questions went to
        whichever of its workers held the smallest tree: on `hot-prefix` x4 and x8 their TTFT p50
        was 4% higher.) Then, as where none holds it, the worker holding the least cache wins (the
        selector's tie-break), not the lower cost: within the uncertainty the costs are equal.
        (Ranked by cost, a worker whose fit had come out a little faster than the
        others' took every new prefix: on a hot-prefix fleet of 8 engines, two or three of the
        cold prefixes shared one engine while the others had one each, and their questions'
        time to first token p50 was 47 ms against 42 once each had an engine.) The uncertainty
        is the fit's own about its expected value, wide on a new worker and narrowing as it
        learns. (It was the spread of single TTFTs, which is mostly where in a step a request
        lands, the same on every candidate: it kept siblings queued behind the first one's step
        on a learned fleet, where another worker holding the context answered ~25 ms sooner.)

        A candidate whose cost includes a wait for memory (``waited``: some candidate's does) is
        uncertain by that wait's spread as well
        (:class:`~kvmesh.router.core.wait_spread.WaitSpread`), and so is the best one: a candidate
        is near when its cost is within the two candidates' uncertainties together (independent
        errors: the root of the sum of squares). (With only the fit's, a conversation's
        last turns, whose home was predicted to wait 1-2 s for memory, went to recompute
        18k-token histories on workers predicted a few hundred ms sooner, and the blocks they took
        there set off moves after them; those home waits came in at 0.4-0.9 of the prediction.)

        So is what a candidate's cost counts of its effect on others, the requests to arrive there
        and the turns to come back (``effect_variances``, :meth:`effect_variance`): those are
        expectations over requests that may or may not come while it is there. (Taken as sure, a
        few milliseconds of them moved turns off the worker holding their history to one
        predicted to answer them no sooner, recomputing the history: under cache pressure those
        moves cost 0.02-0.04 of the fleet's prefix hits.) Only for a request with a history to keep
        (a conversation's later turn) or a twin to join (a sibling), though: a new conversation's
        first turn keeps nothing on any worker, and ``KvRouter`` gives it no such spread, so only
        the fits' uncertainty makes its ties. (With the spread, 8-12 of `chat-fits`' 16 new chats
        started on the engine holding their 208-token system prompt, predicted 1.5-15 ms slower
        there than on an idle engine, and their later turns moved away when they met there,
        recomputing their histories: prefix hits 0.007 lower over six seeds.) And only for a
        candidate that saves work over the cheapest one (less prefill of its own there): that
        saving is what the tie is settled by. One that adds as much is tied with the cheapest
        within the fits' uncertainty alone, and beyond it the expected costs decide. (Tied by the
        spread of its own delay to arrivals, such a candidate won on the smallest tree: a
        9k-token agent turn leaving its home went to an engine priced at 599 ms, its delay to
        arrivals there 317 ms, where the cheapest engine was priced at 343 with 110.)

        Before any of that, a candidate surely beyond the tail of the best times to first token
        the fleet has been offering is left out when another is predicted within it, and one
        surely slower than the best when none is (:meth:`_tail_limit`). ``again``: the same
        decision picked a second time, on other costs; its best offer is already in the tail."""
        limit = self._tail_limit(candidates, scores, offer=not again)
        among: Sequence[int] = range(len(costs))
        lowest = min(costs)  # (C-level min and index: this runs every decision)
        best = costs.index(lowest)
        if limit is not None and not self._within(limit, candidates[best], scores[best]):
            within = self._within
            among = [
                i for i, (key, s) in enumerate(zip(candidates, scores, strict=True)) if within(limit, key, s)
            ]
            lowest = min(costs[i] for i in among)
            best = next(i for i in among if costs[i] == lowest)
            limit = None  # (every one left is within)
        fit = self._timing[candidates[best]].uncertainty_ms(scores[best].prefill_tokens)
        base = fit * fit
        effects = effect_variances[best]
        own_best = own_tokens[best]
        width = self._wait_spread.width_ms
        if waited:
            base += width(scores[best].memory_wait_ms) ** 2
        near = [
            i
            for i in among
            if costs[i] - lowest
            <= math.sqrt(
                base
                + (width(scores[i].memory_wait_ms) ** 2 if waited else 0.0)
                + (effects + effect_variances[i] if own_tokens[i] < own_best else 0.0)
            )
        ]
        if len(near) == 1:
            return best
        # the least own work, then (a prefix held: not a new one to spread) the soonest start, then
        # the smallest tree (the selector's tie-break), then the lowest cost; a random one of those
        # still equal. The cheapest is within the tail's limit, so the near ones beyond it are left
        # out as they come up (usually none is asked about)
        if any(scores[i].overlap_blocks for i in near):
            keys = [(own_tokens[i], scores[i].step_wait_ms, trees[i], costs[i]) for i in near]
        else:
            keys = [(own_tokens[i], 0.0, trees[i], costs[i]) for i in near]
        while True:
            low = min(keys)
            tied = [i for i, k in zip(near, keys, strict=True) if k == low]
            if limit is not None:
                tied = [i for i in tied if self._within(limit, candidates[i], scores[i])]
                if not tied:
                    rest = [(i, k) for i, k in zip(near, keys, strict=True) if k != low]
                    near, keys = [i for i, _ in rest], [k for _, k in rest]
                    continue
            return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _tail_limit(
        self, candidates: Sequence[WorkerKey], scores: Sequence[CandidateScore], offer: bool = True
    ) -> float | None:
        """The predicted time to first token no candidate may be surely beyond (:meth:`_within`),
        as the tail goes (None: no candidate is left out). ``offer``: this decision's best is added
        to the offers (once a decision).

        The bound is the 99th percentile of the best times to first token recently on offer
        (:class:`~kvmesh.router.core.tail.TtftTail`; this decision's best is added to them). A
        candidate is surely beyond it when its predicted time to first token is more than its
        spread above the bound (:meth:`_spread`). Such candidates are left out. (The cost's other
        terms, what the placement does to others, are expectations over many later requests, each
        touched a little; this request's own time falls on it alone. Without the bound, ten-turn
        chats past four engines' caches sent turns to wait 400-970 ms for memory, to spare
        evictions priced a second or two lower, where 100-130 ms was on offer: their p99 read 417 ms
        over five runs (252-611).)

        Where even the best offer is beyond the bound (a crowded moment of the fleet's), the limit
        is that best one's reach, its prediction and spread: the candidates left out are those
        surely slower than it. (Letting the cost decide there sent turns of H1 to a 700-900 ms wait
        for memory where 140-160 ms was predicted elsewhere.)"""
        predicted = [s.predicted_ttft_ms or 0.0 for s in scores]
        best = min(predicted)
        tail = self._tail
        if offer:
            tail.offer(best)
        bound = tail.bound_ms
        if bound is None or max(predicted) <= bound:
            return None
        if best <= bound:
            return bound
        return min(p + self._spread(key, s) for key, s, p in zip(candidates, scores, predicted, strict=True))

    def _within(self, limit: float, key: WorkerKey, score: CandidateScore) -> bool:
        """Whether ``key``'s predicted time to first token, less its spread, is within ``limit``."""
        predicted = score.predicted_ttft_ms or 0.0
        if predicted <= limit:
            return True
        noise = self._timing[key].noise_ms()
        if predicted - noise <= limit:  # (the spread is the noise at the least)
            return True
        wait = score.memory_wait_ms
        return wait > 0.0 and predicted - math.hypot(noise, self._wait_spread.width_ms(wait)) <= limit

    def _spread(self, key: WorkerKey, score: CandidateScore) -> float:
        """How far a candidate's time to first token may come out below its prediction, in one
        standard deviation: the spread of single times to first token around the worker's fit
        (:meth:`WorkerTiming.noise_ms`) and, for a wait for memory, that wait's learned spread
        (waits came in at 0.4-0.9 of the prediction), independent errors taken together."""
        return math.hypot(self._timing[key].noise_ms(), self._wait_spread.width_ms(score.memory_wait_ms))

    @staticmethod
    def effect_variance(delay_ms: float, added_prefill_ms: float, overlap_ms: float, pass_ms: float) -> float:
        """The variance (ms squared) of a candidate's predicted effect on others: ``delay_ms``, its
        delay to the requests arriving there (:meth:`delay_to_arrivals_ms`), and ``overlap_ms``, the
        turns' overlap (:meth:`turns_overlap_ms`). Each is a count of events that may or may not
        happen times what each costs: arrivals during its prefill (``added_prefill_ms`` of engine
        time) each wait up to all of it, half on average, and a meeting of turns costs about a
        decode pass (``pass_ms``). For a Poisson count the variance of such a sum is the expected
        count times the mean square cost: ``delay x (2/3) x prefill`` and ``overlap x pass``. (The
        delay's other parts, a longer decode pass and the memory the arrivals wait for, are taken
        at the same ratio.) Where few events are expected, the spread exceeds the term itself."""
        variance = 0.0
        if delay_ms > 0.0:
            variance += delay_ms * (2.0 / 3.0) * added_prefill_ms
        if overlap_ms > 0.0:
            variance += overlap_ms * pass_ms
        return variance

    def eviction_ms(self, timing: WorkerTiming, added_blocks: int, free_blocks: int) -> float:
        """What placing a request there costs later in evicted cache: the blocks it adds
        (``added_blocks``, those not cached there) beyond the worker's ``free_blocks`` push out
        least-recently-used cache, which the fleet's reported hit share says will be asked for
        again at that rate; recomputing it later costs the fitted per-token prefill time. (The rate
        is the fleet's, not the worker's: a worker's own low hit share would make the worker that
        thrashes most the cheapest place for new prefixes.)"""
        evicted = added_blocks - free_blocks
        if evicted <= 0:
            return 0.0
        return self._stays.reuse_fleet * evicted * self.block_size * timing.ms_per_token()

    def growth_eviction_ms(self, key: WorkerKey, growth_blocks: float, room_blocks: float) -> float:
        """What the cache its conversation grows into there evicts from the other conversations
        living there, in their recompute time when they come back.

        A turn's later turns follow it to the worker holding its history, each adding the blocks a
        turn typically adds: ``growth_blocks`` (the turns its cache is held for,
        :meth:`Conversations.turns_to_hold`, x blocks a turn) more cache
        there. Where the live conversations' blocks (:class:`Conversations`) and this request's
        leave room for that, nothing; beyond it, the excess pushes out blocks that live
        conversations come back for (at the share of turns continued), to be prefilled again at
        the worker's fitted per-token time. Without this the cost saw only the request in hand: a
        new session's first turn, which adds little beyond a cached system prompt, went where that
        prompt was, until a few workers held twelve growing agent sessions each (more than their
        caches), two of eight held none, and turns there waited for memory or recomputed 10k-token
        histories.

        The room is what is left once the conversations already there have grown as well
        (:meth:`Conversations.growth_ahead_blocks`; the tip this turn continues is left out of
        ``held_ahead``, the turns they are held for, as its growth is this turn's own): the cache a
        worker's conversations will need is theirs and this one's together, and of that total this
        conversation's growth is the part beyond what theirs leaves. (Counted from their blocks
        now, a worker whose sessions were all at their first turn looked nearly empty to a new
        session, however far those sessions had yet to grow.) ``room_blocks`` is that room: the
        worker's blocks less the live conversations' (:meth:`Conversations.outlooks`), their
        growth ahead and the blocks this request adds; the caller works it out, as it calls this
        only where the growth exceeds it.
        """
        evicted = growth_blocks - max(room_blocks, 0.0)
        if evicted <= 0:
            return 0.0
        conv = self._conversations
        return conv.continued_share() * evicted * self.block_size * self._timing[key].ms_per_token()

    def pushed_out_ms(
        self,
        key: WorkerKey,
        timing: WorkerTiming,
        added_blocks: int,
        total_blocks: int,
        previous: str | None,
        to_hold: float,
        per_cycle: float,
    ) -> float:
        """The live conversations' blocks this request pushes out of ``key``'s cache, prefilled
        again at every turn those conversations bring back while the push lasts.

        The blocks it adds there (``added_blocks``) beyond what the live conversations' blocks
        (:meth:`Conversations.live_blocks`, its own conversation's left out) leave of the cache
        push theirs out. The engine evicts the least recently used first, which is a conversation
        between turns: the next one back finds the pushed blocks gone, prefills them again, and so
        pushes as many out of the next one's history, turn after turn, for as long as this
        request's blocks stay live there (the ``to_hold`` turns its conversation's cache is held
        for, :meth:`Conversations.turns_to_hold`, and the gap after its last). So they cost the
        worker's fitted per-token time once for every turn the conversations there bring back
        meanwhile: a gap's worth of them (``per_cycle``,
        :meth:`Conversations.held_turns_per_cycle`) per turn this one has to come and one more,
        and no more than they have left (:meth:`Conversations.turns_held_ahead`), the future
        counted as the cache is held for it. Conversations at their last turns cost little; young
        ones with most of their turns ahead, a lot.
        A pushed block costs its recompute only if its conversation would have found it otherwise:
        the price is taken at the share of their histories that later turns have been finding
        (:attr:`Conversations.history_found`). Where the live histories are far past the caches,
        the turns coming back find little of theirs whatever this request does, and pricing every
        return at its whole push made the price (8-11 s a candidate on six engines holding twice
        their caches in live chats, stop 80) outweigh a request's own wait: turns went where they
        were predicted to wait 0.6-1 s for memory, where 0.45 s was on offer, to spare pushes
        that came to nothing.
        (:meth:`eviction_ms` prices what a request evicts once. With 12 agent sessions on 4
        engines, turns that moved onto an engine whose conversations were between turns pushed
        their histories out, and they were prefilled again at every later turn there.)"""
        conv = self._conversations
        pushed = min(added_blocks, conv.live_blocks(key, previous) + added_blocks - total_blocks)
        if pushed <= 0:
            return 0.0
        returns = min(conv.turns_held_ahead(key, previous), (1.0 + to_hold) * per_cycle)
        if returns <= 0:
            return 0.0
        return returns * pushed * self.block_size * timing.ms_per_token() * conv.history_found

    def held_overflow_ms(
        self,
        key: WorkerKey,
        timing: WorkerTiming,
        total_blocks: int,
        own_blocks: int,
        now_blocks: int,
        previous: str | None,
        to_hold: float,
        held_ahead: float,
    ) -> float:
        """What a conversation costs the conversations living with it on ``key``, the worker
        holding its history, by staying there: the other side of a move, whose landing side
        :meth:`pushed_out_ms` and :meth:`growth_eviction_ms` price.

        ``own_blocks``: its blocks there that no other conversation shares (its history and this
        turn's). ``now_blocks``: every live conversation's blocks there, this turn's included.
        With the growth they are held for (``held_ahead`` turns of theirs and ``to_hold`` of its
        own, ``growth_blocks`` a turn), the blocks needed exceed the worker's ``total_blocks``
        ``t0`` gaps between turns from now (the room left over what a gap adds, theirs and its
        own); from then until its cache is let go, each of their turns that comes back (a gap's
        worth a gap, :meth:`Conversations.held_turns_per_cycle`, no more than they have left) finds
        up to ``own_blocks`` of its history evicted and prefills it again at the worker's fitted
        per-token time. The router counts it only where another worker has room for this
        conversation's future and the fleet for all of theirs (:meth:`KvRouter._decide`).
        (Without it, six young agent sessions sharing an engine of eight stayed until their
        histories no longer fitted, and four recomputed 10k tokens each at their fifth turn.)
        As in :meth:`pushed_out_ms`, at the share of their histories later turns find."""
        conv = self._conversations
        g = conv.growth_blocks
        if own_blocks <= 0 or to_hold <= 0.0 or g <= 0.0 or held_ahead <= 0.0:
            return 0.0
        overflow = now_blocks + (held_ahead + to_hold) * g - total_blocks
        if overflow <= 0.0:
            return 0.0
        per_cycle = conv.held_turns_per_cycle(key, previous)
        t0 = max(total_blocks - now_blocks, 0) / ((per_cycle + 1.0) * g)
        returns = min(per_cycle * max(to_hold - t0, 0.0), held_ahead)
        if returns <= 0.0:
            return 0.0
        return (
            returns * min(own_blocks, overflow) * self.block_size * timing.ms_per_token() * conv.history_found
        )

    def turns_overlap_ms(
        self,
        key: WorkerKey,
        timing: WorkerTiming,
        usage: float,
        to_come: float,
        previous: str | None,
        per_cycle: float,
        cycle_s: float,
        turn_tokens: float,
    ) -> float:
        """What this conversation's later turns and those of the conversations living on ``key``
        take from each other's time to first token there.

        A turn that finds the worker decoding waits for the rest of the pass in progress, and each
        of its prefill steps carries a decode pass for the others: ``steps + 0.5`` passes against
        the one pass that emits its first token on an idle worker (:meth:`Curve.ttft_ms`), where
        ``steps`` is what a turn's added blocks take. Each conversation has a request in flight
        there for a share ``f`` of the gap between its turns (a request's stay over ``cycle_s``);
        the ``per_cycle`` conversations living there (:meth:`Conversations.turns_per_cycle`) have
        ``f * per_cycle`` in flight at a random moment, so a turn finds the worker decoding with
        the chance ``1 - exp(-f * per_cycle)``. Each of this conversation's ``to_come`` turns meets
        that; each of theirs that comes back while it lives there (no more than they have left,
        :meth:`Conversations.turns_ahead`) finds it in flight as well ``exp(-f * per_cycle) * (1 -
        exp(-f))`` more often. (Without it a new conversation's first turn went where a 208-token
        system prompt was cached: seven of sixteen chats started on one of four engines, and
        their later turns moved away one by one when they met there, recomputing their
        histories; prefix hits 0.80-0.81 against 0.84 for a router that never moves a turn.)"""
        stay_s = self._stays.decode_of(key)
        f = stay_s / cycle_s
        if f <= 0.0:
            return 0.0
        if f > 1.0:
            f = 1.0
        idle = math.exp(-f * per_cycle)
        theirs = min(self._conversations.turns_ahead(key, previous), to_come * per_cycle)
        met = to_come * (1.0 - idle) + theirs * idle * (1.0 - math.exp(-f))
        steps = math.ceil(turn_tokens / timing.own.max_batched_tokens) if turn_tokens > 0 else 1
        return met * (steps - 0.5) * timing.decode_ms(usage)

    def delay_to_arrivals_ms(
        self,
        key: WorkerKey,
        timing: WorkerTiming,
        view: tuple[float, int, float, int, int],
        own_tokens: float,
        blocks_after: float,
        osl: int | None,
        now: float,
        returning_per_s: float = 0.0,
    ) -> float:
        """The time to first token this request takes from the requests that will arrive on ``key``
        while it is there.

        How many arrive: by Little's law, the requests in flight there over the time a request
        stays (``n / W``; ``W`` is the learned time from dispatch to finish there, the queue and the
        wait for memory included), counted from what the router holds now, so a client that waits
        for each answer before sending the next makes no arrivals during it; or, where more, the
        turns the conversations living there send it (``returning_per_s``:
        :meth:`Conversations.turns_per_cycle` over the gap between turns). (``W`` was the time from
        first token to finish alone, which is a request's whole stay only where nothing queues: on
        a worker past its KV cache, whose requests wait up to a second or two for memory before
        their first token, it counted as many times more arrivals than there were as the stay was
        longer than the decode, and the busiest worker looked the worst place for the blocks of a
        turn whose history it held.) Its decode lasts ``osl`` passes when the client
        gave ``agent_hints.osl``, else the learned first-token-to-finish time.
        Its prefill adds ``S`` ms of engine time: the ``rate * S`` requests arriving meanwhile wait
        half of it on average. Its blocks raise the worker's KV usage for its whole decode, which
        lengthens every decode pass there: each request arriving during that time waits for one and
        a half passes longer (the rest of the step in progress and the step emitting its token).
        Beyond the worker's KV blocks, the arrivals wait for memory as well (:meth:`memory_wait_ms`),
        and the blocks this request adds past the limit are blocks they wait to see freed: each
        waits that share of the cache's turnover time (the worker frees a cache's worth of blocks
        per stay) longer. That lasts while the worker stays over its limit: until the requests
        finishing there have freed the excess and what arrivals bring meanwhile (the blocks in
        flight there over their stay, Little's law again), or for its whole decode when they
        cannot. (Without it the cost saw only the request's own wait for memory, which hinges on
        when the next request there ends: it put turns on a worker already 240 blocks over its
        cache because one request there was about to finish, and the turns behind them waited
        300-500 ms, where spreading the excess over the fleet keeps every wait short.)
        The histories of the conversations living there between turns are cached, not in flight:
        the engine evicts them for the blocks it needs, and no one waits for them. What evicting
        them costs is their recompute when they come back (:meth:`pushed_out_ms`). (Priced here as
        well, as memory every arrival would wait for, they made every block a request adds to a
        worker under cache pressure a wait for everyone arriving there: conversations moved off
        busy engines, and 48 chats outgrowing four engines' caches had 0.68-0.73 of their prompts
        cached instead of 0.76-0.77.)
        An idle worker charges nothing, so a request that would pile onto a worker already taking
        most of the traffic pays for the queue it makes there; a request that shares blocks already
        in use there (a sibling, a conversation's next turn) adds few blocks and little prefill,
        and pays little.
        """
        _, ahead_tokens, blocks_before, in_flight, _ = view
        stay_s = self._stays.decode_of(key)
        if stay_s <= 0.0:
            return 0.0
        # Little's law divides the requests in flight by their whole time there; the decode time
        # alone is the whole only where nothing queues
        in_system_s = self._stays.in_system_s.get(key, self._stays.in_system_fleet)
        if in_system_s < stay_s:
            in_system_s = stay_s
        rate = max(in_flight / in_system_s, returning_per_s)
        if rate <= 0.0:
            return 0.0
        prefill = timing.curve().added_prefill_ms(ahead_tokens, own_tokens)
        total = max(self._workers[key[0]].total_blocks, 1)
        before = min(blocks_before / total, 1.0)
        after = min(blocks_after / total, 1.0)
        own = timing.own  # a decode pass as this worker's streamed gaps have shown it
        pass_after = own.decode_ms(after)
        longer_pass = max(pass_after - own.decode_ms(before), 0.0)
        decode_s = osl * pass_after / 1000.0 if osl is not None and osl > 0 else stay_s
        delay = rate * (prefill / 1000.0) * prefill / 2.0 + rate * decode_s * 1.5 * longer_pass
        added = blocks_after - blocks_before
        over_limit = min(added, blocks_after - total)
        if over_limit > 0:
            inflow = blocks_before / in_system_s
            left_s = self.time_to_free_s(key, blocks_after - total, total, now, stay_s, inflow)
            window = min(left_s, decode_s)
            delay += rate * window * 1000.0 * over_limit / total * stay_s
        return delay

    def memory_wait_ms(
        self,
        key: WorkerKey,
        decode_blocks: float,
        total_blocks: int,
        now: float,
    ) -> float:
        """How long the request waits for KV blocks on ``key`` when the blocks in flight there
        (``decode_blocks``, its own included) exceed the worker's: until enough requests have
        finished to free the excess, in the order they are expected to finish (their blocks come
        back whole, at the end). (Taking the excess as that share of one request's decode time
        put a 10k-token turn behind six long requests that would all run for another half second
        at 250 ms; it waited 550.) Beyond what every request in flight frees, the rest waits a
        further decode time per cache's worth."""
        excess = decode_blocks - total_blocks
        if excess <= 0:
            return 0.0
        stay_s = self._stays.decode_of(key)
        return 1000.0 * self.time_to_free_s(key, excess, total_blocks, now, stay_s, 0.0)

    def time_to_free_s(
        self,
        key: WorkerKey,
        excess: float,
        total_blocks: int,
        now: float,
        stay_s: float,
        inflow: float,
    ) -> float:
        """Seconds until the requests in flight on ``key`` have freed ``excess`` blocks more than
        arrivals bring meanwhile (``inflow`` blocks a second). Past the last of them: with no
        inflow, a further decode time per ``total_blocks`` still missing; with inflow, never."""
        left = freed = 0.0
        for left, freed in self._releases(key, now, stay_s):
            if freed - inflow * left >= excess:
                return left
        if inflow > 0:
            return math.inf
        return left + (excess - freed) / total_blocks * stay_s

    def _releases(self, key: WorkerKey, now: float, stay_s: float) -> list[tuple[float, float]]:
        """:meth:`ActiveSequences.releases <kvmesh.router.core.load.ActiveSequences.releases>` for
        ``key``, worked out once per candidate: a worker past its cache asks for it twice, for the
        request's own wait for memory and for the arrivals' (it sorts every request there and walks
        their shared prefixes: a quarter of a decision's time on 48 agent conversations past four
        workers' caches)."""
        memo = self._released
        if memo is not None and memo[0] == key and memo[1] == now and memo[2] == stay_s:
            return memo[3]
        ends = self._load.releases(key, now, stay_s, self._stays.out_tokens)
        self._released = (key, now, stay_s, ends)
        return ends


def weigh_prefill(
    timing: WorkerTiming, ttft_ms: float, prefill_tokens: float, wait_ms: float, weight: float
) -> float:
    """``--router-prefill-load-scale`` on the latency cost: the prefill part of a predicted TTFT
    (the step waited for and the prefill work) weighed against its decode passes."""
    prefill_part = wait_ms + timing.prefill_ms(prefill_tokens)
    return weight * prefill_part + ttft_ms - prefill_part
