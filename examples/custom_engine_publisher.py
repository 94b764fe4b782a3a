"""A toy inference engine that publishes its KV-cache changes with kvmesh's ``KvEventPublisher``.

Any engine can take part in KV-aware routing this way: report the blocks it caches and evicts,
one batch per scheduler step, in the same wire format vLLM and SGLang use.

    python examples/custom_engine_publisher.py [--endpoint tcp://127.0.0.1:5557]
        [--replay-endpoint tcp://127.0.0.1:5558] [--steps 40] [--step-interval 0.05]

Watch it from another terminal (``--from-seq 0`` replays what you missed):

    kvmesh events tap tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --from-seq 0

The engine is a prefix cache of fixed capacity with LRU eviction. Each step it admits one request
(one of a few shared system prompts plus a user turn), caches the prompt's full blocks that were
not cached yet and evicts the least recently used blocks to make room. Halfway through it resets
its cache, as an engine does when its prefix cache is flushed. It prints every batch it publishes,
then keeps the replay socket up for ``--linger`` seconds so that late subscribers can catch up.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import OrderedDict

from kvmesh.events.publisher import KvEventPublisher
from kvmesh.hashing import block_hashes, sequence_hashes

BLOCK_SIZE = 4
SYSTEM_PROMPTS = [[100 + i for i in range(12)], [200 + i for i in range(8)], [300 + i for i in range(16)]]


class PrefixCache:
    """Blocks keyed by the hash of their whole prefix, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def admit(self, tokens: list[int]) -> tuple[int | None, list[int], list[int], list[int]]:
        """Cache ``tokens``' full blocks. Returns (parent of the new blocks, their hashes, their
        tokens, hashes evicted to make room)."""
        # Rolling hashes: a block's hash covers its whole prefix, like vLLM's block hashes.
        chain = sequence_hashes(block_hashes(tokens, BLOCK_SIZE))
        cached = 0
        while cached < len(chain) and chain[cached] in self.blocks:
            cached += 1
        # Touch the hit blocks child first, so that a parent always outlives its children (LRU
        # then evicts leaves before the prefixes they hang from).
        for h in reversed(chain[:cached]):
            self.blocks.move_to_end(h)
        new = chain[cached:]
        evicted = []
        while self.blocks and len(self.blocks) + len(new) > self.capacity:
            h, _ = self.blocks.popitem(last=False)
            evicted.append(h)
        for h in reversed(new):
            self.blocks[h] = None
        parent = chain[cached - 1] if cached else None
        return parent, new, tokens[cached * BLOCK_SIZE : len(chain) * BLOCK_SIZE], evicted

    def reset(self) -> None:
        self.blocks.clear()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--endpoint", default="tcp://127.0.0.1:5557", help="PUB endpoint to bind (port 0: any)"
    )
    parser.add_argument(
        "--replay-endpoint", default="tcp://127.0.0.1:5558", help="ROUTER replay endpoint to bind"
    )
    parser.add_argument("--steps", type=int, default=40, help="scheduler steps to run")
    parser.add_argument("--step-interval", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--capacity", type=int, default=12, help="cache capacity in blocks")
    parser.add_argument(
        "--linger", type=float, default=2.0, help="seconds to keep serving replays at the end"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the request generator")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    cache = PrefixCache(args.capacity)
    # bind=True: the engine owns these addresses and subscribers connect to it.
    with KvEventPublisher(
        args.endpoint, replay_endpoint=args.replay_endpoint, block_size=BLOCK_SIZE, bind=True
    ) as publisher:
        print(f"publishing on {publisher.endpoint} (replay {publisher.replay_endpoint})", flush=True)
        for step in range(args.steps):
            if step == args.steps // 2:
                cache.reset()
                publisher.cleared()
            prompt = rng.choice(SYSTEM_PROMPTS) + [
                rng.randrange(1000, 2000) for _ in range(rng.randrange(2, 10))
            ]
            parent, stored, tokens, evicted = cache.admit(prompt)
            if evicted:
                publisher.removed(evicted)
            if stored:
                publisher.stored(stored, tokens, parent_block_hash=parent)
            seq = publisher.flush()  # one batch per step, like vLLM's scheduler
            if seq is not None:
                print(
                    f"seq {seq}: stored {stored} removed {evicted}"
                    + (" cleared" if step == args.steps // 2 else ""),
                    flush=True,
                )
            time.sleep(args.step_interval)
        print(f"done: {publisher.last_seq + 1 if publisher.last_seq is not None else 0} batches", flush=True)
        time.sleep(args.linger)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
