"""One request's state inside the mock engine's scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvmesh.mock.block_hash import extend_block_hashes
from kvmesh.mock.block_pool import KVBlock
from kvmesh.mock.sampler import OutputSampler
from kvmesh.router.request.tokenizer import EOS


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "length"
    FINISHED_STOP = "stop"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOP, RequestStatus.FINISHED_ABORTED)
)


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request as the scheduler sees it.

    ``token_ids`` is prompt + output so far. ``num_computed_tokens`` counts the tokens whose KV is
    (or is being, this step) computed; the request emits a token in a step that brings it level
    with ``len(token_ids)``. ``block_hashes`` covers every full block of ``token_ids``;
    ``num_cached_blocks`` of ``blocks`` are in the prefix cache.
    """

    request_id: str
    prompt_len: int
    token_ids: list[int]
    max_tokens: int
    sampler: OutputSampler
    salt: int
    block_size: int
    arrival: float = 0.0
    priority: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    session_id: str | None = None
    reads_cache: bool = True  # False: its prompt is computed whole, whatever is cached
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first schedule (what usage reports)
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)
    blocks: list[KVBlock] = field(default_factory=list)
    num_cached_blocks: int = 0
    # engine-side bookkeeping (the scheduler never reads these)
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        extend_block_hashes(self.block_hashes, self.token_ids, self.block_size, self.salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def append_output(self, token: int) -> RequestStatus | None:
        """Add a generated token; return the finished status if this token ends the request."""
        self.token_ids.append(token)
        if len(self.token_ids) % self.block_size == 0:
            extend_block_hashes(self.block_hashes, self.token_ids, self.block_size, self.salt)
        n_out = len(self.token_ids) - self.prompt_len
        if token == EOS and not self.ignore_eos and n_out >= self.min_tokens:
            return RequestStatus.FINISHED_STOP
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
