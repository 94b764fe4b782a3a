"""Deterministic "model output": the tokens a mock request generates.

Output is a stream of common English words, so streamed text looks like text. The words depend
only on the request's seed and its prompt, so the same request with the same seed always
produces the same tokens, in any process. A request without ``max_tokens`` ends with EOS at a
"natural" length drawn the same way (between ``NATURAL_MIN`` and ``NATURAL_MAX`` tokens).
"""

from __future__ import annotations

import random

from xxhash import xxh3_64_intdigest

from kvmesh.hashing import token_bytes
from kvmesh.router.request.tokenizer import EOS, BuiltinTokenizer

NATURAL_MIN = 16
NATURAL_MAX = 128

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "at",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "her",
    "all",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
]
_tok = BuiltinTokenizer()
_WORD_TOKENS: tuple[tuple[int, ...], ...] = tuple(tuple(_tok.encode(" " + w)) for w in _WORDS)


def sampler_key(seed: int, prompt_token_ids: list[int]) -> int:
    """The seed of a request's output: its own seed mixed with its prompt."""
    return xxh3_64_intdigest(token_bytes(prompt_token_ids), seed & 0xFFFFFFFFFFFFFFFF)


class OutputSampler:
    """Yields a request's output tokens one by one; EOS after ``stop_after`` tokens, if given."""

    __slots__ = ("_pending", "_rng", "emitted", "stop_after")

    def __init__(self, key: int, *, natural_stop: bool) -> None:
        self._rng = random.Random(key)
        self._pending: list[int] = []
        self.emitted = 0
        self.stop_after = self._rng.randint(NATURAL_MIN, NATURAL_MAX) if natural_stop else None

    def next_token(self) -> int:
        self.emitted += 1
        if self.stop_after is not None and self.emitted > self.stop_after:
            return EOS
        if not self._pending:
            word = _WORD_TOKENS[self._rng.randrange(len(_WORD_TOKENS))]
            self._pending.extend(reversed(word))
        return self._pending.pop()
