"""kvmesh.mock.scheduler: continuous batching, chunked prefill, prefix hits, preemption, priority."""

from __future__ import annotations

import itertools
import random

from kvmesh.events.wire import BlockRemoved, BlockStored
from kvmesh.mock.block_pool import BlockPool
from kvmesh.mock.request import EngineRequest, RequestStatus
from kvmesh.mock.sampler import OutputSampler, sampler_key
from kvmesh.mock.scheduler import Scheduler

BS = 4
SALT = 99
_ids = itertools.count()


def make(prompt: list[int], max_tokens: int, *, priority: int = 0, arrival: float = 0.0) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{next(_ids)}",
        prompt_len=len(prompt),
        token_ids=list(prompt),
        max_tokens=max_tokens,
        sampler=OutputSampler(sampler_key(0, prompt), natural_stop=False),
        salt=SALT,
        block_size=BS,
        priority=priority,
        arrival=arrival,
    )


def expected_output(prompt: list[int], n: int) -> list[int]:
    s = OutputSampler(sampler_key(0, prompt), natural_stop=False)
    return [s.next_token() for _ in range(n)]


def run_to_completion(sched: Scheduler, limit: int = 10_000) -> list[EngineRequest]:
    done = []
    for _ in range(limit):
        if not sched.has_work:
            return done
        out = sched.schedule()
        done.extend(sched.update(out).finished)
    raise AssertionError("scheduler did not drain")


def test_a_single_request_prefills_then_decodes_to_max_tokens() -> None:
    pool = BlockPool(16, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    req = make(list(range(10)), 5)
    sched.add_request(req)
    out = sched.schedule()
    assert out.scheduled == [(req, 10)] and out.num_prefill_tokens == 10 and out.num_emitting == 1
    assert len(sched.update(out).tokens) == 1
    out = sched.schedule()
    assert out.scheduled == [(req, 1)] and out.num_prefill_tokens == 0 and out.num_emitting == 1
    sched.update(out)
    run_to_completion(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.token_ids[10:] == expected_output(list(range(10)), 5)
    assert pool.num_used == 0
    assert req.num_cached_tokens == 0


def test_long_prompts_are_prefilled_in_chunks_within_the_budget() -> None:
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=32)
    req = make(list(range(75)), 2)
    sched.add_request(req)
    chunks = []
    while req.num_output_tokens == 0:
        out = sched.schedule()
        chunks.append((out.scheduled[0][1], out.num_emitting))
        sched.update(out)
    assert chunks == [(32, 0), (32, 0), (11, 1)]


def test_a_repeated_prompt_hits_the_cache_but_recomputes_its_last_token() -> None:
    pool = BlockPool(32, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(12))  # exactly three blocks
    first = make(prompt, 3)
    sched.add_request(first)
    run_to_completion(sched)
    again = make(prompt, 3)
    sched.add_request(again)
    out = sched.schedule()
    assert again.num_cached_tokens == 8  # not 12: the last block holds the last prompt token
    assert out.scheduled == [(again, 4)] and out.prefix_hits == 8 and out.prefix_queries == 12
    run_to_completion(sched)
    assert again.token_ids[12:] == first.token_ids[12:]


def test_max_num_seqs_caps_the_running_batch() -> None:
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=1000)
    reqs = [make([i] * 5, 4) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    sched.schedule()
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_fcfs_preempts_the_newest_request_and_it_resumes_from_its_cached_prefix() -> None:
    pool = BlockPool(6, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make([1] * 8, 12), make([2] * 8, 12)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    for _ in range(200):
        if not sched.has_work:
            break
        out = sched.schedule()
        preempted += out.preempted
        sched.update(out)
    assert preempted and preempted[0] is b
    assert b.num_preemptions >= 1
    # preemption never changes what a request generates
    assert a.token_ids[8:] == expected_output([1] * 8, 12)
    assert b.token_ids[8:] == expected_output([2] * 8, 12)
    assert pool.num_used == 0


def test_priority_policy_admits_lower_values_first_and_preempts_the_highest() -> None:
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, max_num_seqs=1, max_num_batched_tokens=100, policy="priority")
    late_urgent = make([3] * 4, 1, priority=-5, arrival=2.0)
    early_normal = make([4] * 4, 1, priority=0, arrival=1.0)
    early_urgent = make([5] * 4, 1, priority=-5, arrival=1.5)
    for r in (early_normal, late_urgent, early_urgent):
        sched.add_request(r)
    order = []
    while sched.has_work:
        out = sched.schedule()
        order += [r for r, _ in out.scheduled if r not in order]
        sched.update(out)
    assert order == [early_urgent, late_urgent, early_normal]

    pool = BlockPool(5, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100, policy="priority")
    important, unimportant = (
        make([6] * 8, 10, priority=-1, arrival=2.0),
        make([7] * 8, 10, priority=3, arrival=1.0),
    )
    sched.add_request(unimportant)
    sched.add_request(important)
    victims = []
    while sched.has_work:
        out = sched.schedule()
        victims += out.preempted
        sched.update(out)
    assert victims and all(v is unimportant for v in victims)


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    pool = BlockPool(16, BS)
    sched = Scheduler(pool, max_num_seqs=1, max_num_batched_tokens=100)
    running, waiting = make([1] * 9, 50), make([2] * 9, 50)
    sched.add_request(running)
    sched.add_request(waiting)
    sched.update(sched.schedule())
    assert pool.num_used == 3
    assert sched.abort(waiting.request_id) is waiting
    assert sched.abort(running.request_id) is running
    assert sched.abort(running.request_id) is None
    assert pool.num_used == 0 and not sched.has_work
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED


def test_random_workload_events_describe_the_cache_and_outputs_stay_deterministic() -> None:
    rng = random.Random(7)
    for policy in ("fcfs", "priority"):
        pool = BlockPool(18, BS)
        sched = Scheduler(pool, max_num_seqs=6, max_num_batched_tokens=24, policy=policy)  # type: ignore[arg-type]
        index: dict[int, tuple[int | None, list[int]]] = {}
        families = [[rng.randrange(100) for _ in range(24)] for _ in range(3)]
        live: list[tuple[EngineRequest, list[int], int]] = []
        finished = preemptions = 0
        for step in range(600):
            if step < 400 and rng.random() < 0.3:
                prompt = rng.choice(families)[: rng.randrange(2, 25)] + [
                    rng.randrange(100) for _ in range(rng.randrange(8))
                ]
                n = rng.randrange(1, 20)
                req = make(prompt, n, priority=rng.randrange(3), arrival=float(step))
                sched.add_request(req)
                live.append((req, prompt, n))
            if live and rng.random() < 0.03:
                sched.abort(rng.choice(live)[0].request_id)
            out = sched.schedule()
            preemptions += len(out.preempted)
            for req in out.admitted:
                assert req.num_cached_tokens % BS == 0 and req.num_cached_tokens < req.prompt_len
            result = sched.update(out)
            finished += len(result.finished)
            for ev in pool.take_events():
                if isinstance(ev, BlockStored):
                    parent = ev.parent_block_hash
                    for j, h in enumerate(ev.block_hashes):
                        index[h] = (parent, list(ev.token_ids[j * BS : (j + 1) * BS]))
                        parent = h
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        del index[h]
            assert {e.block_hashes[0]: (e.parent_block_hash, e.token_ids) for e in pool.snapshot()} == index
            held = sum(len(r.blocks) for r in sched.running)
            assert held == sum(b.ref_cnt for b in pool.blocks)
            for r in sched.running:
                assert len(r.blocks) * BS >= r.num_computed_tokens
        assert not sched.has_work and pool.num_used == 0
        assert finished > 50 and preemptions > 0, (finished, preemptions)
        for req, prompt, n in live:
            if req.status != RequestStatus.FINISHED_ABORTED:
                assert req.token_ids == prompt + expected_output(prompt, n)
