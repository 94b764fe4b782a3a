"""The tail of the best times to first token on offer, and the latency cost's choice it bounds:
no request is sent surely beyond it while another candidate keeps it within, nor surely slower than
the best candidate when none does."""

from __future__ import annotations

import random

import pytest

from kvmesh.hashing import block_hashes
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import Decision, KvRouter, RouteRequest
from kvmesh.router.core.route_types import CandidateScore
from kvmesh.router.core.tail import MIN_SEEN, WINDOW, TtftTail


def test_there_is_no_bound_until_enough_decisions_were_made() -> None:
    tail = TtftTail()
    for i in range(MIN_SEEN - 1):
        tail.offer(float(i))
    assert tail.bound_ms is None
    tail.offer(5000.0)
    assert tail.bound_ms is not None
    assert tail.describe() == {
        "decisions": MIN_SEEN,
        "offered_p99_ms": round(tail.bound_ms, 1),
        "requests": 0,
        "p99_ms": None,
    }


def test_the_bound_is_the_99th_percentile_of_the_latest_best_offers() -> None:
    tail = TtftTail()
    for i in range(WINDOW):
        tail.offer(float(i + 1))  # 1..1000 ms
    assert tail.bound_ms == pytest.approx(990.0, abs=2.0)
    for _ in range(WINDOW):  # the fleet got faster: the old offers leave the window
        tail.offer(50.0)
    assert tail.bound_ms == 50.0


def test_the_times_observed_are_shown_and_bound_nothing() -> None:
    """The observed tail is the outcome of the router's own choices: a tail it made must not
    loosen the bound, nor may a short one stand in for it before decisions were seen."""
    tail = TtftTail()
    for i in range(WINDOW):
        tail.observe(float(i + 1))
    assert tail.bound_ms is None
    assert tail.describe()["p99_ms"] == pytest.approx(990.0, abs=2.0)


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_a_time_that_is_no_time_is_not_counted(bad: float) -> None:
    tail = TtftTail()
    tail.observe(bad)
    assert tail.describe()["requests"] == 0


def test_an_offer_that_is_no_number_is_not_counted() -> None:
    """A NaN sorted into the window would leave its order, and the bound, undefined."""
    tail = TtftTail()
    for i in range(MIN_SEEN):
        tail.offer(float(i))
        tail.offer(float("nan"))
    assert tail.describe()["decisions"] == MIN_SEEN
    assert tail.bound_ms == float(int(0.99 * (MIN_SEEN - 1)))


B = 16


def _router() -> KvRouter:
    r = KvRouter(RouterConfig(), random.Random(0))
    for w in "ab":
        r.add_worker(w, total_blocks=4096, max_num_batched_tokens=8192, block_size=B)
    return r


def _score(worker: str, cost: float, predicted: float, memory_wait: float = 0.0) -> CandidateScore:
    return CandidateScore(
        (worker, 0),
        0,
        0,
        0,
        300.0,
        300.0 / B,
        0.0,
        cost,
        predicted_ttft_ms=predicted,
        memory_wait_ms=memory_wait,
    )


def _choose(r: KvRouter, a: CandidateScore, b: CandidateScore) -> str:
    """What the latency cost's choice makes of two candidates scored so."""
    i = r._cost.pick_saving_work(  # the rule alone, on scores set by hand
        [a.worker, b.worker], [300.0, 300.0], [a.cost, b.cost], [0, 0], [a, b], [0.0, 0.0], waited=True
    )
    return "ab"[i]


def _offered(r: KvRouter, n: int = 400) -> float:
    """``n`` decisions whose best offers were 40-120 ms; returns the bound they set."""
    rng = random.Random(1)
    for _ in range(n):
        r._tail.offer(rng.uniform(40.0, 120.0))
    bound = r._tail.bound_ms
    assert bound is not None and 115.0 < bound <= 120.0
    return bound


def test_a_request_is_not_sent_surely_past_the_tail_when_another_worker_keeps_it_within() -> None:
    """a is cheaper overall (b's placement is priced with evictions a second and a half dearer)
    but would have the request wait 380 ms for memory there: 450 ms to its first token against
    b's 100. Before the router has a tail, the cheaper a takes it; once the best offers of its
    decisions have shown a p99 near 120 ms, a is surely beyond it (even a wait that comes in at
    half its prediction) and b takes it."""
    a = _score("a", cost=500.0, predicted=450.0, memory_wait=380.0)
    b = _score("b", cost=2000.0, predicted=100.0)
    r = _router()
    assert _choose(r, a, b) == "a"
    _offered(r)
    assert _choose(r, a, b) == "b"


def test_a_tail_the_router_made_itself_does_not_loosen_the_bound() -> None:
    """Times to first token observed far out (turns it had sent to wait for memory) leave the
    bound where the offers put it."""
    a = _score("a", cost=500.0, predicted=450.0, memory_wait=380.0)
    b = _score("b", cost=2000.0, predicted=100.0)
    r = _router()
    _offered(r)
    for _ in range(WINDOW):
        r._tail.observe(900.0)
    assert r.ttft_tail_stats()["p99_ms"] == 900.0  # type: ignore[index]
    assert _choose(r, a, b) == "b"


@pytest.mark.parametrize(
    ("a_predicted", "a_wait", "b_predicted", "chosen"),
    [
        # a history's home predicted 150 ms, 100 of them a wait for memory: waits come in at half
        # their prediction as often as not, so it is not surely past a 120 ms tail, and its lower
        # cost keeps the turn there
        (150.0, 100.0, 100.0, "a"),
        # a crowded moment: b's 200 ms is past the tail as well; a's 900, 800 of them a wait, is
        # surely slower than b even if the wait comes in at half, so b takes it
        (900.0, 800.0, 200.0, "b"),
        # past the tail too, but a's 450 ms (380 of them a wait) may well be as quick as b's 300:
        # the cost decides
        (450.0, 380.0, 300.0, "a"),
    ],
    ids=["spread-reaches-within", "every-one-past-and-a-surely-slower", "every-one-past-none-surely-slower"],
)
def test_a_candidate_is_left_out_only_when_surely_slower_than_the_tail_allows(
    a_predicted: float, a_wait: float, b_predicted: float, chosen: str
) -> None:
    """a is the cheaper (b's placement is priced with evictions a second and a half dearer)."""
    r = _router()
    _offered(r)
    a = _score("a", cost=500.0, predicted=a_predicted, memory_wait=a_wait)
    b = _score("b", cost=2000.0, predicted=b_predicted)
    assert _choose(r, a, b) == chosen


def test_the_router_learns_the_tail_from_the_first_tokens_it_times() -> None:
    """Streamed first tokens count; an answer that came whole carries no time to first token."""
    r = _router()
    for i in range(MIN_SEEN):
        rid = f"r{i}"
        tokens = random.Random(i).choices(range(50_000), k=200)
        d = r.route(RouteRequest(rid, block_hashes(tokens, B), len(tokens)), float(i))
        assert isinstance(d, Decision)
        r.first_token(rid, i + 0.05, timed=i % 2 == 0)
        r.finished(rid, i + 0.1)
    stats = r.ttft_tail_stats()
    assert stats is not None
    assert stats["requests"] == MIN_SEEN // 2 and stats["p99_ms"] is None  # too few timed
    # every decision offered its best: enough of them for a bound
    assert stats["decisions"] == MIN_SEEN and stats["offered_p99_ms"] is not None
    assert KvRouter(RouterConfig(router_cost_model="dynamo"), random.Random(0)).ttft_tail_stats() is None
