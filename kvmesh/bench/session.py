"""What a workload is made of: sessions of steps, their spec, and seeded pseudo-text.

A session is a sequence of *steps*; each step is a burst of requests sent together, and a step
may depend on the answers to the previous one (an agent's next turn carries the model's actual
reply). The runner decides when sessions start (open or closed loop); the session decides what to
send. Text is made of pseudo-words from a seeded generator, so every run of a workload with the
same seed sends exactly the same prompts, whatever the tokenizer on the other side (the built-in
tokenizer turns one pseudo-word into about 2.3 tokens).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "den", "par", "qu", "ix", "el", "or", "um",
    "zen", "tri", "bal", "cor", "fen", "gul", "hol", "jin", "mor", "nex", "pol", "ras", "sil",
)  # fmt: skip


def words(rng: random.Random, n: int) -> str:
    syl = _SYLLABLES
    return " ".join("".join(rng.choice(syl) for _ in range(rng.randint(1, 3))) for _ in range(n))


def tool(rng: random.Random, name: str) -> dict[str, Any]:
    """An OpenAI function-tool definition with a seeded description and parameters."""
    params = {f"arg_{i}": {"type": "string", "description": words(rng, 8)} for i in range(rng.randint(2, 4))}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": words(rng, 30),
            "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]},
        },
    }


@dataclass(slots=True)
class Answer:
    """What a step's request came back with (only the text matters to the next step)."""

    text: str
    ok: bool


@dataclass(slots=True)
class Session:
    """One conversation or burst group; ``next_step`` returns the next burst or None when done.

    ``sibling_tails[k]`` (optional) gives step k's siblings one extra user message each (parallel
    tool calls: one shared conversation, a different call per sibling); the conversation then goes
    on with the tail and the answer of the first sibling that succeeded. Without tails a burst is
    ``burst`` identical requests (best-of-n). ``think_scale`` multiplies the runner's think time
    for this session (an agent waits for a tool, a person reads and types).
    """

    session_id: str
    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    steps_left: int
    burst: int = 1
    followups: list[str] = field(default_factory=list)
    step: int = 0
    sibling_tails: list[list[str]] = field(default_factory=list)
    think_scale: float = 1.0
    _last_tails: list[str] = field(default_factory=list)

    def next_step(self, previous: list[Answer] | None) -> list[dict[str, Any]] | None:
        """The request bodies (without ``model``/``stream``) of the next step, or None."""
        if self.steps_left <= 0:
            return None
        if previous is not None:
            chosen = next((i for i, a in enumerate(previous) if a.ok), None)
            if chosen is None:  # the turn failed; an agent would give up on this conversation
                return None
            if self._last_tails:
                self.messages.append({"role": "user", "content": self._last_tails[chosen]})
            self.messages.append({"role": "assistant", "content": previous[chosen].text})
            if self.followups:
                self.messages.append({"role": "user", "content": self.followups.pop(0)})
        self.steps_left -= 1
        self.step += 1
        tails = self.sibling_tails[self.step - 1] if self.step <= len(self.sibling_tails) else []
        self._last_tails = tails
        bodies = []
        for i in range(self.burst):
            messages = list(self.messages)
            if tails:
                messages.append({"role": "user", "content": tails[i]})
            body: dict[str, Any] = {"messages": messages, "max_tokens": self.max_tokens}
            if self.tools:
                body["tools"] = self.tools
            bodies.append(body)
        return bodies

    @property
    def total_requests(self) -> int:
        return self.steps_left * self.burst


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The knobs of a workload. Each workload documents what each knob means for it."""

    name: str
    sessions: int = 32
    turns: int = 6
    burst: int = 4
    prefix_words: int = 600
    question_words: int = 40
    max_tokens: int = 64
    groups: int = 4
    seed: int = 0
    hot_share: float = 0.8
    """hot-prefix: the share of requests that carry the hot prefix."""
    long_share: float = 0.25
    """mixed: the share of sessions that are long agent sessions (the rest are short chats)."""

    def replace(self, **changes: Any) -> WorkloadSpec:
        return dataclasses.replace(self, **changes)
