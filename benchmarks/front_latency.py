"""What a front router adds to the time to first token of a cold long prompt: same engine, same run.

    .venv/bin/python benchmarks/front_latency.py [--requests 30] [--rounds 3] [--prompt-words 1200]

One ``kvmesh mock`` engine at ``--speedup 1`` (engine time as on a GPU: a 3k-token prefill takes
about 75 ms), and in front of it at once:

* kvmesh's router in round-robin mode: the proxy alone;
* kvmesh's router in kv mode, its default: the proxy, plus tokenizing, hashing and routing;
* sglang-router ``cache_aware`` (``python -m sglang_router.launch_router``), when it is installed.

Every request is a prompt nothing has cached, a cold prefill: in a prefix-heavy fleet these are
the slowest requests, so what a front adds to them is what it adds to the tail. The paths take
turns request by request, the engine alone included, in an order rotated every request. One
request is in flight at a time, so each meets an idle engine. A path's added time is its TTFT
minus that of the direct request made next to it. The tables show the median over rounds with
[min, max], and kvmesh kv's own phase times from its ``/metrics`` (means over all its requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import aiohttp
from _harness import machine, percentile, spread, table
from routing_quality import ENGINE_ARGS, MODEL  # the suite's engines: 2,048 blocks, 8k-token steps

from kvmesh._http import SseLines, sse_data
from kvmesh.bench.fleet import add_front, kvmesh_router, parse_metrics, sglang_router, start_fleet
from kvmesh.bench.session import words

PHASES = ("tokenize", "hashing", "scheduling", "total", "forward", "relay_first")


@dataclass(frozen=True)
class Front:
    name: str
    url: str


async def ttft_ms(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 4) -> float:
    """Milliseconds from sending a streamed chat request to its first generated text."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    lines = SseLines()
    sent = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
        first = None
        async for chunk in r.content.iter_any():
            _, whole, _ = lines.feed(chunk)
            for line in whole.splitlines():
                payload = sse_data(line)
                if first is not None or payload is None or payload.strip() == b"[DONE]":
                    continue
                choices = json.loads(payload).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: the stream ended without text")
    return (first - sent) * 1000.0


def has_sglang_router() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.asynccontextmanager
async def fronts(sglang: bool) -> AsyncIterator[list[Front]]:
    """The engine and every front before it, ready; yields the paths (the engine alone first)."""
    async with start_fleet(1, ENGINE_ARGS, kvmesh_router("--router-mode", "round-robin")) as fleet:
        paths = [Front("engine alone", fleet.engine_urls[0]), Front("kvmesh round-robin", fleet.front_url)]
        paths.append(Front("kvmesh kv (default)", await add_front(fleet, kvmesh_router())))
        if sglang:
            paths.append(Front("sglang-router cache_aware", await add_front(fleet, sglang_router())))
        yield paths


async def run_round(
    http: aiohttp.ClientSession, paths: list[Front], n: int, prompt_words: int, rnd: int, progress: bool
) -> dict[str, list[float]]:
    """``{path: [TTFT ms]}`` over ``n`` turns, each path one fresh prompt a turn."""
    rng = random.Random(rnd)
    out: dict[str, list[float]] = {p.name: [] for p in paths}
    for i in range(n):
        k = i % len(paths)
        for path in paths[k:] + paths[:k]:  # a rotated order: no path always goes first
            prompt = f"Report {rnd}-{i}-{path.name}. " + words(rng, prompt_words)
            out[path.name].append(await ttft_ms(http, path.url, prompt))
            await asyncio.sleep(0.02)  # the engine's KV events go out; the next request finds it idle
        if progress:
            print(f"\rround {rnd + 1}: {i + 1}/{n}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return out


async def kv_phases(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Mean microseconds per request of each phase of kvmesh's ``kvmesh_router_overhead_seconds``."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for phase in PHASES:
        m = parse_metrics(text, f'phase="{phase}"')
        total, count = (
            m.get("kvmesh_router_overhead_seconds_sum"),
            m.get("kvmesh_router_overhead_seconds_count"),
        )
        if total is not None and count:
            out[phase] = total / count * 1e6
    return out


async def main_async(args: argparse.Namespace) -> int:
    sglang = has_sglang_router() and not args.no_sglang
    if not sglang and not args.no_sglang:
        print("sglang-router is not installed (the bench extra): kvmesh's fronts only", file=sys.stderr)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http, fronts(sglang) as paths:
        # a warm-up turn: connections, the tokenizer's piece cache, every front's first request
        await run_round(http, paths, 3, args.prompt_words, 10_000, progress=False)
        rounds = [
            await run_round(http, paths, args.requests, args.prompt_words, r, not args.no_progress)
            for r in range(args.rounds)
        ]
        phases = await kv_phases(http, paths[2].url)
    direct = paths[0].name
    rows = []
    for path in paths:
        ttft_meds = [statistics.median(r[path.name]) for r in rounds]
        if path.name == direct:
            rows.append([path.name, spread(ttft_meds), "-", "-"])
            continue
        added = [[t - d for t, d in zip(r[path.name], r[direct], strict=True)] for r in rounds]
        rows.append(
            [
                path.name,
                spread(ttft_meds),
                spread([statistics.median(a) for a in added]),
                spread([percentile(a, 90) for a in added]),
            ]
        )
    print(f"machine: {machine()}")
    print(
        f"{args.rounds} rounds of {args.requests} cold prompts of {args.prompt_words} words per path, "
        "one at a time, paths in turn"
    )
    print()
    print(table(["path", "TTFT median ms", "added median ms", "added p90 ms"], rows))
    if phases:
        print()
        print(
            table(
                ["kvmesh kv (its /metrics)", *(f"{p} us" for p in PHASES)],
                [["mean per request", *(f"{phases.get(p, float('nan')):.0f}" for p in PHASES)]],
            )
        )
        # why total can be below tokenize (kvmesh.router.request.parse's DeferredPrompt)
        print(
            "(a prompt no engine holds is routed on its first block, before it is tokenized, and is "
            "tokenized and hashed after it is sent: the tokenize and hashing columns count that "
            "time, total, arrival to decision, does not, so it can be the smaller; forward runs from "
            "the decision to the request written to the engine, relay_first from the first token's "
            "arrival from the engine to its hand-off to the client)"
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="cold prompts per path per round (default 30)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each with its own prompts (default 3)")
    ap.add_argument(
        "--prompt-words", type=int, default=1200, help="words per prompt (default 1200: about 2,850 tokens)"
    )
    ap.add_argument("--no-sglang", action="store_true", help="leave sglang-router out even when installed")
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    args = ap.parse_args()
    for name in ("requests", "rounds", "prompt_words"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
