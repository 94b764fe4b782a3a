"""The routing-quality workloads: conversations shaped so that where a request goes matters.

Each builder documents what the :class:`WorkloadSpec` knobs mean for it. Token counts below are
for the built-in tokenizer (about 2.3 tokens per pseudo-word); the presets in
:mod:`kvmesh.bench.workloads` give the parameters the suite runs with.

* ``agent-long``  agent sessions with long contexts: each agent type has a long system prompt and
                  six tool definitions shared by all its sessions; every turn appends the model's
                  reply and a long tool output, so a session grows by thousands of tokens.
* ``chat``        multi-turn chat (``chat-pressure`` and ``chat-fits`` are two sizes of it): a short
                  shared system prompt, then each conversation's own growing history.
* ``siblings``    bursts sharing one prefix: even sessions are best-of-n (identical siblings),
                  odd ones parallel tool calls (one conversation, a different call per sibling).
* ``hot-prefix``  single questions over ``groups`` long prefixes, one of which carries
                  ``hot_share`` of the traffic (the herding test).
* ``mixed``       short chats and long agent sessions, interleaved.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvmesh.bench.session import Session, WorkloadSpec, tool, words


def agent_long(spec: WorkloadSpec) -> Iterator[Session]:
    """``groups`` agent types with ``prefix_words``-word system prompts; ``sessions`` sessions of
    ``turns`` turns; each tool output is ``question_words`` words."""
    rng = random.Random(spec.seed)
    agents = []
    for a in range(spec.groups):
        system = f"You are agent {a}. " + words(rng, spec.prefix_words)
        agents.append((system, [tool(rng, f"tool_{a}_{t}") for t in range(6)]))
    for s in range(spec.sessions):
        yield _agent_session(rng, spec, s, *agents[s % len(agents)])


def _agent_session(
    rng: random.Random, spec: WorkloadSpec, s: int, system: str, tools: list[dict[str, object]]
) -> Session:
    task = f"Task {s}: " + words(rng, max(8, spec.question_words // 8))
    outputs = [f"Tool output {s}.{t}: " + words(rng, spec.question_words) for t in range(spec.turns)]
    return Session(
        session_id=f"agent-{s}",
        kind="agent-long",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": task}],
        tools=tools,  # type: ignore[arg-type]
        max_tokens=spec.max_tokens,
        steps_left=spec.turns,
        followups=outputs,
        think_scale=0.25,  # an agent waits for its tool, not for a person
    )


def chat(spec: WorkloadSpec) -> Iterator[Session]:
    """``groups`` shared system prompts of ``prefix_words`` words; ``sessions`` conversations of
    ``turns`` turns, each user message ``question_words`` words."""
    rng = random.Random(spec.seed)
    systems = [f"Assistant persona {g}. " + words(rng, spec.prefix_words) for g in range(spec.groups)]
    for s in range(spec.sessions):
        yield _chat_session(rng, spec, s, systems[s % len(systems)])


def _chat_session(rng: random.Random, spec: WorkloadSpec, s: int, system: str) -> Session:
    first = f"Hi, conversation {s}: " + words(rng, spec.question_words)
    followups = [f"Turn {s}.{t}: " + words(rng, spec.question_words) for t in range(spec.turns)]
    return Session(
        session_id=f"chat-{s}",
        kind="chat",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": first}],
        tools=None,
        max_tokens=spec.max_tokens,
        steps_left=spec.turns,
        followups=followups,
    )


def siblings(spec: WorkloadSpec) -> Iterator[Session]:
    """``sessions`` sessions, each a private ``prefix_words``-word context, ``turns`` steps of
    ``burst`` siblings; a parallel tool call adds ``question_words`` words per sibling."""
    rng = random.Random(spec.seed)
    for s in range(spec.sessions):
        context = f"Workspace {s}: " + words(rng, spec.prefix_words)
        if s % 2 == 0:  # best-of-n: n identical samples of one prompt
            tails = [[f"Attempt step {t}."] * spec.burst for t in range(spec.turns)]
            kind = "best-of-n"
        else:
            tails = [
                [f"Call {t}.{j}: " + words(rng, spec.question_words) for j in range(spec.burst)]
                for t in range(spec.turns)
            ]
            kind = "parallel-tools"
        yield Session(
            session_id=f"siblings-{s}",
            kind=kind,
            messages=[{"role": "user", "content": context}],
            tools=None,
            max_tokens=spec.max_tokens,
            steps_left=spec.turns,
            burst=spec.burst,
            sibling_tails=tails,
            think_scale=0.25,
        )


def hot_prefix(spec: WorkloadSpec) -> Iterator[Session]:
    """``sessions`` single questions of ``question_words`` words over ``groups`` prefixes of
    ``prefix_words`` words; prefix 0 takes ``hot_share`` of them, the others share the rest."""
    rng = random.Random(spec.seed)
    prefixes = [f"Knowledge base {g}. " + words(rng, spec.prefix_words) for g in range(spec.groups)]
    for s in range(spec.sessions):
        g = 0 if spec.groups == 1 or rng.random() < spec.hot_share else rng.randrange(1, spec.groups)
        yield Session(
            session_id=f"hot-{s}",
            kind="hot" if g == 0 else "cold",
            messages=[
                {"role": "system", "content": prefixes[g]},
                {"role": "user", "content": f"Question {s}: " + words(rng, spec.question_words)},
            ],
            tools=None,
            max_tokens=spec.max_tokens,
            steps_left=1,
        )


def mixed(spec: WorkloadSpec) -> Iterator[Session]:
    """``sessions`` sessions, ``long_share`` of them agent-long sessions (system prompts of
    ``prefix_words`` words, tool outputs of ``question_words``), the rest short chats (user
    messages of ``question_words // 8`` words); ``turns`` turns each, in a seeded order."""
    rng = random.Random(spec.seed)
    n_long = round(spec.sessions * spec.long_share)
    agents = []
    for a in range(max(1, min(spec.groups, n_long))):
        system = f"You are agent {a}. " + words(rng, spec.prefix_words)
        agents.append((system, [tool(rng, f"tool_{a}_{t}") for t in range(6)]))
    chat_spec = spec.replace(question_words=max(8, spec.question_words // 8))
    chat_system = "Assistant persona 0. " + words(rng, 80)
    kinds = [True] * n_long + [False] * (spec.sessions - n_long)
    rng.shuffle(kinds)
    for s, is_long in enumerate(kinds):
        if is_long:
            yield _agent_session(rng, spec, s, *agents[s % len(agents)])
        else:
            yield _chat_session(rng, chat_spec, s, chat_system)
