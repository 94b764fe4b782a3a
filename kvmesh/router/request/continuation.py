"""A conversation's later turn, recognised by its messages before it is tokenized.

A chat request's messages begin with the messages of the conversation's request before, followed
by the answer to it (an ``assistant`` message) and what came after. Where the chat template renders
a conversation turn by turn, the earlier prompt, generation prompt included, is where the later one
begins, so the earlier prompt's full blocks are the later prompt's first blocks. :class:`TurnMemo`
keeps the block hashes of recent chat prompts by a fingerprint of what they were rendered from, so
that the router can route a later turn on them and tokenize it once it has been sent (tokenizing a
long conversation is most of the front's time before a decision). The front checks the blocks
against the prompt's own once it has them. A template that renders a conversation otherwise (one
that rewrites earlier turns, or whose generation prompt tokenizes differently once answered) shows
on the first check, and the memo stops there: every later request is tokenized before it is routed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.router.request.pending import PendingCounts

_encode = msgspec.json.encode

MEMO_BLOCKS = 1 << 18
"""Block hashes the memo keeps in all (about 10 MB): the latest turns of a few hundred long
conversations, or of thousands of short ones. The oldest prompts go first."""


@dataclass(frozen=True, slots=True)
class EarlierTurn:
    """A prompt the memo keeps: its full blocks' hashes, its length and its body's."""

    hashes: tuple[int, ...]
    isl: int
    body_bytes: int


class TurnMemo:
    """Recent chat prompts' block hashes by the fingerprint of their messages (see the module)."""

    def __init__(self, max_blocks: int = MEMO_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._turns: OrderedDict[int, EarlierTurn] = OrderedDict()
        self._blocks = 0
        self.stopped: str | None = None
        """Why the memo stopped (a prompt that did not begin with its earlier turn's blocks)."""
        self.found = 0
        """Prompts routed on a kept prompt's blocks: later turns, and the same messages again."""
        self.same = 0
        """Of those, the same messages again (counted and tokenized no more once sent)."""
        self._pending = PendingCounts()
        """Prompts sent and not yet counted (:meth:`defer`), by fingerprint: how to count each."""

    def __len__(self) -> int:
        return len(self._turns)

    @staticmethod
    def fingerprints(
        messages: Sequence[Any], tools: Sequence[Any] | None, namespace: str | None
    ) -> list[int] | None:
        """The fingerprint of each prefix of ``messages`` (``[i]``: of the first ``i + 1``), with
        the tools and the cache namespace (the LoRA adapter) they are rendered for; None for
        messages that do not encode as JSON."""
        try:
            fp = hash((namespace, _encode(tools) if tools else b""))
            out = []
            for message in messages:
                fp = hash((fp, _encode(message)))
                out.append(fp)
        except (TypeError, msgspec.EncodeError):
            return None
        return out

    def find(
        self, fingerprints: Sequence[int], messages: Sequence[Any], generation_prompt: bool = True
    ) -> tuple[EarlierTurn, bool] | None:
        """``(prompt, whole)``: the prompt rendered from these same messages with its generation
        prompt (``whole``: a best-of-n sibling of one routed a moment ago, a retry; its blocks are
        all of this one's; only where this one asks for the generation prompt too), else the
        longest earlier prompt they continue, rendered from their first ``k`` messages, the
        ``k + 1``-th an answer to it (``assistant``). None: none kept, or stopped."""
        if self.stopped is not None or not fingerprints:
            return None
        if generation_prompt and self._pending:
            self.settle(fingerprints[-1])  # the same messages, sent a moment ago: counted now
        turns = self._turns
        same = turns.get(fingerprints[-1]) if generation_prompt else None
        if same is not None:
            turns.move_to_end(fingerprints[-1])
            self.found += 1
            self.same += 1
            return same, True
        for k in range(len(fingerprints) - 1, 0, -1):
            answer = messages[k]
            if not isinstance(answer, dict) or answer.get("role") != "assistant":
                continue
            earlier = turns.get(fingerprints[k - 1])
            if earlier is not None:
                turns.move_to_end(fingerprints[k - 1])
                self.found += 1
                return earlier, False
        return None

    def remember(self, fingerprint: int, hashes: Sequence[int], isl: int, body_bytes: int) -> None:
        """Keep a prompt rendered with its generation prompt (a later turn may begin with it)."""
        if self.stopped is not None or not hashes or len(hashes) > self.max_blocks:
            return
        turns = self._turns
        old = turns.pop(fingerprint, None)
        if old is not None:
            self._blocks -= len(old.hashes)
        turns[fingerprint] = EarlierTurn(tuple(hashes), isl, body_bytes)
        self._blocks += len(hashes)
        while self._blocks > self.max_blocks:
            _, gone = turns.popitem(last=False)
            self._blocks -= len(gone.hashes)

    def defer(self, fingerprint: int, count: Callable[[], None]) -> None:
        """Keep ``count`` (it tokenizes a prompt just sent, counts it and keeps it with
        :meth:`remember`) until the caller runs it with :meth:`settle`, once the requests already
        waiting are on their way.
        A request with the same messages runs it first, from :meth:`find`: it is then routed on
        all of that prompt's blocks, as a best-of-n sibling is."""
        self._pending.defer(fingerprint, count)

    def settle(self, fingerprint: int) -> None:
        """Run the deferred count of the prompt with this fingerprint, if it has not run yet."""
        self._pending.settle(fingerprint)

    def stop(self, reason: str) -> None:
        """Keep nothing more, and find nothing: the template does not render turn by turn."""
        self.stopped = reason
        self._turns.clear()
        self._blocks = 0

    def describe(self) -> dict[str, Any]:
        """For ``GET /kvmesh/router``."""
        return {
            "found": self.found,
            "same": self.same,
            "kept": len(self._turns),
            "blocks": self._blocks,
            "stopped": self.stopped,
        }
