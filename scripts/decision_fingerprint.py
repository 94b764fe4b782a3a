"""A fingerprint of the router core's decisions on seeded synthetic traffic, for refactors.

    .venv/bin/python scripts/decision_fingerprint.py [--requests 1500] [--seed 1]

Prints one fingerprint per configuration (the latency cost on 6 and 8 workers, Dynamo's cost, the
latency cost with temperature, the latency cost leaving copies of a shared prefix to the front)
and how many decisions went into it. A change meant to make ``KvRouter`` faster without changing
what it decides must leave every fingerprint as it was: run this before and after, and compare.
(A test cannot pin the values: any deliberate change to the cost changes them.) With a compiled
build (``kvmesh native build``) it runs compiled; ``KVMESH_NATIVE=0`` runs the same code as
Python, which must print the same fingerprints.

The traffic runs in virtual time through the pure core: conversations that grow turn by turn over
a few shared system prompts, one request in five sent as three siblings, first tokens and finishes
at times that depend on each request's uncached prompt, stored-block events for every prompt and
the engine's reported cached tokens, so the conversation tracking, the copy credit, the delay to
arrivals, the eviction price and the tie rule all take part. Each candidate's cost terms are
fingerprinted, rounded to 6 decimals.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.hashing import block_hashes
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import Decision, KvRouter, RouteRequest

BLOCK = 16


def fingerprint(
    seed: int, requests: int, *, model: str, workers: int, temperature: float, background: bool = False
) -> tuple[str, int]:
    """``(hex digest, decisions)`` of one seeded run. With ``background``, the requests let the
    router name copies of a shared prefix for the front to make, and each is made as the front
    makes it: counted on its worker at once, its blocks stored and its load freed once prefilled."""
    rng = random.Random(seed)
    router = KvRouter(
        RouterConfig(router_queue_threshold=None, router_cost_model=model, router_temperature=temperature),
        random.Random(seed),
    )
    for i in range(workers):
        router.add_worker(f"w{i}", total_blocks=600 + 100 * i, max_num_batched_tokens=2048, block_size=BLOCK)
    systems = [[rng.randrange(50_000) for _ in range(rng.choice([200, 800, 1600]))] for _ in range(5)]
    conversations: dict[int, list[int]] = {}
    events: list[tuple[float, float, str, object]] = []
    now = 0.0
    for i in range(requests):
        now += rng.expovariate(40.0)
        if conversations and rng.random() < 0.6:
            cid = rng.choice(list(conversations))
        else:
            cid = i
            conversations[cid] = list(rng.choice(systems))
        conversations[cid] = conversations[cid] + [
            rng.randrange(50_000) for _ in range(rng.randrange(20, 600))
        ]
        if len(conversations[cid]) > 6000:
            del conversations[cid]
            continue
        heapq.heappush(events, (now, i, "request", (f"r{i}", list(conversations[cid]), rng.random() < 0.2)))
    digest = hashlib.sha256()
    decisions = 0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "request":
            rid, tokens, siblings = payload  # type: ignore[misc]
            for k in range(3 if siblings else 1):
                request_id = f"{rid}.{k}"
                hashes = block_hashes(tokens, BLOCK)
                osl = rng.choice([None, 50, 200])
                request = RouteRequest(
                    request_id, hashes, len(tokens), osl=osl, copies_in_background=background
                )
                result = router.route(request, now)
                if not isinstance(result, Decision):
                    digest.update(repr((request_id, type(result).__name__)).encode())
                    continue
                decisions += 1
                copy_named = (result.copy,) if background else ()
                terms = [
                    (
                        s.worker,
                        round(s.cost, 6),
                        round(s.predicted_ttft_ms or 0.0, 6),
                        round(s.copy_credit_ms, 6),
                        round(s.delay_to_others_ms, 6),
                        round(s.eviction_ms, 6),
                        round(s.turns_overlap_ms, 6),
                    )
                    for s in result.breakdown
                ]
                digest.update(
                    # (the copy named, only where the front makes copies: the other configurations'
                    # fingerprints stay comparable with those taken before background copies)
                    repr((request_id, result.worker, result.overlap_blocks, terms, *copy_named)).encode()
                )
                if result.copy is not None:
                    copy_id, n = f"{request_id}.copy", result.copy.blocks
                    router.track(copy_id, result.copy.worker, hashes[:n], n * BLOCK, now)
                    copied = (copy_id, result.copy.worker, tokens[: n * BLOCK])
                    heapq.heappush(events, (now + 0.01 + 0.00002 * n * BLOCK, rng.random(), "copied", copied))
                ttft = 0.01 + 0.00002 * (len(tokens) - result.overlap_blocks * BLOCK) + rng.random() * 0.01
                first = (request_id, result.worker, tokens, result.overlap_blocks * BLOCK)
                heapq.heappush(events, (now + ttft, rng.random(), "first", first))
                heapq.heappush(
                    events, (now + ttft + 0.2 + rng.random() * 0.3, rng.random(), "finish", request_id)
                )
        elif kind == "first":
            request_id, worker, tokens, cached = payload  # type: ignore[misc]
            router.reported_cached(request_id, cached)
            router.first_token(request_id, now)
            router.output_tokens(request_id, 10, now + 0.01)
            hashes = block_hashes(tokens, BLOCK)
            stored = BlockStored(list(hashes), None, tokens[: len(hashes) * BLOCK], BLOCK)
            router.apply_events(worker[0], EventBatch(now, [stored], 0))
        elif kind == "copied":
            copy_id, worker, tokens = payload  # type: ignore[misc]
            hashes = block_hashes(tokens, BLOCK)
            stored = BlockStored(list(hashes), None, tokens, BLOCK)
            router.apply_events(worker[0], EventBatch(now, [stored], 0))
            router.finished(copy_id, now)
        else:
            router.finished(payload, now)  # type: ignore[arg-type]
    return digest.hexdigest()[:16], decisions


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1500, help="arrivals per configuration")
    parser.add_argument(
        "--seed", type=int, default=1, help="traffic seed (each configuration adds its index)"
    )
    args = parser.parse_args()
    configs = [
        ("latency, 6 workers", "latency", 6, 0.0, False),
        ("latency, 8 workers", "latency", 8, 0.0, False),
        ("dynamo, 6 workers", "dynamo", 6, 0.0, False),
        ("latency, temperature 0.5", "latency", 6, 0.5, False),
        ("latency, background copies", "latency", 6, 0.0, True),
    ]
    for i, (label, model, workers, temperature, background) in enumerate(configs):
        digest, n = fingerprint(
            args.seed + i,
            args.requests,
            model=model,
            workers=workers,
            temperature=temperature,
            background=background,
        )
        print(f"{label:26s} {digest}  ({n} decisions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
