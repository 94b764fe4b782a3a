"""Pins and session retention in vLLM's real block pool, through vLLM's utility-call dispatch."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    from vllm.v1.engine.core import EngineCore

    from kvmesh.adapters.vllm.engine_rpc import EngineRpc
    from kvmesh.adapters.vllm.plugin import register
    from tests.engines.vllm_helpers import (
        BLOCK_SIZE,
        LoopbackEngineCore,
        NoRoom,
        PromptRunner,
        make_hasher,
        make_manager,
    )

pytestmark = pytest.mark.engine_vllm

NUM_BLOCKS = 21  # 20 usable + vLLM's null block


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> tuple[LoopbackEngineCore, PromptRunner, Clock]:
    """An engine core with kvmesh's RPC installed the way the general plugin installs it, whose
    EngineRpc reads a test clock and a 50% pin budget (10 of 20 blocks)."""
    register()
    clock = Clock()
    monkeypatch.setenv("KVMESH_PIN_BUDGET", "0.5")
    manager = make_manager(NUM_BLOCKS, events=False)
    hasher = make_hasher()
    core = LoopbackEngineCore(manager, hasher)
    original = EngineRpc.for_engine_core

    def with_clock(c: Any) -> EngineRpc:
        rpc = original(c)
        rpc.clock = clock
        return rpc

    monkeypatch.setattr(EngineRpc, "for_engine_core", with_clock)
    return core, PromptRunner(manager, hasher), clock


def rpc(core: LoopbackEngineCore, name: str, **payload: Any) -> dict[str, Any]:
    return core.call("kvmesh_rpc", name, payload)  # type: ignore[no-any-return]


def pressure(runner: PromptRunner, rounds: int = 6) -> None:
    """Fill the pool with fresh prompts again and again: every unpinned cached block is evicted."""
    for r in range(rounds):
        for k in range(3):
            base = 100_000 + 1000 * (3 * r + k)
            runner.run(list(range(base, base + 4 * BLOCK_SIZE)))


PROMPT = list(range(1, 1 + 6 * BLOCK_SIZE))  # six full blocks


def test_without_a_pin_pressure_evicts_the_prefix(
    engine: tuple[LoopbackEngineCore, PromptRunner, Clock],
) -> None:
    """The control for the pin tests below: the pressure really evicts."""
    _, runner, _ = engine
    runner.run(PROMPT)
    assert runner.cached_hit(PROMPT) == len(PROMPT)
    pressure(runner)
    assert runner.cached_hit(PROMPT) == 0


def test_a_pin_keeps_the_prefix_resident_until_its_ttl(
    engine: tuple[LoopbackEngineCore, PromptRunner, Clock],
) -> None:
    core, runner, clock = engine
    runner.run(PROMPT)
    assert rpc(core, "pin_prefix", token_ids=PROMPT, ttl_seconds=30.0) == {"blocks_pinned": 6}
    pool = runner.manager.block_pool
    assert pool.get_num_free_blocks() == 20 - 6

    clock.now += 29.0
    assert rpc(core, "tick")["next_expiry_in"] == pytest.approx(1.0)
    pressure(runner)
    assert runner.cached_hit(PROMPT) == len(PROMPT)

    clock.now += 1.0
    assert rpc(core, "tick")["next_expiry_in"] is None
    assert pool.get_num_free_blocks() == 20  # unpinned, still cached, now evictable
    assert runner.cached_hit(PROMPT) == len(PROMPT)
    pressure(runner)
    assert runner.cached_hit(PROMPT) == 0


def test_pinning_the_same_prefix_again_extends_it_without_a_second_reference(
    engine: tuple[LoopbackEngineCore, PromptRunner, Clock],
) -> None:
    core, runner, clock = engine
    runner.run(PROMPT)
    rpc(core, "pin_prefix", token_ids=PROMPT, ttl_seconds=10.0)
    rpc(core, "pin_prefix", token_ids=PROMPT, ttl_seconds=50.0)
    assert rpc(core, "stats")["held_blocks"] == 6
    clock.now += 20.0
    rpc(core, "tick")
    pressure(runner)
    assert runner.cached_hit(PROMPT) == len(PROMPT)
    clock.now += 30.0
    rpc(core, "tick")
    assert runner.manager.block_pool.get_num_free_blocks() == 20  # one reference, dropped once


def test_only_the_cached_prefix_is_pinned(engine: tuple[LoopbackEngineCore, PromptRunner, Clock]) -> None:
    core, runner, _ = engine
    runner.run(PROMPT[: 2 * BLOCK_SIZE])
    assert rpc(core, "pin_prefix", token_ids=PROMPT, ttl_seconds=5.0) == {"blocks_pinned": 2}
    assert rpc(core, "pin_prefix", token_ids=[7, 7, 7, 7, 7], ttl_seconds=5.0) == {"blocks_pinned": 0}


def test_the_budget_caps_distinct_pinned_blocks(
    engine: tuple[LoopbackEngineCore, PromptRunner, Clock],
) -> None:
    core, runner, _ = engine
    other = list(range(500, 500 + 8 * BLOCK_SIZE))
    runner.run(PROMPT)
    runner.run(other)
    assert rpc(core, "pin_prefix", token_ids=PROMPT, ttl_seconds=60.0) == {"blocks_pinned": 6}
    # 10 of 20 blocks may be pinned: the second prefix keeps its first 4 blocks only.
    assert rpc(core, "pin_prefix", token_ids=other, ttl_seconds=60.0) == {"blocks_pinned": 4}
    assert rpc(core, "stats") == {"held_blocks": 10, "budget_blocks": 10, "holds": 2, "sessions": 0}
    assert runner.manager.block_pool.get_num_free_blocks() == 10
    # Running requests still get the other half of the cache.
    runner.run(list(range(9000, 9000 + 10 * BLOCK_SIZE)))
    with pytest.raises(NoRoom):
        runner.run(list(range(9000, 9000 + 11 * BLOCK_SIZE)))


def test_a_failed_rpc_is_reported_through_vllms_utility_failure(
    engine: tuple[LoopbackEngineCore, PromptRunner, Clock],
) -> None:
    core, _, _ = engine
    with pytest.raises(
        RuntimeError, match="Call to kvmesh_rpc method failed: unknown kvmesh engine RPC 'nope'"
    ):
        core.call("kvmesh_rpc", "nope", {})


def test_an_open_session_retains_each_turn_and_releases_on_close(
    engine: tuple[LoopbackEngineCore, PromptRunner, Clock],
) -> None:
    core, runner, _ = engine
    assert rpc(core, "open_session", session_id="s1", timeout=60.0) == {"created": True}
    turn1 = PROMPT[: 3 * BLOCK_SIZE]
    turn2 = PROMPT  # the conversation grows: turn 1's prompt, an answer and a new question

    for turn in (turn1, turn2):
        request = runner.request(turn, session_id="s1")
        # vLLM's EngineCore.add_request, as wrapped by the general plugin, shows kvmesh the turn.
        _note_via_wrapped_add_request(core, request)
        runner.run(turn, session_id="s1")
        rpc(core, "tick")
        pressure(runner)
        assert runner.cached_hit(turn) == len(turn)
    assert rpc(core, "stats")["held_blocks"] == 6  # turn 2 replaced turn 1's (shared) blocks

    assert rpc(core, "close_session", session_id="s1") == {"closed": True}
    assert rpc(core, "close_session", session_id="s1") == {"closed": False}
    pressure(runner)
    assert runner.cached_hit(turn2) == 0


def test_an_idle_session_times_out(engine: tuple[LoopbackEngineCore, PromptRunner, Clock]) -> None:
    core, runner, clock = engine
    rpc(core, "open_session", session_id="s2", timeout=10.0)
    request = runner.request(PROMPT, session_id="s2")
    _note_via_wrapped_add_request(core, request)
    runner.run(PROMPT, session_id="s2")
    rpc(core, "tick")
    clock.now += 9.0
    _note_via_wrapped_add_request(core, runner.request(PROMPT, session_id="s2"))  # a turn slides the deadline
    clock.now += 9.0
    rpc(core, "tick")
    assert rpc(core, "stats")["sessions"] == 1
    clock.now += 1.0
    rpc(core, "tick")
    assert rpc(core, "stats") == {"held_blocks": 0, "budget_blocks": 10, "holds": 0, "sessions": 0}
    pressure(runner)
    assert runner.cached_hit(PROMPT) == 0


def _note_via_wrapped_add_request(core: LoopbackEngineCore, request: Any) -> None:
    """Run the plugin's EngineCore.add_request wrapper with vLLM's original add_request swapped
    for a no-op (admitting into a scheduler needs a model; PromptRunner plays that part)."""
    wrapped = EngineCore.add_request
    assert hasattr(wrapped, "__kvmesh_wrapped__")
    from kvmesh.adapters.vllm.engine_rpc import wrap_add_request

    wrap_add_request(lambda self, request, *a, **k: None)(core.core, request)
