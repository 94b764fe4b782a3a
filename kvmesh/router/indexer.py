"""Prefix index: which worker holds the longest cached prefix of a prompt.

Data structure (chosen for pure-Python speed; a node-per-block walk costs ~50 ns x depth):

* **Router keys.** Every cached block is a node keyed by a 64-bit *prefix key* that identifies the
  whole prefix ending at it. Prefixes are cut into chunks of ``CHUNK`` blocks; the key of the
  prefix of depth ``d`` is ``xxh3_64(le64 bytes of local[k*CHUNK:d], seed=A_k)`` where
  ``k = (d-1) // CHUNK`` and the *anchor* ``A_k`` is the key of depth ``k*CHUNK`` (``A_0 = 0``).
  A node stores its chunk seed and the bytes of its in-chunk prefix, so a child's key costs one
  xxh3 call; a query computes any depth's key with one ``struct.pack`` per chunk plus one xxh3.
* **Holders as bits.** Each (worker, dp_rank) owns a *slot*; a node keeps two ints: ``stored``
  (bit ``3*slot + tier``: the worker holds this block in that tier) and ``reach`` (bit
  ``3*slot + level``: the worker holds every block from the root down to here at a tier <= level).
  ``reach`` is therefore prefix-closed along every chain, which makes a query a gallop over chunk
  anchors plus a bisection inside the last chunk - all workers at once, one dict lookup per probe.
  ``reach`` is exact: when a block is removed or re-stored, the change is pushed down to the
  descendants the worker holds, so a query equals a brute-force block-by-block walk.
* **Two key spaces.** Engines name blocks with opaque hashes. Per slot and tier a dict maps engine
  hash -> node, so removals apply; two workers caching the same content under different engine
  hashes share one node and are both indexed.

Levels: 0 = device, 1 = device or host, 2 = any tier (disk and external storage).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

from xxhash import xxh3_64_intdigest

from kvmesh._types import EngineHash, Tier, WorkerKey
from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvmesh.hashing import block_hashes

CHUNK = 16
_PACK = [struct.Struct(f"<{i}Q").pack for i in range(CHUNK + 1)]
_ONE = _PACK[1]
_LEVEL_OF_TIER = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2, Tier.EXTERNAL: 2}
# Levels a block is present at, from its stored tier bits (t0 device, t1 host, t2 disk).
_LEVELS = [(1 if p & 1 else 0) | (2 if p & 3 else 0) | (4 if p else 0) for p in range(8)]
_U64 = (1 << 64) - 1

STATUS_OK = "ok"
STATUS_PARENT_NOT_FOUND = "parent_not_found"
STATUS_BLOCK_NOT_FOUND = "block_not_found"
STATUS_INVALID = "invalid"


class _Node:
    __slots__ = ("children", "depth", "key", "parent", "reach", "seed", "stored", "tail")

    def __init__(self, key: int, parent: _Node | None, depth: int, seed: int, tail: bytes) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.seed = seed
        self.tail = tail
        self.stored = 0
        self.reach = 0
        self.children: list[_Node] | None = None


@dataclass(frozen=True, slots=True)
class TierDepths:
    """Consecutive prefix depths per level: device, device-or-host, any tier."""

    device: int
    host: int
    disk: int


class _ChainIndex:
    """Nodes, slots and the reach bits; the variants add how entries come and go."""

    def __init__(self) -> None:
        self._root = _Node(0, None, 0, 0, b"")
        self._root.reach = -1  # every slot reaches the empty prefix at every level
        self._nodes: dict[int, _Node] = {}
        self._slot_of: dict[WorkerKey, int] = {}
        self._worker_of: list[WorkerKey | None] = []
        self._free: list[int] = []
        self._counts: list[int] = []
        self._dups: dict[tuple[int, int, _Node], int] = {}
        self._level_bits = [0, 0, 0]  # bits of registered slots per level
        self._all_bits = 0

    # ------------------------------------------------------------------ slots
    def _slot(self, worker: WorkerKey) -> int:
        slot = self._slot_of.get(worker)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
            self._worker_of[slot] = worker
            self._counts[slot] = 0
        else:
            slot = len(self._worker_of)
            self._worker_of.append(worker)
            self._counts.append(0)
            self._on_new_slot()
        self._slot_of[worker] = slot
        for level in range(3):
            self._level_bits[level] |= 1 << (3 * slot + level)
        self._all_bits |= 7 << (3 * slot)
        return slot

    def _on_new_slot(self) -> None:
        """Hook for variants that keep per-slot containers."""

    def _release_slot(self, slot: int) -> None:
        worker = self._worker_of[slot]
        assert worker is not None
        del self._slot_of[worker]
        self._worker_of[slot] = None
        self._free.append(slot)
        for level in range(3):
            self._level_bits[level] &= ~(1 << (3 * slot + level))
        self._all_bits &= ~(7 << (3 * slot))

    @property
    def workers(self) -> list[WorkerKey]:
        return list(self._slot_of)

    def block_count(self, worker: WorkerKey) -> int:
        """Entries indexed for a worker (tree size, for tie-breaks and snapshots)."""
        slot = self._slot_of.get(worker)
        return 0 if slot is None else self._counts[slot]

    def block_counts(self) -> dict[WorkerKey, int]:
        return {w: self._counts[s] for w, s in self._slot_of.items()}

    @property
    def total_entries(self) -> int:
        return sum(self._counts)

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    # ------------------------------------------------------------------ nodes
    def _child(self, parent: _Node, local_hash: int) -> _Node:
        depth = parent.depth + 1
        if parent.depth % CHUNK == 0:
            seed = parent.key
            tail = _ONE(local_hash & _U64)
        else:
            seed = parent.seed
            tail = parent.tail + _ONE(local_hash & _U64)
        key = xxh3_64_intdigest(tail, seed)
        node = self._nodes.get(key)
        if node is None:
            node = _Node(key, parent, depth, seed, tail)
            self._nodes[key] = node
            if parent.children is None:
                parent.children = [node]
            else:
                parent.children.append(node)
        return node

    def _path(self, node: _Node) -> list[int]:
        """Local hashes from the root down to ``node`` (for dumps)."""
        out: list[int] = []
        while node.parent is not None:
            out.append(struct.unpack_from("<Q", node.tail, len(node.tail) - 8)[0])
            node = node.parent
        out.reverse()
        return out

    def _add(self, slot: int, tier: int, node: _Node) -> None:
        bit = 1 << (3 * slot + tier)
        if node.stored & bit:
            k = (slot, tier, node)
            self._dups[k] = self._dups.get(k, 0) + 1
            return
        node.stored |= bit
        self._counts[slot] += 1
        self._refresh(node, slot)

    def _remove(self, slot: int, tier: int, node: _Node) -> None:
        k = (slot, tier, node)
        extra = self._dups.get(k)
        if extra:
            if extra == 1:
                del self._dups[k]
            else:
                self._dups[k] = extra - 1
            return
        node.stored &= ~(1 << (3 * slot + tier))
        self._counts[slot] -= 1
        self._refresh(node, slot)
        self._collect(node)

    def _refresh(self, node: _Node, slot: int) -> None:
        """Recompute ``slot``'s reach bits at ``node`` and push changes down to its descendants."""
        shift = 3 * slot
        clear = ~(7 << shift)
        stack = [node]
        while stack:
            n = stack.pop()
            parent = n.parent
            assert parent is not None
            new = _LEVELS[(n.stored >> shift) & 7] & (parent.reach >> shift) & 7
            if new == (n.reach >> shift) & 7:
                continue
            n.reach = (n.reach & clear) | (new << shift)
            if n.children:
                for child in n.children:
                    if (child.stored >> shift) & 7:
                        stack.append(child)

    def _collect(self, node: _Node) -> None:
        """Free nodes nobody holds and nothing hangs under, walking up."""
        while node.parent is not None and not node.stored and not node.children:
            parent = node.parent
            del self._nodes[node.key]
            assert parent.children is not None
            parent.children.remove(node)
            if not parent.children:
                parent.children = None
            node = parent

    # ------------------------------------------------------------------ queries
    def _match_bits(self, hashes: Sequence[int], alive: int) -> dict[int, int]:
        """Depth of every bit in ``alive``: the deepest query prefix whose node has that reach bit."""
        depths: dict[int, int] = {}
        n = len(hashes)
        if not alive or n == 0:
            return depths
        nodes_get = self._nodes.get
        seed = 0
        start = 0
        while True:
            end = start + CHUNK if start + CHUNK < n else n
            chunk = _PACK[end - start](*hashes[start:end])
            node = nodes_get(xxh3_64_intdigest(chunk, seed))
            reached = (node.reach & alive) if node is not None else 0
            dropped = alive & ~reached
            if dropped:
                self._bisect(chunk, seed, start, end, dropped, depths)
            alive = reached
            if not alive:
                return depths
            if end == n:
                _assign(alive, n, depths)
                return depths
            assert node is not None
            seed = node.key
            start = end

    def _bisect(self, chunk: bytes, seed: int, lo: int, hi: int, bits: int, depths: dict[int, int]) -> None:
        # invariant for each entry: every bit is set at depth lo and clear at depth hi
        nodes_get = self._nodes.get
        stack = [(lo, hi, bits)]
        while stack:
            lo, hi, bits = stack.pop()
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                off = (mid - 1) // CHUNK * CHUNK
                node = nodes_get(xxh3_64_intdigest(chunk[: 8 * (mid - off)], seed))
                up = (node.reach & bits) if node is not None else 0
                if up and up != bits:
                    stack.append((mid, hi, up))
                    bits &= ~up
                    hi = mid
                elif up:
                    lo = mid
                else:
                    hi = mid
            _assign(bits, lo, depths)

    def find_matches(self, local_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Each worker's longest consecutive device-tier prefix of the query (workers with >0 only)."""
        bits = self._match_bits(local_hashes, self._level_bits[0])
        out: dict[WorkerKey, int] = {}
        worker_of = self._worker_of
        for bit, depth in bits.items():
            if depth:
                out[worker_of[bit // 3]] = depth  # type: ignore[index]
        return out

    def find_matches_tiered(self, local_hashes: Sequence[int]) -> dict[WorkerKey, TierDepths]:
        """Device, device-or-host and any-tier prefix depths per worker (any level > 0 only)."""
        bits = self._match_bits(local_hashes, self._all_bits)
        per_slot: dict[int, list[int]] = {}
        for bit, depth in bits.items():
            if depth:
                per_slot.setdefault(bit // 3, [0, 0, 0])[bit % 3] = depth
        worker_of = self._worker_of
        return {worker_of[s]: TierDepths(*d) for s, d in per_slot.items()}  # type: ignore[misc]

    def _drop_slot_entries(self, slot: int, entries: Iterable[tuple[int, _Node]]) -> None:
        for tier, node in entries:
            self._remove(slot, tier, node)


def _assign(bits: int, depth: int, depths: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        depths[low.bit_length() - 1] = depth
        bits ^= low


# ---------------------------------------------------------------------- event-driven index
@dataclass(frozen=True, slots=True)
class DumpedBlock:
    """One (worker, tier, engine hash) entry, enough to rebuild the index exactly."""

    worker: WorkerKey
    engine_hash: EngineHash
    tier: Tier
    path: tuple[int, ...]
    """Local hashes from the root to this block (the block's own hash last)."""


_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


class PrefixIndex(_ChainIndex):
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
        self._engine: list[
            tuple[dict[EngineHash, _Node], dict[EngineHash, _Node], dict[EngineHash, _Node]]
        ] = []
        self.applied: dict[tuple[str, str], int] = {}
        self.pruned_blocks = 0
        self._total = 0

    def _on_new_slot(self) -> None:
        self._engine.append(({}, {}, {}))

    def _count(self, kind: str, status: str) -> None:
        k = (kind, status)
        self.applied[k] = self.applied.get(k, 0) + 1

    # ------------------------------------------------------------------ events
    def apply(self, worker: WorkerKey, events: Iterable[Event]) -> None:
        """Apply a batch's events for one (worker_id, dp_rank)."""
        slot = self._slot(worker)
        for event in events:
            if isinstance(event, BlockStored):
                self._count("stored", self._stored(slot, event))
            elif isinstance(event, BlockRemoved):
                self._count("removed", self._removed(slot, event))
            elif isinstance(event, AllBlocksCleared):
                self._clear_slot(slot)
                self._count("cleared", STATUS_OK)
        if self._total > self.max_entries:
            self._prune()

    def _stored(self, slot: int, event: BlockStored) -> str:
        maps = self._engine[slot]
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            parent = self._root
        else:
            found = maps[0].get(parent_hash) or maps[1].get(parent_hash) or maps[2].get(parent_hash)
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
        if len(locals_) < len(engine):
            return STATUS_INVALID
        self._store_chain(slot, _LEVEL_OF_TIER[event.tier], parent, engine, locals_)
        return STATUS_OK

    def _store_chain(
        self, slot: int, tier: int, parent: _Node, engine: Sequence[EngineHash], locals_: Sequence[int]
    ) -> None:
        # Hot path (every engine step): keys of the whole run come from one packed buffer, and a
        # freshly created node gets its bits directly (it has no descendants to push reach to).
        emap = self._engine[slot][tier]
        nodes = self._nodes
        shift = 3 * slot
        tier_bit = 1 << (shift + tier)
        level_bits = _LEVELS[1 << tier]
        n = len(engine)
        depth = parent.depth
        if depth % CHUNK:
            seed = parent.seed
            head = parent.tail
        else:
            seed = parent.key
            head = b""
        buf = head + _packer(n)(*locals_[:n])
        base = 0
        end = len(head)
        added = 0
        for eh in engine:
            if depth and depth % CHUNK == 0:
                seed = parent.key
                base = end
            depth += 1
            end += 8
            tail = buf[base:end]
            key = xxh3_64_intdigest(tail, seed)
            node = nodes.get(key)
            if node is None:
                node = _Node(key, parent, depth, seed, tail)
                nodes[key] = node
                if parent.children is None:
                    parent.children = [node]
                else:
                    parent.children.append(node)
                old = emap.get(eh)
                emap[eh] = node
                node.stored = tier_bit
                node.reach = (level_bits & (parent.reach >> shift) & 7) << shift
                self._counts[slot] += 1
                added += 1
                if old is not None:
                    self._remove(slot, tier, old)
                    added -= 1
            else:
                old = emap.get(eh)
                if old is not node:
                    emap[eh] = node
                    self._add(slot, tier, node)  # before the removal, so ``node`` cannot be collected
                    added += 1
                    if old is not None:
                        self._remove(slot, tier, old)
                        added -= 1
            parent = node
        self._total += added

    def _removed(self, slot: int, event: BlockRemoved) -> str:
        tier = _LEVEL_OF_TIER[event.tier]
        emap = self._engine[slot][tier]
        status = STATUS_OK
        for eh in event.block_hashes:
            node = emap.pop(eh, None)
            if node is None:
                status = STATUS_BLOCK_NOT_FOUND
                continue
            self._remove(slot, tier, node)
            self._total -= 1
        return status

    def _clear_slot(self, slot: int) -> None:
        for tier, emap in enumerate(self._engine[slot]):
            nodes = list(emap.values())
            emap.clear()
            self._total -= len(nodes)
            # children first, so the reach push-down stays local
            nodes.sort(key=_depth, reverse=True)
            for node in nodes:
                self._remove(slot, tier, node)

    def _prune(self) -> None:
        target = int(self.max_entries * self.prune_target_ratio)
        while self._total > target:
            slot = max(range(len(self._engine)), key=lambda s: sum(map(len, self._engine[s])))
            for tier, emap in enumerate(self._engine[slot]):
                if emap:
                    eh = next(iter(emap))
                    node = emap.pop(eh)
                    self._remove(slot, tier, node)
                    self._total -= 1
                    self.pruned_blocks += 1
                    break

    # ------------------------------------------------------------------ workers
    def clear_worker(self, worker: WorkerKey) -> None:
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._clear_slot(slot)

    def remove_worker(self, worker: WorkerKey) -> None:
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._clear_slot(slot)
            self._release_slot(slot)

    def clear(self) -> None:
        for worker in list(self._slot_of):
            self.remove_worker(worker)

    # ------------------------------------------------------------------ dump / load
    def dump(self) -> list[DumpedBlock]:
        """Every entry, parents before children; ``load`` of it rebuilds an identical index."""
        out: list[tuple[int, DumpedBlock]] = []
        paths: dict[_Node, tuple[int, ...]] = {}
        for worker, slot in self._slot_of.items():
            for tier, emap in enumerate(self._engine[slot]):
                for eh, node in emap.items():
                    path = paths.get(node)
                    if path is None:
                        path = paths[node] = tuple(self._path(node))
                    out.append((node.depth, DumpedBlock(worker, eh, _TIERS[tier], path)))
        out.sort(key=lambda x: x[0])
        return [b for _, b in out]

    def load(self, blocks: Iterable[DumpedBlock]) -> None:
        for b in blocks:
            slot = self._slot(b.worker)
            tier = _LEVEL_OF_TIER[b.tier]
            parent = self._root
            for lh in b.path[:-1]:
                parent = self._child(parent, lh)
            self._store_chain(slot, tier, parent, (b.engine_hash,), (b.path[-1],))
            # _store_chain created nodes along the path; unused ones are collected with the entry

    def load_stored(self, worker: WorkerKey, events: Iterable[BlockStored]) -> None:
        """Cold start from a worker's ``kv_state``: replace its state with these stored events."""
        self.clear_worker(worker)
        self.apply(worker, events)


@lru_cache(maxsize=512)
def _packer(n: int) -> Callable[..., bytes]:
    return struct.Struct(f"<{n}Q").pack


def _depth(node: _Node) -> int:
    return node.depth


# ---------------------------------------------------------------------- approximate index
class ApproxIndex(_ChainIndex):
    """What the router itself routed, each block living ``ttl`` seconds after its last routing.

    Used instead of the event index with ``--no-router-kv-events``, and beside it (short TTL) for
    predict-on-route. Size is capped at ``max_blocks`` (worker, block) entries; beyond that the
    earliest-expiring entries go first until ``prune_target_ratio * max_blocks`` remain.
    """

    def __init__(
        self, *, ttl: float = 120.0, max_blocks: int = 2**20, prune_target_ratio: float = 0.8
    ) -> None:
        super().__init__()
        self.ttl = ttl
        self.max_blocks = max_blocks
        self.prune_target_ratio = prune_target_ratio
        # (slot, node) -> expiry; insertion order is expiry order because ttl is fixed and
        # ``now`` never goes back (a refresh moves the entry to the end).
        self._expiry: dict[tuple[int, _Node], float] = {}
        self.pruned_blocks = 0
        self.expired_blocks = 0

    def record(self, worker: WorkerKey, local_hashes: Sequence[int], now: float) -> None:
        """Remember that ``worker`` now holds this prefix (refreshing the TTL of known blocks)."""
        slot = self._slot(worker)
        expiry = self._expiry
        until = now + self.ttl
        parent = self._root
        bit = 1 << (3 * slot)
        for lh in local_hashes:
            node = self._child(parent, lh)
            k = (slot, node)
            if node.stored & bit:
                del expiry[k]
            else:
                self._add(slot, 0, node)
            expiry[k] = until
            parent = node
        if len(expiry) > self.max_blocks:
            self._prune(int(self.max_blocks * self.prune_target_ratio))

    def expire(self, now: float) -> int:
        """Drop entries whose TTL has passed; returns how many."""
        expiry = self._expiry
        gone = 0
        while expiry:
            k = next(iter(expiry))
            if expiry[k] > now:
                break
            del expiry[k]
            self._remove(k[0], 0, k[1])
            gone += 1
        self.expired_blocks += gone
        return gone

    def _prune(self, target: int) -> None:
        expiry = self._expiry
        while len(expiry) > target:
            k = next(iter(expiry))
            del expiry[k]
            self._remove(k[0], 0, k[1])
            self.pruned_blocks += 1

    def remove_worker(self, worker: WorkerKey) -> None:
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        mine = [k for k in self._expiry if k[0] == slot]
        mine.sort(key=lambda k: k[1].depth, reverse=True)
        for k in mine:
            del self._expiry[k]
            self._remove(slot, 0, k[1])
        self._release_slot(slot)

    def clear(self) -> None:
        for worker in list(self._slot_of):
            self.remove_worker(worker)

    @property
    def size(self) -> int:
        return len(self._expiry)


AnyIndex = Union[PrefixIndex, ApproxIndex]
