"""Routing quality: the same seeded traffic through each router, in front of fresh simulated fleets.

    .venv/bin/python benchmarks/routing_quality.py [--short] [--rounds N] [--seed-per-round]
        [--workloads W,...] [--contenders NAME,...] [--engines N] [--set KNOB=VALUE ...]
        [--num-blocks N[,N,...]] [--engine-speedups S,S,...] [--block-size TOKENS] [--json PATH]
        [--requests PATH] [--plot PATH]

For every case (a workload on a fleet of 4 or 8 engines) and every contender, a fresh fleet of
``kvmesh mock`` engines starts as real processes on loopback (``--speedup 1``: the fitted GPU step
times, so engine time dominates), a router starts in front of it, and the workload's preset traffic
(``kvmesh bench --workload NAME`` sends the same) runs through the router. Then the next
contender gets its own fresh fleet. The order of the contenders rotates from round to round, so a
slow moment of the shared machine does not always hit the same one. Every round sends the same
traffic (``--seed``), unless ``--seed-per-round`` draws new traffic of the same shape for each
round (seeds ``SEED``, ``SEED + 1``, ...; every contender of a round gets that round's): then the
verdicts' ranges cover the draws of the traffic as well as the machine's noise, which on some
workloads differ far more than the routers do.

Contenders:

* ``round-robin``   ``kvmesh router --router-mode round-robin``;
* ``dynamo``        ``kvmesh router`` with NVIDIA Dynamo's cost (prefill blocks + decode blocks);
* ``sglang``        sglang-router 0.3.2, ``--policy cache_aware`` (the ``bench`` extra installs it);
* ``kvmesh``        ``kvmesh router`` with its default cost (when the router has one beyond Dynamo's);
* ``kvmesh+profile`` the same, with engines that report their timing profile (``--report-profile``);
* ``floor``         not a router, and run only when named: the case's sessions one at a time, on one
                    engine of the fleet's kind (the first engine's flags) behind a one-worker
                    ``kvmesh router``, with no think time. Every request meets an idle engine that
                    holds whatever its own session left there, so a later turn's TTFT is about the
                    least any router in front of the fleet could give it (a first turn finds only
                    what earlier sessions left on that one engine): ``floor / round-robin`` in the
                    verdicts is the lowest ``p50 / round-robin`` the case allows.

Reported per case and contender: TTFT p50/p90/p99, ITL p50, throughput, the engine-reported prefix
hit ratio (``usage.prompt_tokens_details.cached_tokens`` over prompt tokens), requests per engine
(from each engine's own /metrics, so every router is counted the same way) and the engines'
fidelity (real busy step time over modelled: near 1.0 means the 2-core machine kept up). The mean
TTFT is split into the engines' own (``engine TTFT mean ms``: where the requests were placed) and
the front's time in the path (``front ms``, the rest); ``engine TTFT p50 ms`` is the engines' own
median, from each engine's ``--request-log`` (beside the client's p50 it shows whether a median is
lost where the requests were placed or in front of the engines; the verdicts hold it against the
baselines' as ``engine p50 / best``). Of the engines' own, ``engine queue mean ms``
is the wait before a step took a request in (``vllm:request_queue_time_seconds``): the rest of the
step running when it arrived, or memory (a burst's later siblings that reach an engine after the
first one's step started wait there for that step). ``routing ms`` is the part of the front's time
a kvmesh front spends from a request's arrival to its decision (parsing, tokenizing, hashing,
routing), from its ``kvmesh_router_overhead_seconds`` histogram (sglang-router reports none).
``front CPU ms/req`` is the CPU time (user + system, all threads, from /proc) the front process
used while the traffic ran, per request: its routing, its proxying of every streamed token both
ways and its KV-event intake, taken from the two cores it shares with the engines and the client.
``front CPU wait ms/req`` is the time its threads were ready to run but waited for a CPU, per
request (Linux's per-thread run-queue delay): on such a machine a write that wakes an engine or the
client often hands it the writer's CPU for as long as it runs, and a front with one thread does
nothing else meanwhile (sglang-router runs several; their waits are summed, as its CPU is).
Every case gets a table that splits each request's time to first token three ways, matched to the
engines' own request logs (``kvmesh/bench/arrivals.py``): from the client's send to the engine
taking the request in, the engine's own time, and from its first token back to the client. The
first part holds the front's parsing, routing and forwarding and any wait for a busy front, then
the engine's reading and tokenizing (the same engines for every router); the last, the engine's
send and the front's relay. Beside sglang-router's, they show on which way a front's time is lost.
A case that sends bursts (``siblings``) gets a second table: the TTFT of each burst's first-sent
request and of its siblings, apart. On the engine holding the context, the first one starts a step
alone when the engine is idle, and the siblings that reach it after that step started wait for it
and run one of their own; spreading them over engines that hold copies avoids that second step
and pays for the copies in prefix hits. The table shows that price too: the share of siblings
that found under half their prompt cached where they ran, read from the engines' usage (so for
every router, whether or not its front names the engine), and their TTFT p50. From the engines'
own request logs it shows how far behind the first of its burst a sibling reached its engine
(p50), and the share of siblings that ran in the first's step on its engine: an idle engine
starts that step within a millisecond, so this is where a front's time per request decides
whether a burst shares one step (``kvmesh/bench/arrivals.py``). The ``floor`` (one session at a
time on one idle engine) shows what keeping every burst whole costs at best.
After the verdicts (each round's ratio of the default router to the better baseline, and their
median over the rounds), a second table says how sure they are: the same ratios over all rounds'
requests pooled, each with a 90% interval from a paired bootstrap over sessions (every router of a
round ran the same sessions, so each draw resamples the sessions once for all of them;
:mod:`kvmesh.bench.paired`). An interval that holds 1.00 is a difference the traffic cannot tell
from an even run; one wholly above it is a loss however the sessions had fallen. It does not
cover a slow minute of the machine during one router's run: the rotation over rounds does. The
plot draws the same intervals in a row of their own below the cases.
``--json`` keeps every summary, ``--requests`` every request (one JSON object a line: its case,
router, round, session and turn, start, TTFT, prompt and cached tokens, and the worker a kvmesh
front chose with its index in the fleet), ``--decisions`` every decision of a kvmesh front with
each candidate's cost terms, joined to the request's session and turn
(:mod:`kvmesh.bench.decisions`; for reading why a slow request went where it did, not for the
numbers), ``--plot`` draws the summaries: per case, the TTFT quantiles, the prefix hits, the
requests per engine, and each router's p50 against its hits (the two baselines sit at different
places on that plane, and the targets ask for a corner of it).

``--set`` and ``--num-blocks`` run the workloads at other sizes and ratios than their presets (the
suite's presets are what the router was developed on; a router that only wins there has been
tuned to them): ``--set prefix_words=3000 --set concurrency=16`` changes every chosen workload's
preset before it is scaled to the fleet, and ``--num-blocks`` each engine's KV cache. A knob that
none of the chosen workloads reads (``burst`` for chat, ``ramp`` for an open loop) is refused.
``--engine-speedups 1,0.5`` runs a mixed fleet: engine ``i`` at ``--speedup S[i mod n]``, so every
other engine takes twice as long per step (a router that learns each worker's speed should send
the slow ones less). ``--num-blocks 2048,1024`` likewise gives every other engine half the KV
cache (engines with less memory: a router that weighs each worker's free cache should put fewer
growing conversations there). ``--block-size 64`` runs the engines with KV blocks of 64 tokens (the
suite's are 16; TensorRT-LLM and SGLang deployments often use larger ones): the cache keeps its
size in tokens (512 blocks of 64 for 2,048 of 16) unless ``--num-blocks`` gives it in blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, table

from kvmesh.bench import report
from kvmesh.bench.arrivals import burst_arrivals, front_split
from kvmesh.bench.decisions import DecisionLog, joined
from kvmesh.bench.fleet import (
    FrontCommand,
    engine_requests,
    engine_stats,
    engine_ttft_p50,
    front_cpu_seconds,
    front_routing_phases,
    front_wait_seconds,
    kvmesh_router,
    sglang_router,
    start_fleet,
)
from kvmesh.bench.paired import Interval, PairedRequest, paired_verdicts
from kvmesh.bench.runner import LoadSpec, Progress, RunResult, run_workload
from kvmesh.bench.workloads import Preset, build, ignored_load_knobs, knob_matters, preset
from kvmesh.commands.argtypes import output_path, positive_float, positive_int
from kvmesh.commands.bench import LOAD_KNOBS as LOAD_KNOB_TYPES
from kvmesh.commands.bench import WORKLOAD_KNOBS
from kvmesh.commands.demo import MAX_ENGINES, engine_count
from kvmesh.mock.config import MAX_NUM_BLOCKS
from kvmesh.router.core.config import RouterConfig

ENGINE_ARGS = (
    "--speedup", "1", "--block-size", "16", "--num-blocks", "2048", "--max-num-batched-tokens", "8192",
)  # fmt: skip
"""Every engine of every fleet: 2,048 blocks of 16 tokens (32k tokens of KV cache), 8k-token steps."""
SHORT_ENGINE_ARGS = (*ENGINE_ARGS[:-4], "--num-blocks", "1024", "--max-num-batched-tokens", "8192")
"""``--short``: half the cache, so half-length conversations press on it as the full ones do."""

MODEL = "kvmesh-mock"
WORKLOADS = ("agent-long", "chat-pressure", "chat-fits", "siblings", "hot-prefix", "mixed")


@dataclass(frozen=True)
class Contender:
    name: str
    front: FrontCommand
    engine_args: tuple[str, ...] = ()
    ask_worker_id: bool = True


FLOOR = "floor"
"""The contender that is no router: the case's sessions one at a time on a single engine, no think
time (a bound to hold the routers against). It runs only when named."""


KNOB_TYPES = {**WORKLOAD_KNOBS, **LOAD_KNOB_TYPES}
"""What ``--set`` may change, with the values each takes: ``kvmesh bench``'s workload and load
flags of the same names, from the same table."""
SPEC_KNOBS = frozenset(WORKLOAD_KNOBS)
LOAD_KNOBS = frozenset(LOAD_KNOB_TYPES)
KNOBS = SPEC_KNOBS | LOAD_KNOBS


T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    workload: str
    engines: int
    short: bool = False
    """Half the turns and think times, one wave of sessions, half the KV cache per engine."""
    changes: tuple[tuple[str, int | float], ...] = ()
    """``--set`` overrides of the preset, in the order given."""
    num_blocks: tuple[int, ...] = ()
    """``--num-blocks``: the engines' KV cache in place of the suite's; several are cycled over the
    fleet (engines of two memory sizes)."""
    speedups: tuple[float, ...] = ()
    """``--engine-speedups``: each engine's ``--speedup``, cycled over the fleet (a mixed fleet)."""
    block_size: int | None = None
    """``--block-size``: the engines' KV block in tokens in place of the suite's 16; without
    ``--num-blocks`` the cache keeps its size in tokens."""

    @property
    def label(self) -> str:
        extra = [f"{k}={v:g}" for k, v in self.changes]
        if self.num_blocks:
            extra.append("num_blocks=" + ",".join(str(b) for b in self.num_blocks))
        if self.speedups:
            extra.append("speedups=" + ",".join(f"{s:g}" for s in self.speedups))
        if self.block_size is not None:
            extra.append(f"block_size={self.block_size}")
        return f"{self.workload} x{self.engines}" + (f" ({', '.join(extra)})" if extra else "")

    @property
    def engine_blocks(self) -> tuple[int, ...]:
        """The caches given per engine: several ``--num-blocks`` (one is every engine's)."""
        return self.num_blocks if len(self.num_blocks) > 1 else ()

    def by_engine(self, values: Sequence[T]) -> list[T]:
        """``values`` cycled over the fleet: engine ``i``'s is ``values[i mod n]`` (none: [])."""
        return [values[i % len(values)] for i in range(self.engines)] if values else []

    @property
    def engine_args(self) -> tuple[str, ...]:
        args = SHORT_ENGINE_ARGS if self.short else ENGINE_ARGS
        if self.block_size is not None:
            base = int(_flag(args, "--block-size"))
            args = _with_flag(args, "--block-size", str(self.block_size))
            if not self.num_blocks:  # the same cache in tokens, in blocks of the new size
                tokens = int(_flag(args, "--num-blocks")) * base
                args = _with_flag(args, "--num-blocks", str(max(tokens // self.block_size, 1)))
        if len(self.num_blocks) != 1:
            return args  # none: the suite's; several: per engine
        return _with_flag(args, "--num-blocks", str(self.num_blocks[0]))

    @property
    def per_engine_args(self) -> tuple[tuple[str, ...], ...]:
        """Each engine's own flags (after :attr:`engine_args`, so they win): its speed and, with
        several ``--num-blocks``, its cache. Empty on a uniform fleet."""
        speeds = [("--speedup", f"{s:g}") for s in self.by_engine(self.speedups)]
        caches = [("--num-blocks", str(b)) for b in self.by_engine(self.engine_blocks)]
        if not speeds or not caches:
            return tuple(speeds or caches)
        return tuple(s + c for s, c in zip(speeds, caches, strict=True))

    def preset(self) -> Preset:
        """The workload's preset with this case's ``--set`` changes."""
        p = preset(self.workload)
        spec_changes = {k: v for k, v in self.changes if k in SPEC_KNOBS}
        load_changes: dict[str, Any] = {k: v for k, v in self.changes if k in LOAD_KNOBS}
        if "rate" in load_changes:  # an open loop has no sessions in flight to keep, and back
            load_changes.setdefault("concurrency", None)
        elif "concurrency" in load_changes:
            load_changes["rate"] = None
        return dataclasses.replace(p, spec=p.spec.replace(**spec_changes), **load_changes)


def _flag(args: Sequence[str], name: str) -> str:
    return args[args.index(name) + 1]


def _with_flag(args: tuple[str, ...], name: str, value: str) -> tuple[str, ...]:
    i = args.index(name)
    return (*args[:i], name, value, *args[i + 2 :])


def changes_something(case: Case, knob: str) -> bool:
    """Whether ``--set knob=...`` changes what ``case`` sends or how (a knob that changes nothing
    is refused, not run as if it had)."""
    if knob in SPEC_KNOBS:
        return knob_matters(case.workload, knob)
    if knob not in ("think_time", "ramp"):
        return True  # concurrency and rate set the load of every workload
    p = case.preset()
    return knob not in ignored_load_knobs(build(p.spec), open_loop=p.rate is not None)


def parse_knob(text: str) -> tuple[str, int | float]:
    """``KNOB=VALUE`` of ``--set``: an integer knob takes an integer, a share or a time a number."""
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in KNOBS:
        raise argparse.ArgumentTypeError(
            f"--set takes KNOB=VALUE with KNOB one of {', '.join(sorted(KNOBS))}; got {text!r}"
        )
    parse = KNOB_TYPES[name]
    try:
        return name, parse(raw)
    except ValueError:  # not a number at all (an ArgumentTypeError is not one: it names the range)
        kind = "an integer" if parse is positive_int else "a number"
        raise argparse.ArgumentTypeError(f"--set {name} needs {kind}, got {raw!r}") from None
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--set {name} {e}") from None


def _per_engine(text: str, parse: Callable[[str], T], wanted: str) -> tuple[T, ...]:
    """Comma-separated values, each read by ``parse``; one bad value refuses the whole flag."""
    try:
        return tuple(parse(part) for part in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: give {wanted}") from None


def parse_num_blocks(text: str) -> tuple[int, ...]:
    """``--num-blocks``: one KV cache size for every engine, or comma-separated sizes cycled over
    the fleet."""
    sizes = _per_engine(text, positive_int, "a positive integer, or comma-separated ones such as 2048,1024")
    if max(sizes) > MAX_NUM_BLOCKS:  # (each engine refused it once the run had begun: a traceback)
        raise argparse.ArgumentTypeError(f"{text!r}: each size must be at most {MAX_NUM_BLOCKS}")
    return sizes


def parse_speedups(text: str) -> tuple[float, ...]:
    """``--engine-speedups``: comma-separated positive step-time divisors."""
    return _per_engine(text, positive_float, "comma-separated positive numbers, such as 1,0.5")


def _has_cost_models() -> bool:
    return any(f.name == "router_cost_model" for f in dataclasses.fields(RouterConfig))


def contenders() -> list[Contender]:
    out = [Contender("round-robin", kvmesh_router("--router-mode", "round-robin"))]
    if _has_cost_models():
        out.append(Contender("dynamo", kvmesh_router("--router-cost-model", "dynamo")))
    else:  # before the latency cost existed, Dynamo's cost was the router's only one
        out.append(Contender("dynamo", kvmesh_router()))
    if importlib.util.find_spec("sglang_router") is not None:
        out.append(Contender("sglang", sglang_router("cache_aware"), ask_worker_id=False))
    else:
        print("sglang-router is not installed (pip install -e '.[bench]'): left out", file=sys.stderr)
    if _has_cost_models():
        out.append(Contender("kvmesh", kvmesh_router()))
        out.append(Contender("kvmesh+profile", kvmesh_router(), engine_args=("--report-profile",)))
    out.append(Contender(FLOOR, kvmesh_router("--router-mode", "round-robin")))
    return out


def choose_contenders(available: Sequence[Contender], names: str | None) -> list[Contender]:
    """``--contenders``: the named ones, in the suite's order; by default every router (the
    ``floor`` runs only when named). An unknown name is a usage error naming it."""
    if names is None:
        return [c for c in available if c.name != FLOOR]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {c.name for c in available}]
    if unknown or not wanted:
        known = ", ".join(c.name for c in available)
        raise ValueError(f"--contenders: unknown {', '.join(unknown) or 'empty list'} (known: {known})")
    return [c for c in available if c.name in wanted]


def cases(short: bool) -> list[Case]:
    if short:
        return [Case(w, 4, short=True) for w in WORKLOADS]
    return [Case(w, 4) for w in WORKLOADS] + [
        Case(w, 8) for w in ("agent-long", "chat-pressure", "hot-prefix")
    ]


def load_for(case: Case, ask_worker_id: bool, seed: int) -> tuple[Any, LoadSpec]:
    """The case's sessions and load: the workload preset, scaled to the fleet (sessions,
    concurrency and rate grow with ``engines / 4``), shortened for ``--short``."""
    p = case.preset()
    k = case.engines / 4
    sessions = max(1, round(p.spec.sessions * k))
    concurrency = None if p.rate else max(1, round((p.concurrency or 8) * k))
    spec = p.spec.replace(sessions=sessions, seed=seed)
    think, ramp = p.think_time, p.ramp
    if case.short:
        sessions = min(sessions, concurrency) if concurrency else sessions // 2
        spec = spec.replace(sessions=sessions, turns=max(2, spec.turns // 2))
        think, ramp = think / 2, ramp / 2
    load = LoadSpec(
        urls=(),
        model=MODEL,  # sglang-router lists its workers' model as "unknown" at /v1/models
        concurrency=concurrency,
        rate=p.rate * k if p.rate else None,
        think_time=think,
        ramp=ramp,
        ask_worker_id=ask_worker_id,
        seed=seed,
    )
    return build(spec), load


def request_rows(
    case: Case, router: str, rnd: int, seed: int, run: RunResult, engine_urls: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per request of a run, for ``--requests``: what the summaries average over (which
    turn of which session was slow, how much of its prompt was cached, where a kvmesh front sent
    it; sglang-router does not say). ``engine`` is the worker's index in the fleet, the order of
    the summaries' ``per_engine``, ``engine_speedups`` and ``engine_num_blocks``."""
    index = {url: i for i, url in enumerate(engine_urls)}
    return [
        {
            "case": case.label,
            "router": router,
            "round": rnd,
            "seed": seed,
            "session": r.session_id,
            "turn": r.step,
            "start_s": round(r.start, 6),
            "ttft_ms": None if r.ttft is None else round(1000.0 * r.ttft, 3),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "worker": r.worker_id,
            "engine": index.get(r.worker_id),  # None when the front did not say
            "error": r.error,
        }
        for r in run.results
    ]


async def run_one(
    case: Case,
    contender: Contender,
    seed: int,
    progress: bool,
    rows: list[dict[str, Any]] | None = None,
    rnd: int = 1,
    decisions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One contender on one case, on a fresh fleet: the run's summary (and, into ``rows``, one row
    per request; into ``decisions``, a kvmesh front's decisions, each joined to its request)."""
    sessions, load = load_for(case, contender.ask_worker_id, seed)
    engine_args = (*case.engine_args, *contender.engine_args)
    engines, per_engine_args = case.engines, case.per_engine_args
    if contender.name == FLOOR:  # the same sessions, one at a time, on one engine of the fleet's kind
        engines, per_engine_args = 1, per_engine_args[:1]
        load = dataclasses.replace(load, concurrency=1, rate=None, think_time=0.0, ramp=0.0)
    async with start_fleet(
        engines, engine_args, contender.front, per_engine_args=per_engine_args, request_logs=True
    ) as fleet:
        load = dataclasses.replace(load, urls=(fleet.front_url,))
        total = sum(s.total_requests for s in sessions)
        bar = Progress(total, f"{case.label:>16} {contender.name:>14}", enabled=None if progress else False)
        cpu0 = front_cpu_seconds(fleet)  # (after start-up: its imports are no cost per request)
        wait0 = front_wait_seconds(fleet)
        if decisions is not None and contender.ask_worker_id and contender.name != FLOOR:
            async with DecisionLog(fleet.front_url) as log:
                run = await run_workload(contender.name, sessions, load, progress=bar)
            tag = {"case": case.label, "router": contender.name, "round": rnd, "seed": seed}
            decisions.extend({**tag, **row} for row in joined(log, run))
            if log.missed:
                print(
                    f"--decisions: {log.missed} polls found every decision new: some were missed",
                    file=sys.stderr,
                )
        else:
            run = await run_workload(contender.name, sessions, load, progress=bar)
        cpu1 = front_cpu_seconds(fleet)
        wait1 = front_wait_seconds(fleet)
        stats = await engine_stats(fleet.engine_urls)
        phases = await front_routing_phases(fleet.front_url)
        engine_log = engine_requests(fleet)
        engine_p50_s = engine_ttft_p50(engine_log)
    if rows is not None:
        rows.extend(request_rows(case, contender.name, rnd, seed, run, fleet.engine_urls))
    summary = report.summarize(run)
    if summary.get("bursts"):
        summary["bursts"]["arrivals"] = burst_arrivals(run, engine_log)
    summary["front_split"] = front_split(run, engine_log)
    summary["seed"] = seed
    summary["front_routing_mean_s"] = phases.get("total")
    summary["front_routing_phases_s"] = phases
    sent = len(run.results)  # failed ones too: the front handled them
    summary["front_cpu_s_per_request"] = (
        (cpu1 - cpu0) / sent if cpu0 is not None and cpu1 is not None and sent else None
    )
    summary["front_wait_s_per_request"] = (
        (wait1 - wait0) / sent if wait0 is not None and wait1 is not None and sent else None
    )
    summary["per_engine"] = [s.requests for s in stats]
    if case.speedups:  # a mixed fleet: which engine ran at which speed
        summary["engine_speedups"] = case.by_engine(case.speedups)
    if case.engine_blocks:  # engines of several cache sizes: which had which
        summary["engine_num_blocks"] = case.by_engine(case.engine_blocks)
    modelled = sum(s.modelled_seconds for s in stats)
    summary["fidelity"] = sum(s.busy_seconds for s in stats) / modelled if modelled else None
    counted = sum(s.ttft_count for s in stats)
    summary["engine_ttft_mean_s"] = sum(s.ttft_seconds_sum for s in stats) / counted if counted else None
    summary["engine_ttft_p50_s"] = engine_p50_s
    queued = sum(s.queue_count for s in stats)
    summary["engine_queue_mean_s"] = sum(s.queue_seconds_sum for s in stats) / queued if queued else None
    return summary


# ---------------------------------------------------------------------------------------- report
METRICS = (
    ("TTFT p50 ms", lambda s: _ms(s["ttft_s"]["p50"])),
    ("TTFT p90 ms", lambda s: _ms(s["ttft_s"]["p90"])),
    ("TTFT p99 ms", lambda s: _ms(s["ttft_s"]["p99"])),
    ("TTFT mean ms", lambda s: _ms(s["ttft_s"].get("mean"))),
    # the engines' own mean TTFT (placement) and what the front adds on the way in and out
    ("engine TTFT mean ms", lambda s: _ms(s.get("engine_ttft_mean_s"))),
    # and their median: beside the client's p50, whether a median is lost in placement or in front
    ("engine TTFT p50 ms", lambda s: _ms(s.get("engine_ttft_p50_s"))),
    # of the engines' own, the wait before a step took the request in: behind the step running
    # when it arrived (a sibling that missed the first one's step) or for memory
    ("engine queue mean ms", lambda s: _ms(s.get("engine_queue_mean_s"))),
    ("front ms", lambda s: _front_ms(s)),
    # of that, a kvmesh front's own work before it forwards (parse, tokenize, hash, route)
    ("routing ms", lambda s: _ms(s.get("front_routing_mean_s"))),
    # the CPU the front process took per request, on the cores it shares with the engines
    ("front CPU ms/req", lambda s: _ms(s.get("front_cpu_s_per_request"))),
    # and the time its threads were ready to run but off a CPU: mostly put off it by the engine or
    # client one of its writes woke (summed over threads: one of several waiting stops only itself)
    ("front CPU wait ms/req", lambda s: _ms(s.get("front_wait_s_per_request"))),
    ("ITL p50 ms", lambda s: _ms(s["itl_s"]["p50"])),
    ("req/s", lambda s: s["throughput_rps"]),
    ("prefix hits", lambda s: s["prefix_hit_ratio"]),
)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def _front_ms(s: dict[str, Any]) -> float | None:
    """Mean TTFT as the client saw it minus as the engines did: the front's own time in the path
    (its parsing, routing and proxying both ways), which no placement can win back."""
    client, engine = s["ttft_s"].get("mean"), s.get("engine_ttft_mean_s")
    return None if client is None or engine is None else 1000 * (client - engine)


def _fmt(values: Sequence[float | None], digits: int) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    mid = statistics.median(vals)
    if len(vals) == 1:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def case_table(results: dict[str, list[dict[str, Any]]]) -> str:
    headers = ["router", *(m[0] for m in METRICS), "requests per engine (last round)", "errors", "fidelity"]
    rows = []
    for name, runs in results.items():
        cells = [name]
        for label, get in METRICS:
            cells.append(_fmt([get(r) for r in runs], 3 if label == "prefix hits" else 1))
        cells.append(" ".join(str(n) for n in runs[-1]["per_engine"]))
        cells.append(str(sum(r["errors"] for r in runs)))
        cells.append(_fmt([r["fidelity"] for r in runs], 2))
        rows.append(cells)
    return table(headers, rows)


BURST_METRICS = (
    ("first TTFT p50 ms", lambda b: _ms(b["first_ttft_s"]["p50"])),
    ("first TTFT mean ms", lambda b: _ms(b["first_ttft_s"]["mean"])),
    ("siblings TTFT p50 ms", lambda b: _ms(b["siblings_ttft_s"]["p50"])),
    ("siblings TTFT mean ms", lambda b: _ms(b["siblings_ttft_s"]["mean"])),
    # siblings that found under half their prompt cached (their context computed again, or their
    # step shared with the first one's): what a burst spread over engines pays in prefix hits
    ("siblings under half cached %", lambda b: _share(b["siblings_uncached"]["share"])),
    ("their TTFT p50 ms", lambda b: _ms(b["siblings_uncached"]["ttft_p50_s"])),
    # from the engines' request logs: how far behind the burst's first its siblings reached their
    # engines, and how many ran in its step there (an idle engine starts it within a millisecond)
    (
        "siblings at the engine after the first p50 ms",
        lambda b: _arrivals(b, "siblings_after_first_ms", "p50"),
    ),
    ("siblings in the first's step %", lambda b: _share(_arrivals(b, "joined_share"))),
)


def _arrivals(bursts: dict[str, Any], key: str, q: str | None = None) -> float | None:
    """One reading of :func:`~kvmesh.bench.arrivals.burst_arrivals` (None where the engines kept
    no logs, or in a summary written before it was measured)."""
    arrivals = bursts.get("arrivals")
    if not arrivals:
        return None
    value = arrivals[key]
    return value[q] if q is not None else value


def _share(x: float | None) -> float | None:
    return None if x is None else 100 * x


def burst_table(results: dict[str, list[dict[str, Any]]]) -> str | None:
    """For a case that sends bursts, each router's first-sent request of a burst and its siblings
    apart, beside its prefix hits (see :func:`kvmesh.bench.report._bursts`); None otherwise."""
    if not any(r.get("bursts") for runs in results.values() for r in runs):
        return None
    headers = ["router", *(m[0] for m in BURST_METRICS), "prefix hits"]
    rows = []
    for name, runs in results.items():
        bursts = [r["bursts"] for r in runs if r.get("bursts")]
        cells = [name, *(_fmt([get(b) for b in bursts], 1) for _, get in BURST_METRICS)]
        cells.append(_fmt([r["prefix_hit_ratio"] for r in runs], 3))
        rows.append(cells)
    return table(headers, rows)


PHASE_COLUMNS = (
    ("tokenize ms", "tokenize"),
    ("hash ms", "hashing"),
    ("find matches ms", "find_matches"),
    ("decide ms", "scheduling"),
    ("arrival to decision ms", "total"),
    ("decision to write ms", "forward"),
    ("first token through ms", "relay_first"),
)


SPLIT_COLUMNS = (
    ("to the engine p50 ms", "to_engine_ms", "p50"),
    ("to the engine p90 ms", "to_engine_ms", "p90"),
    ("engine p50 ms", "engine_ms", "p50"),
    ("back to the client p50 ms", "from_engine_ms", "p50"),
    ("back to the client p90 ms", "from_engine_ms", "p90"),
)


def split_table(results: dict[str, list[dict[str, Any]]]) -> str | None:
    """Each router's time to first token in three parts, medians over rounds of each round's
    percentile (:func:`~kvmesh.bench.arrivals.front_split`), with the share of requests found in
    the engines' logs; None where no engine kept one."""
    rows = []
    for name, runs in results.items():
        splits = [r.get("front_split") for r in runs]
        if not any(splits):
            continue
        cells = [name]
        for _, part, q in SPLIT_COLUMNS:
            cells.append(_fmt([s[part][q] if s else None for s in splits], 1))
        cells.append(_fmt([100 * s["matched"] if s else None for s in splits], 0))
        rows.append(cells)
    if not rows:
        return None
    return table(["router", *(label for label, _, _ in SPLIT_COLUMNS), "requests found %"], rows)


def phase_table(results: dict[str, list[dict[str, Any]]]) -> str | None:
    """For the fronts that report their routing phases (kvmesh's), a request's mean time in each
    (see :data:`kvmesh.bench.fleet.ROUTING_PHASES`), median over rounds; None where none does."""
    rows = []
    for name, runs in results.items():
        phases = [r.get("front_routing_phases_s") or {} for r in runs]
        if any(phases):
            rows.append([name, *(_fmt([_ms(p.get(key)) for p in phases], 2) for _, key in PHASE_COLUMNS)])
    if not rows:
        return None
    return table(["router", *(label for label, _ in PHASE_COLUMNS)], rows)


def verdicts(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """Per case, the default router's ratios against the baselines of the same rounds."""
    headers = [
        "case",
        "p50 / best(sglang, dynamo)",
        "p99 / best(sglang, dynamo)",
        "mean / best(sglang, dynamo)",
        "engine mean / best",
        "engine p50 / best",
        "hits - best(sglang, dynamo)",
        "p50 / round-robin",
        "floor / round-robin",
    ]
    rows = []
    for case, per in results.items():
        if "kvmesh" not in per:
            continue
        me = per["kvmesh"]
        rounds = len(me)
        base = [n for n in ("sglang", "dynamo") if n in per]
        if not base and "round-robin" not in per:
            continue  # nothing to hold it against

        def ratio(
            q: str, others: Sequence[str], me: list[dict[str, Any]] = me, per: dict[str, Any] = per
        ) -> str:
            if not others:
                return "-"
            # "engine", "engine p50": the engines' own mean and median TTFT, which placement decides
            # (no front time in them)
            engine_key = {"engine": "engine_ttft_mean_s", "engine p50": "engine_ttft_p50_s"}.get(q)

            def get(s: dict[str, Any]) -> float | None:
                return s.get(engine_key) if engine_key else s["ttft_s"].get(q)

            vals = []
            for i in range(len(me)):
                best = min(get(per[n][i]) or float("inf") for n in others)
                mine = get(me[i])
                vals.append(mine / best if mine is not None and best != float("inf") else None)
            return _fmt(vals, 2)

        # against the baselines, as every other column (and the pooled table) is: held against a
        # best that counted kvmesh itself, the column could never read above 0. (The floor holds
        # every history, and is no router: no router's hits are held to it.)
        hits: list[float | None] = []
        for i in range(rounds):
            if not base:
                hits.append(None)
                continue
            best_hits = max(per[n][i]["prefix_hit_ratio"] or 0.0 for n in base)
            hits.append((me[i]["prefix_hit_ratio"] or 0.0) - best_hits)
        rr = ratio("p50", ["round-robin"]) if "round-robin" in per else "-"
        floor = "-"
        if FLOOR in per and "round-robin" in per:
            floor = ratio("p50", ["round-robin"], per[FLOOR])
        rows.append(
            [
                case,
                ratio("p50", base),
                ratio("p99", base),
                ratio("mean", base),
                ratio("engine", base),
                ratio("engine p50", base),
                _fmt(hits, 3),
                rr,
                floor,
            ]
        )
    return table(headers, rows) if rows else ""


@dataclass(frozen=True)
class HowSure:
    """One case's verdicts pooled over its rounds, with their intervals (:func:`how_sure`)."""

    verdicts: dict[str, Interval | None]
    sessions: int


def how_sure(requests: dict[str, dict[str, list[dict[str, Any]]]], draws: int = 1000) -> dict[str, HowSure]:
    """Per case, the default router's verdicts pooled over the rounds' requests, each with its 90%
    interval from a paired bootstrap over sessions (:mod:`kvmesh.bench.paired`): a ratio whose
    interval holds 1.00 (or a hits difference whose interval reaches above -0.02) is not a loss the
    traffic tells apart from an even run. (The verdicts table takes each round on its own and prints
    the median of the rounds; pooled, a round weighs by its requests.) Cases without the default
    router or a baseline are left out."""
    out = {}
    for case, per in requests.items():
        base = {n: per[n] for n in ("sglang", "dynamo") if per.get(n)}
        if not per.get("kvmesh") or not base:
            continue
        got = paired_verdicts(_paired(per["kvmesh"]), {n: _paired(v) for n, v in base.items()}, draws=draws)
        out[case] = HowSure(got, len({(r["round"], r["session"]) for r in per["kvmesh"]}))
    return out


def sureness_table(sure: dict[str, HowSure]) -> str:
    headers = [
        "case",
        "p50 / best(sglang, dynamo)",
        "p99 / best(sglang, dynamo)",
        "mean / best(sglang, dynamo)",
        "hits - best(sglang, dynamo)",
        "sessions",
    ]
    rows = []
    for case, h in sure.items():
        got = h.verdicts
        hits = got["hits"]
        rows.append(
            [
                case,
                *(str(got[q]) if got[q] is not None else "-" for q in ("p50", "p99", "mean")),
                f"{hits.value:+.3f} ({hits.low:+.3f} to {hits.high:+.3f})" if hits is not None else "-",
                str(h.sessions),
            ]
        )
    return table(headers, rows) if rows else ""


def _paired(rows: list[dict[str, Any]]) -> list[PairedRequest]:
    """``--requests`` rows as the bootstrap reads them (a failed request has no TTFT)."""
    return [
        PairedRequest(
            r["round"],
            r["session"],
            None if r["error"] else r["ttft_ms"],
            r["prompt_tokens"],
            r["cached_tokens"],
        )
        for r in rows
    ]


def write_plot(
    results: dict[str, dict[str, list[dict[str, Any]]]], path: Path, sure: dict[str, HowSure] | None = None
) -> Path:
    """Per case a row of panels (TTFT quantiles, prefix hits, requests per engine, p50 against
    hits); below them, when ``sure`` has any case, the verdicts with their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    extra = 1 if sure else 0
    height = [3.2] * len(labels) + ([0.5 + 0.45 * len(sure)] if sure else [])
    fig = plt.figure(figsize=(21, sum(height)))
    grid = fig.add_gridspec(len(labels) + extra, 4, height_ratios=height)
    axes = [[fig.add_subplot(grid[row, col]) for col in range(4)] for row in range(len(labels))]
    if sure:
        _draw_how_sure(fig.add_subplot(grid[len(labels), :]), sure)
    for row, case in enumerate(labels):
        per = results[case]
        names = list(per)
        ax_t, ax_h, ax_w, ax_x = axes[row]
        _draw_tradeoff(ax_x, per)
        width = 0.8 / 3
        for j, q in enumerate(("p50", "p90", "p99")):
            vals = [statistics.median(1000 * (r["ttft_s"][q] or 0.0) for r in per[n]) for n in names]
            ax_t.bar([i + j * width for i in range(len(names))], vals, width=width, label=f"TTFT {q}")
        ax_t.set_xticks([i + width for i in range(len(names))])
        ax_t.set_xticklabels(names, fontsize=8)
        ax_t.set_ylabel("ms")
        # a case named with its --set changes runs long: wrapped, it stays over its own panel
        ax_t.set_title(textwrap.fill(f"{case}: time to first token", 60), fontsize=9)
        ax_t.legend(fontsize=7)
        hits = [statistics.median((r["prefix_hit_ratio"] or 0) * 100 for r in per[n]) for n in names]
        ax_h.bar(names, hits, color=[f"C{i}" for i in range(len(names))])
        ax_h.set_ylim(0, 100)
        ax_h.set_title("engine-reported prefix hits (%)")
        ax_h.tick_params(axis="x", labelsize=8)
        fleets = [n for n in names if n != FLOOR] or names  # the floor runs on one engine
        engines = len(per[fleets[0]][-1]["per_engine"])
        w = 0.8 / len(fleets)
        for i, n in enumerate(fleets):
            counts = per[n][-1]["per_engine"]
            ax_w.bar([e + i * w for e in range(len(counts))], counts, width=w, label=n)
        ax_w.set_xticks([e + w * (len(fleets) - 1) / 2 for e in range(engines)])
        speeds = per[fleets[0]][-1].get("engine_speedups")
        caches = per[fleets[0]][-1].get("engine_num_blocks")
        ax_w.set_xticklabels(
            [
                f"e{e}" + (f" x{speeds[e]:g}" if speeds else "") + (f" {caches[e]}b" if caches else "")
                for e in range(engines)
            ],
            fontsize=8,
        )
        ax_w.set_title("requests per engine (last round)")
        ax_w.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _draw_how_sure(ax: Any, sure: dict[str, HowSure]) -> None:
    """A forest plot: per case, the default router's p50, p99 and mean TTFT over the better
    baseline's, each a point with its 90% interval; right of the line at 1.00 is slower."""
    cases = list(sure)
    marks = (("p50", "o"), ("p99", "s"), ("mean", "^"))
    for j, (q, marker) in enumerate(marks):
        for i, case in enumerate(cases):
            iv = sure[case].verdicts.get(q)
            if iv is None:
                continue
            y = i + (j - 1) * 0.22
            ax.errorbar(
                [iv.value], [y], xerr=[[iv.value - iv.low], [iv.high - iv.value]], fmt=marker,
                color=f"C{j}", capsize=2, label=q if i == 0 else None,
            )  # fmt: skip
    ax.axvline(1.0, color="0.4", linewidth=1)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=8)
    ax.set_ylim(-0.5, len(cases) - 0.5)  # each case's three marks sit inside its own band, none on a spine
    ax.invert_yaxis()
    ax.set_xlabel(
        "kvmesh / best of sglang-router and Dynamo's cost (90% interval, paired bootstrap over sessions)"
    )
    ax.set_title("the verdicts, how sure (left of 1.00: faster)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the marks, not on them


def tradeoff_points(per: dict[str, list[dict[str, Any]]]) -> list[tuple[str, float, float, float, float]]:
    """Per router: ``(name, hits %, p50 ms, lowest p50, highest p50)`` over its rounds (medians;
    the p50's range): where it sits between keeping prefixes cached and answering first."""
    out = []
    for name, runs in per.items():
        p50s = [1000.0 * r["ttft_s"]["p50"] for r in runs if r["ttft_s"]["p50"] is not None]
        hits = [100.0 * r["prefix_hit_ratio"] for r in runs if r["prefix_hit_ratio"] is not None]
        if p50s and hits:
            out.append((name, statistics.median(hits), statistics.median(p50s), min(p50s), max(p50s)))
    return out


def _draw_tradeoff(ax: Any, per: dict[str, list[dict[str, Any]]]) -> None:
    """TTFT p50 against prefix hits, a point per router (a bar for the p50's range over rounds):
    down and to the right is better on both. Two baselines at different places on it (sglang-router
    keeping hits, Dynamo's cost answering sooner) make the issue's targets a corner to reach."""
    for i, (name, hits, p50, low, high) in enumerate(tradeoff_points(per)):
        ax.errorbar([hits], [p50], yerr=[[p50 - low], [high - p50]], fmt="o", color=f"C{i}", capsize=3)
        ax.annotate(name, (hits, p50), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.set_xlabel("prefix hits (%)")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("p50 against hits (lower right is better)")
    ax.margins(0.15)  # the points and their names off the axes' edges
    ax.grid(alpha=0.3)


async def main_async(args: argparse.Namespace) -> int:
    chosen = cases(args.short)
    if args.only:  # (names checked in main)
        wanted = set(args.only.split(","))
        chosen = [c for c in chosen if c.workload in wanted]
    if args.engines is not None:
        chosen = [dataclasses.replace(c, engines=args.engines) for c in chosen]
        chosen = list(dict.fromkeys(chosen))
    if args.speedups:
        chosen = [dataclasses.replace(c, speedups=args.speedups) for c in chosen]
    if args.block_size is not None:
        chosen = [dataclasses.replace(c, block_size=args.block_size) for c in chosen]
    if args.changes or args.num_blocks:
        changes = tuple(dict(args.changes).items())  # the last of a knob set twice wins
        chosen = [dataclasses.replace(c, changes=changes, num_blocks=args.num_blocks) for c in chosen]
        ignored = [name for name, _ in changes if not any(changes_something(c, name) for c in chosen)]
        if ignored:
            workloads = ", ".join(dict.fromkeys(c.workload for c in chosen))
            print(
                f"--set {', '.join(ignored)}: no effect on the chosen workloads ({workloads})",
                file=sys.stderr,
            )
            return 2
    try:
        people = choose_contenders(contenders(), args.contenders)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"machine: {machine()}")
    engine_args = chosen[0].engine_args if chosen else ENGINE_ARGS
    by_engine = []
    if args.speedups:
        by_engine.append(f"--speedup {','.join(f'{s:g}' for s in args.speedups)}")
    if len(args.num_blocks) > 1:
        by_engine.append(f"--num-blocks {','.join(str(b) for b in args.num_blocks)}")
    own_flags = f" ({'; '.join(by_engine)} by engine)" if by_engine else ""
    seeds = (
        f"seeds {args.seed}-{args.seed + args.rounds - 1}, one a round"
        if args.seed_per_round
        else f"seed {args.seed}"
    )
    print(f"engines: kvmesh mock {' '.join(engine_args)}{own_flags}; {seeds}; rounds {args.rounds}")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    requests: dict[str, dict[str, list[dict[str, Any]]]] = {}  # case -> router -> every request
    if args.requests_path:
        Path(args.requests_path).write_text("")  # this run's requests only
    if args.decisions_path:
        Path(args.decisions_path).write_text("")
    started = time.monotonic()
    runs_total = len(chosen) * len(people) * args.rounds
    done = 0
    for case in chosen:
        per: dict[str, list[dict[str, Any]]] = {c.name: [] for c in people}
        kept = requests[case.label] = {c.name: [] for c in people}
        for rnd in range(args.rounds):
            seed = args.seed + rnd if args.seed_per_round else args.seed
            k = rnd % len(people)
            for contender in people[k:] + people[:k]:
                done += 1
                print(
                    f"[{done}/{runs_total}] {case.label} round {rnd + 1}: {contender.name} "
                    f"({time.monotonic() - started:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
                rows: list[dict[str, Any]] = []
                decided: list[dict[str, Any]] | None = [] if args.decisions_path else None
                per[contender.name].append(
                    await run_one(case, contender, seed, not args.no_progress, rows, rnd + 1, decided)
                )
                kept[contender.name].extend(rows)
                if args.requests_path:  # as each run ends: a long run's requests survive a crash
                    with open(args.requests_path, "a") as out:
                        out.writelines(json.dumps(row) + "\n" for row in rows)
                if decided:
                    with open(args.decisions_path, "a") as out:
                        out.writelines(json.dumps(row) + "\n" for row in decided)
        results[case.label] = per
        p = preset(case.workload)
        cache = "" if case.num_blocks else ", half the cache"  # (--num-blocks sets the cache)
        size = f"short: half the turns, one wave{cache}" if case.short else f"x{case.engines / 4:g}"
        note = f"the preset is {p.note}" if case.changes else p.note  # the label gives the changes
        print(f"\n### {case.label}: {note} ({size})\n")
        print(case_table(per))
        bursts = burst_table(per)
        if bursts:
            print(f"\n{case.label}, by place in a burst (the first-sent request, then its siblings):\n")
            print(bursts)
        split = split_table(per)
        if split:
            print(
                f"\n{case.label}, the time to first token in three parts, from the engines' own request "
                "logs: from the client's send to the engine taking the request in (the front's "
                "parsing, routing and forwarding, then the engine's reading and tokenizing), the "
                "engine's own, and from its first token to the client (the engine's send and the "
                "front's relay):\n"
            )
            print(split)
        phases = phase_table(per)
        if phases:
            print(
                f"\n{case.label}, where a kvmesh front's own time goes, means a request (a prompt routed "
                "before it was tokenized, on its first block or on its conversation's earlier turn, is "
                "tokenized and hashed after it was sent: in those two columns, not in the arrival to "
                "decision; the first token's way through the front is a streamed answer's, from its bytes' "
                "arrival from the engine to their hand-off to the client):\n"
            )
            print(phases)
        sys.stdout.flush()
    if args.json_path:  # first: a long run's numbers must survive whatever the report does
        Path(args.json_path).write_text(json.dumps(results, indent=1))
    summary = verdicts(results)
    sure = how_sure(requests)
    if summary:
        print("\n### the default router against the baselines (same rounds)\n")
        print(summary)
        if sure:
            print(
                "\n### how sure: the verdicts over all rounds' requests, with 90% intervals "
                "(paired bootstrap over sessions)\n"
            )
            print(sureness_table(sure))
    print(f"\ntotal {time.monotonic() - started:.0f}s")
    if args.json_path:
        print(f"wrote {args.json_path}")
    if args.requests_path:
        print(f"wrote {args.requests_path}")
    if args.decisions_path:
        print(f"wrote {args.decisions_path}")
    if args.plot:
        print(f"wrote {write_plot(results, Path(args.plot), sure)}")
    errors = sum(r["errors"] for per in results.values() for runs in per.values() for r in runs)
    return 0 if errors == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--short", action="store_true", help="half-size cases, for CI time")
    parser.add_argument(
        "--rounds", type=positive_int, default=1, help="rounds per case (ranges are over rounds)"
    )
    parser.add_argument(
        "--workloads", "--only", dest="only", default=None, help="comma-separated workloads to run"
    )
    parser.add_argument(
        "--engines",
        type=engine_count,
        default=None,
        help=f"run every chosen case on this many engines (1-{MAX_ENGINES}, each a process)",
    )
    parser.add_argument(
        "--contenders",
        default=None,
        help="comma-separated contenders to run: round-robin, dynamo, sglang, kvmesh, kvmesh+profile "
        "(all by default), and floor (each session alone on one engine; only when named)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    parser.add_argument(
        "--seed-per-round",
        action="store_true",
        help="round r sends the traffic of seed SEED + r - 1 (new traffic of the same shape each round, "
        "the same for every contender of the round; needs --rounds 2 or more; default: every round sends "
        "SEED's)",
    )
    parser.add_argument(
        "--set",
        dest="changes",
        type=parse_knob,
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="change every chosen workload's preset (repeatable): "
        + ", ".join(sorted(KNOBS))
        + "; sizes are for 4 engines and scale with --engines",
    )
    parser.add_argument(
        "--num-blocks",
        type=parse_num_blocks,
        default=(),
        metavar="N[,N,...]",
        help="KV cache blocks per engine (default: 2048, or 1024 with --short); several, such as "
        "2048,1024, are cycled over the fleet (engine i gets N[i mod n])",
    )
    parser.add_argument(
        "--engine-speedups",
        dest="speedups",
        type=parse_speedups,
        default=(),
        metavar="S,S,...",
        help="a mixed fleet: engine i runs at --speedup S[i mod n] (0.5 = twice as slow), e.g. 1,0.5 "
        "(default: every engine at 1)",
    )
    parser.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="the engines' KV block size; the cache keeps its size in tokens unless --num-blocks gives "
        "it in blocks (default: 16)",
    )
    # (outputs are checked before anything runs: a whole suite's numbers are not lost at its first write)
    parser.add_argument(
        "--json", dest="json_path", type=output_path, default=None, help="write every summary here"
    )
    parser.add_argument(
        "--requests",
        dest="requests_path",
        type=output_path,
        default=None,
        metavar="PATH",
        help="write every request's result here, one JSON object a line (case, router, round, "
        "session, turn, start, TTFT, prompt and cached tokens, the worker a kvmesh front chose and "
        "its index in the fleet)",
    )
    parser.add_argument(
        "--decisions",
        dest="decisions_path",
        type=output_path,
        default=None,
        metavar="PATH",
        help="write every decision of a kvmesh front here, one JSON object a line: the router's "
        "/kvmesh/decisions (every candidate's cost terms), polled during the run and joined to the "
        "request it placed (case, router, round, session, turn; moved: it left the worker holding "
        "most of its prompt). For reading why a request went where it did: the polls cost the "
        "front some CPU, so leave it off for the numbers",
    )
    parser.add_argument(
        "--plot",
        type=output_path,
        default="routing-quality.png",
        help="PNG plot path ('' for none) [%(default)s]",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    if args.seed_per_round and args.rounds < 2:  # one round sends --seed's traffic either way
        parser.error(f"--seed-per-round: needs --rounds 2 or more (got {args.rounds})")
    if args.only is not None:
        names = [w.strip() for w in args.only.split(",")]
        if not all(names):
            parser.error(f"--workloads: an empty name in {args.only!r}; choose from {', '.join(WORKLOADS)}")
        unknown = [w for w in names if w not in WORKLOADS]
        if unknown:
            parser.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
        args.only = ",".join(names)
    knobs = dict(args.changes)
    if "rate" in knobs and "concurrency" in knobs:  # (the load is a closed loop or an open one)
        parser.error("--set rate and --set concurrency: a case's load is one or the other, not both")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
