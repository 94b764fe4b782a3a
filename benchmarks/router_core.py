"""Router core vs NVIDIA Dynamo's compiled RadixTree, same workload, same run.

    .venv/bin/python benchmarks/router_core.py [--sequences 10000] [--blocks 64] [--block-size 16] [--baseline REV]

Workload: ``--sequences`` prompts of ``--blocks`` blocks over 4 workers; every prompt starts with one
of 100 shared 32-block prefixes. Each worker publishes what a prefix-caching engine would: the
whole prompt the first time it sees a prefix, afterwards only the new blocks, chained to the cached
prefix by ``parent_block_hash``.

Measured (GC disabled while timing, like every script here; medians over interleaved rounds):
* find_matches for a 2,048-block query (one cached prompt, then unknown blocks);
* applying all stored events, hashing their tokens included (kvmesh: ``PrefixIndex.apply`` on
  decoded BlockStored structs; Dynamo: ``compute_block_hash_for_seq`` + ``RadixTree.apply_event`` on
  KvCacheEvent JSON, shown with and without building that JSON);
* one full ``KvRouter.route`` decision for a 2,048-block request over 8 workers, with both cost
  models; with ``--baseline REV`` also that revision's ``route()`` beside this tree's: both
  revisions are imported into this process and their decisions timed call by call in turn, so a
  target stated against older code is measured against that code at the same moments;
* memory of the index per (block, worker) entry (tracemalloc) and what the default budget bounds.

Dynamo's binding comes from the ``bench`` extra; without it only kvmesh's numbers print.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, median, percentile, table
from route_decision import PREFIX_BLOCKS, PREFIXES, query_tokens, routers, time_routes, workload

import kvmesh as kvmesh_package
from kvmesh._native import ENV as NATIVE_ENV
from kvmesh.events.wire import BlockStored
from kvmesh.hashing import block_hashes
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.event_index import PrefixIndex


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


REPO = Path(__file__).resolve().parent.parent


def resolve_commit(rev: str) -> str:
    """The commit ``rev`` names in this repository (ValueError: none)."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not commit:
        raise ValueError(f"--baseline: {rev!r} is not a commit of {REPO}")
    return commit


def revision_tree(commit: str, into: str) -> None:
    """Extract ``commit``'s ``kvmesh`` package into the directory ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "kvmesh"], capture_output=True, check=True
    )
    # the "data" filter (Python 3.10.12+) refuses members that would land outside ``into``
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, **safe)


def _kvmesh_modules() -> dict[str, object]:
    return {k: m for k, m in sys.modules.items() if k == "kvmesh" or k.startswith("kvmesh.")}


def _own_modules() -> dict[str, object]:
    """This process's own kvmesh, with everything a router is built from imported: what this
    tree's contenders run on (compiled where ``kvmesh native build`` built these sources, as a
    user's router would run), set aside while another tree's are imported."""
    import kvmesh.router.core.kv_router  # noqa: F401

    return _kvmesh_modules()


OWN = _own_modules()
OWN_TREE = Path(kvmesh_package.__file__).resolve().parent.parent


def _built(model: str, args: argparse.Namespace):
    """``(router, request, modules)`` on whatever kvmesh ``sys.modules`` holds now."""
    key = None if model == "default" else model
    made, req = routers([key], args.sequences, args.blocks, args.block_size, args.query_blocks)
    return made[key], req, _kvmesh_modules()


def _load_contender(tree: str, model: str, args: argparse.Namespace):
    """``(router, request, modules)``: a router of ``model`` on ``tree``'s kvmesh, built on the
    shared set-up, and the kvmesh modules it runs on, to be put back in ``sys.modules`` before each
    of its calls (an import made inside ``route()`` then resolves to its own revision). This
    process's own tree runs on its own modules; another tree's kvmesh is imported afresh, as
    Python (compiled modules are this process's: one copy of them per process)."""
    for name in _kvmesh_modules():
        del sys.modules[name]
    if Path(tree).resolve() == OWN_TREE:
        sys.modules.update(OWN)
        return _built(model, args)
    sys.path.insert(0, tree)
    native = os.environ.get(NATIVE_ENV)
    os.environ[NATIVE_ENV] = "0"
    try:
        import kvmesh

        if not str(Path(kvmesh.__file__).resolve()).startswith(str(Path(tree).resolve())):
            raise RuntimeError(f"imported {kvmesh.__file__}, not the kvmesh under {tree}")
        return _built(model, args)
    finally:
        sys.path.remove(tree)
        if native is None:
            del os.environ[NATIVE_ENV]
        else:
            os.environ[NATIVE_ENV] = native


def interleaved_routes(contenders, rounds: int, samples: int) -> list[list[list[float]]]:
    """``[contender][round]`` route() samples in seconds, the contenders taking turns call by call
    (in an order rotated every call), so a slow moment of the shared machine falls on all of them
    rather than on whichever ran then. Each decision's request is finished after it, untimed."""
    out: list[list[list[float]]] = [[[] for _ in range(rounds)] for _ in contenders]
    n = len(contenders)
    for rnd in range(rounds):
        for i in range(samples):
            for j in range(n):
                k = (i + j) % n
                router, req, modules = contenders[k]
                sys.modules.update(modules)
                gc.disable()
                t0 = time.perf_counter()
                router.route(req, 0.0)
                t1 = time.perf_counter()
                gc.enable()
                router.finished(req.request_id, 0.0)
                out[k][rnd].append(t1 - t0)
    return out


def baseline_table(rev: str, args: argparse.Namespace) -> str:
    """route() of revision ``rev`` (its default configuration) beside this tree's two cost models,
    all three in this process and timed call by call in turn (:func:`interleaved_routes`): the
    ratio is the median of each call's time over the baseline call made next to it. (Timed one
    process after another, the baseline's own median ranged 126-262 us over rounds on this shared
    machine and the ratio 0.83-2.70; interleaved, the ratio repeats within a few percent.)"""
    commit = resolve_commit(rev)
    own = _kvmesh_modules()
    with tempfile.TemporaryDirectory(prefix="kvmesh-baseline-") as tree:
        revision_tree(commit, tree)
        names = [
            f"{rev} ({commit[:9]}), its default",
            "this tree, --router-cost-model dynamo",
            "this tree, --router-cost-model latency",
        ]
        built = []
        try:
            for where, model in ((tree, "default"), (str(REPO), "dynamo"), (str(REPO), "latency")):
                print(f"route() vs {rev}: building {where} ({model})", file=sys.stderr, flush=True)
                built.append(_load_contender(where, model, args))
            print(f"route() vs {rev}: {args.rounds} rounds, interleaved", file=sys.stderr, flush=True)
            samples = interleaved_routes(built, args.rounds, 400)
        finally:
            for name in _kvmesh_modules():
                del sys.modules[name]
            sys.modules.update(own)
    base = samples[0]
    rows = []
    for name, rounds in zip(names, samples, strict=True):
        meds = [median(r) for r in rounds]
        # each call against the baseline call made next to it: the two share that moment's machine
        per_round = sorted(
            median([t / b for t, b in zip(r, br, strict=True)]) for r, br in zip(rounds, base, strict=True)
        )
        everything = median(
            [t / b for r, br in zip(rounds, base, strict=True) for t, b in zip(r, br, strict=True)]
        )
        rows.append(
            [
                name,
                f"{median(meds) * 1e6:.1f} ({min(meds) * 1e6:.1f}-{max(meds) * 1e6:.1f})",
                f"{everything:.2f}x ({per_round[0]:.2f}-{per_round[-1]:.2f})",
            ]
        )
    head = f"route(), {args.query_blocks} blocks, 8 workers, interleaved in one process, {args.rounds} rounds"
    return table(
        [head, "median us (per-round range)", f"time vs {rev}, call by call (per-round range)"], rows
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=10_000)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--query-blocks", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="also time route() of this git revision's code (its default configuration) beside this "
        "tree's, call by call in turn in this process; e.g. the code a target was stated against",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.baseline is not None:
        try:
            resolve_commit(args.baseline)  # before the minutes of the rest, not after them
        except ValueError as exc:
            ap.error(str(exc))
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
    query = block_hashes(query_tokens(prompts, args.blocks, args.query_blocks, bs), bs)
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
    routed, req = routers(("dynamo", "latency"), args.sequences, args.blocks, bs, args.query_blocks)
    routes: dict[str, list[float]] = {"dynamo": [], "latency": []}
    for rnd in range(args.rounds):
        order = ["dynamo", "latency"] if rnd % 2 == 0 else ["latency", "dynamo"]
        for model in order:
            routes[model] += time_routes(routed[model], req, 200)
    # the latency cost's route() ran its whole path: a request in flight shares the query's prompt,
    # so every decision priced a copy of it
    assert routed["latency"].shared_prefix_stats()["followed"] == 1  # type: ignore[index]
    del routed

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
            [
                f"KvRouter.route, {args.query_blocks} blocks, 8 workers",
                "median us",
                "p99 us",
                "time vs dynamo cost",
            ],
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
    if args.baseline is not None:
        print()
        print(baseline_table(args.baseline, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
