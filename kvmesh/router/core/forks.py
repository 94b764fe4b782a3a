"""Forks: where prompts held on a worker part inside a chunk, the blocks they share there, once.

The load model names a prompt's blocks by prefix identities (:mod:`kvmesh.router.core.load`): a
whole chunk is one identity, each block after the last whole chunk one more. Two prompts that
share a prefix up to a point inside a chunk hold two identities for that chunk, and the blocks
before the point are counted twice: a burst's siblings after their shared context, the first
turns of conversations after a shared system prompt.

Each prompt names the block hashes of its *ends*, its last :data:`END_CHUNKS` whole chunks and
its partial chunk, each under the identity before it (its *parent*). A worker's :class:`Forks`
keeps the ends its holders named, each for as long as its identity is held there, whoever holds
it then. Under one parent the whole chunks count ``chunk`` blocks each and the partial paths
count their distinct blocks (their identities chain block by block); all of them together hold
the distinct blocks of their union. The difference is the parent's *overlap*, and the load
model's count is the identities' weights less every parent's overlap. Both are functions of what
is held, so the count cannot drift, whatever the order of arrivals and departures. An identity
held only by prompts for which it is not an end is not known here: a prefix that parts earlier
than the ends of every prompt that holds it is counted as before.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from itertools import pairwise

END_CHUNKS = 2
"""Whole chunks at a prompt's end whose block hashes it names, with its partial chunk."""

End = tuple[int, int, tuple[int, ...], bool]
"""``(identity, parent identity (0: none), block hashes, whole chunk?)``: a whole chunk's identity
is its own; a partial chunk's, the identity of its last block (which names all of it)."""


def prompt_ends(local_hashes: Sequence[int], ids: Sequence[int], anchors: int, chunk: int) -> list[End]:
    """The ends of a prompt whose identities are ``ids`` (``anchors`` whole chunks of ``chunk``
    blocks, then one identity a block)."""
    ends: list[End] = [
        (ids[k], ids[k - 1] if k else 0, tuple(local_hashes[k * chunk : (k + 1) * chunk]), True)
        for k in range(max(anchors - END_CHUNKS, 0), anchors)
    ]
    if len(ids) > anchors:
        ends.append(
            (ids[-1], ids[anchors - 1] if anchors else 0, tuple(local_hashes[anchors * chunk :]), False)
        )
    return ends


class Forks:
    """The ends held on one worker, and the blocks counted twice among them."""

    __slots__ = ("_parent", "_under", "total")

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}
        """Identity of each end kept here -> its parent."""
        self._under: dict[int, dict[int, tuple[tuple[int, ...], bool]]] = {}
        """Parent -> the ends kept under it (identity -> block hashes, whole chunk?)."""
        self.total = 0
        """Every parent's overlap: blocks the identities count that are counted already."""

    def __bool__(self) -> bool:
        return bool(self._parent)

    def keep(self, ends: Iterable[End], held: Collection[int]) -> int:
        """Keep a prompt's ``ends`` whose identities are ``held`` now; returns how much the overlap
        grew (blocks its identities counted that were counted already)."""
        grew = 0
        for ident, parent, hashes, whole in ends:
            if ident in self._parent or ident not in held:
                continue
            under = self._under.get(parent)
            if under is None:
                under = self._under[parent] = {}
            before = _overlap(under.values()) if under else 0
            under[ident] = (hashes, whole)
            self._parent[ident] = parent
            if len(under) > 1:
                grew += _overlap(under.values()) - before
        self.total += grew
        return grew

    def drop(self, gone: Iterable[int]) -> int:
        """Identities no one holds here any more: forget those that were ends; returns how much the
        overlap shrank."""
        shrank = 0
        parent_of = self._parent
        for ident in parent_of.keys() & gone:  # (a set operation in C: most gone are no ends)
            parent = parent_of.pop(ident)
            under = self._under[parent]
            before = _overlap(under.values()) if len(under) > 1 else 0
            del under[ident]
            if not under:
                del self._under[parent]
            shrank += before - (_overlap(under.values()) if len(under) > 1 else 0)
        self.total -= shrank
        return shrank

    def overlap_if_held(self, ends: Iterable[End], held: Collection[int]) -> int:
        """How much the overlap would grow if a prompt with these ``ends`` were held here too;
        ``held``: the identities held now (an end kept here whose identity is not, a request's own
        while what the others carry is asked, counts as gone)."""
        grew = 0
        for ident, parent, hashes, whole in ends:
            under = self._under.get(parent)
            if not under or (ident in under and ident in held):
                continue  # nothing under its parent, or kept already: it adds no overlap
            kept = [v for k, v in under.items() if k in held]
            if kept:
                grew += _overlap([*kept, (hashes, whole)]) - _overlap(kept)
        return grew

    def shrink(self, gone: Collection[int]) -> int:
        """How much the overlap would shrink if the identities ``gone`` were no one's here."""
        parents = {p for p in map(self._parent.get, gone) if p is not None}
        return sum(self.shrink_at(p, gone) for p in parents)

    def shrink_at(self, parent: int, gone: Collection[int]) -> int:
        """How much ``parent``'s overlap would shrink if the identities ``gone`` were no one's."""
        under = self._under.get(parent)
        if not under or len(under) < 2:
            return 0
        return _overlap(under.values()) - _overlap([v for k, v in under.items() if k not in gone])

    def parent_of(self, ident: int) -> int | None:
        """The parent of a kept end (None: not one)."""
        return self._parent.get(ident)


def _overlap(ends: Iterable[tuple[tuple[int, ...], bool]]) -> int:
    """Blocks the identities of ``ends`` under one parent count more than once: whole chunks count
    every block, partial paths their distinct blocks, all together the distinct blocks of the
    union."""
    whole: list[tuple[int, ...]] = []
    partial: list[tuple[int, ...]] = []
    for hashes, is_whole in ends:
        (whole if is_whole else partial).append(hashes)
    if not whole:
        return 0  # partial paths share identities block by block: counted once already (or none)
    counted = sum(map(len, whole)) + (_distinct(partial) if partial else 0)
    return counted - _distinct(whole + partial)


def _distinct(paths: list[tuple[int, ...]]) -> int:
    """Distinct prefixes of ``paths`` (nodes of their trie): in sorted order, each path adds what
    it does not share with the one before."""
    paths = sorted(paths)
    total = len(paths[0])
    for a, b in pairwise(paths):
        shared = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            shared += 1
        total += len(b) - shared
    return total
