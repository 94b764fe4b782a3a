"""Batches of prompts, each request carrying many, through each front in the same run.

    .venv/bin/python benchmarks/prompt_batches.py [--engines 4] [--batches 24] [--batch-size 16]
        [--tasks 8] [--tasks-per-batch 2] [--context-words 600] [--question-words 30]
        [--max-tokens 4] [--concurrency 2] [--rounds 3] [--api completions|generate]
        [--fronts kvmesh,sglang,round-robin] [--seed 0]

An evaluation harness sends its prompts in batches: ``/v1/completions`` with a list of prompts
(lm-evaluation-harness's ``local-completions`` with ``batch_size``), or SGLang's ``/generate`` with
a list of texts. Here ``--tasks`` tasks each have a few-shot context of ``--context-words`` words,
and each prompt is one task's context with a question of its own; a batch holds ``--batch-size``
prompts of ``--tasks-per-batch`` tasks (a harness sorting its requests by length mixes tasks in a
batch). ``--batches`` batches go out, ``--concurrency`` at a time, to a fresh fleet of ``--engines``
``kvmesh mock`` engines (``--speedup 1``: the fitted GPU step times) per front and round.

Fronts: ``kvmesh`` (``kvmesh router``, the default cost: it routes each prompt of a batch on its
own prefix), ``round-robin`` (``kvmesh router --router-mode round-robin``: each prompt to the next
engine) and ``sglang`` (sglang-router 0.3.2 ``cache_aware``, from the ``bench`` extra: it sends a
batch whole to one engine). Reported per front: a batch's time to its whole answer (p50, p90),
prompts answered per second, the engines' own prefix-cache hit ratio (their
``vllm:prefix_cache_hits`` over ``queries``), prompts per engine, and errors; then kvmesh against
each other front, round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import chosen_fronts, machine, percentile, run_rounds, spread, table
from routing_quality import ENGINE_ARGS, MODEL  # (the suite's engines: the fitted GPU step times)

from kvmesh.bench.fleet import FrontCommand, kvmesh_router, parse_metrics, sglang_router, start_fleet
from kvmesh.commands.argtypes import positive_int


def fronts() -> dict[str, FrontCommand]:
    out = {"kvmesh": kvmesh_router(), "round-robin": kvmesh_router("--router-mode", "round-robin")}
    if importlib.util.find_spec("sglang_router") is not None:
        out["sglang"] = sglang_router("cache_aware")
    else:
        print("sglang-router is not installed (pip install -e '.[bench]'): left out", file=sys.stderr)
    return out


def batches(args: argparse.Namespace, seed: int) -> list[list[str]]:
    """The prompts of every batch, the same for every front of a round."""
    rng = random.Random(seed)
    contexts = [
        f"Task {t}. " + " ".join(f"t{t}w{rng.randrange(4000)}" for _ in range(args.context_words))
        for t in range(args.tasks)
    ]
    out = []
    for _ in range(args.batches):
        chosen = rng.sample(range(args.tasks), min(args.tasks_per_batch, args.tasks))
        prompts = []
        for i in range(args.batch_size):
            question = " ".join(f"q{rng.randrange(4000)}" for _ in range(args.question_words))
            prompts.append(f"{contexts[chosen[i % len(chosen)]]}\nQuestion: {question}\nAnswer:")
        out.append(prompts)
    return out


def body(api: str, prompts: list[str], max_tokens: int) -> tuple[str, dict[str, Any]]:
    if api == "generate":
        return "/generate", {
            "text": prompts,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
        }
    return "/v1/completions", {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


def answered(api: str, doc: Any) -> int:
    """How many prompts a batch's answer answers."""
    if api == "generate":
        return len(doc) if isinstance(doc, list) else 0
    return len(doc.get("choices", ())) if isinstance(doc, dict) else 0


async def run_round(front: FrontCommand, work: list[list[str]], args: argparse.Namespace) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    async with start_fleet(args.engines, ENGINE_ARGS, front) as fleet:
        gate = asyncio.Semaphore(args.concurrency)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def one(prompts: list[str]) -> None:
                nonlocal errors
                path, doc = body(args.api, prompts, args.max_tokens)
                async with gate:
                    t0 = time.perf_counter()
                    async with http.post(fleet.front_url + path, json=doc) as r:
                        answer = await r.json(content_type=None)
                        ok = r.status == 200 and answered(args.api, answer) == len(prompts)
                    if ok:
                        latencies.append(time.perf_counter() - t0)
                    else:
                        errors += 1

            start = time.perf_counter()
            await asyncio.gather(*(one(b) for b in work))
            wall = time.perf_counter() - start
            per_engine, hits, queries = [], 0.0, 0.0
            for url in fleet.engine_urls:
                async with http.get(url + "/metrics") as r:
                    m = parse_metrics(await r.text())
                per_engine.append(int(m.get("vllm:request_success_total", 0)))
                hits += m.get("vllm:prefix_cache_hits_total", 0.0)
                queries += m.get("vllm:prefix_cache_queries_total", 0.0)
    prompts = sum(len(b) for b in work)
    return {
        "p50": percentile(latencies, 50) * 1000 if latencies else float("nan"),
        "p90": percentile(latencies, 90) * 1000 if latencies else float("nan"),
        "rate": prompts / wall,
        "hits": hits / queries if queries else 0.0,
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
        f"engines: {args.engines} x kvmesh mock {' '.join(ENGINE_ARGS)}; {args.batches} batches of "
        f"{args.batch_size} prompts ({args.tasks_per_batch} of {args.tasks} tasks, {args.context_words}-word "
        f"contexts, {args.question_words}-word questions), {args.max_tokens} tokens each, {args.concurrency} "
        f"batches in flight, /{args.api}; rounds {args.rounds}, seeds {args.seed}+round"
    )
    results = await run_rounds(
        names,
        args.rounds,
        lambda r: batches(args, args.seed + r),
        lambda name, work: run_round(available[name], work, args),
    )
    rows = []
    for name in names:
        runs = results[name]
        rows.append(
            [
                name,
                spread([x["p50"] for x in runs], ".1f"),
                spread([x["p90"] for x in runs], ".1f"),
                spread([x["rate"] for x in runs], ".1f"),
                spread([x["hits"] for x in runs], ".3f"),
                " ".join(str(c) for c in runs[-1]["per_engine"]),
                str(sum(x["errors"] for x in runs)),
            ]
        )
    headers = ["front", "batch p50 ms", "batch p90 ms", "prompts/s", "engine prefix hits"]
    print()
    print(table([*headers, "prompts per engine (last round)", "errors"], rows))
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
                    spread([a["p50"] / b["p50"] for a, b in zip(me, other, strict=True)]),
                    spread([a["p90"] / b["p90"] for a, b in zip(me, other, strict=True)]),
                    spread([a["rate"] / b["rate"] for a, b in zip(me, other, strict=True)]),
                    spread([a["hits"] - b["hits"] for a, b in zip(me, other, strict=True)], "+.3f"),
                ]
            )
        if rows:
            print()
            print("kvmesh against each front, round by round (median [min, max]):")
            print(table(["ratio", "batch p50", "batch p90", "prompts/s", "hits difference"], rows))
    return 1 if any(x["errors"] for runs in results.values() for x in runs) else 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", type=positive_int, default=4, help="simulated engines per fleet (default 4)")
    p.add_argument("--batches", type=positive_int, default=24, help="batches sent per round (default 24)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="prompts per batch (default 16)")
    p.add_argument(
        "--tasks", type=positive_int, default=8, help="tasks, each with a context of its own (default 8)"
    )
    p.add_argument(
        "--tasks-per-batch", type=positive_int, default=2, help="tasks mixed in one batch (default 2)"
    )
    p.add_argument(
        "--context-words", type=positive_int, default=600, help="words of a task's context (default 600)"
    )
    p.add_argument("--question-words", type=positive_int, default=30, help="words of a question (default 30)")
    p.add_argument(
        "--max-tokens", type=positive_int, default=4, help="tokens generated per prompt (default 4)"
    )
    p.add_argument("--concurrency", type=positive_int, default=2, help="batches in flight (default 2)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds, each on fresh fleets (default 3)")
    p.add_argument(
        "--api", choices=("completions", "generate"), default="completions", help="the batch's API"
    )
    p.add_argument("--fronts", default="kvmesh,sglang,round-robin", help="fronts to compare, in order")
    p.add_argument("--seed", type=int, default=0, help="round r draws its prompts from seed + r (default 0)")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
