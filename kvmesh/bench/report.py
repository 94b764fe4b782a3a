"""Summaries of bench runs: a text table, a JSON document and an optional PNG plot.

The prefix hit ratio is what the *engine* reported (``usage.prompt_tokens_details.cached_tokens``
summed over prompt tokens), not what a router predicted. Per-worker spread comes from the
``nvext.worker_id`` echo (or the ``x-kvmesh-worker-id`` header); plain servers leave it empty.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.bench.runner import RequestResult, RunResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(run: RunResult) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.chunk_gaps]
    latencies = [r.latency for r in ok if r.latency is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok if r.cached_tokens is not None)
    cached = sum(r.cached_tokens or 0 for r in ok if r.cached_tokens is not None)
    output = sum(r.completion_tokens if r.completion_tokens is not None else r.output_chunks for r in ok)
    workers = Counter(r.worker_id for r in ok if r.worker_id is not None)
    duration = max(run.duration, 1e-9)
    errors = Counter((r.error or "")[:80] for r in run.results if not r.ok)
    return {
        "name": run.name,
        "requests": len(run.results),
        "ok": len(ok),
        "errors": len(run.results) - len(ok),
        "error_kinds": dict(errors.most_common(5)),
        "duration_s": run.duration,
        # the mean beside the quantiles: a router that trades a request's own wait for the waits it
        # causes others shows it in the mean and the tail, not the median
        "ttft_s": {**{f"p{q}": percentile(ttfts, q) for q in (50, 90, 99)}, "mean": _mean(ttfts)},
        "itl_s": {f"p{q}": percentile(gaps, q) for q in (50, 90, 99)},
        "latency_s": {f"p{q}": percentile(latencies, q) for q in (50, 90, 99)},
        "throughput_rps": len(ok) / duration,
        "output_tokens_per_s": output / duration,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_hit_ratio": (cached / prompt) if prompt else None,
        "per_worker": dict(sorted(workers.items())),
        "worker_spread": _spread(workers),
        "bursts": _bursts(ok),
    }


def _bursts(ok: Sequence[RequestResult]) -> dict[str, Any] | None:
    """Where a workload sends bursts (several requests for one step of a session: best-of-n,
    parallel tool calls), the first-sent request's TTFT and its siblings', apart; None without
    bursts.

    They are apart because an engine takes a burst in two ways: siblings that reach it before the
    step the first one starts share that step (and its prefix), and the later ones wait for it to
    end and run a step of their own. A router that keeps a burst on the engine holding its context
    keeps its cache hits but pays that second step; one that spreads the siblings over engines
    holding copies of the context pays for the copies in hits instead.

    ``siblings_uncached``: of the siblings whose usage reported their cached tokens, the share
    that found under half their prompt cached where they ran (they computed their context again,
    or shared a step with the first one before it was cached), and their TTFT p50. It is read from
    the engines' usage, so it is the same for every router, whether or not its front says where a
    request went."""
    steps: dict[tuple[str, int], list[tuple[float, float, bool | None]]] = {}  # per step
    for r in ok:
        if r.ttft is not None:
            cold = (
                None
                if r.prompt_tokens is None or r.cached_tokens is None
                else 2 * r.cached_tokens < r.prompt_tokens
            )
            steps.setdefault((r.session_id, r.step), []).append((r.start, r.ttft, cold))
    firsts: list[float] = []
    rest: list[float] = []
    told = 0  # siblings whose cached tokens are known
    uncached: list[float] = []  # ... the TTFTs of those with under half their prompt cached
    for group in steps.values():
        if len(group) < 2:
            continue
        group.sort(key=lambda g: g[:2])  # by start (then TTFT), never by the None-or-bool
        firsts.append(group[0][1])
        for _, ttft, cold in group[1:]:
            rest.append(ttft)
            if cold is not None:
                told += 1
                if cold:
                    uncached.append(ttft)
    if not firsts:
        return None
    return {
        "count": len(firsts),
        "first_ttft_s": {"p50": percentile(firsts, 50), "mean": _mean(firsts)},
        "siblings_ttft_s": {"p50": percentile(rest, 50), "mean": _mean(rest)},
        "siblings_uncached": {
            "share": len(uncached) / told if told else None,
            "ttft_p50_s": percentile(uncached, 50) if uncached else None,
        },
    }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _spread(workers: Counter[str]) -> float | None:
    """max/min requests per worker (1.0 = perfectly even); None without worker ids."""
    if not workers:
        return None
    counts = list(workers.values())
    return max(counts) / max(min(counts), 1)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One column per run, one row per metric."""
    rows: list[tuple[str, list[str]]] = [
        ("requests (ok/total)", [f"{s['ok']}/{s['requests']}" for s in summaries]),
        ("TTFT p50 (ms)", [_ms(s["ttft_s"]["p50"]) for s in summaries]),
        ("TTFT p90 (ms)", [_ms(s["ttft_s"]["p90"]) for s in summaries]),
        ("TTFT p99 (ms)", [_ms(s["ttft_s"]["p99"]) for s in summaries]),
        ("ITL p50 (ms)", [_ms(s["itl_s"]["p50"]) for s in summaries]),
        ("ITL p90 (ms)", [_ms(s["itl_s"]["p90"]) for s in summaries]),
        ("latency p50 (ms)", [_ms(s["latency_s"]["p50"]) for s in summaries]),
        ("throughput (req/s)", [f"{s['throughput_rps']:.2f}" for s in summaries]),
        ("output tokens/s", [f"{s['output_tokens_per_s']:.1f}" for s in summaries]),
        ("prefix hit ratio", [_pct(s["prefix_hit_ratio"]) for s in summaries]),
        *_burst_rows(summaries),
        ("duration (s)", [f"{s['duration_s']:.1f}" for s in summaries]),
        ("per-worker requests", [_workers(s["per_worker"]) for s in summaries]),
    ]
    names = [str(s["name"]) for s in summaries]
    label_width = max(len(r[0]) for r in rows)
    widths = [max(len(names[i]), *(len(r[1][i]) for r in rows)) for i in range(len(names))]
    lines = ["  ".join([" " * label_width, *(n.rjust(w) for n, w in zip(names, widths, strict=True))])]
    lines.append("  ".join(["-" * label_width, *("-" * w for w in widths)]))
    for label, cells in rows:
        lines.append(
            "  ".join([label.ljust(label_width), *(c.rjust(w) for c, w in zip(cells, widths, strict=True))])
        )
    return "\n".join(lines)


def _burst_rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    if not any(s.get("bursts") for s in summaries):
        return []
    got = [s.get("bursts") or {} for s in summaries]
    return [
        ("burst: first TTFT p50 (ms)", [_ms(b["first_ttft_s"]["p50"]) if b else "-" for b in got]),
        ("burst: siblings TTFT p50 (ms)", [_ms(b["siblings_ttft_s"]["p50"]) if b else "-" for b in got]),
        (
            "burst: siblings under half cached",
            [_pct(b["siblings_uncached"]["share"]) if b else "-" for b in got],
        ),
    ]


def _workers(per_worker: dict[str, int]) -> str:
    if not per_worker:
        return "-"
    return " ".join(str(n) for _, n in sorted(per_worker.items()))


def to_json(runs: Sequence[RunResult], summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": [
            {
                "summary": s,
                "requests": [
                    {
                        "session": r.session_id,
                        "step": r.step,
                        "url": r.url,
                        "start_s": r.start,
                        "ttft_s": r.ttft,
                        "latency_s": r.latency,
                        "output_chunks": r.output_chunks,
                        "prompt_tokens": r.prompt_tokens,
                        "cached_tokens": r.cached_tokens,
                        "worker_id": r.worker_id,
                        "error": r.error,
                    }
                    for r in run.results
                ],
            }
            for run, s in zip(runs, summaries, strict=True)
        ]
    }


def write_plot(runs: Sequence[RunResult], summaries: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """TTFT distribution (CDF), prefix hit ratio and per-worker load, one colour per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'kvmesh[plot]'") from None
    fig, (ax_cdf, ax_hit, ax_workers) = plt.subplots(1, 3, figsize=(15, 4.5))
    for run in runs:
        ttfts = sorted(r.ttft * 1000 for r in run.results if r.ok and r.ttft is not None)
        if ttfts:
            ax_cdf.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=run.name)
    ax_cdf.set_xlabel("time to first token (ms)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.grid(alpha=0.3)
    ax_cdf.legend()
    names = [str(s["name"]) for s in summaries]
    hits = [100 * (s["prefix_hit_ratio"] or 0.0) for s in summaries]
    ax_hit.bar(names, hits, color=[f"C{i}" for i in range(len(names))])
    ax_hit.set_ylabel("engine-reported prefix hit ratio (%)")
    ax_hit.set_title("Prefix cache hits")
    # Runs may use different workers (fresh fleets on new ports): compare them by position.
    columns = max((len(s["per_worker"]) for s in summaries), default=0)
    width = 0.8 / max(len(summaries), 1)
    for i, s in enumerate(summaries):
        counts = [n for _, n in sorted(s["per_worker"].items())]
        ax_workers.bar([j + i * width for j in range(len(counts))], counts, width=width, label=s["name"])
    ax_workers.set_xticks([j + width * (len(summaries) - 1) / 2 for j in range(columns)])
    ax_workers.set_xticklabels([f"worker {j + 1}" for j in range(columns)])
    ax_workers.set_ylabel("requests")
    ax_workers.set_title("Requests per worker")
    if columns:
        ax_workers.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
