"""Workloads: deterministic scripts of OpenAI chat requests with realistic prefix sharing.

A workload is a list of :class:`Session` objects. A session is a sequence of *steps*; each step
is a burst of requests sent together, and a step may depend on the answers to the previous one
(an agent's next turn carries the model's actual reply). The runner decides when sessions start
(open or closed loop); the session decides what to send.

* ``agentic``      multi-turn agent conversations: a few agent types, each with its own long system
                   prompt and tool definitions shared by all its conversations; every turn appends
                   the model's reply and a tool result, so the prompt grows turn by turn.
* ``shared-prefix`` single-turn questions over a handful of long shared documents.
* ``best-of-n``    bursts of n identical sibling requests (sampling n answers to one prompt).
* ``long-context`` one long private document per session, then follow-up questions about it.

Text is made of pseudo-words from a seeded generator, so every run of a workload with the same
seed sends exactly the same prompts, whatever the tokenizer on the other side.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("agentic", "shared-prefix", "best-of-n", "long-context")

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "den", "par", "qu", "ix", "el", "or", "um",
    "zen", "tri", "bal", "cor", "fen", "gul", "hol", "jin", "mor", "nex", "pol", "ras", "sil",
)  # fmt: skip


def _words(rng: random.Random, n: int) -> str:
    syl = _SYLLABLES
    return " ".join("".join(rng.choice(syl) for _ in range(rng.randint(1, 3))) for _ in range(n))


@dataclass(slots=True)
class Answer:
    """What a step's request came back with (only the text matters to the next step)."""

    text: str
    ok: bool


@dataclass(slots=True)
class Session:
    """One conversation or burst group; ``next_step`` returns the next burst or None when done."""

    session_id: str
    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    steps_left: int
    burst: int = 1
    followups: list[str] = field(default_factory=list)
    step: int = 0

    def next_step(self, previous: list[Answer] | None) -> list[dict[str, Any]] | None:
        """The request bodies (without ``model``/``stream``) of the next step, or None."""
        if self.steps_left <= 0:
            return None
        if previous is not None:
            reply = next((a.text for a in previous if a.ok), None)
            if reply is None:  # the turn failed; an agent would give up on this conversation
                return None
            self.messages.append({"role": "assistant", "content": reply})
            if self.followups:
                self.messages.append({"role": "user", "content": self.followups.pop(0)})
        self.steps_left -= 1
        self.step += 1
        body: dict[str, Any] = {"messages": list(self.messages), "max_tokens": self.max_tokens}
        if self.tools:
            body["tools"] = self.tools
        return [body] * self.burst

    @property
    def total_requests(self) -> int:
        return (self.steps_left) * self.burst


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    sessions: int = 32
    turns: int = 6
    burst: int = 4
    prefix_words: int = 600
    question_words: int = 40
    max_tokens: int = 64
    groups: int = 4
    seed: int = 0


def _tool(rng: random.Random, name: str) -> dict[str, Any]:
    params = {f"arg_{i}": {"type": "string", "description": _words(rng, 8)} for i in range(rng.randint(2, 4))}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": _words(rng, 30),
            "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]},
        },
    }


def agentic(spec: WorkloadSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    agents = []
    for a in range(spec.groups):
        system = f"You are agent {a}. " + _words(rng, spec.prefix_words)
        tools = [_tool(rng, f"tool_{a}_{t}") for t in range(4)]
        agents.append((system, tools))
    sessions = []
    for s in range(spec.sessions):
        system, tools = agents[s % len(agents)]
        task = f"Task {s}: " + _words(rng, spec.question_words)
        followups = [
            f"Tool result {s}.{t}: " + _words(rng, spec.question_words * 2) for t in range(spec.turns)
        ]
        sessions.append(
            Session(
                session_id=f"agentic-{s}",
                kind="agentic",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": task}],
                tools=tools,
                max_tokens=spec.max_tokens,
                steps_left=spec.turns,
                followups=followups,
            )
        )
    return sessions


def shared_prefix(spec: WorkloadSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    documents = [f"Document {g}. " + _words(rng, spec.prefix_words) for g in range(spec.groups)]
    return [
        Session(
            session_id=f"shared-{s}",
            kind="shared-prefix",
            messages=[
                {"role": "system", "content": documents[rng.randrange(len(documents))]},
                {"role": "user", "content": f"Question {s}: " + _words(rng, spec.question_words)},
            ],
            tools=None,
            max_tokens=spec.max_tokens,
            steps_left=1,
        )
        for s in range(spec.sessions)
    ]


def best_of_n(spec: WorkloadSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    return [
        Session(
            session_id=f"bon-{s}",
            kind="best-of-n",
            messages=[{"role": "user", "content": f"Problem {s}: " + _words(rng, spec.prefix_words)}],
            tools=None,
            max_tokens=spec.max_tokens,
            steps_left=1,
            burst=spec.burst,
        )
        for s in range(spec.sessions)
    ]


def long_context(spec: WorkloadSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    sessions = []
    for s in range(spec.sessions):
        document = f"Report {s}. " + _words(rng, spec.prefix_words * 8)
        questions = [f"Follow-up {s}.{t}: " + _words(rng, spec.question_words) for t in range(spec.turns)]
        sessions.append(
            Session(
                session_id=f"long-{s}",
                kind="long-context",
                messages=[
                    {"role": "system", "content": document},
                    {"role": "user", "content": f"Summary request {s}: " + _words(rng, spec.question_words)},
                ],
                tools=None,
                max_tokens=spec.max_tokens,
                steps_left=max(1, min(spec.turns, 3)),
                followups=questions,
            )
        )
    return sessions


_BUILDERS: dict[str, Callable[[WorkloadSpec], list[Session]]] = {
    "agentic": agentic,
    "shared-prefix": shared_prefix,
    "best-of-n": best_of_n,
    "long-context": long_context,
}


def build(spec: WorkloadSpec) -> list[Session]:
    """The sessions of workload ``spec.name`` (deterministic for a given spec)."""
    try:
        builder = _BUILDERS[spec.name]
    except KeyError:
        raise ValueError(f"unknown workload {spec.name!r}; choose one of {', '.join(WORKLOADS)}") from None
    return builder(spec)
