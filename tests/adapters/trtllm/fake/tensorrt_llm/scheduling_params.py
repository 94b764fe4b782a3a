"""Fake of ``tensorrt_llm/scheduling_params.py`` (SchedulingParams dataclass, 1.1+ shape)."""

from dataclasses import dataclass


@dataclass
class SchedulingParams:
    attention_dp_rank: int | None = None
    attention_dp_relax: bool = True
    agent_hierarchy: list | None = None
