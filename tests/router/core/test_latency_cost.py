"""The latency cost: predicted time to first token per worker, the cache it would evict, and
what the router learns from feedback. Decisions are asserted, never wall-clock times."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

import pytest

from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.hashing import block_hashes
from kvmesh.router.core import load as load_module
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import Decision, KvRouter, RouteRequest
from kvmesh.router.core.latency_cost import LatencyCost
from kvmesh.router.core.route_types import CandidateScore
from kvmesh.router.core.timing import MOCKER_PRIOR, Profile

B = 16
_engine_hash = iter(range(10**9))


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def router(workers: str = "ab", total_blocks: int = 4096, **cfg: object) -> KvRouter:
    r = KvRouter(RouterConfig(**cfg), random.Random(0))  # type: ignore[arg-type]
    for w in workers:
        r.add_worker(w, total_blocks=total_blocks, max_num_batched_tokens=8192, block_size=B)
    return r


def req(rid: str, tokens: list[int], **kw: object) -> RouteRequest:
    return RouteRequest(rid, block_hashes(tokens, B), len(tokens), **kw)  # type: ignore[arg-type]


def store(r: KvRouter, worker: str, tokens: list[int]) -> None:
    n = len(tokens) // B
    hashes = [next(_engine_hash) for _ in range(n)]
    r.apply_events(worker, EventBatch(0.0, [BlockStored(hashes, None, tokens[: n * B], B)], 0))


def pick(r: KvRouter, rid: str, tokens: list[int], now: float = 0.0) -> Decision:
    d = r.route(req(rid, tokens), now)
    assert isinstance(d, Decision), d
    return d


def queue_prefill(r: KvRouter, worker: str, tokens: int, seed: int) -> None:
    """Pin uncached requests to ``worker`` that stay in prefill (no first token yet)."""
    d = r.route(req(f"q{seed}", toks(seed, tokens), backend_instance_id=worker), 0.0)
    assert isinstance(d, Decision)


def test_latency_is_the_default_and_dynamo_stays_selectable() -> None:
    assert RouterConfig().router_cost_model == "latency"
    d = pick(router(router_cost_model="dynamo"), "r", toks(1, 400))
    assert all(s.predicted_ttft_ms is None for s in d.breakdown)
    d = pick(router(), "r", toks(1, 400))
    for s in d.breakdown:  # predicted TTFT + the engine time it adds there + eviction
        assert s.predicted_ttft_ms is not None and s.delay_to_others_ms == 0  # nobody arrives there yet
        assert s.cost == pytest.approx(s.predicted_ttft_ms + s.delay_to_others_ms + s.eviction_ms)


def stream_to(
    r: KvRouter, worker: str | dict[str, float], prompt: Callable[[int], list[int]], n: int, gap_s: float
) -> float:
    """``n`` requests pinned to ``worker`` every ``gap_s``, each 30 ms to its first token and done
    250 ms after it was sent, fed to the router in time order; returns the time after the last.
    ``worker`` may map several workers to a queue wait each: every one gets its own ``n``
    requests (the k-th worker's prompts ``prompt(i + 1000 * k)``), first token and finish that
    much later."""
    waits = {worker: 0.0} if isinstance(worker, str) else worker
    events: list[tuple[float, int, str, int]] = []  # (time, what: 0 route 1 first 2 done, worker, i)
    for i in range(n):
        t = i * gap_s
        for w, wait in waits.items():
            events += [(t, 0, w, i), (t + 0.03 + wait, 1, w, i), (t + 0.25 + wait, 2, w, i)]
    offset = {w: 1000 * k for k, w in enumerate(waits)}
    now = n * gap_s
    for t, what, w, i in sorted(e for e in events if e[0] < now):
        if what == 0:
            r.route(req(f"{w}{i}", prompt(i + offset[w]), backend_instance_id=w), t)
        elif what == 1:
            r.first_token(f"{w}{i}", t)
        else:
            r.finished(f"{w}{i}", t)
    return now


def test_the_delay_to_others_counts_the_requests_arriving_there() -> None:
    """A worker nobody sends to charges nothing; one with requests streaming in charges what its
    arrivals will wait for (rate from the requests in flight there over their time there), and a
    client that waits for each answer before the next makes no arrivals during it."""
    r = router()
    now = stream_to(r, "a", lambda i: toks(100 + i, 300), 20, 0.02)
    d = pick(r, "new", toks(3, 2000), now=now)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["b"].delay_to_others_ms == 0 and by["a"].delay_to_others_ms > 0
    assert d.worker == ("b", 0)

    r = router()
    now = stream_to(r, "a", lambda i: toks(100 + i, 300), 20, 0.5)  # one at a time
    d = pick(r, "new", toks(3, 2000), now=now)
    assert all(s.delay_to_others_ms == 0 for s in d.breakdown)


def test_the_arrivals_are_the_requests_in_flight_over_their_whole_stay() -> None:
    """a and b each take a request every 20 ms and each request decodes for 220 ms; b's wait
    500 ms more for their first token, so b holds about three times as many in flight. They
    arrive no faster there: the delay charged on b may grow with b's longer queue ahead of the
    request, but not with the requests waiting in it. (Counted over the decode time alone, b's
    arrivals read 3.4 times a's, and its delay to others ~10 times a's.)"""
    r = router()
    now = stream_to(r, {"a": 0.0, "b": 0.5}, lambda i: toks(i, 300), 40, 0.02)
    by = {s.worker[0]: s for s in pick(r, "new", toks(3, 2000), now=now).breakdown}
    assert by["a"].delay_to_others_ms > 0
    assert by["b"].delay_to_others_ms < 4 * by["a"].delay_to_others_ms


def test_a_hot_prefix_spreads_once_its_worker_takes_traffic_faster_than_the_cache_saves() -> None:
    """The herding test: one hot prefix, requests arriving on its worker ever faster. At a slow
    pace the cache wins; once the requests piling up there cost the arrivals more than recomputing
    the prefix on an idle worker saves, the next one goes to the idle worker."""
    hot = toks(1, 2800)

    def placed_after(gap_s: float) -> str:
        r = router()
        store(r, "a", hot)
        now = stream_to(r, "a", lambda i: hot + toks(200 + i, 140), 60, gap_s)
        return pick(r, "next", hot + toks(7, 140), now=now).worker[0]

    assert placed_after(1.0) == "a"
    assert placed_after(0.005) == "b"


def stream(
    r: KvRouter,
    prompt: Callable[[int], list[int]],
    n: int,
    gap_s: float,
    stay_s: float = 0.25,
    background: bool = False,
) -> list[tuple[float, Decision]]:
    """``n`` requests routed by the router every ``gap_s``, each to its first token after 20 ms and
    15 us per token it did not find cached, done ``stay_s`` after it was sent; fed in time order.
    With ``background``, the requests may leave copies of their prefix to the front, which sends
    each as the front does (``KvRouter.track``) and finishes it once its cold prefill is done."""
    events = [(i * gap_s, 0, i) for i in range(n)]
    heapq.heapify(events)
    placed: list[tuple[float, Decision]] = []
    copied: dict[int, tuple[str, list[int]]] = {}
    while events:
        t, what, i = heapq.heappop(events)
        if what == 0:
            tokens = prompt(i)
            d = r.route(req(f"s{i}", tokens, copies_in_background=background), t)
            assert isinstance(d, Decision), d
            placed.append((t, d))
            heapq.heappush(events, (t + 0.02 + 15e-6 * (len(tokens) - d.overlap_blocks * B), 1, i))
            heapq.heappush(events, (t + stay_s, 2, i))
            if d.copy is not None:
                blocks = d.copy.blocks
                r.track(f"copy{i}", d.copy.worker, block_hashes(tokens, B)[:blocks], blocks * B, t)
                heapq.heappush(events, (t + 0.02 + 15e-6 * blocks * B, 3, i))
                copied[i] = (d.copy.worker[0], tokens[: blocks * B])
        elif what == 1:
            r.first_token(f"s{i}", t)
        elif what == 2:
            r.finished(f"s{i}", t)
        else:  # the copy's engine stored the prefix, and its one-token answer ended
            store(r, *copied.pop(i))
            r.finished(f"copy{i}", t)
    return placed


@pytest.mark.parametrize(("gap_s", "copies"), [(0.05, True), (0.5, False)])
def test_a_prefix_in_steady_demand_is_copied_for_the_waits_the_copy_saves_later(
    gap_s: float, copies: bool
) -> None:
    """A 2.8k-token prefix cached on a, asked for every 50 ms for 10 s: each request alone is
    answered sooner on a than by a cold prefill elsewhere, but the requests queue behind each
    other's prefill steps there. Once the prefix has been in demand long enough for a copy to save
    more than its cold prefill costs, it is copied, and each copy was made for that credit (the
    copying request's own cost was above a's). Asked for every 500 ms, it never queues: one copy."""
    hot = toks(1, 2800)
    r = router("abcd")
    store(r, "a", hot)
    placed = stream(r, lambda i: hot + toks(200 + i, 140), int(10 / gap_s), gap_s)
    first: dict[str, tuple[float, Decision]] = {}
    for t, d in placed:
        first.setdefault(d.worker[0], (t, d))
    if not copies:
        assert set(first) == {"a"}
        return
    assert len(first) >= 3
    for worker, (t, d) in first.items():
        if worker == "a":
            continue
        assert t > 1.0  # a new demand is not worth a copy yet
        by = {s.worker[0]: s for s in d.breakdown}
        assert by[worker].copy_credit_ms > 0
        assert by[worker].cost + by[worker].copy_credit_ms > min(
            s.cost for s in d.breakdown if s.copy_credit_ms == 0
        )


def test_a_copy_left_to_the_front_keeps_every_request_on_a_worker_holding_the_prefix() -> None:
    """The steady demand above, with a front that copies a prefix by itself: each copy the cost
    decides is named in the decision of a request that goes to a holder instead (its own fastest
    place), and the prefix spreads to the workers copied to. No request
    after the first prefill pays a cold prefill of the prefix. (The engine's KV events tell the
    router its copy is cached, as they do for a request's blocks.)"""
    hot = toks(1, 2800)
    r = router("abcd")
    store(r, "a", hot)
    placed = stream(r, lambda i: hot + toks(200 + i, 140), 200, 0.05, background=True)
    copies = [(t, d) for t, d in placed if d.copy is not None]
    assert copies
    # the prefix the requests in flight share, in whole chunks (the 15 blocks past them, the first
    # request on a copy prefills)
    shared = len(hot) // B // load_module.CHUNK * load_module.CHUNK
    assert all(d.overlap_blocks >= shared for _, d in placed)  # cached or in flight there
    for t, d in copies:
        assert d.copy is not None and d.copy.blocks == shared
        by = {s.worker: s for s in d.breakdown}
        assert d.copy.worker != d.worker and by[d.copy.worker].overlap_blocks == 0
        assert by[d.copy.worker].copy_credit_ms > 0 and t > 1.0  # decided for the credit, as above
        assert by[d.worker].predicted_ttft_ms < by[d.copy.worker].predicted_ttft_ms
    # each copy takes a share of the requests that came after it
    last = {d.worker[0] for _, d in placed[-50:]}
    assert {"a"} | {d.copy.worker[0] for _, d in copies if d.copy} == last
    assert r.shared_prefix_stats() == {"followed": 1, "copies": len(copies), "background": len(copies)}
    tail = r.ttft_tail_stats()  # a decision picked again without the credit is still one decision
    assert tail is not None and tail["decisions"] == len(placed)


@pytest.mark.parametrize(("gap_s", "background"), [(0.02, True), (0.005, False)])
def test_a_copy_is_left_to_the_front_only_where_a_holder_is_the_requests_fastest_place(
    gap_s: float, background: bool
) -> None:
    """A hot prefix's requests pinned to a, every 20 ms: a is still this request's fastest place,
    and the copy's credit alone picks b, so the request goes to a and names the copy to b. Every
    5 ms, a's queue makes b faster even for a cold prefill: the request itself goes to b and is
    the copy (its decision names none), as with the copies made by requests."""
    hot = toks(1, 2800)
    r = router()
    store(r, "a", hot)
    now = stream_to(r, "a", lambda i: hot + toks(200 + i, 140), 60, gap_s)
    d = r.route(req("next", hot + toks(7, 140), copies_in_background=True), now)
    assert isinstance(d, Decision)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["b"].copy_credit_ms > 0
    a_ttft, b_ttft = by["a"].predicted_ttft_ms, by["b"].predicted_ttft_ms
    assert a_ttft is not None and b_ttft is not None
    if background:
        assert a_ttft < b_ttft
        assert d.worker == ("a", 0) and d.copy is not None and d.copy.worker == ("b", 0)
    else:
        assert b_ttft < a_ttft
        assert d.worker == ("b", 0) and d.copy is None


def test_a_new_hot_prefix_is_copied_before_any_request_has_finished() -> None:
    """A fleet's first traffic: a 2.8k-token prefix cached on a, asked for every 20 ms, and no
    request finishes within the first 2 s (long answers). The router has learned no stay yet, but
    every request it sent is still in flight, so the requests carrying the prefix over the time
    since its first one are the rate they arrive at: the prefix is copied for the waits a copy
    saves, while the first answers are still streaming."""
    hot = toks(1, 2800)
    r = router("abcd")
    store(r, "a", hot)
    placed = stream(r, lambda i: hot + toks(200 + i, 140), 50, 0.02, stay_s=2.0)
    copies = [(t, d) for t, d in placed if d.worker[0] != "a"]
    assert copies
    t, d = copies[0]
    assert t < 1.0  # the first answers end at 2 s
    by = {s.worker[0]: s for s in d.breakdown}
    assert by[d.worker[0]].copy_credit_ms > 0


def test_the_cached_worker_wins_while_its_cache_saves_more_than_its_queue_costs() -> None:
    prefix = toks(1, 4000)
    prompt = prefix + toks(2, 100)
    r = router()
    store(r, "a", prefix)
    queue_prefill(r, "a", 1000, seed=10)  # a short queue: ~1k tokens ahead on a
    d = pick(r, "r1", prompt)
    assert d.worker == ("a", 0)  # 1.1k tokens of work on a beat 4.1k uncached on b

    r = router()
    store(r, "a", prefix)
    for i in range(3):
        queue_prefill(r, "a", 7000, seed=20 + i)  # a long queue: 21k tokens ahead on a
    d = pick(r, "r1", prompt)
    assert d.worker == ("b", 0)  # the idle worker recomputes the prefix sooner
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].overlap_blocks == 250 and by["a"].predicted_ttft_ms > by["b"].predicted_ttft_ms


def test_a_queue_the_engine_reports_and_the_router_did_not_route_counts_like_its_own() -> None:
    """Another replica queued three long prefills on a: this router routed none of them, but a's
    engine reports them waiting. Counted as requests the size of those this router has in prefill
    (7k tokens), they make a's queue what it would be had it routed them itself, and b wins, as in
    the test above."""
    r = router()
    store(r, "a", toks(1, 4000))
    prompt = toks(1, 4000) + toks(2, 100)  # the 4k-token prefix a holds, and 100 tokens more
    assert pick(r, "before", prompt).worker == ("a", 0)
    r.cancel("before", 0.0)

    queue_prefill(r, "b", 7000, seed=30)  # in prefill when a reports: the size of a waiting request
    r.engine_load("a", running=0, waiting=3, now=0.0)
    r.cancel("q30", 0.0)
    assert [s.unseen_requests for s in r.worker_snapshot()] == [3.0, 0.0]
    d = pick(r, "r1", prompt)
    assert d.worker == ("b", 0)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].overlap_blocks == 250 and by["a"].predicted_ttft_ms > by["b"].predicted_ttft_ms
    r.cancel("r1", 0.0)

    r.engine_load("a", running=0, waiting=0, now=1.0)  # drained (or no longer reported)
    assert pick(r, "after", prompt).worker == ("a", 0)
    r.engine_load("gone", running=9, waiting=9, now=1.0)  # a worker the router does not know: ignored


def test_an_engine_that_labels_its_dp_ranks_has_each_rank_s_queue_where_it_reports_it() -> None:
    """Engine d runs two DP ranks and reports three long prefills waiting on rank 1 (vLLM's
    ``engine`` label, SGLang's ``dp_rank``): rank 1 carries them and loses to rank 0, which the
    same totals spread over both ranks would have half-loaded as well."""
    r = KvRouter(RouterConfig(), random.Random(0))
    r.add_worker("d", dp_size=2, total_blocks=4096, max_num_batched_tokens=8192, block_size=B)
    r.add_worker("b", total_blocks=4096, max_num_batched_tokens=8192, block_size=B)
    queue_prefill(r, "b", 7000, seed=30)  # in prefill when d reports: the size of a waiting request
    r.engine_load("d", running=0, waiting=3, now=0.0, ranks={1: (0.0, 3.0)})
    r.cancel("q30", 0.0)
    assert [(s.worker, s.unseen_requests) for s in r.worker_snapshot()] == [
        (("d", 0), 0.0),
        (("d", 1), 3.0),
        (("b", 0), 0.0),
    ]
    d = pick(r, "r1", toks(3, 300))
    by = {s.worker: s for s in d.breakdown}
    assert d.worker != ("d", 1)
    assert by[("d", 1)].predicted_ttft_ms > by[("d", 0)].predicted_ttft_ms == by[("b", 0)].predicted_ttft_ms
    r.cancel("r1", 0.0)

    # a rank the worker does not have (another server's ranks): the totals, spread over both
    r.engine_load("d", running=0, waiting=4, now=1.0, ranks={0: (0.0, 1.0), 5: (0.0, 3.0)})
    assert [s.unseen_requests for s in r.worker_snapshot()] == [2.0, 2.0, 0.0]
    r.engine_load("d", running=0, waiting=4, now=1.0)  # no per-rank counts: the same
    assert [s.unseen_requests for s in r.worker_snapshot()] == [2.0, 2.0, 0.0]


def test_dynamo_weighs_blocks_one_to_one_where_latency_weighs_time() -> None:
    """One case where they disagree: a long cached prefix behind a modest queue. Dynamo adds the
    queue's blocks twice (as prefill and as decode blocks held) against the prefix's blocks; in
    time, 3.5k tokens of work ahead still finish well before 6.2k recomputed, and the blocks held
    cost only a slightly slower decode pass."""
    prefix = toks(1, 6000)
    prompt = prefix + toks(2, 200)

    def decide(model: str) -> str:
        r = router(router_cost_model=model)
        store(r, "a", prefix)
        queue_prefill(r, "a", 1500, seed=11)
        queue_prefill(r, "a", 1800, seed=12)
        return pick(r, "r1", prompt).worker[0]

    assert decide("latency") == "a"
    assert decide("dynamo") == "b"


def _teach_reuse(r: KvRouter, worker: str, seed: int, n: int = 40) -> None:
    """Feedback as the middleware gives it: requests on ``worker`` that the engine reports as
    mostly cached, each answered at the model's own predicted time."""
    for i in range(n):
        t = toks(seed + i, 800)
        d = r.route(req(f"reuse-{worker}-{i}", t, backend_instance_id=worker), 10.0 + i)
        assert isinstance(d, Decision)
        r.first_token(d.request_id, 10.0 + i + 0.03)
        r.reported_cached(d.request_id, 720)
        assert r.finished(d.request_id, 10.0 + i + 0.2) is not None


def test_a_full_cache_of_reused_blocks_loses_a_new_prefix_to_a_worker_with_room() -> None:
    r = router(total_blocks=1000)
    store(r, "a", toks(100, 1000 * B))  # a's cache is full...
    _teach_reuse(r, "a", 200)  # ...of blocks that keep being hit
    queue_prefill(r, "b", 300, seed=30)  # b is a little busier, but has room
    new = toks(5, 6000)  # a new 6k-token prefix: 375 blocks to place
    d = pick(r, "new", new, now=100.0)
    assert d.worker == ("b", 0)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].eviction_ms > 0 and by["b"].eviction_ms == 0
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms  # a would answer sooner...
    assert by["a"].cost > by["b"].cost  # ...but what it evicts costs more later


def test_a_later_turn_known_by_its_earlier_turn_prices_the_blocks_its_estimate_adds() -> None:
    # routed before it is tokenized, on the blocks of the turn it continues and a length estimated
    # from its body (ParsedRequest.deferred): what it adds is the estimate beyond what is cached
    r = router(total_blocks=1000)
    earlier = toks(6, 100 * B)
    store(r, "a", toks(100, 900 * B))
    store(r, "a", earlier)  # a's cache is full, the earlier turn in it...
    _teach_reuse(r, "a", 200)  # ...of blocks that keep being hit
    isl = 475 * B  # the later turn brings 375 blocks of its own
    d = r.route(RouteRequest("t2", block_hashes(earlier, B), isl, estimated_blocks=isl // B), 100.0)
    assert isinstance(d, Decision)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].overlap_blocks == 100 and by["b"].overlap_blocks == 0
    assert by["a"].eviction_ms > 0 and by["b"].eviction_ms == 0
    assert by["a"].prefill_tokens == isl - 100 * B


def test_a_sibling_counted_whole_keeps_the_blocks_its_twin_in_flight_carries() -> None:
    # best-of-n: the twin is routed and in prefill, its blocks not reported yet; the sibling is
    # routed on the twin's prompt (the same messages) and counted whole once sent (amend)
    r = router()
    t = toks(3, 3000)
    d1 = pick(r, "twin", t)
    d2 = r.route(RouteRequest("sibling", block_hashes(t, B), len(t), estimated_blocks=len(t) // B), 0.001)
    assert isinstance(d2, Decision) and d2.worker == d1.worker and d2.overlap_blocks == len(t) // B
    routed = {s.worker: s for s in r.worker_snapshot()}[d1.worker]
    assert r.amend("sibling", block_hashes(t, B), len(t), 0.002)
    amended = {s.worker: s for s in r.worker_snapshot()}[d1.worker]
    # its blocks stay the twin's, and its prefill the few tokens past them: not the prompt again
    assert amended.active_prefill_tokens == routed.active_prefill_tokens < 2 * len(t)
    assert amended.active_decode_blocks == routed.active_decode_blocks


def test_a_full_cache_still_wins_when_the_request_hits_it() -> None:
    r = router(total_blocks=1000)
    held = toks(100, 1000 * B)
    store(r, "a", held)
    _teach_reuse(r, "a", 200)
    queue_prefill(r, "b", 300, seed=30)
    d = pick(r, "hit", held[: 500 * B] + toks(6, 200), now=100.0)  # extends a cached prefix
    assert d.worker == ("a", 0)


def test_a_worker_reported_slow_loses_the_traffic_its_cache_would_attract() -> None:
    prefix = toks(1, 3000)
    prompt = prefix + toks(2, 200)
    r = router()
    store(r, "b", prefix)
    assert pick(r, "before", prompt).worker == ("b", 0)
    r.finished("before", 0.0)
    rng = random.Random(4)
    # b answers 10x slower than the prior predicts; a as predicted. (At 5x, b's 3k cached tokens
    # still save the requests after it more engine time than b's slowness costs this one.)
    for i in range(120):
        for w, slow in (("a", 1.0), ("b", 10.0)):
            t = toks(1000 + 2 * i + (w == "b"), rng.randrange(100, 6000))
            d = r.route(req(f"{w}{i}", t, backend_instance_id=w), 1.0 + i)
            assert isinstance(d, Decision)
            x = len(t)
            ttft = slow * (MOCKER_PRIOR.prefill_ms[0] * x * x + MOCKER_PRIOR.prefill_ms[1] * x + 16.5 + 5.74)
            r.first_token(d.request_id, 1.0 + i + ttft / 1000)
            r.reported_cached(d.request_id, 0)
            r.finished(d.request_id, 1.0 + i + 0.5)
    models = {s.worker[0]: s.timing for s in r.worker_snapshot()}
    assert models["b"] is not None and models["a"] is not None
    assert models["b"]["prefill_ms"][1] > 3 * models["a"]["prefill_ms"][1]
    assert pick(r, "after", prompt, now=500.0).worker == ("a", 0)


def test_aic_decays_the_oldest_active_prefill_over_its_predicted_duration() -> None:
    # Dynamo's cost; the latency cost's view of the same queue is the step test below
    r = router(router_cost_model="dynamo", router_prefill_load_model="aic")
    queue_prefill(r, "a", 1000, seed=1)
    queue_prefill(r, "a", 500, seed=2)
    expected = _prefill_ms(1000) / 1000

    def active_on_a(now: float, rid: str) -> float:
        d = pick(r, rid, toks(99, 32), now)
        r.cancel(rid, now)
        by = {s.worker[0]: s for s in d.breakdown}
        return by["a"].prefill_tokens - 32

    assert active_on_a(0.0, "t0") == pytest.approx(1500)
    assert active_on_a(expected / 2, "t1") == pytest.approx(1000)  # half of the oldest is done
    assert active_on_a(expected * 3, "t2") == pytest.approx(500)  # the younger waits in full
    r.first_token("q1", expected * 3)  # the oldest is done: the next starts to decay now
    assert active_on_a(expected * 3, "t3") == pytest.approx(500)
    r = router(router_cost_model="dynamo")  # without aic, nothing decays
    queue_prefill(r, "a", 1000, seed=1)
    d = pick(r, "late", toks(99, 32), 60.0)
    assert {s.worker[0]: s for s in d.breakdown}["a"].prefill_tokens == 1032


def _prefill_ms(x: float) -> float:
    c2, c1, c0 = MOCKER_PRIOR.prefill_ms
    return c2 * x * x + c1 * x + c0


def test_the_step_in_progress_is_waited_for_and_the_queue_behind_it_is_joined() -> None:
    """The latency cost's view of the same queue: the oldest prefill is the step running now, which
    a new request waits out (its predicted time less what has passed); the younger one is queued
    for the next step, which the new request joins (its tokens count in the same steps)."""
    r = router()
    queue_prefill(r, "a", 1000, seed=1)
    queue_prefill(r, "a", 500, seed=2)
    first, second = _prefill_ms(1000), _prefill_ms(500)

    def view(now: float, rid: str) -> tuple[float, float]:
        d = pick(r, rid, toks(99, 32), now)
        r.cancel(rid, now)
        a = {s.worker[0]: s for s in d.breakdown}["a"]
        return a.step_wait_ms, a.prefill_tokens - 32

    assert view(0.0, "t0") == (pytest.approx(first), pytest.approx(500))
    assert view(first / 2000, "t1") == (pytest.approx(first / 2), pytest.approx(500))
    assert view(first * 3 / 1000, "t2") == (0.0, pytest.approx(500))  # overdue: nothing left to wait
    r.first_token("q1", first * 3 / 1000)  # the oldest is done: the younger one runs now
    assert view(first * 3 / 1000, "t3") == (pytest.approx(second), 0.0)


def test_a_request_arriving_during_a_long_prefill_goes_to_an_idle_worker_holding_nothing() -> None:
    """Both hold nothing of the prompt; a has just started a 1.6k-token prefill, b is idle. Joining
    a would mean waiting out that step, then running its own: b prefills it sooner. Once a's step
    is over (its first token seen), a is idle again and holds the context: a wins."""
    r = router()
    context = toks(7, 1600)
    d = r.route(req("first", context + toks(8, 16), backend_instance_id="a"), 0.0)
    assert isinstance(d, Decision)
    sibling = pick(r, "sibling", toks(9, 1600) + toks(10, 16), now=0.002)
    by = {s.worker[0]: s for s in sibling.breakdown}
    assert by["a"].step_wait_ms > 30.0 and by["b"].step_wait_ms == 0.0
    assert sibling.worker == ("b", 0)
    r.cancel("sibling", 0.002)
    store(r, "a", context)
    r.first_token("first", 0.05)
    r.finished("first", 0.06)
    assert pick(r, "next", context + toks(11, 16), now=0.07).worker == ("a", 0)


def _pairs(r: KvRouter, n: int, start: float, *, follower_lag: float) -> float:
    """``n`` times: a 1.6k-token prompt sent to a, its identical twin routed 0.3 ms later to a too,
    the twin's first token ``follower_lag`` after the first one's; returns the time after them."""
    now = start
    for i in range(n):
        prompt = toks(1000 + i, 1600)
        for rid, at in ((f"lead{i}", now), (f"twin{i}", now + 0.0003)):
            d = r.route(req(rid, prompt, backend_instance_id="a"), at)
            assert isinstance(d, Decision) and d.worker == ("a", 0)
        r.first_token(f"lead{i}", now + 0.045)
        r.first_token(f"twin{i}", now + 0.045 + follower_lag)
        r.finished(f"lead{i}", now + 0.2)
        r.finished(f"twin{i}", now + 0.2 + follower_lag)
        now += 0.5
    return now


def _twin_prediction(r: KvRouter, seed: int, now: float) -> float:
    """The predicted TTFT on a of a twin routed 0.3 ms after its first, the step in progress."""
    prompt = toks(seed, 1600)
    assert isinstance(r.route(req(f"first{seed}", prompt, backend_instance_id="a"), now), Decision)
    d = pick(r, f"second{seed}", prompt, now + 0.0003)
    a = {s.worker[0]: s for s in d.breakdown}["a"]
    assert a.step_wait_ms > 20.0  # behind the first one's step, as the model sees it
    r.cancel(f"first{seed}", now)
    r.cancel(f"second{seed}", now)
    assert a.predicted_ttft_ms is not None
    return a.predicted_ttft_ms


def test_requests_that_reach_the_engine_before_the_step_they_wait_for_starts_are_learned_to_join_it() -> None:
    """Twins routed 0.3 ms apart: the model first takes the second to wait out the first one's step
    and then run its own. Where the engine shows both first tokens together (it took both into one
    step), the router learns that requests routed so soon join the step, predicts the second twin
    without a step of its own, and does not teach its curve those TTFTs as waits they never had.
    Where the second shows its first token a step later, nothing changes."""
    joined, missed = router(), router()
    before = _twin_prediction(joined, 1, 0.0)
    assert _twin_prediction(missed, 1, 0.0) == pytest.approx(before)

    end = _pairs(joined, 12, 1.0, follower_lag=0.0005)
    _pairs(missed, 12, 1.0, follower_lag=0.030)
    stats = joined.join_stats()
    assert stats is not None and stats["joined_share"][0] == 1.0 and stats["seen"][0] == 12.0
    assert missed.join_stats()["joined_share"][0] == 0.0  # type: ignore[index]

    after_joined = _twin_prediction(joined, 2, end)
    after_missed = _twin_prediction(missed, 2, end)
    step = MOCKER_PRIOR.prefill_ms[2]  # the step constant a step of its own costs
    assert after_joined < after_missed - step / 2
    observations = {
        r: {s.worker[0]: s.timing["observations"] for s in r.worker_snapshot() if s.timing}
        for r in (joined, missed)
    }
    assert observations[joined]["a"] == 12  # the first of each pair only
    assert observations[missed]["a"] == 24


def test_a_request_behind_an_answer_that_came_whole_is_not_compared_with_it() -> None:
    """A non-streamed request shows no first token (its whole answer arrives at once): the twin
    routed behind its step has nothing to compare with, and teaches nothing about joins."""
    r = router()
    prompt = toks(5, 1600)
    for rid, at in (("whole", 0.0), ("twin", 0.0003)):
        assert isinstance(r.route(req(rid, prompt, backend_instance_id="a"), at), Decision)
    r.first_token("whole", 0.2, timed=False)
    r.first_token("twin", 0.045)
    stats = r.join_stats()
    assert stats is not None and sum(stats["seen"]) == 0


def test_busy_thresholds_temperature_and_pins_still_apply_on_top() -> None:
    r = router(active_prefill_tokens_threshold=2000)
    store(r, "a", toks(1, 4000))
    for i in range(2):
        queue_prefill(r, "a", 1500, seed=40 + i)
    assert pick(r, "r", toks(1, 4000) + toks(2, 64)).worker == ("b", 0)  # a is busy
    d = r.route(req("pinned", toks(3, 100), backend_instance_id="a"), 0.0)
    assert isinstance(d, Decision) and d.worker == ("a", 0) and d.reason == "pinned"
    hot = router(router_temperature=1.0)
    seen = {pick(hot, f"t{i}", toks(1, 400)).worker for i in range(40)}
    assert seen == {("a", 0), ("b", 0)}


def test_a_reported_profile_seeds_the_worker_model() -> None:
    r = KvRouter(RouterConfig(), random.Random(0))
    fast = Profile((0.0, 0.001, 1.0), (0.0, 0.0, 1.0), 1.0, "worker profile")
    r.add_worker("a", total_blocks=4096, max_num_batched_tokens=8192, block_size=B, profile=fast)
    r.add_worker("b", total_blocks=4096, max_num_batched_tokens=8192, block_size=B)
    snap = {s.worker[0]: s.timing for s in r.worker_snapshot()}
    assert snap["a"] is not None and snap["a"]["seed"] == "worker profile"
    assert snap["b"] is not None and snap["b"]["seed"] == "reference mocker fit"
    d = pick(r, "r", toks(1, 2000))
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms == pytest.approx(2 + 2.0, rel=0.01)  # 0.001*2000 + 1 + decode 1
    assert d.worker == ("a", 0)


def learn(r: KvRouter, workers: str, n: int, start: float = 0.0) -> float:
    """Teach each worker's model the prior's own curve: ``n`` pinned requests of 100-6000 tokens
    each, one at a time, answered exactly as the curve says. Returns the time after them."""
    rng = random.Random(11)
    now = start
    for i in range(n):
        for w in workers:
            t = toks(5000 + 10 * i + ord(w), rng.randrange(100, 6000))
            d = r.route(req(f"learn-{w}{i}", t, backend_instance_id=w), now)
            assert isinstance(d, Decision)
            r.first_token(d.request_id, now + (_prefill_ms(len(t)) + MOCKER_PRIOR.decode(0.0)) / 1000)
            r.reported_cached(d.request_id, 0)
            r.finished(d.request_id, now + 0.3)
            now += 0.5
    return now


def test_siblings_in_flight_count_as_cache_where_they_were_sent() -> None:
    """Samples of one prompt: once the first sibling's prefill step is over (its first token
    seen) its blocks are cached where it runs, before any KV event says so, and the next
    siblings join it there. While that 3k-token step is still running, waiting it out is slower
    than a prefill on an idle worker; a router that has learned its workers knows it and spreads
    them, while one still on its prior cannot tell the two apart and saves the work."""
    prompt = toks(8, 3000)
    for learned in (False, True):
        r = router("abcd")
        now = learn(r, "abcd", 40) if learned else 0.0
        first = pick(r, "s0", prompt, now=now)
        during = pick(r, "during", prompt, now=now + 0.001)
        assert (during.worker != first.worker) == learned
        r.cancel("during", now + 0.001)
        r.first_token("s0", now + 0.09)
        after = {pick(r, f"s{i}", prompt, now=now + 0.09 + i / 1000).worker for i in range(1, 4)}
        assert after == {first.worker}  # one prefill, three hits

    def burst(model: str) -> set[str]:
        r = router("abcd", router_cost_model=model)
        return {pick(r, f"s{i}", prompt).worker[0] for i in range(4)}

    assert len(burst("dynamo")) == 4  # Dynamo's cost spreads them by load


def test_a_decoding_worker_costs_the_rest_of_its_step_but_a_long_history_still_wins() -> None:
    """A request that joins a worker mid-decode waits for that step to end (half a pass on
    average); an idle worker starts it at once. A long conversation history cached on the busy
    worker is still worth that wait."""
    r = router()
    busy = r.route(req("busy", toks(2, 800), backend_instance_id="a"), 0.0)
    assert isinstance(busy, Decision)
    r.first_token("busy", 0.05)  # a is decoding now, b is idle
    d = pick(r, "cold", toks(3, 800), now=0.1)
    assert d.worker == ("b", 0)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms is not None and by["b"].predicted_ttft_ms is not None
    half_pass = 0.5 * r._timing[("a", 0)].own.decode_ms(0.0)
    assert by["a"].predicted_ttft_ms - by["b"].predicted_ttft_ms >= half_pass

    history = toks(4, 2400)
    r = router()
    store(r, "a", history)
    busy = r.route(req("busy", toks(5, 800), backend_instance_id="a"), 0.0)
    assert isinstance(busy, Decision)
    r.first_token("busy", 0.05)
    assert pick(r, "turn", history + toks(6, 200), now=0.1).worker == ("a", 0)


@pytest.mark.parametrize("model", ["latency", "dynamo"])
def test_a_decode_stage_goes_to_the_least_loaded_worker_then_the_one_holding_the_prompt(model: str) -> None:
    """Prefilled elsewhere, a request adds no prefill on its decode worker: a sibling in flight
    there does not draw it (as it would an aggregated request), the requests in flight do; among
    equally loaded workers, the one already holding the prompt needs the least KV moved."""
    prompt = toks(9, 640)
    r = router("ab", router_cost_model=model)
    first = r.route(req("d0", prompt, prefilled_elsewhere=True), 0.0)
    assert isinstance(first, Decision)
    second = r.route(req("d1", prompt, prefilled_elsewhere=True), 0.0)
    assert isinstance(second, Decision) and second.worker != first.worker
    r = router("ab", router_cost_model=model)
    store(r, "b", prompt)
    assert [pick_stage(r, f"e{i}", prompt).worker[0] for i in range(4)] == ["b", "a", "b", "a"]


def pick_stage(r: KvRouter, rid: str, tokens: list[int]) -> Decision:
    d = r.route(req(rid, tokens, prefilled_elsewhere=True), 0.0)
    assert isinstance(d, Decision), d
    return d


def _answer(
    r: KvRouter, rid: str, worker: str, tokens: list[int], start: float, n_out: int, ttft_s: float = 0.03
) -> None:
    """A pinned request answered in full: first token ``ttft_s`` after it was sent, then ``n_out``
    tokens 10 ms apart."""
    d = r.route(req(rid, tokens, backend_instance_id=worker), start)
    assert isinstance(d, Decision)
    r.first_token(rid, start + ttft_s)
    r.output_tokens(rid, 1, start + ttft_s)
    r.output_tokens(rid, n_out - 1, start + ttft_s + 0.01 * n_out)
    r.finished(rid, start + ttft_s + 0.01 * n_out)


def _held_by_three(generated: int, pace: float) -> KvRouter:
    """a runs three 300-block requests (900 of its 1000 blocks), ``generated`` tokens into their
    40-token answers at ``pace`` s a token; b is idle."""
    r = router(total_blocks=1000)
    for i in range(20):  # the fleet's requests answer 40 tokens
        _answer(r, f"teach{i}", "ab"[i % 2], toks(900 + i, 300), i * 0.5, 40)
    now = 20.0
    for i in range(3):
        rid = f"long{i}"
        d = r.route(req(rid, toks(10 + i, 300 * B), backend_instance_id="a"), now - 5.0)
        assert isinstance(d, Decision)
        r.first_token(rid, now - pace * (generated - 1))
        r.output_tokens(rid, 1, now - pace * (generated - 1))
        r.output_tokens(rid, generated - 1, now)
    return r


@pytest.mark.parametrize(("generated", "pace", "worker"), [(39, 0.02, "a"), (5, 0.1, "b")])
def test_a_request_short_of_kv_blocks_waits_for_whole_requests_to_finish(
    generated: int, pace: float, worker: str
) -> None:
    """a holds the request's 6k-token prefix, but the requests running there hold most of its KV
    blocks: the request waits until one of them finishes. A token from their 40-token answers'
    end, a is still the better place; 5 tokens in, at their pace, an idle b without the prefix is.
    (Taken as the excess share of one request's decode time, ~0.1 x 0.4 s, the wait looked
    small either way, and the request queued on a.)"""
    r = _held_by_three(generated, pace)
    prefix = toks(1, 6000)
    store(r, "a", prefix)
    d = pick(r, "new", prefix + toks(2, 200), 20.0)
    assert d.worker == (worker, 0)
    by = {s.worker[0]: s for s in d.breakdown}
    wait_ms = by["a"].predicted_ttft_ms - by["b"].predicted_ttft_ms
    assert wait_ms > 0 if worker == "b" else wait_ms < 0


def test_the_blocks_a_request_puts_past_the_limit_delay_arrivals_while_the_worker_stays_over() -> None:
    """A 200-block request would put a 100 blocks past its limit either way. When the three
    requests there end within a token, the worker is back under its limit before arrivals notice;
    when they run on for seconds, every arrival during the new request's stay waits for those
    100 blocks to be freed, and the request pays for it."""
    ending = pick(_held_by_three(39, 0.02), "new", toks(2, 200 * B), 20.0)
    running = pick(_held_by_three(5, 0.1), "new", toks(2, 200 * B), 20.0)
    brief = next(s for s in ending.breakdown if s.worker == ("a", 0)).delay_to_others_ms
    long = next(s for s in running.breakdown if s.worker == ("a", 0)).delay_to_others_ms
    assert long > 4 * brief > 0


def test_a_request_sent_past_the_kv_cache_does_not_teach_the_prefill_curve() -> None:
    """Five requests sent to a while its three running requests hold 900 of its 1000 blocks wait
    for memory and see their first tokens 1.5 s later. That wait is predicted apart (from when the
    running requests free their blocks), so the curve does not learn from them: the predictions
    for a new prompt are what they were, and /kvmesh/router counts them as not fitted. The same
    five sent to b, with room, are fitted, and move its prediction."""
    r = _held_by_three(39, 0.02)
    probe = toks(77, 100 * B)

    def predicted() -> dict[str, float]:
        d = r.route(req("probe", probe), 20.0)
        assert isinstance(d, Decision)
        r.cancel("probe", 20.0)
        return {s.worker[0]: s.predicted_ttft_ms for s in d.breakdown}

    def slow(worker: str) -> dict[str, dict[str, int]]:
        for i in range(5):
            rid = f"slow-{worker}{i}"
            d = r.route(req(rid, toks(300 + i, 200 * B), backend_instance_id=worker), 20.0)
            assert isinstance(d, Decision)
            r.first_token(rid, 21.5)
            r.output_tokens(rid, 1, 21.5)
            r.finished(rid, 21.6)
        return {s.worker[0]: s.timing for s in r.worker_snapshot() if s.timing}

    before = predicted()
    fitted = {s.worker[0]: s.timing["observations"] for s in r.worker_snapshot() if s.timing}
    snap = slow("a")
    assert snap["a"]["not_fitted_memory_wait"] == 5
    assert snap["a"]["observations"] == fitted["a"]
    assert predicted() == pytest.approx(before, rel=1e-9)
    snap = slow("b")
    assert snap["b"]["not_fitted_memory_wait"] == 0
    assert snap["b"]["observations"] == fitted["b"] + 5
    assert predicted()["b"] > 1.2 * before["b"]


def _three_running_on_each_and_waits_seen_on_c(exact_waits: int) -> KvRouter:
    """Workers a, b and c each run three 300-block requests (900 of their 1000 blocks) at 0.1 s a
    token, 36, 38 and 37 tokens into their 40-token answers; the router has seen ``exact_waits``
    requests wait for memory on c, each for just the wait it predicted."""
    r = router("abc", total_blocks=1000)
    for i in range(20):  # the fleet's requests answer 40 tokens
        _answer(r, f"teach{i}", "ab"[i % 2], toks(900 + i, 300), i * 0.5, 40)
    now = 20.0
    for worker, generated in (("a", 36), ("b", 38), ("c", 37)):
        for i in range(3):
            rid = f"long-{worker}{i}"
            d = r.route(req(rid, toks(10 + i, 300 * B), backend_instance_id=worker), now - 5.0)
            assert isinstance(d, Decision)
            r.first_token(rid, now - 0.1 * (generated - 1))
            r.output_tokens(rid, 1, now - 0.1 * (generated - 1))
            r.output_tokens(rid, generated - 1, now)
    for i in range(exact_waits):
        rid = f"wait{i}"
        d = r.route(req(rid, toks(5000 + i, 200 * B), backend_instance_id="c"), now)
        assert isinstance(d, Decision)
        (score,) = d.breakdown
        assert score.memory_wait_ms > 0.0 and score.predicted_ttft_ms is not None
        answered = now + score.predicted_ttft_ms / 1000.0
        r.first_token(rid, answered)
        r.output_tokens(rid, 1, answered)
        r.output_tokens(rid, 39, answered + 0.4)  # a 40-token answer, as the fleet's
        r.finished(rid, answered + 0.4)  # its blocks are back: the next one finds c as this one did
    return r


def test_a_history_s_home_keeps_its_turn_while_its_wait_for_memory_is_within_what_waits_come_to() -> None:
    """a holds the turn's 3k-token history; a and b are both short of KV blocks for it until one
    of their running requests ends, b's 200 ms sooner (a's predicted wait 400 ms, b's 200). Before
    the router has seen how waits for memory come out, a wait is taken to be within half of itself
    (the prior spread): the costs are a tie, and the turn stays where it adds the least prefill work, its history's home. Once
    it has seen predicted waits come true (on c), the same waits are a difference it can tell, and
    the turn goes where it starts sooner."""
    prefix = toks(1, 3000)
    chosen = {}
    for taught in (0, 200):
        r = _three_running_on_each_and_waits_seen_on_c(taught)
        store(r, "a", prefix)
        d = r.route(req(f"turn{taught}", prefix + toks(2, 200), allowed_workers=frozenset("ab")), 20.0)
        assert isinstance(d, Decision)
        by = {s.worker[0]: s for s in d.breakdown}
        assert by["a"].memory_wait_ms > by["b"].memory_wait_ms > 0.0
        assert by["b"].cost < by["a"].cost  # the longer wait makes a dearer either way
        chosen[taught] = d.worker[0]
    assert chosen == {0: "a", 200: "b"}
    assert r.memory_wait_stats()["relative_spread"] < 0.3  # type: ignore[index]


def test_a_new_prefix_within_the_fit_s_uncertainty_goes_where_least_is_cached() -> None:
    """a and b have each answered a few uncached requests, a a little faster than b; c has seen
    none (its curve is the fleet's, between the two). A new prefix costs the same prefill on all
    three, and their predictions differ by less than the fits are sure of: a tie the model cannot
    resolve. c, which holds no cache, takes it rather than a, which looks a millisecond faster
    and holds the prefixes it answered. (Ranked by those costs, a worker whose curve came out a
    little fast took every new prefix: the cold prefixes of a hot-prefix fleet went two and three
    to an engine.)"""
    r = router("abc")
    n = 0
    for _ in range(6):
        for worker, ttft_s in (("a", 0.042), ("b", 0.048)):
            n += 1
            prompt = toks(500 + n, 2000)
            _answer(r, f"seen{n}", worker, prompt, float(n), 20, ttft_s)
            store(r, worker, prompt)
    d = pick(r, "new", toks(999, 2000), now=100.0)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].cost < by["c"].cost < by["b"].cost  # the fits do differ...
    assert by["b"].cost - by["a"].cost < r._timing[("a", 0)].uncertainty_ms(2000)  # ...by less than they know
    assert d.worker == ("c", 0)


@pytest.mark.parametrize("expected_arrivals", [0.3, 2.0, 12.0])
def test_the_spread_of_the_delay_to_arrivals_is_that_of_a_poisson_count_of_waits(
    expected_arrivals: float,
) -> None:
    """The delay a request's prefill causes its arrivals is a Poisson count of requests, each
    waiting a uniform share of the prefill (half of it on average): the variance the tie rule
    gives it matches such sums drawn at random, and with few arrivals expected the spread is
    wider than the delay itself."""
    prefill_ms = 40.0
    delay = expected_arrivals * prefill_ms / 2.0
    variance = LatencyCost.effect_variance(delay, prefill_ms, 0.0, 9.0)
    rng = random.Random(7)
    sums = []
    for _ in range(40_000):
        n, t = 0, rng.expovariate(expected_arrivals)  # Poisson count: arrivals in one unit of time
        while t < 1.0:
            n += 1
            t += rng.expovariate(expected_arrivals)
        sums.append(sum(rng.uniform(0.0, prefill_ms) for _ in range(n)))
    mean = sum(sums) / len(sums)
    drawn = sum((x - mean) ** 2 for x in sums) / len(sums)
    assert mean == pytest.approx(delay, rel=0.05)
    assert variance == pytest.approx(drawn, rel=0.05)
    assert (variance**0.5 > delay) is (expected_arrivals < 4 / 3)
    # the turns' overlap: meetings of about a decode pass each; nothing to be unsure of without either
    assert LatencyCost.effect_variance(0.0, prefill_ms, 12.0, 9.0) == pytest.approx(12.0 * 9.0)
    assert LatencyCost.effect_variance(0.0, prefill_ms, 0.0, 9.0) == 0.0


@pytest.mark.parametrize(("home_cost", "chosen"), [(700.0, "a"), (500.0, "home")])
def test_only_a_candidate_saving_work_is_tied_with_the_cheapest_by_the_spread_of_its_effects(
    home_cost: float, chosen: str
) -> None:
    """A 9k-token agent turn is priced on three engines (the rule alone, on scores set by hand, the
    fits on their prior: 156 ms sure at that prefill). Its home holds all but 1,172 tokens of it;
    a and b would recompute it all. b is priced 260 ms above a, the cheapest, mostly for its delay
    to the requests arriving there, whose spread (with a's) is wider than that, and b holds the
    smallest tree. Adding as much prefill as a, b saves nothing a tie could be settled by: beyond
    the fits' uncertainty it is simply dearer, and a takes the turn (b took it when the spread
    tied them, on its tree). The home saves most of the prefill: within the spread of its and
    a's effects it is a tie, which it wins; priced further above a than that, a takes it."""
    r = KvRouter(RouterConfig(), random.Random(0))
    for w in ("home", "a", "b"):
        r.add_worker(w, total_blocks=4096, max_num_batched_tokens=8192, block_size=16)
    own = [1172.0, 8900.0, 8900.0]
    costs = [home_cost, 340.0, 600.0]
    variances = [300.0, 16_000.0, 46_000.0]  # the delay to arrivals' spread: b's the widest
    keys = [(w, 0) for w in ("home", "a", "b")]
    scores = [
        CandidateScore(k, 0, 0, 0, t, t / 16, 600.0, c, predicted_ttft_ms=p)
        for k, t, c, p in zip(keys, own, costs, [100.0, 227.0, 237.0], strict=True)
    ]
    fit = r._timing[("a", 0)].uncertainty_ms(8900.0)
    excess = costs[2] - costs[1]
    assert fit < excess < (fit**2 + variances[1] + variances[2]) ** 0.5  # beyond the fits, within the effects
    i = r._cost.pick_saving_work(keys, own, costs, [900, 800, 100], scores, variances)
    assert keys[i][0] == chosen


@pytest.mark.skipif(
    not load_module.__file__.endswith(".py"),
    reason="counts calls by replacing a method, which a compiled class refuses (make test runs "
    "tests/router/core again as Python)",
)
def test_a_worker_past_its_cache_has_its_releases_worked_out_once_a_decision() -> None:
    """A worker past its cache prices the request's own wait for memory and the arrivals' from the
    same releases (when each request there ends and what it frees): worked out once per candidate
    and decision, and afresh at the next decision, even at the same instant (the load has moved in
    between: the first turn is in flight now)."""
    r = _three_running_on_each_and_waits_seen_on_c(0)
    load = r._load
    calls: list[str] = []
    releases = load.releases

    def counted(worker: tuple[str, int], *args: float) -> list[tuple[float, float]]:
        calls.append(worker[0])
        return releases(worker, *args)

    load.releases = counted  # type: ignore[method-assign]
    prefix = toks(1, 3000)
    first = r.route(req("turn-1", prefix + toks(2, 200), allowed_workers=frozenset("ab")), 20.0)
    assert isinstance(first, Decision)
    by = {s.worker[0]: s for s in first.breakdown}
    assert by["a"].memory_wait_ms > 0.0 and by["b"].memory_wait_ms > 0.0
    assert sorted(calls) == ["a", "b"]  # each asked twice (its own wait, the arrivals'), worked out once
    last = calls[-1]
    calls.clear()
    second = r.route(req("turn-2", prefix + toks(3, 200), allowed_workers=frozenset(last)), 20.0)
    assert isinstance(second, Decision)
    assert calls == [last]


@pytest.mark.parametrize(
    ("a_streamed_ms_ago", "b_streamed_ms_ago", "expected"), [(0.5, 4.5, "b"), (4.5, 0.5, "a")]
)
def test_a_request_tied_between_cached_workers_goes_where_the_decode_pass_ends_first(
    a_streamed_ms_ago: float, b_streamed_ms_ago: float, expected: str
) -> None:
    """a and b hold the same prefix and each decodes one request of the same size. Engines take a
    request in only between steps, so it waits for the rest of the decode pass running there,
    which the router reads off when that worker last streamed tokens: the worker that streamed
    0.5 ms ago has most of a pass to go, the one that streamed 4.5 ms ago (of a ~6 ms pass) little.
    Their costs are otherwise the same, a tie the fit cannot resolve: the request goes where it
    starts soonest, whichever worker holds the smaller tree, and each candidate shows that wait."""
    r = router()
    prefix = toks(40, 1600)
    store(r, "a", prefix)
    store(r, "b", prefix)
    store(r, "a", toks(41, 320))  # a holds the larger tree: the old tie-break would pick b
    now = 10.0
    for worker, ago_ms in (("a", a_streamed_ms_ago), ("b", b_streamed_ms_ago)):
        rid = f"decoding-{worker}"
        d = r.route(req(rid, toks(50 + ord(worker), 64), backend_instance_id=worker), now - 0.2)
        assert isinstance(d, Decision)
        r.first_token(rid, now - ago_ms / 1000.0)
        r.output_tokens(rid, 1, now - ago_ms / 1000.0)
    d = pick(r, "question", prefix + toks(42, 60), now)
    assert d.worker == (expected, 0)
    by = {s.worker[0]: s for s in d.breakdown}
    # the same pass on both: the waits differ by how much longer ago one of them streamed
    assert by["a"].step_wait_ms - by["b"].step_wait_ms == pytest.approx(b_streamed_ms_ago - a_streamed_ms_ago)
    assert min(by["a"].step_wait_ms, by["b"].step_wait_ms) > 0.0


def test_a_sibling_that_turns_the_cache_credit_off_is_amended_as_it_was_decided() -> None:
    # the request's own kv_overlap_score_credit of 0 counted none of its twin's blocks as cached
    # when it was routed; counted whole, it must not be credited them by the router's default
    r = router(workers="a")  # one worker: the sibling shares its twin's
    t = toks(3, 3000)
    pick(r, "twin", t)
    sibling = RouteRequest(
        "sibling", block_hashes(t, B), len(t), estimated_blocks=len(t) // B, overlap_score_credit=0.0
    )
    d = r.route(sibling, 0.001)
    assert isinstance(d, Decision) and d.overlap_blocks == 0
    routed = r.worker_snapshot()[0]
    assert routed.active_prefill_tokens >= 2 * len(t)  # the twin's prompt and its own, whole
    assert r.amend("sibling", block_hashes(t, B), len(t), 0.002, overlap_score_credit=0.0)
    amended = r.worker_snapshot()[0]
    assert amended.active_prefill_tokens == routed.active_prefill_tokens
