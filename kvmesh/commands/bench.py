"""``kvmesh bench --url URL``: load-test any OpenAI-compatible endpoint with prefix-heavy workloads."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.workloads import WORKLOADS

    parser.add_argument(
        "--url", required=True, help="base URL(s), comma-separated; sessions are spread round-robin"
    )
    parser.add_argument(
        "--workload", choices=WORKLOADS, default="agentic", help="what to send (default: agentic)"
    )
    parser.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=int, default=None, help="closed loop: sessions in flight (default 8)"
    )
    load.add_argument(
        "--rate", type=float, default=None, help="open loop: sessions started per second (Poisson)"
    )
    parser.add_argument("--sessions", type=int, default=32, help="conversations / groups / bursts to run")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation (agentic, long-context)")
    parser.add_argument("--burst", type=int, default=4, help="siblings per burst (best-of-n)")
    parser.add_argument("--groups", type=int, default=4, help="distinct shared prefixes (agents / documents)")
    parser.add_argument("--prefix-words", type=int, default=600, help="length of shared prefixes in words")
    parser.add_argument(
        "--question-words", type=int, default=40, help="length of per-turn user text in words"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument(
        "--think-time", type=float, default=0.0, help="seconds between an answer and the next turn"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="workload and arrival seed (same seed, same prompts)"
    )
    parser.add_argument(
        "--header", action="append", default=[], metavar="NAME:VALUE", help="extra request header"
    )
    parser.add_argument(
        "--no-nvext", action="store_true", help="do not ask for nvext.worker_id (plain servers)"
    )
    parser.add_argument(
        "--json", dest="json_path", default=None, help="write every request and the summary here"
    )
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from kvmesh.bench import report
    from kvmesh.bench.runner import LoadSpec, Progress, run_workload
    from kvmesh.bench.workloads import WorkloadSpec, build

    urls = tuple(u.strip().rstrip("/") for u in args.url.split(",") if u.strip())
    headers = []
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep:
            print(f"kvmesh bench: --header {item!r} must look like NAME:VALUE", file=sys.stderr)
            return 2
        headers.append((name.strip(), value.strip()))
    spec = WorkloadSpec(
        name=args.workload,
        sessions=args.sessions,
        turns=args.turns,
        burst=args.burst,
        prefix_words=args.prefix_words,
        question_words=args.question_words,
        max_tokens=args.max_tokens,
        groups=args.groups,
        seed=args.seed,
    )
    sessions = build(spec)
    load = LoadSpec(
        urls=urls,
        model=args.model,
        concurrency=None if args.rate else (args.concurrency or 8),
        rate=args.rate,
        think_time=args.think_time,
        ask_worker_id=not args.no_nvext,
        headers=tuple(headers),
        seed=args.seed,
    )
    total = sum(s.total_requests for s in sessions)
    progress = Progress(total, args.workload, enabled=False if args.no_progress else None)
    result = asyncio.run(run_workload(args.workload, sessions, load, progress=progress))
    summary = report.summarize(result)
    print(report.format_table([summary]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report.to_json([result], [summary]), indent=1))
        print(f"wrote {args.json_path}")
    if args.plot:
        print(f"wrote {report.write_plot([result], [summary], args.plot)}")
    return 0 if summary["ok"] else 1
