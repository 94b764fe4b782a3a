"""Workloads: deterministic scripts of OpenAI chat requests with realistic prefix sharing.

A workload is a list of :class:`Session` objects (see :mod:`kvmesh.bench.session`). Every
registered workload also has a :class:`Preset`: the spec and the load shape (closed loop with think
times, or open loop) it runs with unless told otherwise, so ``kvmesh bench --workload NAME`` sends
what the routing-quality suite sends.

* ``agentic``       multi-turn agent conversations: a few agent types, each with its own system
                    prompt and tool definitions shared by all its conversations; every turn appends
                    the model's reply and a tool result, so the prompt grows turn by turn.
* ``shared-prefix`` single-turn questions over a handful of long shared documents.
* ``best-of-n``     bursts of n identical sibling requests (sampling n answers to one prompt).
* ``long-context``  one long private document per session, then follow-up questions about it.

The routing-quality workloads (``agent-long``, ``chat-pressure``, ``chat-fits``, ``siblings``,
``hot-prefix``, ``mixed``) live in :mod:`kvmesh.bench.conversations`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

from kvmesh.bench import conversations
from kvmesh.bench.session import Answer, Session, WorkloadSpec, tool, words

__all__ = [
    "PRESETS",
    "WORKLOADS",
    "Answer",
    "Preset",
    "Session",
    "WorkloadSpec",
    "build",
    "ignored_load_knobs",
    "knob_matters",
    "preset",
    "sessions_of",
]


def agentic(spec: WorkloadSpec) -> Iterator[Session]:
    rng = random.Random(spec.seed)
    agents = []
    for a in range(spec.groups):
        system = f"You are agent {a}. " + words(rng, spec.prefix_words)
        tools = [tool(rng, f"tool_{a}_{t}") for t in range(4)]
        agents.append((system, tools))
    for s in range(spec.sessions):
        system, tools = agents[s % len(agents)]
        task = f"Task {s}: " + words(rng, spec.question_words)
        followups = [
            f"Tool result {s}.{t}: " + words(rng, spec.question_words * 2) for t in range(spec.turns)
        ]
        yield Session(
            session_id=f"agentic-{s}",
            kind="agentic",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": task}],
            tools=tools,
            max_tokens=spec.max_tokens,
            steps_left=spec.turns,
            followups=followups,
        )


def shared_prefix(spec: WorkloadSpec) -> Iterator[Session]:
    rng = random.Random(spec.seed)
    documents = [f"Document {g}. " + words(rng, spec.prefix_words) for g in range(spec.groups)]
    for s in range(spec.sessions):
        yield Session(
            session_id=f"shared-{s}",
            kind="shared-prefix",
            messages=[
                {"role": "system", "content": documents[rng.randrange(len(documents))]},
                {"role": "user", "content": f"Question {s}: " + words(rng, spec.question_words)},
            ],
            tools=None,
            max_tokens=spec.max_tokens,
            steps_left=1,
        )


def best_of_n(spec: WorkloadSpec) -> Iterator[Session]:
    rng = random.Random(spec.seed)
    for s in range(spec.sessions):
        yield Session(
            session_id=f"bon-{s}",
            kind="best-of-n",
            messages=[{"role": "user", "content": f"Problem {s}: " + words(rng, spec.prefix_words)}],
            tools=None,
            max_tokens=spec.max_tokens,
            steps_left=1,
            burst=spec.burst,
        )


def long_context(spec: WorkloadSpec) -> Iterator[Session]:
    rng = random.Random(spec.seed)
    for s in range(spec.sessions):
        document = f"Report {s}. " + words(rng, spec.prefix_words * 8)
        questions = [f"Follow-up {s}.{t}: " + words(rng, spec.question_words) for t in range(spec.turns)]
        yield Session(
            session_id=f"long-{s}",
            kind="long-context",
            messages=[
                {"role": "system", "content": document},
                {"role": "user", "content": f"Summary request {s}: " + words(rng, spec.question_words)},
            ],
            tools=None,
            max_tokens=spec.max_tokens,
            steps_left=max(1, min(spec.turns, 3)),
            followups=questions,
        )


# (Each builder yields its sessions one by one, in the order and from the draws of one seeded
# generator, so a caller can show its progress through a large workload.)
_BUILDERS: dict[str, Callable[[WorkloadSpec], Iterator[Session]]] = {
    "agentic": agentic,
    "shared-prefix": shared_prefix,
    "best-of-n": best_of_n,
    "long-context": long_context,
    "agent-long": conversations.agent_long,
    "chat-pressure": conversations.chat,
    "chat-fits": conversations.chat,
    "siblings": conversations.siblings,
    "hot-prefix": conversations.hot_prefix,
    "mixed": conversations.mixed,
}
WORKLOADS = tuple(_BUILDERS)


@dataclass(frozen=True, slots=True)
class Preset:
    """How a workload runs by default, sized for a fleet of 4 engines.

    ``concurrency`` sessions in flight (closed loop), or ``rate`` sessions started per second
    (open loop); ``think_time`` is the mean pause between a session's steps (drawn exponentially
    per session and step, from the seed); ``ramp`` spreads the closed loop's first starts.
    """

    spec: WorkloadSpec
    concurrency: int | None = 8
    rate: float | None = None
    think_time: float = 0.0
    ramp: float = 0.0
    note: str = ""


PRESETS: dict[str, Preset] = {
    "agentic": Preset(WorkloadSpec("agentic")),
    "shared-prefix": Preset(WorkloadSpec("shared-prefix")),
    "best-of-n": Preset(WorkloadSpec("best-of-n")),
    "long-context": Preset(WorkloadSpec("long-context")),
    # 4 agent types, system prompt + tools ~3.9k tokens, tool outputs ~1.2k tokens a turn: a
    # session reaches ~11k tokens; 12 in flight hold ~80k tokens against 128k of fleet cache.
    "agent-long": Preset(
        WorkloadSpec(
            "agent-long", sessions=24, turns=6, groups=4, prefix_words=1500, question_words=500, max_tokens=32
        ),
        concurrency=12,
        think_time=1.0,
        ramp=2.0,
        note="24 sessions x 6 turns, 4 agent types, 12 in flight",
    ),
    # 48 conversations live, each ~0.4k tokens a turn, 8 turns: ~3.4k tokens each by the last turn,
    # ~165k tokens of history against 4 x 32k of cache. A sticky router overflows by ~1.3x at the
    # end; round-robin, which spreads each conversation over all 4 caches, by ~5x. (At 0.7k tokens
    # a turn the running requests alone outgrew the KV cache: every router queued for memory, p90
    # ~2.4 s for all, which measured admission, not routing.)
    "chat-pressure": Preset(
        WorkloadSpec(
            "chat-pressure",
            sessions=48,
            turns=8,
            groups=1,
            prefix_words=80,
            question_words=150,
            max_tokens=64,
        ),
        concurrency=48,
        think_time=1.5,
        ramp=3.0,
        note="48 conversations x 8 turns, all live at once, working set > fleet cache",
    ),
    # 16 conversations of ~1.5k tokens: every engine could hold every conversation.
    "chat-fits": Preset(
        WorkloadSpec(
            "chat-fits", sessions=16, turns=8, groups=1, prefix_words=80, question_words=80, max_tokens=64
        ),
        concurrency=16,
        think_time=1.0,
        ramp=2.0,
        note="16 conversations x 8 turns, working set fits every engine",
    ),
    # private ~1.6k-token contexts, 4 steps of 4 siblings; half best-of-n, half parallel tool calls
    "siblings": Preset(
        WorkloadSpec(
            "siblings", sessions=16, turns=4, burst=4, prefix_words=700, question_words=60, max_tokens=32
        ),
        concurrency=6,
        think_time=1.0,
        ramp=1.0,
        note="16 sessions x 4 steps x 4 siblings, 6 sessions in flight",
    ),
    # 5 prefixes of ~2.8k tokens, 80% of questions on one of them, Poisson arrivals
    "hot-prefix": Preset(
        WorkloadSpec(
            "hot-prefix",
            sessions=240,
            groups=5,
            prefix_words=1200,
            question_words=60,
            max_tokens=32,
            hot_share=0.8,
        ),
        concurrency=None,
        rate=20.0,
        note="240 questions at 20/s, 80% on one of 5 prefixes",
    ),
    # 8 long agent sessions among 24 short chats
    "mixed": Preset(
        WorkloadSpec(
            "mixed",
            sessions=32,
            turns=6,
            groups=2,
            prefix_words=1500,
            question_words=500,
            max_tokens=32,
            long_share=0.25,
        ),
        concurrency=16,
        think_time=1.0,
        ramp=2.0,
        note="8 agent-long sessions + 24 short chats x 6 turns, 16 in flight",
    ),
}
assert set(PRESETS) == set(_BUILDERS), "every workload needs a preset"


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None


def build(spec: WorkloadSpec) -> list[Session]:
    """The sessions of workload ``spec.name`` (deterministic for a given spec)."""
    return list(sessions_of(spec))


def sessions_of(spec: WorkloadSpec) -> Iterator[Session]:
    """The sessions of workload ``spec.name``, made one at a time, the same as :func:`build`'s."""
    try:
        builder = _BUILDERS[spec.name]
    except KeyError:
        raise ValueError(f"unknown workload {spec.name!r}; choose one of {', '.join(WORKLOADS)}") from None
    return builder(spec)


@cache
def knob_matters(workload: str, knob: str) -> bool:
    """Whether the :class:`WorkloadSpec` field ``knob`` changes what workload ``workload`` sends:
    its preset built with the knob moved to another value sends other sessions. (Read from the
    builders themselves rather than a table beside them, so a new knob or workload cannot make a
    flag that is parsed and then ignored.)"""
    spec = preset(workload).spec
    value = getattr(spec, knob)
    other = (1.0 - value if value != 0.5 else 0.25) if isinstance(value, float) else value + 1
    return build(spec) != build(spec.replace(**{knob: other}))


def ignored_load_knobs(sessions: list[Session], *, open_loop: bool) -> frozenset[str]:
    """The load knobs that change nothing for these sessions: ``ramp`` spreads the starts of a
    closed loop only, and ``think_time`` is the pause between a session's steps, which
    single-step sessions never take."""
    ignored = {"ramp"} if open_loop else set()
    if all(s.steps_left <= 1 for s in sessions):
        ignored.add("think_time")
    return frozenset(ignored)
