"""Configuration of one simulated engine (the ``kvmesh mock`` flags), validated in one place."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from kvmesh.errors import ConfigError
from kvmesh.events.nats_link import parse_event_plane

DEFAULT_MODEL = "kvmesh-mock"


MAX_NUM_BLOCKS = 1 << 22
"""Blocks a simulated cache may have: 4,194,304, about 0.8 GB of block objects (a million took
190 MB). `--num-blocks 99999999999` went on making them, 0.9 GB in six seconds, before serving."""


@dataclass(frozen=True)
class MockConfig:
    model: str = DEFAULT_MODEL
    block_size: int = 64
    num_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: as many tokens as the whole cache holds
    speedup: float = 1.0
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    seed: int = 0
    pin_budget: float = 0.5  # share of the cache that pins and open sessions may hold
    admin_token: str | None = None
    report_profile: bool = False  # serve the step-time model in /kvmesh/info (real engines have none)
    worker_rpc: bool = True  # serve the /kvmesh/* RPCs; without, as a vLLM without kvmesh's plugin
    request_log: str | None = None  # append one JSON line per ended request here (benchmarks)
    # disaggregated serving (vLLM's kv_transfer_params protocol, simulated transfer)
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    transfer_ms_per_block: float = 0.1  # pulling one block's KV from the prefill engine
    transfer_fixed_ms: float = 2.0  # per hand-off: handshake and the transfer's completion notice
    event_plane: str = "zmq"  # or nats://host:port[,...]: KV events to JetStream, registration in the bucket
    advertise_url: str | None = None  # with NATS: the URL registered in the worker bucket at start
    event_name: str | None = None  # its subject token on NATS (default: a random one per process)
    advertise_host: str | None = None  # in /kvmesh/info, for event sockets bound to every interface

    def validate(self) -> MockConfig:
        """Return self, or raise ConfigError naming the flag at fault."""
        positive = {
            "--block-size": self.block_size,
            "--num-blocks": self.num_blocks,
            "--max-num-seqs": self.max_num_seqs,
            "--max-num-batched-tokens": self.max_num_batched_tokens,
        }
        for flag, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
        if self.num_blocks > MAX_NUM_BLOCKS:
            raise ConfigError(
                f"--num-blocks must be at most {MAX_NUM_BLOCKS} (each simulated block is an object "
                f"in memory), got {self.num_blocks}"
            )
        if not self.model:
            raise ConfigError("--model must not be empty")
        if not 0 < self.speedup < math.inf:  # (an infinite speed-up would make every step free)
            raise ConfigError(f"--speedup must be a positive finite number, got {self.speedup!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if not 0.0 <= self.pin_budget < 1.0:
            raise ConfigError(f"--pin-budget must be in [0, 1), got {self.pin_budget!r}")
        capacity = self.num_blocks * self.block_size
        if self.max_model_len is not None and not 1 < self.max_model_len <= capacity:
            raise ConfigError(
                f"--max-model-len must be in [2, {capacity}] (--num-blocks x --block-size), got {self.max_model_len}"
            )
        if self.role not in ("aggregated", "prefill", "decode"):
            raise ConfigError(f"--role must be aggregated, prefill or decode, got {self.role!r}")
        for flag, ms in (
            ("--transfer-ms-per-block", self.transfer_ms_per_block),
            ("--transfer-fixed-ms", self.transfer_fixed_ms),
        ):
            if not 0 <= ms < math.inf:  # (infinity held every decode request's hand-off for ever)
                raise ConfigError(f"{flag} must be a finite number of at least 0, got {ms!r}")
        if self.kv_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("--kv-replay-endpoint needs --kv-events-endpoint")
        if parse_event_plane(self.event_plane) and self.kv_events_endpoint is not None:
            raise ConfigError("--event-plane nats://... replaces --kv-events-endpoint; give one of them")
        if self.advertise_url is not None and not parse_event_plane(self.event_plane):
            raise ConfigError("an advertised URL needs --event-plane nats://...")
        return self

    @property
    def model_len(self) -> int:
        """The longest sequence (prompt + output) a request may have."""
        return self.max_model_len or self.num_blocks * self.block_size

    def replace(self, **changes: object) -> MockConfig:
        return dataclasses.replace(self, **changes).validate()  # type: ignore[arg-type]
