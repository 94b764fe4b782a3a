"""Live conversations: which requests come back, where, and how much cache they will need then.

A conversation's next turn sends its whole history again plus a little more, and a KV-aware router
sends it back to the worker holding that history. So placing a conversation's turn also places
its later turns, and the cache they will grow into. The router learns that from its own traffic:

* a request **continues** an earlier one when its full blocks start with all of the earlier
  prompt's full blocks and add more (identical prompts are siblings, not turns);
* each request is a **tip** until a later turn continues it (the tip moves to that turn, on the
  worker it went to) or it is not continued for ``EXPIRE_CYCLES`` typical gaps between turns (the
  conversation is taken to be over);
* each request has a **turn number** (1 when it continues nothing; a sibling shares its twin's);
  from how many conversations reached each turn, the share that went on from each turn to the next
  (of those whose next turn has come or is overdue: a conversation still between its turns has not
  ended), the turns still to come after turn ``n``, the blocks a turn adds, and the gap between
  turns;
* per worker, the **live blocks**: the blocks of the tips placed there, a prefix shared by several
  counted once. They are what conversations will ask that worker for again.

Pure: no clock, no I/O. Prefixes are named by :class:`~kvmesh.router.core.load.PromptBlocks`
identities (a chunk of 16 blocks is one identity), so a tip costs a list the router already built.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh._types import WorkerKey
from kvmesh.router.core.load import PromptBlocks, hold_prefix, release_prefix

ALPHA = 0.05
"""Weight of one turn in the moving averages of growth and gap (the last ~20 turns)."""
EXPIRE_CYCLES = 4.0
"""A tip not continued after this many typical gaps between turns is taken as the end of its
conversation: gaps vary (think time, tool time) but rarely by 4x."""
EXPIRE_FIRST_S = 30.0
"""The expiry before any gap between turns has been seen."""
LAPSE_CYCLES = 2.0
"""The young fleet's forecast (as many turns again as a conversation has had,
:meth:`Conversations.turns_to_hold`) lapses once this many typical gaps have passed since the
first conversation reached the deepest turn with none gone past it: had they gone on, some would
have by then. Until they expire (``EXPIRE_CYCLES`` gaps after their last turns), a wave of
conversations that all ended at the same turn otherwise read as young: every one of them was to
hold its cache for as many turns again, and the next wave's sessions were placed around that
growth (six-turn agents on five engines: 13 s of it, each new session held for 11 turns where 5
came)."""
MAX_TURNS_TO_COME = 19.0
"""A fleet of endless conversations has no finite answer, and beyond ~20 turns the first ones'
cache is long gone anyway."""
MAX_TURN = 1024
"""Turns past this one are counted as this one."""
MAX_TIPS = 20_000
"""Live conversations the router follows at most (~1.5 kB each); past it the oldest tip is
dropped, as if its conversation had ended. A fleet with more conversations between turns than this
is priced from the most recent ones."""
HALVE_AT = 2000.0
"""When this many conversations have been counted, every count is halved, so the statistics
follow the traffic of the last thousand or two conversations."""


@dataclass(slots=True)
class Turn:
    """Where a request stands in its conversation (:meth:`Conversations.lookup`)."""

    previous: str | None
    """The tip it continues (None: it continues nothing)."""
    number: int
    """1 for a conversation's first request; a sibling has its twin's."""
    sibling: bool = False
    """Its prompt is a live tip's: the same turn again (best-of-n, a retry), not a new one."""
    key: tuple[int, tuple[int, ...]] = (0, ())
    """The prompt as tips are indexed (:func:`_prompt_key`), so its commit does not rebuild it."""


@dataclass(slots=True)
class _Tip:
    worker: WorkerKey
    ids: list[int]
    anchors: int
    trailing: tuple[int, ...]
    """Local hashes of the full blocks after the last whole chunk (fewer than ``chunk``)."""
    at: float
    number: int
    counted: float
    """What it added to the turns reached (1, halved with them; 0 for a sibling): while it waits
    for its next turn, that much of its turn's count has no fate yet."""
    chunk: int
    """Blocks in one of its whole chunks (:func:`~kvmesh.router.core.load.chunk_blocks`)."""

    @property
    def n_blocks(self) -> int:
        return self.anchors * self.chunk + len(self.trailing)


class Conversations:
    """The router's view of the conversations in flight or between turns, per worker."""

    def __init__(self) -> None:
        self._tips: dict[str, _Tip] = {}
        """By request id, oldest first (tips are made in routing order)."""
        self._by_prompt: dict[tuple[int, tuple[int, ...]], dict[str, None]] = {}
        """Tips by their prompt: the identity of its last whole chunk (0 when it is shorter than a
        chunk) and the local hashes of the full blocks after it. Identical prompts (siblings)
        share an entry, oldest first (a dict, not a set: a set of strings iterates in an order
        that varies between processes, and a run must replay exactly)."""
        self._tails: dict[int, dict[int, int]] = {}
        """Per last-chunk identity, how many tips have each number of full blocks after it: the
        few lengths a prompt's lookup tries at that chunk (never a scan over the tips)."""
        self._depths: dict[int, int] = {}
        """Per depth in whole chunks, how many identities of ``_tails`` end there. An identity
        names its whole prefix, so a prompt holds one of depth ``d`` only as its own ``d``-th:
        a lookup probes one identity per depth present, not every chunk of a long prompt."""
        self._refs: dict[WorkerKey, Counter[int]] = {}
        self._live: dict[WorkerKey, int] = {}
        self._numbers: dict[WorkerKey, dict[int, int]] = {}
        """Per worker, how many tips there are at each turn number: what their growth still ahead
        is computed from (:meth:`growth_ahead_blocks`)."""
        self._to_come: list[float] | None = None
        """``turns_to_come(n)`` for every ``n`` reached, rebuilt after the counts change."""
        self._to_hold: list[float] | None = None
        """``turns_to_hold(n)`` for every ``n`` reached, rebuilt after the counts change."""
        self._go_on_held: list[float] | None = None
        """:meth:`held_turns_per_cycle`'s shares, rebuilt after the counts change."""
        self._go_on: list[float] | None = None
        """``[n - 1]``: the share of the conversations that reached turn ``n`` that went on to
        ``n + 1``, for every ``n`` but the deepest reached; rebuilt after the counts change."""
        self._reached: list[float] = []
        """``[n - 1]``: how many conversations reached turn ``n`` (live ones as far as they got).
        Counting what was seen, rather than a share of requests continued, never extrapolates: a
        share learned from the tips' fates ran to 19 turns to come in a fleet of 4-turn
        conversations, since a continuation is seen a turn later and an ending only after
        ``EXPIRE_CYCLES`` gaps, or never within a run. No turn past the deepest one reached is
        counted on."""
        self._waiting: list[float] = []
        """``[n - 1]``: of ``_reached[n - 1]``, the conversations still between turn ``n`` and the
        next (their tips live, not yet continued nor overdue). They have not gone on yet, nor
        ended: a share that counts them as ended reads every conversation of a fleet that is still
        starting up as a short one (six-turn sessions starting one every 0.1 s, a turn a second,
        read 0.33 turns to come after their first 1.5 s in, where the turns seen allow 1, and
        the histories a newcomer would push out were priced as if few turns came back for them)."""
        self._deepest_at = 0.0
        """When the first conversation reached the deepest turn (see :data:`LAPSE_CYCLES`)."""
        self._lapsed = False
        self.growth_blocks = 0.0
        self.cycle_s = 0.0
        self.history_found = 1.0
        """The share of its own history (the blocks of its earlier prompt no other conversation on
        that worker shares) a later turn finds still cached on the worker holding it, as the
        router's index sees it when the turn is routed (a moving average, 1 until turns come
        back): what the cache prices that count on the histories being found
        (:meth:`LatencyCost.pushed_out_ms`, :meth:`LatencyCost.held_overflow_ms`) scale by. A
        prefix many conversations share is kept warm by their turns, and is not what a
        newcomer pushes out."""

    def found_at_home(self, found_blocks: int, history_blocks: int) -> None:
        """A later turn found ``found_blocks`` of its own ``history_blocks`` cached on the worker
        holding them (:attr:`history_found`)."""
        if history_blocks > 0:
            share = found_blocks / history_blocks if found_blocks < history_blocks else 1.0
            self.history_found += ALPHA * (share - self.history_found)

    # ------------------------------------------------------------------ views
    def home(self, tip_id: str) -> tuple[WorkerKey, int, int] | None:
        """``(worker, own blocks, prompt blocks)`` of the live tip ``tip_id``: the worker it was
        placed on, its blocks there that no other tip there shares (:meth:`live_blocks` with and
        without it) and its prompt's full blocks. None: no such live tip."""
        tip = self._tips.get(tip_id)
        if tip is None:
            return None
        worker = tip.worker
        return worker, self.live_blocks(worker) - self.live_blocks(worker, tip_id), tip.n_blocks

    def live_blocks(self, worker: WorkerKey, exclude: str | None = None) -> int:
        """Blocks of the conversations placed on ``worker`` and not over. ``exclude``: a tip whose
        own blocks (those no other tip there shares) are left out: the conversation of the request
        being priced, whose blocks are that request's."""
        live = self._live.get(worker, 0)
        tip = self._tips.get(exclude) if exclude is not None else None
        if tip is None or tip.worker != worker:
            return live
        refs = self._refs.get(worker)
        if not refs:
            return live
        ids, anchors = tip.ids, tip.anchors
        only = [refs.get(ident) == 1 for ident in ids]
        return live - tip.chunk * sum(only[:anchors]) - sum(only[anchors:])

    def turns_to_come(self, number: int = 1) -> float:
        """Further turns a conversation at turn ``number`` brings, on average: the chance it reaches
        each later turn (the shares that went on, :meth:`_shares_going_on`, multiplied out), summed
        up to the deepest turn reached (0 before any conversation went past ``number``)."""
        to_come = self._to_come
        if to_come is None:
            to_come = self._to_come = self._build_to_come()
        n = min(number, MAX_TURN)
        return to_come[n - 1] if n <= len(to_come) else 0.0

    def turns_to_hold(self, number: int = 1) -> float:
        """The turns a conversation at turn ``number`` is to keep its cache for: :meth:`turns_to_come`,
        but while every conversation at the deepest turn reached is still between turns, one there
        is expected to go on for as many turns again as it has had (nothing else is known of it
        yet, the estimate :mod:`copies` makes of a shared prefix's future), until that presumption
        lapses (:data:`LAPSE_CYCLES`).

        Only what a worker's cache must hold is priced with it (the growth ahead, the histories a
        newcomer pushes out), not the turns' overlap: counting on no turn past the deepest one
        seen keeps a worker's first conversations together where a cache fits them. But while a
        fleet is starting up every conversation is at the deepest turn, read as its last, so
        their growth and the histories pushed out of them cost nothing: with eight engines and
        128-token answers, six growing agent sessions shared each of four engines until their
        fifth turns, which then recomputed 10k-token histories elsewhere."""
        to_hold = self._to_hold_table()
        n = min(number, MAX_TURN)
        return to_hold[n - 1] if n <= len(to_hold) else 0.0

    def _to_hold_table(self) -> list[float]:
        to_hold = self._to_hold
        if to_hold is None:
            to_hold = self._to_hold = self._build_to_come(hold=True)
        return to_hold

    def _build_to_come(self, hold: bool = False) -> list[float]:
        go_on = self._shares_going_on()
        to_come = [0.0] * (len(go_on) + 1)
        if hold and self._deepest_all_waiting():
            deepest = len(go_on)  # (its index)
            to_come[deepest] = min(float(deepest + 1), MAX_TURNS_TO_COME)
        for k in range(len(go_on) - 1, -1, -1):  # from the deepest turn back
            to_come[k] = min(go_on[k] * (1.0 + to_come[k + 1]), MAX_TURNS_TO_COME)
        return to_come

    def _deepest_all_waiting(self) -> bool:
        """Whether every conversation at the deepest turn reached is still between turns, once some
        conversation has gone on at all (before that, nothing says the requests are turns of
        conversations: single questions look like conversations at their first turn)."""
        reached = self._reached
        return len(reached) > 1 and self._waiting[-1] >= reached[-1] > 0.0 and not self._lapsed

    def held_turns_per_cycle(self, worker: WorkerKey, exclude: str | None = None) -> float:
        """:meth:`turns_per_cycle` as :meth:`turns_to_hold` counts the future: a conversation at
        the deepest turn reached, while all there are between turns, goes on with the chance that
        brings as many turns again as it has had (``n / (n + 1)`` a turn, at turn ``n``)."""
        held = self._go_on_held
        if held is None:
            held = list(self._shares_going_on())
            if self._deepest_all_waiting():
                deepest = len(held) + 1
                held.append(deepest / (deepest + 1.0))
            self._go_on_held = held
        return self._over_tips(worker, exclude, held)

    def _shares_going_on(self) -> list[float]:
        """``[n - 1]``: of the conversations that reached turn ``n`` and are no longer waiting at it,
        the share that went on to ``n + 1``."""
        go_on = self._go_on
        if go_on is None:
            reached, waiting = self._reached, self._waiting
            go_on = self._go_on = [
                reached[n] / max(reached[n - 1] - waiting[n - 1], reached[n], 1e-9)
                for n in range(1, len(reached))
            ]
        return go_on

    def growth_ahead_blocks(self, worker: WorkerKey, exclude: str | None = None) -> float:
        """The blocks the conversations living on ``worker`` will still add there: each tip at
        turn ``n`` comes back :meth:`turns_to_hold` more times, ``growth_blocks`` each. ``exclude``:
        a tip left out (the one the request being priced continues, whose growth is its own)."""
        if self.growth_blocks <= 0:
            return 0.0
        return self.turns_held_ahead(worker, exclude) * self.growth_blocks

    def turns_held_ahead(self, worker: WorkerKey, exclude: str | None = None) -> float:
        """:meth:`turns_ahead` counted with :meth:`turns_to_hold`: the turns the conversations
        living on ``worker`` are to keep their cache there for."""
        return self._over_tips(worker, exclude, self._to_hold_table())

    def turns_ahead(self, worker: WorkerKey, exclude: str | None = None) -> float:
        """The turns the conversations living on ``worker`` will still send it: each tip at turn
        ``n`` comes back :meth:`turns_to_come` more times. ``exclude``: a tip left out."""
        to_come = self._to_come
        if to_come is None:
            to_come = self._to_come = self._build_to_come()
        return self._over_tips(worker, exclude, to_come)

    def turns_per_cycle(self, worker: WorkerKey, exclude: str | None = None) -> float:
        """The turns the conversations living on ``worker`` send it over one gap between turns:
        each tip at turn ``n`` once, with the chance that a conversation at ``n`` went on
        (:meth:`_shares_going_on`; none at the deepest turn seen).
        Over ``cycle_s``, the turns a second they send it, by Little's law over conversations:
        unlike the requests in flight there, this does not fall to 0 while a worker's
        conversations are all between turns, just before their next turns arrive. ``exclude``: a
        tip left out (the one the request being priced continues: it is that turn)."""
        return self._over_tips(worker, exclude, self._shares_going_on())

    def outlook(self, worker: WorkerKey, exclude: str | None = None) -> tuple[int, float, float]:
        """``(live_blocks(worker), turns_held_ahead(worker, exclude), turns_per_cycle(worker,
        exclude))`` in one call."""
        return self.outlooks((worker,), exclude)[0]

    def outlooks(
        self, workers: Sequence[WorkerKey], exclude: str | None = None
    ) -> list[tuple[int, float, float]]:
        """:meth:`outlook` of each of ``workers``: what the latency cost reads of every candidate
        of every decision, in one call (the tables are looked up once, not once a candidate)."""
        hold, going_on = self._to_hold_table(), self._shares_going_on()
        n_hold, n_on = len(hold), len(going_on)
        live, per_worker = self._live, self._numbers
        tip = self._tips.get(exclude) if exclude is not None else None
        out = []
        for worker in workers:  # (_over_tips of both tables in one pass over the tips' turns)
            numbers = per_worker.get(worker)
            if not numbers:
                out.append((live.get(worker, 0), 0.0, 0.0))
                continue
            ahead = per_cycle = 0.0
            for number, count in numbers.items():
                if number <= n_hold:
                    ahead += count * hold[number - 1]
                if number <= n_on:
                    per_cycle += count * going_on[number - 1]
            if tip is not None and tip.worker == worker:
                if tip.number <= n_hold:
                    ahead -= hold[tip.number - 1]
                if tip.number <= n_on:
                    per_cycle -= going_on[tip.number - 1]
            out.append((live.get(worker, 0), max(ahead, 0.0), max(per_cycle, 0.0)))
        return out

    def _over_tips(self, worker: WorkerKey, exclude: str | None, table: list[float]) -> float:
        """``table[n - 1]`` summed over the tips on ``worker`` at turn ``n`` (0 past the table),
        ``exclude``'s left out. (:meth:`outlooks` sums two tables so, in one pass.)"""
        numbers = self._numbers.get(worker)
        if not numbers:
            return 0.0
        last = len(table)
        total = 0.0
        for number, count in numbers.items():
            if number <= last:
                total += count * table[number - 1]
        tip = self._tips.get(exclude) if exclude is not None else None
        if tip is not None and tip.worker == worker and tip.number <= last:
            total -= table[tip.number - 1]
        return max(total, 0.0)

    def continued_share(self) -> float:
        """The share of turns that a later turn continued: the chance that a live conversation
        comes back for its blocks."""
        total = sum(self._reached)
        return (total - self._reached[0]) / total if total > 0 else 0.0

    def describe(self) -> dict[str, float | int]:
        """What the router has learned, for ``GET /kvmesh/router``."""
        return {
            "continued_share": round(self.continued_share(), 4),
            "turns_to_come": round(self.turns_to_come(), 3),
            "turns_to_hold": round(self.turns_to_hold(), 3),
            "deepest_turn": len(self._reached),
            "blocks_per_turn": round(self.growth_blocks, 2),
            "seconds_between_turns": round(self.cycle_s, 4),
            "history_found": round(self.history_found, 4),
            "live": len(self._tips),
        }

    def expiry_s(self) -> float:
        return EXPIRE_CYCLES * self.cycle_s if self.cycle_s > 0 else EXPIRE_FIRST_S

    # ------------------------------------------------------------------ lifecycle
    def lookup(self, prompt: PromptBlocks, local_hashes: Sequence[int], now: float) -> Turn:
        """Where a request with this prompt would stand: the tip it continues, its turn number."""
        self.expire(now)
        key = _prompt_key(prompt, local_hashes)
        previous = self._continued(prompt, local_hashes)
        if previous is not None:
            return Turn(previous, self._tips[previous].number + 1, key=key)
        twins = self._by_prompt.get(key)
        if twins:
            return Turn(None, self._tips[next(iter(twins))].number, sibling=True, key=key)
        return Turn(None, 1, key=key)

    def routed(
        self,
        request_id: str,
        worker: WorkerKey,
        prompt: PromptBlocks,
        local_hashes: Sequence[int],
        now: float,
        turn: Turn | None = None,
    ) -> str | None:
        """A request went to ``worker``: it becomes a tip, replacing the one it continues (whose
        id is returned). ``turn``: its :meth:`lookup` at ``now``, when the caller made one."""
        # the same request routed again: not an earlier turn of itself, nor a turn more. Out of
        # the index before the lookup, or the lookup takes it for the turn it continues (routed
        # on its earlier turn's blocks, then amended with all of its own). Nor is a tip routed
        # after its first routing (a twin sent on the same blocks) the turn it continues.
        again = self._unindex(request_id) if request_id in self._tips else None
        if turn is None:
            turn = self.lookup(prompt, local_hashes, now)
        previous = turn.previous
        if (
            again is not None
            and previous is not None
            and (previous == request_id or self._tips[previous].at >= again.at)
        ):
            previous = None
        number = turn.number if again is None else again.number
        counted = again.counted if again is not None else 0.0 if turn.sibling else 1.0
        if again is None and not turn.sibling:
            deepest = len(self._reached)
            self._count(number)
            if len(self._reached) > deepest:
                self._deepest_at = now
                self._lapsed = False
        replaced = None
        if previous is not None:
            replaced = self._unindex(previous)
            growth = prompt.n_blocks - replaced.n_blocks
            gap = max(now - replaced.at, 0.0)
            if self.cycle_s > 0:
                self.growth_blocks += ALPHA * (growth - self.growth_blocks)
                self.cycle_s += ALPHA * (gap - self.cycle_s)
            else:
                self.growth_blocks, self.cycle_s = float(growth), gap
        if again is not None:
            if replaced is None:
                replaced = again
            else:
                self._release(again, 0)
        anchor, trailing = turn.key
        tip = _Tip(worker, prompt.ids, prompt.n_anchors, trailing, now, number, counted, prompt.chunk)
        self._tips[request_id] = tip
        if counted:
            self._wait(number, counted)
        numbers = self._numbers.setdefault(worker, {})
        numbers[number] = numbers.get(number, 0) + 1
        self._by_prompt.setdefault(turn.key, {})[request_id] = None
        tails = self._tails.get(anchor)
        if tails is None:
            tails = self._tails[anchor] = {}
            self._depths[tip.anchors] = self._depths.get(tip.anchors, 0) + 1
        tails[len(tip.trailing)] = tails.get(len(tip.trailing), 0) + 1
        # A turn that stays on its worker moves only what changed: the history's whole chunks
        # are held by both (a conversation's every turn would otherwise walk its whole history)
        shared = _shared_anchors(replaced, tip) if replaced is not None and replaced.worker == worker else 0
        self._hold(tip, shared)
        if replaced is not None:
            self._release(replaced, shared)
        while len(self._tips) > MAX_TIPS:
            self._drop(next(iter(self._tips)))
        return previous

    def expire(self, now: float) -> int:
        """End the conversations whose next turn is overdue; returns how many. (And let the young
        fleet's forecast lapse, :data:`LAPSE_CYCLES`.)"""
        if not self._lapsed and self.cycle_s > 0 and now - self._deepest_at > LAPSE_CYCLES * self.cycle_s:
            self._lapsed = True
            self._forget_future()
        horizon = now - self.expiry_s()
        gone = 0
        while self._tips:
            rid, tip = next(iter(self._tips.items()))
            if tip.at > horizon:
                break
            self._drop(rid)
            gone += 1
        return gone

    def remove_worker(self, worker: WorkerKey) -> None:
        for rid in [rid for rid, tip in self._tips.items() if tip.worker == worker]:
            self._drop(rid)
        self._refs.pop(worker, None)
        self._live.pop(worker, None)
        self._numbers.pop(worker, None)

    # ------------------------------------------------------------------ internals
    def _continued(self, prompt: PromptBlocks, local_hashes: Sequence[int]) -> str | None:
        """A tip whose full blocks this prompt starts with, adding more (the longest); None if
        none. The prompt's whole chunks that tips end after are found with one probe per depth
        that tips end at (``_depths``) or one per chunk of the prompt, whichever is fewer (a
        2,048-block prompt has 128 chunks; tips of a few lengths end at a few depths); at each,
        one probe per tip length present there (never a scan over the tips)."""
        tails = self._tails
        if not tails:
            return None
        ids = prompt.ids
        n_anchors = prompt.n_anchors
        depths = self._depths
        if len(depths) <= n_anchors:  # a long prompt: one probe per depth tips end at
            levels = [d for d in depths if d <= n_anchors and (d == 0 or ids[d - 1] in tails)]
        else:  # a short one among tips of many lengths: one probe per chunk of it, in C
            anchors = ids if n_anchors == len(ids) else ids[:n_anchors]
            levels = [ids.index(a, 0, n_anchors) + 1 for a in tails.keys() & anchors]
            if 0 in tails:
                levels.append(0)
        n = prompt.n_blocks
        for k in sorted(levels, reverse=True):  # longest prefix first
            anchor = ids[k - 1] if k else 0
            start = k * prompt.chunk
            for length in sorted(tails[anchor], reverse=True):
                if start + length >= n:
                    continue  # as long as this prompt or longer: a sibling, not an earlier turn
                same = self._by_prompt.get((anchor, tuple(local_hashes[start : start + length])))
                if same:
                    return next(iter(same))
        return None

    def _count(self, number: int) -> None:
        """One more conversation reached turn ``number``."""
        reached = self._reached
        n = min(number, MAX_TURN)
        if n > len(reached):
            reached.extend([0.0] * (n - len(reached)))
            self._waiting.extend([0.0] * (n - len(self._waiting)))
        reached[n - 1] += 1.0
        if reached[0] >= HALVE_AT:
            self._reached = [r / 2.0 for r in reached]
            self._waiting = [w / 2.0 for w in self._waiting]
            for tip in self._tips.values():  # (once per ~1,000 conversations)
                tip.counted /= 2.0
        self._forget_future()

    def _forget_future(self) -> None:
        """Drop the tables built from the counts, after the counts change."""
        self._to_come = self._to_hold = self._go_on = self._go_on_held = None

    def _wait(self, number: int, weight: float) -> None:
        """``weight`` more (or less) of turn ``number``'s count waits for its next turn."""
        n = min(number, MAX_TURN) - 1
        waiting = self._waiting
        if n < len(waiting):
            waiting[n] = max(waiting[n] + weight, 0.0)
            self._forget_future()

    def _hold(self, tip: _Tip, start: int) -> None:
        """Count ``tip``'s identities from ``start`` on as live on its worker."""
        refs = self._refs.setdefault(tip.worker, Counter())
        added = hold_prefix(refs, tip.ids, tip.anchors, tip.chunk, start)
        self._live[tip.worker] = self._live.get(tip.worker, 0) + added

    def _release(self, tip: _Tip, start: int) -> None:
        refs = self._refs.get(tip.worker)
        if refs is not None:  # else its worker is gone
            self._live[tip.worker] -= release_prefix(refs, tip.ids, tip.anchors, tip.chunk, start)

    def _drop(self, request_id: str) -> None:
        self._release(self._unindex(request_id), 0)

    def _unindex(self, request_id: str) -> _Tip:
        tip = self._tips.pop(request_id)
        if tip.counted:  # its fate is known now: continued, or over
            self._wait(tip.number, -tip.counted)
        numbers = self._numbers.get(tip.worker)
        if numbers is not None:  # else its worker is gone
            if numbers[tip.number] == 1:
                del numbers[tip.number]
            else:
                numbers[tip.number] -= 1
        anchor = _anchor(tip)
        key = (anchor, tip.trailing)
        same = self._by_prompt[key]
        same.pop(request_id, None)
        if not same:
            del self._by_prompt[key]
        tails = self._tails[anchor]
        length = len(tip.trailing)
        if tails[length] == 1:
            del tails[length]
            if not tails:
                del self._tails[anchor]
                depths = self._depths
                if depths[tip.anchors] == 1:
                    del depths[tip.anchors]
                else:
                    depths[tip.anchors] -= 1
        else:
            tails[length] -= 1
        return tip


def _shared_anchors(old: _Tip, new: _Tip) -> int:
    """Whole chunks two prompts start with (chunk identities name the whole prefix up to them)."""
    k = min(old.anchors, new.anchors)
    while k and old.ids[k - 1] != new.ids[k - 1]:
        k -= 1
    return k


def _prompt_key(prompt: PromptBlocks, local_hashes: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """How tips are indexed: the identity of the prompt's last whole chunk (0 when it is shorter
    than a chunk) and the local hashes of the full blocks after it."""
    anchor = prompt.ids[prompt.n_anchors - 1] if prompt.n_anchors else 0
    return anchor, tuple(local_hashes[prompt.n_anchors * prompt.chunk : prompt.n_blocks])


def _anchor(tip: _Tip) -> int:
    return tip.ids[tip.anchors - 1] if tip.anchors else 0
