"""Router core vs NVIDIA Dynamo's compiled RadixTree, same workload, same run.

    .venv/bin/python benchmarks/router_core.py [--sequences 10000] [--blocks 64] [--block-size 16]

Workload: ``--sequences`` prompts of ``--blocks`` blocks over 4 workers; every prompt starts with one
of 100 shared 32-block prefixes. Each worker publishes what a prefix-caching engine would: the
whole prompt the first time it sees a prefix, afterwards only the new blocks, chained to the cached
prefix by ``parent_block_hash``.

Measured (GC disabled while timing, like every script here; medians over interleaved rounds):
* find_matches for a 2,048-block query (one cached prompt, then unknown blocks);
* applying all stored events, hashing their tokens included (kvmesh: ``PrefixIndex.apply`` on
  decoded BlockStored structs; Dynamo: ``compute_block_hash_for_seq`` + ``RadixTree.apply_event`` on
  KvCacheEvent JSON, shown with and without building that JSON);
* one full ``KvRouter.route`` decision for a 2,048-block request over 8 workers;
* memory of the index per (block, worker) entry (tracemalloc) and what the default budget bounds.

Dynamo's binding comes from the ``bench`` extra; without it only kvmesh's numbers print.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, median, percentile, table

from kvmesh.events.wire import BlockStored
from kvmesh.hashing import block_hashes
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.event_index import PrefixIndex
from kvmesh.router.core.kv_router import KvRouter, RouteRequest

PREFIXES = 100
PREFIX_BLOCKS = 32


def workload(n_seq: int, n_blocks: int, bs: int, n_workers: int, seed: int = 0):
    """(worker index, BlockStored) events in publish order, plus every prompt's tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(150_000) for _ in range(PREFIX_BLOCKS * bs)] for _ in range(PREFIXES)]
    prefix_hashes = [[rng.getrandbits(63) for _ in range(PREFIX_BLOCKS)] for _ in range(PREFIXES)]
    prompts, events = [], []
    known: dict[tuple[int, int], list[int]] = {}  # (worker, prefix) -> engine hashes of the prefix
    for i in range(n_seq):
        p = i % PREFIXES
        w = (i // PREFIXES) % n_workers  # every prefix ends up on every worker
        toks = prefixes[p] + [rng.randrange(150_000) for _ in range((n_blocks - PREFIX_BLOCKS) * bs)]
        prompts.append(toks)
        hashes = known.get((w, p))
        if hashes is None:
            # the same content gets the same engine hash on every worker (vLLM without a salt): the
            # compiled reference indexes only the first worker that stores a block under another hash
            ehs = prefix_hashes[p] + [rng.getrandbits(63) for _ in range(n_blocks - PREFIX_BLOCKS)]
            known[(w, p)] = prefix_hashes[p]
            events.append((w, BlockStored(ehs, None, toks, bs)))
        else:
            ehs = [rng.getrandbits(63) for _ in range(n_blocks - PREFIX_BLOCKS)]
            events.append((w, BlockStored(ehs, hashes[-1], toks[PREFIX_BLOCKS * bs :], bs)))
    return events, prompts


def dynamo_json(event_id: int, ev: BlockStored, local: list[int]) -> bytes:
    blocks = [{"block_hash": eh, "tokens_hash": h} for eh, h in zip(ev.block_hashes, local, strict=True)]
    data = {"stored": {"parent_hash": ev.parent_block_hash, "blocks": blocks}}
    return json.dumps({"event_id": event_id, "data": data, "dp_rank": 0}).encode()


def timed(fn) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def per_call(fn, repeat: int) -> list[float]:
    for _ in range(20):
        fn()
    out = []
    gc.disable()
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=10_000)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--query-blocks", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    bs = args.block_size
    try:
        from dynamo._core import RadixTree, compute_block_hash_for_seq
    except ImportError:
        RadixTree = None
        print("dynamo binding not installed (pip install -e '.[bench]'): kvmesh only", file=sys.stderr)

    events, prompts = workload(args.sequences, args.blocks, bs, 4)
    n_blocks = sum(len(e.block_hashes) for _, e in events)
    workers = [(f"w{i}", 0) for i in range(4)]

    # ---------------------------------------------------------------- store throughput
    def kv_store() -> PrefixIndex:
        index = PrefixIndex(block_size=bs)
        for w, ev in events:
            index.apply(workers[w], (ev,))
        return index

    store: dict[str, list[float]] = {"kvmesh": []}
    if RadixTree is not None:
        store.update({"dynamo hash+apply": [], "dynamo hash+json+apply": []})
        locals_ = [compute_block_hash_for_seq(list(e.token_ids), bs) for _, e in events]
        payloads = [
            dynamo_json(i, e, loc) for i, ((_, e), loc) in enumerate(zip(events, locals_, strict=True))
        ]
        probe = block_hashes(prompts[0], bs)

        def dyn_apply(encode: bool):
            tree = RadixTree()

            def run() -> None:
                for i, (w, ev) in enumerate(events):
                    loc = compute_block_hash_for_seq(ev.token_ids, bs)
                    tree.apply_event(w, dynamo_json(i, ev, loc) if encode else payloads[i])
                tree.find_matches(probe)  # the tree applies on a background thread: wait for it

            return tree, run

    def kv_round() -> None:
        store["kvmesh"].append(timed(kv_store))

    def dynamo_round() -> None:
        _, run = dyn_apply(True)
        store["dynamo hash+json+apply"].append(timed(run))
        _, run = dyn_apply(False)
        # hashing is timed in the run; the pre-built JSON is not (it needs the hashes first)
        store["dynamo hash+apply"].append(timed(run))

    for r in range(args.rounds):
        # alternate which side goes first, so neither always runs on a warmer (or busier) machine
        order = [kv_round] if RadixTree is None else [kv_round, dynamo_round]
        for step in order if r % 2 == 0 else order[::-1]:
            step()

    # ---------------------------------------------------------------- find_matches
    index = kv_store()
    rng = random.Random(1)
    query_tokens = prompts[5] + [
        rng.randrange(150_000) for _ in range((args.query_blocks - args.blocks) * bs)
    ]
    query = block_hashes(query_tokens, bs)
    # every worker holds prompt 5's shared prefix; its own worker holds all of it
    expected = {w: PREFIX_BLOCKS for w in workers} | {workers[(5 // PREFIXES) % 4]: args.blocks}
    assert index.find_matches(query) == expected, index.find_matches(query)
    finds: dict[str, list[float]] = {"kvmesh find_matches": []}
    if RadixTree is not None:
        tree, run = dyn_apply(False)
        run()
        got = tree.find_matches(query).scores
        assert {(f"w{w}", r): s for (w, r), s in got.items()} == expected, got
        finds["dynamo find_matches"] = []
    for _ in range(args.rounds):
        finds["kvmesh find_matches"] += per_call(lambda: index.find_matches(query), 400)
        if RadixTree is not None:
            finds["dynamo find_matches"] += per_call(lambda: tree.find_matches(query).scores, 400)

    # ---------------------------------------------------------------- route()
    # Both cost models on the same index and load, timed in interleaved rounds: Dynamo's formula
    # (the route() of earlier runs) and the latency cost (the default).
    from kvmesh.events.wire import EventBatch

    eight, _ = workload(args.sequences, args.blocks, bs, 8)
    req = RouteRequest("r", query, len(query_tokens))
    routers = {}
    for model in ("dynamo", "latency"):
        router = KvRouter(
            RouterConfig(router_queue_threshold=None, router_cost_model=model), random.Random(0)
        )
        for i in range(8):
            router.add_worker(f"w{i}", total_blocks=100_000, max_num_batched_tokens=8192, block_size=bs)
        for w, ev in eight:
            router.apply_events(f"w{w}", EventBatch(0.0, [ev], 0))
        # one request answered, so the router knows how long a request stays; then some load in
        # flight, so the load model has work to do (one of them carries the query's prompt)
        router.route(RouteRequest("done", block_hashes(prompts[99], bs), len(prompts[99])), -1.0)
        router.first_token("done", -0.95)
        router.finished("done", -0.5)
        for i in range(16):
            router.route(RouteRequest(f"bg{i}", block_hashes(prompts[i], bs), len(prompts[i])), 0.0)
        routers[model] = router
    del eight
    routes: dict[str, list[float]] = {"dynamo": [], "latency": []}
    for rnd in range(args.rounds):
        order = ["dynamo", "latency"] if rnd % 2 == 0 else ["latency", "dynamo"]
        for model in order:
            router = routers[model]
            for _ in range(200):
                gc.disable()
                t0 = time.perf_counter()
                router.route(req, 0.0)
                routes[model].append(time.perf_counter() - t0)
                gc.enable()
                router.finished("r", 0.0)
    # the latency cost's route() ran its whole path: a request in flight shares the query's prompt,
    # so every decision priced a copy of it
    assert routers["latency"].shared_prefix_stats()["followed"] == 1  # type: ignore[index]
    del routers, router

    # ---------------------------------------------------------------- memory
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem_index = kv_store()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    entries = mem_index.total_entries
    per_entry = (after - before) / entries
    budget = RouterConfig().router_index_max_blocks

    # ---------------------------------------------------------------- report
    print(f"machine: {machine()}")
    print(
        f"workload: {args.sequences} sequences x {args.blocks} blocks (block {bs}), 4 workers, "
        f"{PREFIXES} shared {PREFIX_BLOCKS}-block prefixes; {n_blocks} stored blocks\n"
    )
    base = store.get("dynamo hash+apply")

    def ratios(s: list[float]) -> str:
        # each round ran both sides back to back, so a round's ratio shares that round's noise
        if base is None:
            return "-"
        per_round = sorted(b / t for b, t in zip(base, s, strict=True))
        return f"{median(per_round):.2f}x ({per_round[0]:.2f}-{per_round[-1]:.2f})"

    rows = [
        [
            name,
            f"{n_blocks / median(s) / 1e6:.2f} ({n_blocks / max(s) / 1e6:.2f}-{n_blocks / min(s) / 1e6:.2f})",
            f"{median(s) * 1e3:.0f}",
            ratios(s),
        ]
        for name, s in store.items()
    ]
    print(
        table(
            [
                f"apply stored events (hashing included), {args.rounds} rounds",
                "M blocks/s median (range)",
                "ms total",
                "speed vs dynamo hash+apply, per round",
            ],
            rows,
        )
    )
    print()
    fbase = median(finds["dynamo find_matches"]) if RadixTree is not None else float("nan")
    rows = [
        [name, f"{median(s) * 1e6:.1f}", f"{percentile(s, 99) * 1e6:.1f}", f"{fbase / median(s):.2f}x"]
        for name, s in finds.items()
    ]
    print(
        table(
            [f"find_matches, {args.query_blocks}-block query", "median us", "p99 us", "speed vs dynamo"], rows
        )
    )
    print()
    print(
        table(
            ["KvRouter.route, 2048 blocks, 8 workers", "median us", "p99 us", "time vs dynamo cost"],
            [
                [
                    f"route() decision, --router-cost-model {model}",
                    f"{median(routes[model]) * 1e6:.1f}",
                    f"{percentile(routes[model], 99) * 1e6:.1f}",
                    f"{median(routes[model]) / median(routes['dynamo']):.2f}x",
                ]
                for model in ("dynamo", "latency")
            ],
        )
    )
    print()
    print(
        table(
            ["index memory", "value"],
            [
                ["(block, worker) entries", f"{entries}"],
                ["distinct blocks (trie nodes)", f"{mem_index.node_count}"],
                ["bytes per entry (tracemalloc)", f"{per_entry:.0f}"],
                [
                    "default budget --router-index-max-blocks",
                    f"{budget} entries ~ {budget * per_entry / 2**30:.1f} GiB",
                ],
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
