"""Whether a burst's requests share one engine step: sent straight to an idle engine, and through a front.

    .venv/bin/python benchmarks/burst_joins.py [--burst 4] [--trials 12] [--staggers 0,0.5,1,2]
        [--fronts engine,kvmesh,sglang] [--context-words 700] [--tail-words 60]

The ``siblings`` workload of ``routing_quality.py`` (best-of-n samples, parallel tool calls) loses its
median where a burst's first request reaches an idle engine and starts a step alone: the others
arrive while that step runs and wait for it. This measures how often that happens before any
routing choice is involved. One ``kvmesh mock`` engine (``--speedup 1``: the fitted GPU step
times), idle between bursts; ``--burst`` identical chat requests of the suite's kind of text
(``siblings``' sizes by default) sent together by this process, each ``--staggers`` milliseconds
after the one before, ``--trials`` times per setting:

* ``cold``: a context no one has sent before (``--context-words`` words);
* ``warm``: the context sent once first, then the burst adds ``--tail-words`` words to it (a later
  step of an agent: its history cached, a new tail).

Paths (``--fronts``): ``engine`` (straight to the engine), ``kvmesh`` (``kvmesh router`` in front,
one worker, the built-in tokenizer) and ``sglang`` (sglang-router 0.3.2 ``cache_aware``, from the
``bench`` extra; left out when it is not installed). From the engine's own ``--request-log``:
the steps a burst was taken into (1 = all shared the first one's step), and the spread of its
arrivals at the engine (last minus first); from the client: the first-sent request's TTFT and the
others'. A path whose bursts arrive closer together gives the engine more chances to take them in
one step.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, table
from front_latency import ttft_ms  # (max_tokens=2 here: a burst's steps are its prefills)

from kvmesh.bench.fleet import FrontCommand, engine_requests, kvmesh_router, sglang_router, start_fleet
from kvmesh.bench.session import words


async def run_front(name: str, front: FrontCommand | None, args: argparse.Namespace) -> list[list[str]]:
    """Every stagger and prompt kind through one path; one table row each."""
    import aiohttp

    engine_args = ["--speedup", "1", "--block-size", "16", "--num-blocks", "8192"]
    rows = []
    async with start_fleet(1, engine_args, front, request_logs=True) as fleet:
        url = fleet.engine_urls[0] if name == "engine" else fleet.front_url
        rng = random.Random(args.seed)
        async with aiohttp.ClientSession() as http:
            await ttft_ms(http, url, words(rng, 50), 2)  # connections and code paths warm
            for stagger_ms in args.staggers:
                for kind in ("cold", "warm"):
                    steps: Counter[int] = Counter()
                    spreads, firsts, others = [], [], []
                    for _ in range(args.trials):
                        context = words(rng, args.context_words)
                        prompt = context
                        if kind == "warm":
                            await ttft_ms(http, url, context, 2)
                            prompt = f"{context} {words(rng, args.tail_words)}"
                        await asyncio.sleep(0.2)  # the engine idle again
                        seen = len(engine_requests(fleet))  # (the warm-up's and the context's)

                        async def send(i: int, prompt: str = prompt, stagger_ms: float = stagger_ms) -> float:
                            if i and stagger_ms:
                                await asyncio.sleep(i * stagger_ms / 1000.0)
                            return await ttft_ms(http, url, prompt, 2)

                        ttfts = await asyncio.gather(*(send(i) for i in range(args.burst)))
                        await asyncio.sleep(0.1)  # (the engine logs a request when it ends)
                        logged = engine_requests(fleet)
                        burst = logged[seen:]
                        if len(burst) != args.burst:
                            raise RuntimeError(f"{name}: the engine logged {len(burst)} of a burst")
                        steps[len({r["step"] for r in burst})] += 1
                        arrivals = [r["arrival"] for r in burst]
                        spreads.append((max(arrivals) - min(arrivals)) * 1000.0)
                        firsts.append(ttfts[0])
                        others.extend(ttfts[1:])
                    rows.append(
                        [
                            name,
                            f"{stagger_ms:g}",
                            kind,
                            f"{steps[1]}/{args.trials}",
                            " ".join(f"{k}:{v}" for k, v in sorted(steps.items())),
                            f"{statistics.median(spreads):.2f}",
                            f"{statistics.median(firsts):.1f}",
                            f"{statistics.median(others):.1f}",
                        ]
                    )
                    print(f"  {name} stagger {stagger_ms:g} ms {kind}: done", file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=4, help="requests sent together (default 4)")
    ap.add_argument("--trials", type=int, default=12, help="bursts per setting (default 12)")
    ap.add_argument(
        "--staggers",
        default="0,0.5,1,2",
        help="milliseconds between the sends of a burst, comma-separated (default 0,0.5,1,2)",
    )
    ap.add_argument(
        "--fronts",
        default="engine,kvmesh,sglang",
        help="paths to measure: engine (direct), kvmesh, sglang (default all three)",
    )
    ap.add_argument(
        "--context-words", type=int, default=700, help="words of the context (default 700, as `siblings`)"
    )
    ap.add_argument(
        "--tail-words", type=int, default=60, help="words a warm burst adds (default 60, as `siblings`)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' words (default 0)")
    args = ap.parse_args()
    if args.burst < 2:
        ap.error("--burst must be at least 2")
    if args.trials < 1:
        ap.error("--trials must be at least 1")
    try:
        args.staggers = [float(s) for s in args.staggers.split(",") if s.strip()]
    except ValueError:
        ap.error("--staggers must be comma-separated numbers of milliseconds")
    if not args.staggers or any(s < 0 for s in args.staggers):
        ap.error("--staggers must name at least one stagger, none negative")
    fronts = [f.strip() for f in args.fronts.split(",") if f.strip()]
    known = {"engine": None, "kvmesh": kvmesh_router(), "sglang": sglang_router()}  # engine: no front
    unknown = [f for f in fronts if f not in known]
    if unknown or not fronts:
        ap.error(
            f"--fronts: unknown {', '.join(unknown) or '(none given)'}; choose from engine, kvmesh, sglang"
        )
    if "sglang" in fronts and importlib.util.find_spec("sglang_router") is None:
        print("sglang-router is not installed (the bench extra): left out", file=sys.stderr)
        fronts.remove("sglang")

    print(f"machine: {machine()}")
    print(
        f"one kvmesh mock engine (--speedup 1), bursts of {args.burst} identical chat requests, "
        f"{args.trials} per setting; context {args.context_words} words, warm tail {args.tail_words}"
    )
    rows: list[list[str]] = []
    for name in fronts:
        rows += asyncio.run(run_front(name, known[name], args))
    print()
    print(
        table(
            [
                "path",
                "stagger ms",
                "prompt",
                "bursts in one step",
                "steps per burst: bursts",
                "engine arrival spread p50 ms",
                "first TTFT p50 ms",
                "others TTFT p50 ms",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
