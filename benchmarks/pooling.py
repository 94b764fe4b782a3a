"""Embedding requests of mixed sizes through each front in the same run.

    .venv/bin/python benchmarks/pooling.py [--engines 4] [--requests 480] [--rate 40]
        [--doc-share 0.15] [--doc-inputs 16] [--doc-words 300] [--query-words 20] [--rounds 3]
        [--fronts kvmesh,sglang,round-robin] [--seed 0]

A retrieval service embeds two kinds of request on one fleet: a user's query (one short input,
waited for by a person) and a document batch from an indexing job (``--doc-inputs`` inputs of
``--doc-words`` words each). ``--requests`` requests, a ``--doc-share`` of them document batches,
arrive at ``--rate`` a second (Poisson arrivals, seeded: the same times for every front, so each
front meets the same load, whatever its speed) as ``POST /v1/embeddings`` at a fresh fleet of
``--engines`` ``kvmesh mock`` engines (``--speedup 1``: each input costs the fitted GPU prefill time
of its tokens) per front and round.

Fronts: ``kvmesh`` (``kvmesh router``: each request to the engine with the fewest requests in
flight), ``round-robin`` (``kvmesh router --router-mode round-robin``: each to the next engine) and
``sglang`` (sglang-router 0.3.2 ``cache_aware``, from the ``bench`` extra, which relays
``/v1/embeddings`` by its policy). Reported per front: a query's time to its answer (p50, p99), a
document batch's (p50), inputs embedded per second, requests per engine, and errors; then kvmesh
against each other front, round by round. Inputs per second reads the rate the fleet kept up
with: below the offered rate, requests were left queued at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import chosen_fronts, machine, percentile, run_rounds, spread, table
from prompt_batches import fronts
from routing_quality import ENGINE_ARGS, MODEL  # (the suite's engines: the fitted GPU step times)

from kvmesh.bench.fleet import FrontCommand, parse_metrics, start_fleet
from kvmesh.commands.argtypes import positive_float, positive_int


def probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def requests(args: argparse.Namespace, seed: int) -> list[tuple[float, list[str]]]:
    """Each request's arrival (seconds from the start) and inputs, the same for every front of a
    round: a query has one input."""
    rng = random.Random(seed)

    def words(n: int, tag: str) -> str:
        return " ".join(f"{tag}{rng.randrange(5000)}" for _ in range(n))

    out = []
    at = 0.0
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        if rng.random() < args.doc_share:
            out.append((at, [words(args.doc_words, "d") for _ in range(args.doc_inputs)]))
        else:
            out.append((at, [words(args.query_words, "q")]))
    return out


async def run_round(
    front: FrontCommand, work: list[tuple[float, list[str]]], args: argparse.Namespace
) -> dict[str, Any]:
    queries: list[float] = []
    docs: list[float] = []
    errors = 0
    async with start_fleet(args.engines, ENGINE_ARGS, front) as fleet:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def one(at: float, inputs: list[str]) -> None:
                nonlocal errors
                doc = {"model": MODEL, "input": inputs[0] if len(inputs) == 1 else inputs}
                await asyncio.sleep(max(start + at - time.perf_counter(), 0.0))
                t0 = time.perf_counter()
                async with http.post(fleet.front_url + "/v1/embeddings", json=doc) as r:
                    answer = await r.json(content_type=None)
                    ok = r.status == 200 and len(answer.get("data", ())) == len(inputs)
                if not ok:
                    errors += 1
                else:
                    (queries if len(inputs) == 1 else docs).append(time.perf_counter() - t0)

            start = time.perf_counter()
            await asyncio.gather(*(one(at, inputs) for at, inputs in work))
            wall = time.perf_counter() - start
            per_engine = []
            for url in fleet.engine_urls:
                async with http.get(url + "/metrics") as r:
                    m = parse_metrics(await r.text())
                per_engine.append(int(m.get("vllm:request_success_total", 0)))

    def ms(samples: list[float], q: float) -> float:
        return percentile(samples, q) * 1000 if samples else float("nan")

    return {
        "query_p50": ms(queries, 50),
        "query_p99": ms(queries, 99),
        "doc_p50": ms(docs, 50),
        "doc_p99": ms(docs, 99),
        "rate": sum(len(inputs) for _, inputs in work) / wall,
        "per_engine": per_engine,
        "errors": errors,
    }


async def main_async(args: argparse.Namespace) -> int:
    available = fronts()
    names = chosen_fronts(available, args.fronts)
    if names is None:
        return 2
    print(f"machine: {machine()}")
    print(
        f"engines: {args.engines} x kvmesh mock {' '.join(ENGINE_ARGS)}; {args.requests} embedding "
        f"requests, {args.doc_share:.0%} of them batches of {args.doc_inputs} {args.doc_words}-word "
        f"documents, the rest {args.query_words}-word queries, arriving at {args.rate:g}/s; rounds "
        f"{args.rounds}, seeds {args.seed}+round"
    )
    results = await run_rounds(
        names,
        args.rounds,
        lambda r: requests(args, args.seed + r),
        lambda name, work: run_round(available[name], work, args),
    )
    rows = []
    for name in names:
        runs = results[name]
        rows.append(
            [
                name,
                spread([x["query_p50"] for x in runs], ".1f"),
                spread([x["query_p99"] for x in runs], ".1f"),
                spread([x["doc_p50"] for x in runs], ".1f"),
                spread([x["doc_p99"] for x in runs], ".1f"),
                spread([x["rate"] for x in runs], ".1f"),
                " ".join(str(c) for c in runs[-1]["per_engine"]),
                str(sum(x["errors"] for x in runs)),
            ]
        )
    headers = ["front", "query p50 ms", "query p99 ms", "batch p50 ms", "batch p99 ms", "inputs/s"]
    print()
    print(table([*headers, "inputs per engine (last round)", "errors"], rows))
    if "kvmesh" in names:
        me = results["kvmesh"]
        rows = []
        for name in names:
            if name == "kvmesh":
                continue
            other = results[name]
            rows.append(
                [
                    f"kvmesh / {name}",
                    *(
                        spread([a[k] / b[k] for a, b in zip(me, other, strict=True)])
                        for k in ("query_p50", "query_p99", "doc_p50", "doc_p99", "rate")
                    ),
                ]
            )
        if rows:
            print()
            print("kvmesh against each front, round by round (median [min, max]):")
            print(table(["ratio", "query p50", "query p99", "batch p50", "batch p99", "inputs/s"], rows))
    return 1 if any(x["errors"] for runs in results.values() for x in runs) else 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", type=positive_int, default=4, help="simulated engines per fleet (default 4)")
    p.add_argument("--requests", type=positive_int, default=480, help="requests sent per round (default 480)")
    p.add_argument(
        "--rate", type=positive_float, default=40.0, help="requests arriving a second (default 40)"
    )
    p.add_argument(
        "--doc-share", type=probability, default=0.15, help="share of document batches (default 0.15)"
    )
    p.add_argument("--doc-inputs", type=positive_int, default=16, help="documents per batch (default 16)")
    p.add_argument("--doc-words", type=positive_int, default=300, help="words of a document (default 300)")
    p.add_argument("--query-words", type=positive_int, default=20, help="words of a query (default 20)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds, each on fresh fleets (default 3)")
    p.add_argument("--fronts", default="kvmesh,sglang,round-robin", help="fronts to compare, in order")
    p.add_argument("--seed", type=int, default=0, help="round r draws its requests from seed + r (default 0)")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
