"""Prompts hashed only as far as their first chunk (``RouteRequest.complete``): placed on that
where nothing can match past it, committed whole by ``flush()``, and otherwise hashed at once. The
router must end up exactly where it would have, had it hashed every prompt whole."""

from __future__ import annotations

import random

import pytest

from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.hashing import block_hashes
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import Decision, KvRouter, RouteRequest
from kvmesh.router.core.load import CHUNK

B = 4
HEAD = CHUNK  # blocks hashed before the decision


def toks(rng: random.Random, n_blocks: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n_blocks * B + rng.randrange(B))]


def router(**cfg) -> KvRouter:
    r = KvRouter(RouterConfig(**cfg), random.Random(0))
    for w in "abc":
        r.add_worker(w, total_blocks=400, max_num_batched_tokens=256, block_size=B)
    return r


class Calls:
    """A ``complete`` callable that counts its calls."""

    def __init__(self, hashes: list[int]) -> None:
        self.hashes = hashes
        self.calls = 0

    def __call__(self) -> list[int]:
        self.calls += 1
        return self.hashes


def lazy(rid: str, tokens: list[int]) -> tuple[RouteRequest, Calls]:
    hashes = block_hashes(tokens, B)
    calls = Calls(hashes)
    return RouteRequest(rid, hashes[:HEAD], len(tokens), complete=calls), calls


def whole(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(rid, block_hashes(tokens, B), len(tokens))


def test_a_prompt_nobody_holds_is_placed_on_its_head_and_committed_whole_by_flush() -> None:
    r = router()
    prompt = toks(random.Random(1), 3 * CHUNK)
    request, calls = lazy("r1", prompt)
    decision = r.route(request, 0.0)
    assert isinstance(decision, Decision)
    assert calls.calls == 0  # decided without the rest of the prompt
    assert r.worker_snapshot()[0].active_requests + r.worker_snapshot()[1].active_requests == 1
    assert calls.calls == 1  # reading the load committed it first
    # committed whole: a sibling sent now finds every block of it on that worker, so it is hashed
    # at once (its start is held) and credited in full there
    sibling, sibling_calls = lazy("r2", prompt)
    second = r.route(sibling, 0.001)
    assert isinstance(second, Decision)
    assert sibling_calls.calls == 1
    held = {s.worker: s.overlap_blocks for s in second.breakdown}
    assert held == {w: len(prompt) // B if w == decision.worker else 0 for w in held}


def test_a_prompt_whose_first_block_is_cached_is_hashed_before_the_decision() -> None:
    r = router()
    rng = random.Random(2)
    system = toks(rng, 2 * CHUNK)
    full = system[: 2 * CHUNK * B]
    r.apply_events("b", EventBatch(0.0, [BlockStored(list(range(2 * CHUNK)), None, full, B)], 0))
    request, calls = lazy("r1", full + toks(rng, 2 * CHUNK))
    decision = r.route(request, 0.0)
    assert calls.calls == 1
    assert isinstance(decision, Decision)
    assert (decision.worker, decision.overlap_blocks) == (("b", 0), 2 * CHUNK)


def test_a_session_or_a_pin_is_hashed_before_the_decision() -> None:
    r = router()
    prompt = toks(random.Random(3), 2 * CHUNK)
    for extra in ({"session_id": "s", "session_action": "open"}, {"backend_instance_id": "c"}):
        request, calls = lazy(f"r-{len(extra)}", prompt)
        for name, value in extra.items():
            setattr(request, name, value)
        assert isinstance(r.route(request, 0.0), Decision)
        assert calls.calls == 1
        prompt = toks(random.Random(4), 2 * CHUNK)


def _workload(seed: int, n: int) -> list[list[int]]:
    """Conversations over a few shared system prompts, fresh one-off prompts and siblings."""
    rng = random.Random(seed)
    systems = [toks(rng, rng.choice((0, CHUNK // 2, CHUNK, 2 * CHUNK)))[: CHUNK * B] for _ in range(3)]
    chats: list[list[int]] = []
    out: list[list[int]] = []
    for _ in range(n):
        roll = rng.random()
        if chats and roll < 0.45:  # a conversation's next turn
            i = rng.randrange(len(chats))
            chats[i] = chats[i] + toks(rng, rng.randrange(1, CHUNK))
            out.append(chats[i])
        elif out and roll < 0.55:  # a sibling of something just sent
            out.append(list(out[-1]))
        elif roll < 0.8:  # a new conversation on a shared system prompt, or none
            chats.append(rng.choice(systems) + toks(rng, rng.randrange(CHUNK, 3 * CHUNK)))
            out.append(chats[-1])
        else:  # a one-off prompt nobody has seen
            out.append(toks(rng, rng.randrange(CHUNK, 4 * CHUNK)))
    return out


def _state(r: KvRouter) -> tuple:
    snaps = tuple(
        (s.worker, s.active_requests, s.active_prefill_tokens, round(s.active_decode_blocks, 6))
        for s in r.worker_snapshot()
    )
    return snaps, r.conversation_stats()


@pytest.mark.parametrize("cost_model", ["latency", "dynamo"])
def test_lazy_and_whole_prompts_make_the_same_decisions_and_leave_the_same_state(cost_model: str) -> None:
    for seed in range(4):
        eager, deferred = router(router_cost_model=cost_model), router(router_cost_model=cost_model)
        rng = random.Random(100 + seed)
        prompts = _workload(seed, 160)
        live: list[tuple[str, tuple[str, int], list[int]]] = []
        now = 0.0
        went_lazy = 0
        next_id = 1
        for i, prompt in enumerate(prompts):
            now += rng.expovariate(20.0)
            rid = f"r{i}"
            got_e = eager.route(whole(rid, prompt), now)
            request, calls = lazy(rid, prompt)
            got_d = deferred.route(request, now)
            assert isinstance(got_e, Decision) and isinstance(got_d, Decision)
            assert got_d.worker == got_e.worker, (seed, i)
            assert got_d.overlap_blocks == got_e.overlap_blocks
            assert [round(s.cost, 6) for s in got_d.breakdown] == [round(s.cost, 6) for s in got_e.breakdown]
            went_lazy += calls.calls == 0
            if rng.random() < 0.5:
                deferred.flush()  # the forwarder's call, once the request is written
            live.append((rid, got_e.worker, prompt))
            # the engine caches some prompts, answers some requests
            if rng.random() < 0.6:
                n = len(prompt) // B
                ids = list(range(next_id, next_id + n))
                next_id += n
                for r in (eager, deferred):
                    r.apply_events(
                        got_e.worker[0], EventBatch(now, [BlockStored(ids, None, prompt[: n * B], B)])
                    )
            for rid_done, _, _ in [x for x in live if rng.random() < 0.15]:
                for r in (eager, deferred):
                    r.first_token(rid_done, now)
                    r.output_tokens(rid_done, 8, now)
                    r.finished(rid_done, now)
                live = [x for x in live if x[0] != rid_done]
            assert _state(deferred) == _state(eager), (seed, i)
        # a run that never took the lazy path would prove nothing
        assert went_lazy >= 10, went_lazy
