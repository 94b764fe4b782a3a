"""The demo's verdict lines say which way a ratio goes: a run slower than the baseline reads as
slower, not as "x0.91 faster"."""

from __future__ import annotations

from kvmesh.commands.demo import comparison_line


def _summary(p50: float | None, p90: float | None, hits: float) -> dict:
    return {"ttft_s": {"p50": p50, "p90": p90}, "prefix_hit_ratio": hits}


def test_a_faster_and_a_slower_percentile_each_read_the_right_way() -> None:
    kv = _summary(0.1271, 0.2876, 0.763)
    dynamo = _summary(0.1157, 0.4828, 0.725)
    line = comparison_line(kv, dynamo, "Dynamo's cost")
    assert line == (
        "KV routing (latency cost) vs Dynamo's cost: TTFT p50 1.10x slower, p90 1.68x faster, "
        "prefix hit ratio 76% vs 72%"
    )


def test_no_verdict_without_ttfts() -> None:
    assert comparison_line(_summary(None, None, 0.0), _summary(0.1, 0.2, 0.5), "round-robin") is None
    assert comparison_line(_summary(0.1, 0.2, 0.5), _summary(0.1, None, 0.5), "round-robin") is None
