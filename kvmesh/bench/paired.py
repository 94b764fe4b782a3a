"""How sure a verdict is: a paired bootstrap over sessions of one router's ratio to the baselines.

Every router of a round ran the same sessions, so the routers' requests pair up session by
session. Resampling whole sessions (a session's turns and a burst's siblings are not independent
of each other) with the same draw for every router keeps the pairing: what the traffic itself
happened to hold moves every router alike and cancels in the ratio, and what is left is how much
the verdict could move had other sessions of the same kind been sent. Rounds are strata: each
draw resamples each round's sessions on their own, and a statistic pools the rounds' requests.

The intervals cover the traffic's draw and the noise inside each run, not a difference between
runs (a slow minute of the machine during one router's run); rotating the routers' order over
rounds is what covers that.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Interval", "PairedRequest", "paired_verdicts"]

STATISTICS = ("p50", "p99", "mean", "hits")
"""The verdicts' statistics: TTFT quantiles and mean (a ratio to the best baseline) and the prefix
hit ratio (a difference from the best baseline)."""


@dataclass(frozen=True, slots=True)
class PairedRequest:
    """One request as the bootstrap needs it: its session (within its round), its time to first
    token (None when it failed) and its prompt and cached tokens (None when not reported)."""

    round: int
    session: str
    ttft: float | None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Interval:
    """A statistic's value over the requests as they were, and the bootstrap's interval of it."""

    value: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.value:.2f} ({self.low:.2f}-{self.high:.2f})"


class _Router:
    """One router's requests indexed for weighted statistics: every request of a session takes
    that session's count in the draw as its weight."""

    def __init__(self, requests: Sequence[PairedRequest], unit_of: Mapping[tuple[int, str], int]) -> None:
        n = len(unit_of)
        self.ttft_sum = [0.0] * n
        self.ttft_count = [0] * n
        self.prompt = [0] * n
        self.cached = [0] * n
        timed = []
        for r in requests:
            if r.ttft is None:
                continue
            u = unit_of[(r.round, r.session)]
            timed.append((r.ttft, u))
            self.ttft_sum[u] += r.ttft
            self.ttft_count[u] += 1
            if r.prompt_tokens is not None and r.cached_tokens is not None:
                self.prompt[u] += r.prompt_tokens
                self.cached[u] += r.cached_tokens
        timed.sort()
        self.values = [v for v, _ in timed]
        self.units = [u for _, u in timed]

    def stat(self, name: str, weights: Sequence[int]) -> float | None:
        if name == "mean":
            count = sum(w * c for w, c in zip(weights, self.ttft_count, strict=True))
            total = sum(w * s for w, s in zip(weights, self.ttft_sum, strict=True))
            return total / count if count else None
        if name == "hits":
            prompt = sum(w * p for w, p in zip(weights, self.prompt, strict=True))
            cached = sum(w * c for w, c in zip(weights, self.cached, strict=True))
            return cached / prompt if prompt else None
        return self._quantile(50.0 if name == "p50" else 99.0, weights)

    def _quantile(self, q: float, weights: Sequence[int]) -> float | None:
        """The q-th percentile of the requests repeated by their weights, interpolated as
        :func:`kvmesh.bench.report.percentile` does over the repeated list."""
        values, units = self.values, self.units
        total = sum(weights[u] for u in units)
        if total == 0:
            return None
        pos = (total - 1) * q / 100.0
        lo = int(pos)
        frac = pos - lo
        return _nth(values, units, weights, lo, total) * (1.0 - frac) + (
            _nth(values, units, weights, min(lo + 1, total - 1), total) * frac if frac else 0.0
        )


def _nth(values: Sequence[float], units: Sequence[int], weights: Sequence[int], k: int, total: int) -> float:
    """The k-th (from 0) of ``values`` (sorted) each repeated ``weights[unit]`` times; walked from
    the nearer end, since the verdicts ask for a median and a 99th percentile."""
    if k < total // 2:
        seen = 0
        for v, u in zip(values, units, strict=True):
            seen += weights[u]
            if seen > k:
                return v
    else:
        seen = total
        for v, u in zip(reversed(values), reversed(units), strict=True):
            seen -= weights[u]
            if seen <= k:
                return v
    raise AssertionError("k is within the weighted total")  # pragma: no cover


def paired_verdicts(
    mine: Sequence[PairedRequest],
    baselines: Mapping[str, Sequence[PairedRequest]],
    *,
    draws: int = 1000,
    level: float = 0.90,
    seed: int = 0,
) -> dict[str, Interval | None]:
    """For ``p50``, ``p99``, ``mean``: this router's statistic over the best (lowest) baseline's;
    for ``hits``: its prefix hit ratio less the best (highest) baseline's. Each with the central
    ``level`` interval over ``draws`` paired resamplings of the sessions. None where a statistic
    cannot be had (no timed request, no reported tokens).

    Every router must have run the same sessions in each round (the suite's contract); a session
    one router has no request for counts as empty there, as it would in that router's summary."""
    if not baselines:
        raise ValueError("at least one baseline is needed")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be within (0, 1), got {level}")
    if draws < 1:
        raise ValueError(f"draws must be at least 1, got {draws}")
    everyone = [mine, *baselines.values()]
    keys = sorted({(r.round, r.session) for reqs in everyone for r in reqs})
    unit_of = {k: i for i, k in enumerate(keys)}
    strata: dict[int, list[int]] = {}
    for (rnd, _), i in unit_of.items():
        strata.setdefault(rnd, []).append(i)
    routers = [_Router(reqs, unit_of) for reqs in everyone]

    def verdict(name: str, weights: Sequence[int]) -> float | None:
        own = routers[0].stat(name, weights)
        others = [r.stat(name, weights) for r in routers[1:]]
        known = [o for o in others if o is not None]
        if own is None or not known:
            return None
        if name == "hits":
            return own - max(known)
        best = min(known)
        return own / best if best > 0 else None

    ones = [1] * len(keys)
    rng = random.Random(seed)
    out: dict[str, Interval | None] = {}
    samples: dict[str, list[float]] = {name: [] for name in STATISTICS}
    for _ in range(draws):
        weights = [0] * len(keys)
        for units in strata.values():
            for u in rng.choices(units, k=len(units)):
                weights[u] += 1
        for name in STATISTICS:
            v = verdict(name, weights)
            if v is not None:
                samples[name].append(v)
    tail = (1.0 - level) / 2.0
    for name in STATISTICS:
        value = verdict(name, ones)
        got = sorted(samples[name])
        if value is None or not got:
            out[name] = None
            continue
        low = got[min(len(got) - 1, int(tail * len(got)))]
        high = got[max(0, int((1.0 - tail) * len(got)) - 1)]
        out[name] = Interval(value, low, high)
    return out
