"""Speculative prefill's effect: the next turn's TTFT with and without ``speculative_prefill: true``.

    .venv/bin/python benchmarks/speculative_prefill.py [--conversations 8] [--turns 5] [--think 1.0]

Two fresh fleets (``kvmesh mock`` engines as processes, ``--speedup 1``: the fitted GPU step
times) behind a standalone ``kvmesh router``, one per variant, get the same seeded multi-turn
conversations: every conversation runs its turns in order, a pause (the user or the tool) between
them, all conversations at once. Variant ``on`` sends each turn with
``nvext.agent_hints.speculative_prefill: true``, so after each answer the router sends the
conversation so far (answer included) to the same worker as a ``max_tokens: 1`` warm-up; the next
turn should then find everything but its new message cached. Reported for turns 2.. (the ones a
warm-up can help): TTFT p50 / p90 and the share of prompt tokens the engine reports cached.

What to expect on the simulated engine: like vLLM, it caches the blocks an answer fills while it
is generated, so without a warm-up the next turn already finds most of the answer cached and misses
only the answer's last, partial block and the end-of-turn marks. A warm-up pays off most where the
next prompt diverges from what the engine generated (reasoning removed from the history, a
tokenizer that does not round-trip), which the simulated engine does not model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, percentile, table

from kvmesh.bench.fleet import kvmesh_router, start_fleet
from kvmesh.bench.session import words
from kvmesh.commands.argtypes import non_negative_float, positive_int
from kvmesh.commands.demo import engine_count

ENGINE_ARGS = (
    "--speedup",
    "1",
    "--block-size",
    "16",
    "--num-blocks",
    "4096",
    "--max-num-batched-tokens",
    "8192",
)
MODEL = "kvmesh-mock"


async def turn(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]], answer_tokens: int, speculate: bool
) -> tuple[float, int, int, str]:
    """One streamed turn: (TTFT s, prompt tokens, cached tokens, the answer's text)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": answer_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if speculate:
        body["nvext"] = {"agent_hints": {"speculative_prefill": True}}
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            usage = event.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft or 0.0, int(usage.get("prompt_tokens", 0)), int(cached), "".join(text)


async def conversation(
    http: aiohttp.ClientSession, url: str, seed: int, args: argparse.Namespace, speculate: bool
) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": f"conversation {seed}: " + words(rng, args.system_words)}]
    out = []
    await asyncio.sleep(rng.uniform(0, args.think))  # conversations do not start in lockstep
    for i in range(args.turns):
        messages.append({"role": "user", "content": words(rng, args.user_words)})
        ttft, prompt, cached, answer = await turn(http, url, messages, args.answer_tokens, speculate)
        if i:
            out.append((ttft, prompt, cached))
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(args.think * rng.uniform(0.5, 1.5))
    return out


def warmup_outcomes(metrics: str) -> dict[str, float]:
    """The router's ``kvmesh_speculative_prefills_total`` by outcome."""
    out = {}
    for m in re.finditer(r'^kvmesh_speculative_prefills_total\{outcome="(\w+)"\} (\S+)$', metrics, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


async def run_variant(args: argparse.Namespace, speculate: bool) -> dict[str, float]:
    async with (
        start_fleet(args.engines, ENGINE_ARGS, kvmesh_router()) as fleet,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http,
    ):
        runs = await asyncio.gather(
            *(
                conversation(http, fleet.front_url, seed, args, speculate)
                for seed in range(args.conversations)
            )
        )
        async with http.get(fleet.front_url + "/metrics") as r:
            warmups = warmup_outcomes(await r.text())
    turns = [t for run in runs for t in run]
    ttfts = [t[0] * 1000 for t in turns]
    return {
        "turns": len(turns),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p90_ms": percentile(ttfts, 90),
        "cached_share": sum(t[2] for t in turns) / max(sum(t[1] for t in turns), 1),
        "uncached_per_turn": sum(t[1] - t[2] for t in turns) / max(len(turns), 1),
        "warmups_done": warmups.get("done", 0.0),
        "warmups_cancelled": warmups.get("cancelled", 0.0),
    }


async def main_async(args: argparse.Namespace) -> int:
    results = {}
    for name, speculate in (("off", False), ("on", True)):
        results[name] = await run_variant(args, speculate)
    print(machine())
    print(
        f"{args.engines} engines, {args.conversations} conversations x {args.turns} turns, "
        f"system {args.system_words} words, user {args.user_words} words, answers {args.answer_tokens} tokens, "
        f"think {args.think}s"
    )
    headers = [
        "speculative_prefill",
        "next turns",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "cached share",
        "uncached tok/turn",
        "warm-ups done/cancelled",
    ]
    rows = [
        [
            name,
            str(int(r["turns"])),
            f"{r['ttft_p50_ms']:.1f}",
            f"{r['ttft_p90_ms']:.1f}",
            f"{r['cached_share']:.3f}",
            f"{r['uncached_per_turn']:.1f}",
            f"{r['warmups_done']:.0f}/{r['warmups_cancelled']:.0f}",
        ]
        for name, r in results.items()
    ]
    print(table(headers, rows))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--engines", type=engine_count, default=2, help="simulated engines (1-64, each a process) [2]"
    )
    parser.add_argument("--conversations", type=positive_int, default=8)
    parser.add_argument("--turns", type=positive_int, default=5)
    parser.add_argument("--system-words", type=positive_int, default=300)
    parser.add_argument("--user-words", type=positive_int, default=40)
    parser.add_argument("--answer-tokens", type=positive_int, default=120)
    parser.add_argument(
        "--think", type=non_negative_float, default=1.0, help="mean pause between turns, seconds"
    )
    args = parser.parse_args()
    if args.turns < 2:  # the first turn of a conversation has nothing to warm it: only the next are measured
        parser.error(f"--turns must be at least 2 (the first turn is not measured), got {args.turns}")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
