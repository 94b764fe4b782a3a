"""Turn by turn: what each router's requests cost at each turn of a multi-turn case.

    .venv/bin/python benchmarks/turns_plot.py --case 'agent-long x4 (turns=12)' \\
        before=/tmp/old.jsonl after=/tmp/new-1.jsonl,/tmp/new-2.jsonl --out docs/turns.png

Reads the ``--requests`` files of ``benchmarks/routing_quality.py`` runs (one JSON object a
request) under labels, several files under one label being more rounds of the same thing, and
draws for one case the mean time to first token and the prompt tokens prefilled (not cached) at
every turn, one line per label and router, the tokens averaged over rounds. A table of the same
numbers prints. Where a multi-turn case's tail comes from (late turns that find their history
gone) shows here and not in the suite's percentiles.

A second table counts, per turn and round, the requests **moved**: served by an engine that served
none of its session's previous turn (a router that moves a conversation prefills its history again
there), with the prompt tokens those moved requests prefilled (and the plot, a third panel of the
requests moved). Where a router's prefix hits went shows there. It needs the engine of each
request, which the suite records for a kvmesh front (``engine``); another router's moves print as
``-`` and draw no line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _rows(paths: list[Path], case: str, routers: set[str] | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(index of the file, request)`` for the answered requests of ``case`` by ``routers``."""
    for i, path in enumerate(paths):
        with path.open() as f:
            for line in f:
                row = json.loads(line)
                if row["case"] != case or row.get("error") or (routers and row["router"] not in routers):
                    continue
                yield i, row


def load(labelled: list[tuple[str, list[Path]]], case: str, routers: set[str] | None):
    """``{(label, router): {turn: (mean TTFT ms, mean uncached tokens per round)}}``."""
    out: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for label, paths in labelled:
        ttft: dict[tuple[str, int], list[float]] = defaultdict(list)
        uncached: dict[tuple[str, int], float] = defaultdict(float)
        rounds: dict[str, set[tuple[int, int]]] = defaultdict(set)
        for i, row in _rows(paths, case, routers):
            key = (row["router"], row["turn"])
            ttft[key].append(row["ttft_ms"])
            uncached[key] += row["prompt_tokens"] - (row["cached_tokens"] or 0)
            rounds[row["router"]].add((i, row["round"]))
        for (router, turn), values in ttft.items():
            n_rounds = len(rounds[router])
            out.setdefault((label, router), {})[turn] = (
                sum(values) / len(values),
                uncached[(router, turn)] / n_rounds,
            )
    return out


def moves(labelled: list[tuple[str, list[Path]]], case: str, routers: set[str] | None):
    """``{(label, router): {turn: (requests moved, prompt tokens they prefilled), per round}}``,
    for the routers whose requests all name their engine; a request is moved when no request of
    its session's previous turn (same file and round) was served by its engine."""
    out: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for label, paths in labelled:
        served: dict[tuple[int, int, str, str], dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
        rows: list[tuple[int, int, str, str, int, int, int]] = []
        blind: set[str] = set()
        for i, row in _rows(paths, case, routers):
            engine = row.get("engine")
            if engine is None:
                blind.add(row["router"])
                continue
            key = (i, row["round"], row["router"], row["session"])
            served[key][row["turn"]].add(engine)
            prefilled = row["prompt_tokens"] - (row["cached_tokens"] or 0)
            rows.append((*key, row["turn"], engine, prefilled))
        counts: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
        rounds: dict[str, set[tuple[int, int]]] = defaultdict(set)
        for i, rnd, router, session, turn, engine, prefilled in rows:
            rounds[router].add((i, rnd))
            counts[(router, turn)]  # every turn gets a cell, 0 where nothing moved
            before = served[(i, rnd, router, session)].get(turn - 1)
            if before and engine not in before:
                counts[(router, turn)][0] += 1
                counts[(router, turn)][1] += prefilled
        for (router, turn), (moved, tokens) in counts.items():
            if router in blind:
                continue  # some of its requests do not say where they went: no count is honest
            n = len(rounds[router])
            out.setdefault((label, router), {})[turn] = (moved / n, tokens / n)
    return out


def _count(per_round: float) -> str:
    """A count per round: whole when it is whole (as it always is over one round), else to a
    tenth."""
    return f"{per_round:.0f}" if abs(per_round - round(per_round)) < 1e-9 else f"{per_round:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "runs",
        nargs="+",
        metavar="LABEL=PATH[,PATH...]",
        help="--requests files of suite runs, labelled (several under one label: more rounds)",
    )
    ap.add_argument("--case", required=True, help="the case to draw, as the suite names it")
    ap.add_argument(
        "--routers", default="", help="comma-separated routers to draw (default: all in the files)"
    )
    ap.add_argument("--out", default="", help="PNG path ('' for the table alone)")
    args = ap.parse_args(argv)
    labelled = []
    for run in args.runs:
        label, sep, joined = run.partition("=")
        paths = [Path(p) for p in joined.split(",") if p]
        if not sep or not label or not paths:
            ap.error(f"{run!r}: expected LABEL=PATH[,PATH...]")
        for path in paths:
            if not path.is_file():
                ap.error(f"{path}: no such file")
        labelled.append((label, paths))
    routers = {r for r in args.routers.split(",") if r} or None
    lines = load(labelled, args.case, routers)
    if not lines:
        by = f" by {', '.join(sorted(routers))}" if routers else ""
        files = ", ".join(str(p) for _, ps in labelled for p in ps)
        ap.error(f"no request of case {args.case!r}{by} in {files}")
    turns = sorted({t for by_turn in lines.values() for t in by_turn})
    print(f"{args.case}: mean TTFT ms / prompt tokens prefilled (thousands, per round) at each turn")
    print("| run | " + " | ".join(f"turn {t}" for t in turns) + " | total prefilled |")
    print("|---" * (len(turns) + 2) + "|")
    for (label, router), by_turn in lines.items():
        cells = [f"{by_turn[t][0]:.0f} / {by_turn[t][1] / 1000:.1f}k" if t in by_turn else "-" for t in turns]
        total = sum(v[1] for v in by_turn.values())
        print(f"| {label} {router} | " + " | ".join(cells) + f" | {total / 1000:.1f}k |")
    moved = moves(labelled, args.case, routers)
    print()
    print(f"{args.case}: requests moved / prompt tokens they prefilled (thousands), per round, at each turn")
    print("| run | " + " | ".join(f"turn {t}" for t in turns) + " | total moved |")
    print("|---" * (len(turns) + 2) + "|")
    for label, router in lines:
        by_turn = moved.get((label, router))
        if by_turn is None:
            print(f"| {label} {router} | " + " | ".join("-" for _ in turns) + " | - |")
            continue
        cells = [
            f"{_count(by_turn[t][0])} / {by_turn[t][1] / 1000:.1f}k" if t in by_turn else "-" for t in turns
        ]
        n = sum(v[0] for v in by_turn.values())
        tokens = sum(v[1] for v in by_turn.values())
        print(f"| {label} {router} | " + " | ".join(cells) + f" | {_count(n)} / {tokens / 1000:.1f}k |")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right, third) = plt.subplots(1, 3, figsize=(17, 4.2))
        for (label, router), by_turn in lines.items():
            xs = sorted(by_turn)
            name = f"{label}: {router}"
            (line,) = left.plot(xs, [by_turn[t][0] for t in xs], marker="o", label=name)
            color = line.get_color()  # the same run in the same colour on every panel
            right.plot(xs, [by_turn[t][1] / 1000 for t in xs], marker="o", label=name, color=color)
            moved_by_turn = moved.get((label, router))
            if moved_by_turn is not None:  # (a router that does not name its engines has no line)
                xs = sorted(moved_by_turn)
                third.plot(xs, [moved_by_turn[t][0] for t in xs], marker="o", label=name, color=color)
        left.set(title=f"{args.case}: mean time to first token", xlabel="turn", ylabel="ms")
        right.set(title="prompt tokens prefilled (not cached), per round", xlabel="turn", ylabel="thousands")
        third.set(
            title="requests moved off their session's engine, per round", xlabel="turn", ylabel="requests"
        )
        for ax in (left, right, third):
            ax.set_xticks(turns)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out, dpi=100)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
