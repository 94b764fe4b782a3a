"""The mock engine's paged KV cache: fixed blocks, prefix caching, reference counts, LRU eviction.

Modelled on vLLM v1's block pool. Every block is always in exactly one of three states:

* in use: ``ref_cnt > 0`` (held by running requests, pins or sessions); never evicted;
* free and cached: ``ref_cnt == 0`` with a ``block_hash``; reusable by a prefix hit until evicted;
* free and empty: ``ref_cnt == 0`` without a hash.

Free blocks sit in an intrusive doubly linked list ordered by eviction priority::

    head <-> b7 <-> b2 <-> b9 <-> tail        (b7 is evicted first, b9 last)

Allocation pops from the head, so the least recently freed block goes first; freeing appends at
the tail. A prefix hit on a free cached block unlinks it in O(1). Callers free a request's blocks
in reverse order, so a sequence's tail blocks are evicted before its head (which more requests
are likely to share).

Each change to the set of cached blocks is recorded as a KV event (``BlockStored`` when blocks
are cached, ``BlockRemoved`` when a cached block is evicted for reuse, ``AllBlocksCleared`` on a
reset). Events are a side output: :meth:`BlockPool.take_events` swaps the list out, and the
engine publishes it as one batch per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

MEDIUM = "GPU"


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix cache: its engine hash, its parent's hash (None for a
    # sequence's first block), its position in the sequence, and its tokens (for kv_state dumps).
    block_hash: int | None = None
    parent_hash: int | None = None
    position: int = 0
    token_ids: tuple[int, ...] = ()
    # Links of the free list; both None while the block is in use.
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with O(1) removal from the middle."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self.num_free = len(blocks)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None, f"{block} is already in the free queue"
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterable[KVBlock]:  # type: ignore[misc]  # for tests and debugging
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens with a hash -> block prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self._events: list[Event] = []

    # --- queries -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def cached_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> list[KVBlock]:
        """The cached blocks of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``)."""
        hits: list[KVBlock] = []
        cached = self.cached
        for h in block_hashes[:max_blocks]:
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # --- reference counting ------------------------------------------------------------------

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block, pulling free ones out of the eviction queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block; a block nobody holds joins the eviction queue's tail."""
        append = self.free_queue.append
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` free blocks (caller checks ``num_free``), evicting their cached contents."""
        assert n <= self.free_queue.num_free, f"allocate({n}) with {self.free_queue.num_free} free"
        out: list[KVBlock] = []
        evicted: list[int | bytes] = []
        popleft = self.free_queue.popleft
        for _ in range(n):
            block = popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM))
        return out

    # --- prefix cache ------------------------------------------------------------------------

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        first: int,
        last: int,
    ) -> None:
        """Enter blocks ``first..last-1`` of one sequence into the prefix cache.

        ``blocks[i]`` holds ``token_ids[i*B:(i+1)*B]`` and has hash ``block_hashes[i]``. A block
        whose hash another block already caches (two requests computing the same prefix in the
        same step) stays private to its request and publishes nothing, so every published hash
        names exactly one block. Consecutive newly cached blocks are published as one
        ``BlockStored`` event chained to the hash before them, as vLLM does.
        """
        bs = self.block_size
        run_hashes: list[int | bytes] = []
        run_tokens: list[int | tuple[int, int]] = []
        run_parent: int | None = None
        for i in range(first, last):
            block = blocks[i]
            h = block_hashes[i]
            if block.block_hash is not None or h in self.cached:
                # already cached (a prefix hit) or a duplicate: ends the current run
                if run_hashes:
                    self._store(run_hashes, run_parent, run_tokens)
                    run_hashes, run_tokens = [], []
                continue
            parent = block_hashes[i - 1] if i > 0 else None
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block.block_hash = h
            block.parent_hash = parent
            block.position = i
            block.token_ids = tokens
            self.cached[h] = block
            if not run_hashes:
                run_parent = parent
            run_hashes.append(h)
            run_tokens.extend(tokens)
        if run_hashes:
            self._store(run_hashes, run_parent, run_tokens)

    def _store(
        self, hashes: list[int | bytes], parent: int | None, tokens: list[int | tuple[int, int]]
    ) -> None:
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
            )
        )

    def _uncache(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when no block is in use, like vLLM); False otherwise."""
        if self.num_used:
            return False
        for block in self.cached.values():
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = ()
        self.cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    # --- events and dumps --------------------------------------------------------------------

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def has_events(self) -> bool:
        return bool(self._events)

    def snapshot(self) -> list[BlockStored]:
        """Every cached block as a one-block ``BlockStored``, parents before children."""
        blocks = sorted(self.cached.values(), key=lambda b: b.position)
        return [
            BlockStored(
                block_hashes=[b.block_hash],  # type: ignore[list-item]
                parent_block_hash=b.parent_hash,
                token_ids=list(b.token_ids),
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
            )
            for b in blocks
        ]
