"""Tiny shared timing helpers for the benchmark scripts (no dependency beyond the stdlib)."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

W = TypeVar("W")


def time_calls(fn: Callable[[], object], *, repeat: int, warmup: int = 20) -> list[float]:
    """Seconds per call for ``repeat`` calls, GC disabled while timing (it adds noise, not cost)."""
    for _ in range(warmup):
        fn()
    samples = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def spread(values: list[float], fmt: str = ".2f") -> str:
    """``median [min, max]`` of per-round values (just the value for a single round)."""
    mid = format(statistics.median(values), fmt)
    if len(values) == 1:
        return mid
    return f"{mid} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, {platform.platform()}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table, so the output pastes straight into docs/BENCHMARKS.md."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def chosen_fronts(available: Mapping[str, object], spec: str) -> list[str] | None:
    """The fronts a comma-separated ``spec`` names, in order; None, with the reason on stderr,
    when one is unknown or not installed."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown:
        print(
            f"unknown or unavailable fronts: {', '.join(unknown)} (have: {', '.join(available)})",
            file=sys.stderr,
        )
        return None
    return names


async def run_rounds(
    names: list[str],
    rounds: int,
    work_of: Callable[[int], W],
    run_round: Callable[[str, W], Awaitable[dict[str, Any]]],
) -> dict[str, list[dict[str, Any]]]:
    """Each front's result for each round: round ``r``'s work (``work_of(r)``, the same for every
    front) through every front, the fronts' order rotated by round (no front is always first on
    the machine), with progress on stderr."""
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    steps = rounds * len(names)
    done = 0
    for r in range(rounds):
        work = work_of(r)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            results[name].append(await run_round(name, work))
            done += 1
            print(
                f"[{done}/{steps}] round {r + 1}: {name} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr
            )
    return results
