"""Why each request went where it did: a kvmesh front's decisions, read while a run goes on, each
joined to the request it placed.

A kvmesh router keeps its last 64 decisions, with every candidate's cost terms, behind ``GET
/kvmesh/decisions``. :class:`DecisionLog` polls that while a load runs (a few times a second, far
faster than 64 decisions arrive in any of the suite's workloads; a poll that finds all 64 new says
some were missed) and keeps each decision once, stamped with when it was made. :func:`joined` then
gives each decision the session and turn of the request it placed, so a slow request can be read
beside what the router expected of every worker for it: the turn that left its history, and the
price that made it leave.

A decision names the router's own request id, which no client sees, so a request is found by what
both sides know: the worker chosen (the front names it in ``x-kvmesh-worker-id``), the prompt's
length (the chosen candidate's cached blocks and tokens to prefill, within :data:`PROMPT_SLACK` of
what the engine reports) and the time (a decision comes a moment after its request was sent, and
after its wait in the router's queue: the earliest request not yet taken that fits, as a front
decides in the order requests arrive). Decisions the
router made for itself (a hot prefix's copy) match no client request and keep no session.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from kvmesh.bench.runner import RequestResult, RunResult
from kvmesh.router.core.kv_router import DECISION_HISTORY
from kvmesh.router.mesh.runtime import DECISIONS_PATH

WINDOW = DECISION_HISTORY
"""Decisions a router keeps (``GET /kvmesh/decisions`` gives at most this many)."""
POLL_S = 0.25
PROMPT_SLACK = 0.35
"""How far (a share, plus a block) the router's count of a prompt's tokens may be from the
engine's. A prompt no worker holds is routed before it is tokenized, on a count from its bytes
(4,072 tokens for 5,158); otherwise the counts differ by the chat template's few tokens."""
MATCH_WINDOW_S = 0.25
"""How long after it was sent (and beyond any wait in the router's queue, ``queued_s``) a request
may be decided and still be matched to its decision; the earliest fitting request is taken."""
SURE_GAP_S = 0.05
"""A request to the same worker this close before its decision fits whatever the length: a later
turn routed on its earlier turn's blocks is decided on a guess at its length (6,427 for 8,887)."""
CLOCK_SLACK_S = 0.005
"""How far before its send time a decision may read (the clocks are read a moment apart)."""


class DecisionLog:
    """Polls one front's decisions while a run goes on (``async with``): :attr:`decisions`, each
    with ``at`` (``time.monotonic()`` when it was made), oldest first; :attr:`missed` polls found
    every decision new (some between two polls were lost)."""

    def __init__(self, front_url: str) -> None:
        self.url = f"{front_url.rstrip('/')}{DECISIONS_PATH}?limit={WINDOW}"
        self.decisions: list[dict[str, Any]] = []
        self.missed = 0
        self.block_size = 0
        self._seen: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def __aenter__(self) -> DecisionLog:
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        self.decisions.sort(key=lambda d: d["at"])

    async def _poll(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            first = True
            while True:
                stopping = self._stop.is_set()  # (one last read after the run: its last decisions)
                try:
                    async with http.get(self.url) as r:
                        doc = await r.json() if r.status == 200 else None
                    now = time.monotonic()
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    doc = None
                if doc is not None:
                    self._take(doc, now, first)
                    first = False
                if stopping:
                    return
                try:
                    await asyncio.wait_for(self._stop.wait(), POLL_S)
                except asyncio.TimeoutError:
                    pass

    def _take(self, doc: dict[str, Any], now: float, first: bool) -> None:
        self.block_size = int(doc.get("block_size") or 0)
        batch = doc.get("decisions") or []
        new = [d for d in batch if d["request_id"] not in self._seen]
        if not first and len(batch) >= WINDOW and len(new) == len(batch):
            self.missed += 1
        for d in new:
            self._seen.add(d["request_id"])
            d["at"] = now - float(d["age_s"])
            self.decisions.append(d)


def prompt_tokens(decision: dict[str, Any], block_size: int) -> float | None:
    """The prompt's length as the router counted it: the chosen candidate's cached blocks and the
    tokens it had to prefill."""
    for c in decision.get("candidates") or []:
        if c.get("chosen"):
            return float(c["overlap_blocks"] * block_size + c["prefill_tokens"])
    return None


def joined(log: DecisionLog, run: RunResult) -> list[dict[str, Any]]:
    """Every decision of ``log`` (oldest first) with ``at_s`` (seconds since ``run`` started, the
    clock of its requests' ``start``), the ``session``, ``turn`` and ``start_s`` of the request it
    placed (as ``--requests`` writes them: the three name one request, siblings included; None where
    none fits, the router's own requests), and ``moved``: it went elsewhere than the worker holding
    most of the prompt."""
    pending: list[RequestResult] = sorted(
        (r for r in run.results if r.worker_id is not None and r.prompt_tokens is not None),
        key=lambda r: r.start,
    )
    out = []
    for d in log.decisions:
        at_s = d["at"] - run.monotonic_start
        sent_s = at_s - float(d.get("queued_s") or 0.0)  # (a queued request was decided later)
        isl = prompt_tokens(d, log.block_size)
        found = None
        fits = []
        for i, r in enumerate(pending):
            gap = sent_s - r.start
            if gap < -CLOCK_SLACK_S:
                break  # (by send time: every later one was sent after this decision)
            if r.worker_id != d["worker_id"] or gap > MATCH_WINDOW_S:
                continue
            close = (
                isl is not None
                and abs(float(r.prompt_tokens or 0) - isl) <= PROMPT_SLACK * isl + log.block_size
            )
            if close or gap <= SURE_GAP_S:
                fits.append((not close, -gap, i))  # (the earliest: a front decides in arrival order)
        if fits:
            found = pending.pop(min(fits)[2])
        row = {k: v for k, v in d.items() if k not in ("at", "age_s")}
        row["at_s"] = round(at_s, 4)
        row["session"] = found.session_id if found else None
        row["turn"] = found.step if found else None
        row["start_s"] = round(found.start, 6) if found else None  # (its siblings share the turn)
        held = [c["overlap_blocks"] for c in d.get("candidates") or []]
        row["moved"] = bool(held) and d["overlap_blocks"] < max(held)  # (off the worker holding most)
        out.append(row)
    return out
