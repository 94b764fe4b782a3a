"""One ``KvRouter.route`` decision, timed on whichever kvmesh is first on the path.

    PYTHONPATH=<a tree> .venv/bin/python benchmarks/route_decision.py --model latency [--samples 200]

``benchmarks/router_core.py --baseline REV`` builds its routers with :func:`routers` from here, once
for another revision's kvmesh and once for the working tree's, in one process, and times them call
by call in turn; run on its own, this script times whichever kvmesh is first on the path. It
therefore imports only the router API every revision since the router's layer folders has had
(``KvRouter``, ``RouteRequest``, ``RouterConfig``, ``EventBatch``, ``BlockStored``,
``block_hashes``), and imports it inside the functions, from whichever kvmesh is loaded then.

The set-up, the same in both scripts: ``--sequences`` prompts of ``--blocks`` blocks over 8
workers (every prompt starts with one of 100 shared 32-block prefixes, every prefix on every
worker), one request answered (the router learns a request's stay), 16 requests in flight (one
shares the query's prompt), then the same ``--query-blocks``-block request routed and finished
again and again. Prints one JSON object: the kvmesh package timed, the model, and the samples in
seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time

PREFIXES = 100
PREFIX_BLOCKS = 32


def workload(n_seq: int, n_blocks: int, bs: int, n_workers: int, seed: int = 0):
    """(worker index, BlockStored) events in publish order, plus every prompt's tokens."""
    from kvmesh.events.wire import BlockStored

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


def query_tokens(prompts: list[list[int]], n_blocks: int, query_blocks: int, bs: int) -> list[int]:
    """Prompt 5 (cached whole on one worker, its prefix on all) followed by unknown blocks."""
    rng = random.Random(1)
    return prompts[5] + [rng.randrange(150_000) for _ in range((query_blocks - n_blocks) * bs)]


def routers(models, sequences: int, blocks: int, bs: int, query_blocks: int):
    """``({model: router}, request)`` on the set-up above; a model of None is the revision's
    default configuration (a revision older than ``--router-cost-model`` has no such setting)."""
    from kvmesh.events.wire import EventBatch
    from kvmesh.hashing import block_hashes
    from kvmesh.router.core.config import RouterConfig
    from kvmesh.router.core.kv_router import KvRouter, RouteRequest

    eight, prompts = workload(sequences, blocks, bs, 8)
    tokens = query_tokens(prompts, blocks, query_blocks, bs)
    out = {}
    for model in models:
        extra = {} if model is None else {"router_cost_model": model}
        router = KvRouter(RouterConfig(router_queue_threshold=None, **extra), random.Random(0))
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
        out[model] = router
    return out, RouteRequest("r", block_hashes(tokens, bs), len(tokens))


def time_routes(router, req, samples: int) -> list[float]:
    """Seconds per decision, GC off while timing; each decision's request is finished after it."""
    out = []
    for _ in range(samples):
        gc.disable()
        t0 = time.perf_counter()
        router.route(req, 0.0)
        out.append(time.perf_counter() - t0)
        gc.enable()
        router.finished(req.request_id, 0.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        choices=("default", "dynamo", "latency"),
        default="default",
        help="--router-cost-model to time: dynamo, latency, or default (the revision's own default)",
    )
    ap.add_argument("--samples", type=int, default=200, help="decisions timed (default 200)")
    ap.add_argument("--sequences", type=int, default=10_000, help="cached prompts (default 10000)")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per cached prompt (default 64)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    ap.add_argument(
        "--query-blocks", type=int, default=2048, help="blocks of the routed request (default 2048)"
    )
    args = ap.parse_args()
    # the set-up needs the 100 shared prefixes' prompts and whole prefixes in every prompt and query
    for flag, value, least in (
        ("--samples", args.samples, 1),
        ("--block-size", args.block_size, 1),
        ("--sequences", args.sequences, PREFIXES),
        ("--blocks", args.blocks, PREFIX_BLOCKS),
        ("--query-blocks", args.query_blocks, args.blocks),
    ):
        if value < least:
            ap.error(f"{flag} must be at least {least}, got {value}")
    import kvmesh

    model = None if args.model == "default" else args.model
    made, req = routers([model], args.sequences, args.blocks, args.block_size, args.query_blocks)
    samples = time_routes(made[model], req, args.samples)
    print(json.dumps({"kvmesh": kvmesh.__file__, "model": args.model, "samples_s": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
