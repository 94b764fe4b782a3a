"""Event-driven index: the chain trie fed by workers' KV events (stored, removed, cleared).

Two key spaces. Engines name blocks with opaque hashes, the trie with the router's own local hashes
(computed here from the event's tokens). Per slot and tier a dict maps engine hash -> handle, so
removals apply; two workers caching the same content under different engine hashes share one block
and are both indexed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice, repeat

from kvmesh._types import EngineHash, Tier, WorkerKey, tier_of_medium
from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvmesh.hashing import block_hashes
from kvmesh.router.core.chain_trie import ROOT, SHIFT, ChainIndex
from kvmesh.router.core.index import IndexCounters

_LEVEL_OF_TIER = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2, Tier.EXTERNAL: 2}
_LEVEL_OF_MEDIUM: dict[str | None, int] = {None: 0, "GPU": 0, "CPU": 1, "CPU_PINNED": 1, "DISK": 2}

STATUS_OK = "ok"
STATUS_PARENT_NOT_FOUND = "parent_not_found"
STATUS_BLOCK_NOT_FOUND = "block_not_found"
STATUS_INVALID = "invalid"


@dataclass(frozen=True, slots=True)
class DumpedBlock:
    """One (worker, tier, engine hash) entry, enough to rebuild the index exactly."""

    worker: WorkerKey
    engine_hash: EngineHash
    tier: Tier
    path: tuple[int, ...]
    """Local hashes from the root to this block (the block's own hash last)."""


_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


class PrefixIndex(ChainIndex):
    """The index driven by workers' KV events (BlockStored / BlockRemoved / AllBlocksCleared).

    ``max_entries`` bounds memory in (block, worker, tier) entries: beyond it the oldest entries
    of the largest workers are dropped (down to ``prune_target_ratio``) and counted in
    ``pruned_blocks``.
    """

    def __init__(
        self, *, block_size: int | None = None, max_entries: int = 2**23, prune_target_ratio: float = 0.8
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.max_entries = max_entries
        self.prune_target_ratio = prune_target_ratio
        self._engine: list[tuple[dict[EngineHash, int], dict[EngineHash, int], dict[EngineHash, int]]] = []
        # Per slot: (tier, engine hash) -> extra copies. vLLM caches a second physical block under a
        # hash it already caches (two requests computing one prefix in a step, or the recomputed
        # last block of a fully cached prompt), reports each as stored and each eviction as removed:
        # the block stays cached until its last copy goes.
        self._copies: list[dict[tuple[int, EngineHash], int]] = []
        self.applied: dict[tuple[str, str], int] = {}
        self.pruned_blocks = 0
        self._total = 0

    def _on_new_slot(self) -> None:
        self._engine.append(({}, {}, {}))
        self._copies.append({})

    # ------------------------------------------------------------------ events
    def apply(self, worker: WorkerKey, events: Iterable[Event]) -> None:
        """Apply a batch's events for one (worker_id, dp_rank)."""
        slot = self._slot(worker)
        applied = self.applied
        for event in events:
            if isinstance(event, BlockStored):
                outcome = ("stored", self._stored(slot, event))
            elif isinstance(event, BlockRemoved):
                outcome = ("removed", self._removed(slot, event))
            elif isinstance(event, AllBlocksCleared):
                self._clear_slot(slot)
                outcome = ("cleared", STATUS_OK)
            else:
                continue
            applied[outcome] = applied.get(outcome, 0) + 1
        if self._total > self.max_entries:
            self._prune()

    def _stored(self, slot: int, event: BlockStored) -> str:
        maps = self._engine[slot]
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            parent = ROOT
        else:
            found = maps[0].get(parent_hash)
            if found is None:
                found = maps[1].get(parent_hash)
                if found is None:
                    found = maps[2].get(parent_hash)
                    if found is None:
                        return STATUS_PARENT_NOT_FOUND
            parent = found
        block_size = event.block_size or self.block_size
        if not block_size or block_size <= 0:
            return STATUS_INVALID
        tokens = event.token_ids
        if tokens and not isinstance(tokens[0], int):
            # SGLang EAGLE publishes (token, draft token) pairs; the first is the sequence token.
            tokens = [t[0] if isinstance(t, (tuple, list)) else t for t in tokens]  # type: ignore[misc]
        try:
            locals_ = block_hashes(tokens, block_size, event.adapter)  # type: ignore[arg-type]
        except (OverflowError, TypeError, ValueError):
            return STATUS_INVALID
        engine = event.block_hashes
        if len(locals_) < len(engine) or not engine:
            return STATUS_INVALID if engine else STATUS_OK
        keyed = event.keyed_from
        if keyed is not None:
            # Salted or multimodal from block ``keyed`` on: only the plain prefix before it is
            # what a token-only hash names (later blocks and their children stay unindexed).
            if keyed == 0:
                return STATUS_OK
            engine = engine[:keyed]
            locals_ = locals_[:keyed]
        medium = event.medium or None
        tier = _LEVEL_OF_MEDIUM.get(medium)  # type: ignore[arg-type]
        if tier is None:
            tier = _LEVEL_OF_TIER[tier_of_medium(medium)]  # type: ignore[arg-type]
        self._store_run(
            slot, tier, parent, engine, locals_ if len(locals_) == len(engine) else locals_[: len(engine)]
        )
        return STATUS_OK

    def _store_run(
        self, slot: int, tier: int, parent: int, engine: Sequence[EngineHash], locals_: Sequence[int]
    ) -> None:
        handles = self._insert_run(parent, locals_, slot, tier)
        emap = self._engine[slot][tier]
        # the common case in one probe per hash: every hash of the run is new to this map
        before = len(emap)
        deque(map(emap.setdefault, engine, handles), maxlen=0)
        added = len(emap) - before
        if added == len(engine):
            self._total += added
            return
        # a hash was known already, or repeats inside the run: take back what setdefault just
        # appended (the newest keys) and apply the run one hash at a time
        for eh in list(islice(reversed(emap), added)):
            del emap[eh]
        copies = self._copies[slot]
        for eh, h in zip(engine, handles, strict=True):
            old = emap.get(eh)
            emap[eh] = h
            if old is None:
                self._total += 1
                continue
            if old == h:  # another copy of the same block: one more removal before it goes
                copies[tier, eh] = copies.get((tier, eh), 0) + 1
            else:  # the hash now names another block
                copies.pop((tier, eh), None)
            # undo the extra bit count the store just took (or drop the block the hash named)
            self._remove(slot, tier, old)

    def _removed(self, slot: int, event: BlockRemoved) -> str:
        tier = _LEVEL_OF_TIER[event.tier]
        emap = self._engine[slot][tier]
        copies = self._copies[slot]
        status = STATUS_OK
        for eh in event.block_hashes:
            if copies:
                extra = copies.get((tier, eh))
                if extra:  # one copy of several evicted: the block stays cached
                    if extra == 1:
                        del copies[tier, eh]
                    else:
                        copies[tier, eh] = extra - 1
                    continue
            h = emap.pop(eh, None)
            if h is None:
                status = STATUS_BLOCK_NOT_FOUND
                continue
            self._remove(slot, tier, h)
            self._total -= 1
        return status

    def _clear_slot(self, slot: int) -> None:
        self._copies[slot].clear()
        for tier, emap in enumerate(self._engine[slot]):
            handles = list(emap.values())
            emap.clear()
            self._total -= len(handles)
            # children first, so the reach push-down stays local
            handles.sort(key=self._depth_of, reverse=True)
            for h in handles:
                self._remove(slot, tier, h)

    def _prune(self) -> None:
        target = int(self.max_entries * self.prune_target_ratio)
        while self._total > target:
            slot = max(range(len(self._engine)), key=lambda s: sum(map(len, self._engine[s])))
            for tier, emap in enumerate(self._engine[slot]):
                if emap:
                    eh = next(iter(emap))
                    h = emap.pop(eh)
                    self._copies[slot].pop((tier, eh), None)
                    self._remove(slot, tier, h)
                    self._total -= 1
                    self.pruned_blocks += 1
                    break

    # ------------------------------------------------------------------ workers
    def clear_worker(self, worker: WorkerKey) -> None:
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._clear_slot(slot)

    def forget_predicted(self, worker: WorkerKey) -> None:
        """Ignored: this index holds what the events said, and the flush's own event clears it."""

    def remove_worker(self, worker: WorkerKey) -> None:
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._clear_slot(slot)
            self._release_slot(slot)

    def clear(self) -> None:
        for worker in list(self._slot_of):
            self.remove_worker(worker)

    def counters(self) -> IndexCounters:
        return IndexCounters(dict(self.applied), self.pruned_blocks, 0)

    # ------------------------------------------------------------------ routing decisions (KvIndex)
    def record(self, worker: WorkerKey, local_hashes: Sequence[int], now: float) -> None:
        """Ignored: this index holds what the engines report, not what the router sent where."""

    def expire(self, now: float) -> int:
        """Nothing here has a TTL: entries go when the engine evicts them (or the budget prunes)."""
        return 0

    # ------------------------------------------------------------------ dump / load
    def dump(self) -> list[DumpedBlock]:
        """Every entry (an entry with copies once per copy), parents before children; ``load`` of it
        rebuilds an identical index."""
        out: list[tuple[int, DumpedBlock]] = []
        paths: dict[int, tuple[int, ...]] = {}
        for worker, slot in self._slot_of.items():
            copies = self._copies[slot]
            for tier, emap in enumerate(self._engine[slot]):
                for eh, h in emap.items():
                    path = paths.get(h)
                    if path is None:
                        path = paths[h] = tuple(self._path(h))
                    block = DumpedBlock(worker, eh, _TIERS[tier], path)
                    # every copy, so that ``load`` counts them again
                    out.extend(repeat((len(path), block), 1 + copies.get((tier, eh), 0)))
        out.sort(key=lambda x: x[0])
        return [b for _, b in out]

    def load(self, blocks: Iterable[DumpedBlock]) -> None:
        for b in blocks:
            slot = self._slot(b.worker)
            parent = ROOT
            if len(b.path) > 1:
                # the parent prefix may be held by nobody (an orphaned entry): build it bare
                parent = self._insert_run(ROOT, b.path[:-1], None, 0)[-1]
            self._store_run(slot, _LEVEL_OF_TIER[b.tier], parent, (b.engine_hash,), (b.path[-1],))
            if len(b.path) > 1:
                self._collect(self._segs[parent >> SHIFT])

    def load_stored(self, worker: WorkerKey, events: Iterable[BlockStored]) -> None:
        """Cold start from a worker's ``kv_state``: replace its state with these stored events."""
        self.clear_worker(worker)
        self.apply(worker, events)
