"""Chain trie: the prefix structure every index shares, and the query over all workers at once.

Data structure (chosen for pure-Python speed: per stored block the interpreter does no work of its
own, only bulk C operations over the run, and a query touches a few objects per *run*, not per block):

* **A trie of runs.** Blocks form a trie keyed by local hash: a child is one block further down the
  prefix. A *segment* is a chain parent -> b0 -> b1 -> ... -> bn-1 stored as one object: the local
  hashes and the per-block state in three lists. (An ``array('Q')`` of hashes would save ~33 bytes
  per block, but converting every stored run and every query to it cost ~7% of store throughput
  and more of a query.) A run stored under the last block of a segment with no other child extends
  that segment in place, so a conversation that grows turn by turn (or a decode that adds one block
  per step) stays one segment. Children other than the next block of a segment hang off
  ``branches[index][local hash]`` as segment ids; the roots off ``_roots[local hash]``. A block's
  *handle* is ``segment id << 32 | index``.
* **Matching compares runs, not blocks.** A query follows the trie: one dict lookup per segment it
  enters, one list comparison (a C loop) for the blocks inside it, a bisection only where it diverges.
  Storing a run walks the same way, so blocks another worker already holds are shared, and the new
  tail costs a few slices and list repeats whatever its length.
* **Holders as bits.** Each (worker, dp_rank) owns a *slot*; a block keeps two ints: ``stored``
  (bit ``3*slot + tier``: the worker holds this block in that tier) and ``reach`` (bit
  ``3*slot + level``: the worker holds every block from the root down to here at a tier <= level).
  ``reach`` is therefore prefix-closed along every chain, which makes a query all workers at once:
  the bits still alive at the end of a segment, and a bisection over the segment's ``reach`` list for
  the ones that dropped inside it. ``reach`` is exact: when a block is removed or re-stored, the
  change is pushed down to the descendants the worker holds, so a query equals a brute-force
  block-by-block walk.

The variants (``event_index.PrefixIndex``, ``approx_index.ApproxIndex``) decide how entries come and
go; this module only stores runs, keeps the bits exact and answers queries.

Levels: 0 = device, 1 = device or host, 2 = any tier (disk and external storage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import and_, indexOf, ne, or_

from kvmesh._types import WorkerKey

# Levels a block is present at, from its stored tier bits (t0 device, t1 host, t2 disk).
_LEVELS = [(1 if p & 1 else 0) | (2 if p & 3 else 0) | (4 if p else 0) for p in range(8)]

# A segment holds at most 2**32 blocks: more than one event can carry, and extending a segment
# past it starts a new one. Handles stay two-digit ints (32 bytes) up to 2**28 segments.
SHIFT = 32
LOW = (1 << SHIFT) - 1
ROOT = -1
"""Handle of the empty prefix. A block's handle is ``segment id << 32 | index in the segment``."""


class _Seg:
    """A chain of blocks parent -> b0 -> ... -> bn-1 (one or more stored runs laid end to end).

    No per-block Python object is made here (the local hashes are the run's own ints, the state lists
    hold shared ints until a bit changes), so storing a run is a few bulk operations and the cyclic
    GC has a few objects per segment to look at.
    """

    __slots__ = ("branches", "depth0", "id", "live", "locals", "n_branches", "parent", "reach", "stored")

    def __init__(
        self, sid: int, parent: int, depth0: int, locals_: list[int], stored: int, reach: int
    ) -> None:
        self.id = sid
        self.parent = parent
        self.depth0 = depth0  # prefix depth of block 0 (the root's children have depth 1)
        self.locals = locals_
        n = len(locals_)
        self.stored = [stored] * n
        self.reach = [reach] * n
        self.live = n if stored else 0  # blocks somebody holds; the segment dies at 0 without branches
        self.branches: dict[int, dict[int, int]] | None = None  # index -> {first local hash: child sid}
        self.n_branches = 0


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two equally long lists (whole-list compare, then bisection)."""
    if a == b:
        return len(a)
    lo, hi = 0, len(a)  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 8:
        mid = (lo + hi) >> 1
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo + indexOf(map(ne, a[lo:hi], b[lo:hi]), True)


@dataclass(slots=True)  # not frozen: one per worker per lookup, and a frozen one is ~3x slower to build
class TierDepths:
    """Consecutive prefix depths per level: device, device-or-host, any tier. Read, never changed."""

    device: int
    host: int
    disk: int


class ChainIndex:
    """Segments, slots and the reach bits; the variants add how entries come and go."""

    def __init__(self) -> None:
        self._roots: dict[int, int] = {}  # local hash of a first block -> segment id
        self._segs: dict[int, _Seg] = {}
        self._next_seg = 0
        self._n_blocks = 0
        self._slot_of: dict[WorkerKey, int] = {}
        self._worker_of: list[WorkerKey | None] = []
        self._free: list[int] = []
        self._counts: list[int] = []
        self._dups: dict[tuple[int, int, int], int] = {}
        self._level_bits = [0, 0, 0]  # bits of registered slots per level
        self._all_bits = 0
        # Some block was stored off the device (host, disk) at some point. Until then every level's
        # depth is the device's, and a tiered query follows a third of the bits. (Never reset: a
        # flag that stays set only costs that query its shortcut.)
        self._off_device = False

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
        """Blocks indexed for a worker (tree size, for tie-breaks and snapshots)."""
        slot = self._slot_of.get(worker)
        return 0 if slot is None else self._counts[slot]

    def block_counts(self) -> dict[WorkerKey, int]:
        return {w: self._counts[s] for w, s in self._slot_of.items()}

    @property
    def total_entries(self) -> int:
        return sum(self._counts)

    @property
    def node_count(self) -> int:
        """Distinct prefixes in the trie (blocks of live segments)."""
        return self._n_blocks

    @property
    def segment_count(self) -> int:
        return len(self._segs)

    # ------------------------------------------------------------------ structure
    def _insert_run(
        self, parent: int, locals_: Sequence[int], slot: int | None, tier: int, *, dup_ok: bool = True
    ) -> Sequence[int]:
        """Handles of the run ``locals_`` under ``parent``: blocks already in the trie get the slot's
        tier bit via ``_add``; the new tail extends the parent's segment or becomes a new one, its
        bits set in bulk. ``slot=None`` only builds the structure; ``dup_ok=False`` leaves blocks
        that already carry the bit alone."""
        run = list(locals_)  # the index keeps (slices of) it: never the caller's list
        if not run:
            return run
        if tier and slot is not None:
            self._off_device = True
        first = run[0]
        if parent == ROOT:
            if first not in self._roots:
                return self._attach(parent, None, run, slot, tier)
        else:
            seg = self._segs[parent >> SHIFT]
            i = parent & LOW
            known = (i + 1 < len(seg.stored) and seg.locals[i + 1] == first) or (
                seg.branches is not None and first in seg.branches.get(i, ())
            )
            if not known:  # the common case: the whole run is new
                return self._attach(parent, seg, run, slot, tier)
        return self._follow(parent, run, slot, tier, dup_ok)

    def _follow(self, at: int, run: list[int], slot: int | None, tier: int, dup_ok: bool) -> list[int]:
        """``_insert_run`` for a run whose first block is in the trie: walk down it, then attach the rest."""
        n = len(run)
        segs = self._segs
        pos = 0  # blocks of the run found in the trie so far
        handles: list[int] = []
        while pos < n:
            first = run[pos]
            if at == ROOT:
                sid = self._roots.get(first)
                start = 0
            else:
                seg = segs[at >> SHIFT]
                i = at & LOW
                if i + 1 < len(seg.stored) and seg.locals[i + 1] == first:
                    sid, start = seg.id, i + 1
                else:
                    start = 0
                    kids = seg.branches.get(i) if seg.branches is not None else None
                    sid = kids.get(first) if kids is not None else None
            if sid is None:
                handles += self._attach(at, segs[at >> SHIFT] if at != ROOT else None, run[pos:], slot, tier)
                break
            seg = segs[sid]
            avail = min(len(seg.stored) - start, n - pos)
            m = _common(seg.locals[start : start + avail], run[pos : pos + avail])
            base = (sid << SHIFT) | start
            if slot is not None:
                self._add_range(slot, tier, seg, start, start + m, dup_ok)
            handles += range(base, base + m)
            pos += m
            at = base + m - 1
        return handles

    def _attach(self, at: int, seg: _Seg | None, new: list[int], slot: int | None, tier: int) -> range:
        """Handles of the new blocks ``new`` under block ``at`` (in ``seg``; None for the root): they
        extend ``seg`` when ``at`` ends it with no other child, else they become a new segment."""
        k = len(new)
        if slot is None:
            stored = reach = 0
        else:
            shift = 3 * slot
            stored = 1 << (shift + tier)
            above = seg.reach[at & LOW] if seg is not None else -1  # the root reaches every level
            reach = (_LEVELS[1 << tier] & (above >> shift) & 7) << shift
            self._counts[slot] += k
        self._n_blocks += k
        if seg is None:
            depth0 = 1
        else:
            i = at & LOW
            size = len(seg.stored)
            if i + 1 == size and (seg.branches is None or i not in seg.branches) and size + k <= LOW + 1:
                # ``at`` ends its segment and has no other child: grow the segment in place
                seg.locals += new
                seg.stored += [stored] * k
                seg.reach += [reach] * k
                if stored:
                    seg.live += k
                return range(at + 1, at + 1 + k)
            depth0 = seg.depth0 + i + 1
        sid = self._next_seg
        self._next_seg += 1
        self._segs[sid] = _Seg(sid, at, depth0, new, stored, reach)
        if seg is None:
            self._roots[new[0]] = sid
        else:
            if seg.branches is None:
                seg.branches = {}
            seg.branches.setdefault(at & LOW, {})[new[0]] = sid
            seg.n_branches += 1
        base = sid << SHIFT
        return range(base, base + k)

    def _depth_of(self, h: int) -> int:
        """Prefix depth of block ``h`` (the root's children have depth 1)."""
        return self._segs[h >> SHIFT].depth0 + (h & LOW)

    def _reach_of(self, h: int) -> int:
        if h == ROOT:
            return -1  # every slot reaches the empty prefix at every level
        return self._segs[h >> SHIFT].reach[h & LOW]

    def _path(self, h: int) -> list[int]:
        """Local hashes from the root down to block ``h`` (for dumps)."""
        parts: list[list[int]] = []
        while h != ROOT:
            seg = self._segs[h >> SHIFT]
            parts.append(seg.locals[: (h & LOW) + 1])
            h = seg.parent
        out: list[int] = []
        for part in reversed(parts):
            out += part
        return out

    # ------------------------------------------------------------------ entries
    def _add(self, slot: int, tier: int, h: int) -> None:
        seg = self._segs[h >> SHIFT]
        i = h & LOW
        bit = 1 << (3 * slot + tier)
        old = seg.stored[i]
        if old & bit:
            k = (slot, tier, h)
            self._dups[k] = self._dups.get(k, 0) + 1
            return
        if not old:
            seg.live += 1
        seg.stored[i] = old | bit
        self._counts[slot] += 1
        self._refresh(seg, i, slot)

    def _add_range(self, slot: int, tier: int, seg: _Seg, start: int, stop: int, dup_ok: bool) -> None:
        """``_add`` for blocks ``start:stop`` of ``seg`` (a chain), in bulk when none carries the bit
        yet: one reach refresh then walks the whole range instead of one per block."""
        bit = 1 << (3 * slot + tier)
        held = seg.stored[start:stop]
        if any(map(and_, held, repeat(bit, stop - start))):
            sid = seg.id << SHIFT
            for j, old in enumerate(held, start):
                if dup_ok or not old & bit:
                    self._add(slot, tier, sid | j)
            return
        seg.live += held.count(0)
        stored = seg.stored
        stored[start:stop] = map(or_, held, repeat(bit, stop - start))
        self._counts[slot] += stop - start
        # every block of the range changed, so recompute them all in order (a refresh from ``start``
        # alone stops where a block's reach happens not to change), pushing changes off the range
        shift = 3 * slot
        clear = ~(7 << shift)
        reach = seg.reach
        branches = seg.branches
        above = reach[start - 1] if start else self._reach_of(seg.parent)
        changed = False
        for j in range(start, stop):
            new = _LEVELS[(stored[j] >> shift) & 7] & (above >> shift) & 7
            above = reach[j]
            changed = new != (above >> shift) & 7
            if changed:
                above = reach[j] = (above & clear) | (new << shift)
                if branches is not None and j in branches:
                    for sid in branches[j].values():
                        child = self._segs[sid]
                        if (child.stored[0] >> shift) & 7:
                            self._refresh(child, 0, slot)
        if changed and stop < len(stored) and (stored[stop] >> shift) & 7:
            self._refresh(seg, stop, slot)

    def _remove(self, slot: int, tier: int, h: int) -> None:
        k = (slot, tier, h)
        extra = self._dups.get(k)
        if extra:
            if extra == 1:
                del self._dups[k]
            else:
                self._dups[k] = extra - 1
            return
        seg = self._segs[h >> SHIFT]
        i = h & LOW
        seg.stored[i] &= ~(1 << (3 * slot + tier))
        self._counts[slot] -= 1
        if not seg.stored[i]:
            seg.live -= 1
        self._refresh(seg, i, slot)
        self._collect(seg)

    def _refresh(self, seg: _Seg, i: int, slot: int) -> None:
        """Recompute ``slot``'s reach bits at block (seg, i) and push changes down its descendants."""
        shift = 3 * slot
        clear = ~(7 << shift)
        segs = self._segs
        stack = [(seg, i)]
        while stack:
            s, j = stack.pop()
            parent_reach = s.reach[j - 1] if j else self._reach_of(s.parent)
            new = _LEVELS[(s.stored[j] >> shift) & 7] & (parent_reach >> shift) & 7
            old = s.reach[j]
            if new == (old >> shift) & 7:
                continue
            s.reach[j] = (old & clear) | (new << shift)
            if j + 1 < len(s.stored) and (s.stored[j + 1] >> shift) & 7:
                stack.append((s, j + 1))
            if s.branches is not None:
                kids = s.branches.get(j)
                if kids is not None:
                    for sid in kids.values():
                        child = segs[sid]
                        if (child.stored[0] >> shift) & 7:
                            stack.append((child, 0))

    def _collect(self, seg: _Seg) -> None:
        """Free segments nobody holds a block of and nothing hangs under, walking up."""
        while not seg.live and not seg.n_branches:
            del self._segs[seg.id]
            self._n_blocks -= len(seg.stored)
            first = seg.locals[0]
            if seg.parent == ROOT:
                del self._roots[first]
                return
            pseg = self._segs[seg.parent >> SHIFT]
            assert pseg.branches is not None
            i = seg.parent & LOW
            kids = pseg.branches[i]
            del kids[first]
            if not kids:
                del pseg.branches[i]
            pseg.n_branches -= 1
            seg = pseg

    # ------------------------------------------------------------------ queries
    def _match_bits(self, hashes: Sequence[int], alive: int) -> dict[int, int]:
        """Depth of every bit in ``alive``: the deepest query prefix whose block has that reach bit."""
        depths: dict[int, int] = {}
        n = len(hashes)
        if not alive or n == 0:
            return depths
        sid = self._roots.get(hashes[0])
        if sid is None:
            return depths
        segs = self._segs
        query = hashes if isinstance(hashes, list) else list(hashes)
        d = 0  # query blocks matched so far
        start = 0  # index in the segment of the block at depth d + 1
        while True:
            seg = segs[sid]
            avail = min(len(seg.stored) - start, n - d)
            m = _common(seg.locals[start : start + avail], query[d : d + avail])
            last = start + m - 1
            reach = seg.reach
            reached = reach[last] & alive
            dropped = alive & ~reached
            if dropped:
                _bisect(reach, start - 1, last, dropped, d + 1 - start, depths)
            alive = reached
            d += m
            if not alive:
                return depths
            kids = seg.branches.get(last) if seg.branches is not None and d < n else None
            nxt = kids.get(query[d]) if kids is not None else None
            if nxt is None:
                _assign(alive, d, depths)
                return depths
            sid = nxt
            start = 0

    def _handle_of(self, hashes: list[int]) -> int | None:
        """Handle of the query's last block, if the trie holds the whole query as a prefix."""
        n = len(hashes)
        sid = self._roots.get(hashes[0]) if n else None
        segs = self._segs
        d = start = 0
        while sid is not None:
            seg = segs[sid]
            avail = min(len(seg.locals) - start, n - d)
            m = _common(seg.locals[start : start + avail], hashes[d : d + avail])
            d += m
            if d == n:
                return (sid << SHIFT) | (start + m - 1)
            if m < avail:
                return None
            kids = seg.branches.get(len(seg.locals) - 1) if seg.branches is not None else None
            sid = kids.get(hashes[d]) if kids is not None else None
            start = 0
        return None

    def continuation(self, local_hashes: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` local hashes of the blocks that follow the whole query in the trie, as long
        as they follow it one way only (a fork, or the query missing, ends them; none here: ``[]``).

        A conversation's earlier prompt is followed by the blocks its answer's decode stored; a
        later turn known only by that earlier prompt begins with them too."""
        out: list[int] = []
        h = self._handle_of(local_hashes if isinstance(local_hashes, list) else list(local_hashes))
        if h is None:
            return out
        segs = self._segs
        seg, i = segs[h >> SHIFT], h & LOW
        while len(out) < limit:
            branches = seg.branches
            kids = branches.get(i) if branches is not None else None
            if kids is not None:  # block i has a child off its run: one way on only at the run's end
                if i + 1 < len(seg.locals) or len(kids) != 1:
                    return out
                seg = segs[next(iter(kids.values()))]
                out.append(seg.locals[0])
                i = 0
                continue
            if i + 1 == len(seg.locals):
                return out  # nothing follows
            stop = min(len(seg.locals) - 1, i + limit - len(out))  # along the run: to a fork at most
            if branches:
                stop = min([stop, *(j for j in branches if i < j < stop)])
            out += seg.locals[i + 1 : stop + 1]
            i = stop
        return out

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
        if not self._off_device:  # every block is on a device: the three depths are one
            worker_of = self._worker_of
            return {
                worker_of[bit // 3]: TierDepths(depth, depth, depth)  # type: ignore[misc]
                for bit, depth in self._match_bits(local_hashes, self._level_bits[0]).items()
                if depth
            }
        bits = self._match_bits(local_hashes, self._all_bits)
        per_slot: dict[int, list[int]] = {}
        for bit, depth in bits.items():
            if depth:
                per_slot.setdefault(bit // 3, [0, 0, 0])[bit % 3] = depth
        worker_of = self._worker_of
        return {worker_of[s]: TierDepths(*d) for s, d in per_slot.items()}  # type: ignore[misc]


def _bisect(reach: list[int], lo: int, hi: int, bits: int, offset: int, depths: dict[int, int]) -> None:
    """Depths of ``bits``, each set at index ``lo`` (-1: the segment's parent) and clear at ``hi``;
    index ``j`` is depth ``j + offset``. Bits that part ways split the range."""
    stack = [(lo, hi, bits)]
    while stack:
        lo, hi, bits = stack.pop()
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            up = reach[mid] & bits
            if up and up != bits:
                stack.append((mid, hi, up))
                bits &= ~up
                hi = mid
            elif up:
                lo = mid
            else:
                hi = mid
        _assign(bits, lo + offset, depths)


def _assign(bits: int, depth: int, depths: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        depths[low.bit_length() - 1] = depth
        bits ^= low
