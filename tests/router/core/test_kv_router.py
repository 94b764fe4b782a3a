"""KvRouter end to end on the pure core: events in, decisions out, feedback back."""

from __future__ import annotations

import random

import pytest

from kvmesh.errors import ConfigError, WorkerError
from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.hashing import block_hashes
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import Decision, ExpiredSession, KvRouter, Queued, Rejected, RouteRequest
from kvmesh.router.request.nvext import parse_nvext

B = 4


def toks(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n_blocks * B)]


def router(workers: str = "abc", **cfg) -> KvRouter:
    """Dynamo's cost unless told otherwise: these tests pin its formula (the latency cost has
    its own tests in test_latency_cost.py)."""
    if cfg.get("router_mode", "kv") in ("kv", "direct"):  # (the other modes take no cost flags)
        cfg.setdefault("router_cost_model", "dynamo")
    r = KvRouter(RouterConfig(**cfg), random.Random(0))
    for w in workers:
        r.add_worker(w, total_blocks=100, max_num_batched_tokens=64, block_size=B)
    return r


def req(rid: str, tokens: list[int], **kw) -> RouteRequest:
    return RouteRequest(rid, block_hashes(tokens, B), len(tokens), **kw)


def store(r: KvRouter, worker: str, tokens: list[int], rank: int = 0) -> None:
    n = len(tokens) // B
    r.apply_events(worker, EventBatch(0.0, [BlockStored(list(range(n)), None, tokens, B)], rank))


def test_the_worker_holding_the_prefix_wins_and_the_breakdown_explains_it() -> None:
    r = router()
    t = toks(1, 10)
    store(r, "b", t[: 6 * B])
    d = r.route(req("r1", t), now=0.0)
    assert isinstance(d, Decision)
    assert (d.worker, d.overlap_blocks, d.cached_tokens, d.reason) == (("b", 0), 6, 24, "kv")
    by_worker = {s.worker: s for s in d.breakdown}
    # a: 40 prefill tokens = 10 blocks + 10 decode blocks; b: 16 tokens = 4 blocks + 10
    assert by_worker[("a", 0)].cost == 20
    assert by_worker[("b", 0)].cost == 14
    assert by_worker[("b", 0)].prefill_tokens == 16


def test_load_steers_away_from_a_busy_cache_holder() -> None:
    r = router("ab")
    t = toks(1, 10)
    store(r, "a", t[: 2 * B])
    for i in range(3):
        r.route(req(f"other{i}", toks(10 + i, 10), backend_instance_id="a"), now=0.0)
    d = r.route(req("r1", t), now=0.0)
    assert isinstance(d, Decision) and d.worker == ("b", 0)


def test_feedback_returns_load_to_zero() -> None:
    r = router("a", router_track_output_blocks=True)
    r.route(req("r1", toks(1, 10), osl=8), now=0.0)
    snap = r.worker_snapshot()[0]
    # the osl's answer blocks count from routing: ceil(8 / 4) = 2
    assert (snap.active_prefill_tokens, snap.active_decode_blocks, snap.active_requests) == (40, 12, 1)
    r.first_token("r1", 1.0)
    r.output_tokens("r1", 4, 1.0)
    assert r.worker_snapshot()[0].active_decode_blocks == 10 + 1.0
    r.finished("r1", 2.0)
    snap = r.worker_snapshot()[0]
    assert (snap.active_prefill_tokens, snap.active_decode_blocks, snap.active_requests) == (0, 0, 0)


def test_dp_ranks_are_separate_candidates() -> None:
    r = KvRouter(RouterConfig(), random.Random(0))
    r.add_worker("a", dp_size=2, total_blocks=100, max_num_batched_tokens=64, block_size=B)
    t = toks(1, 8)
    store(r, "a", t, rank=1)
    d = r.route(req("r1", t), now=0.0)
    assert isinstance(d, Decision) and d.worker == ("a", 1) and d.overlap_blocks == 8


def test_all_busy_is_rejected_with_retry_after() -> None:
    r = router(
        "ab", active_prefill_tokens_threshold=10, router_queue_threshold=None, busy_retry_after_secs=2.0
    )
    r.route(req("r1", toks(1, 5), backend_instance_id="a"), now=0.0)
    d = r.route(req("r2", toks(2, 5)), now=0.0)
    assert isinstance(d, Decision) and d.worker == ("b", 0)  # a is busy, b is not
    rejected = r.route(req("r3", toks(3, 5)), now=0.0)
    assert rejected == Rejected("r3", "busy", "all 2 candidate workers are busy", 2.0)
    r.set_busy_thresholds(active_prefill_tokens_threshold=None)
    assert isinstance(r.route(req("r4", toks(3, 5)), now=0.0), Decision)


def test_busy_thresholds_are_validated_with_the_flag_name() -> None:
    r = router("a")
    with pytest.raises(ConfigError, match=r"--active-decode-blocks-threshold must be in \[0, 1\]"):
        r.set_busy_thresholds(active_decode_blocks_threshold=1.5)
    assert r.set_busy_thresholds(active_decode_blocks_threshold=0.5).active_decode_blocks_threshold == 0.5


def test_pins() -> None:
    r = router("ab")
    store(r, "a", toks(1, 8))
    d = r.route(req("r1", toks(1, 8), backend_instance_id="b"), now=0.0)
    assert isinstance(d, Decision) and (d.worker, d.reason) == (("b", 0), "pinned")
    assert r.route(req("r2", toks(1, 8), backend_instance_id="zz"), now=0.0) == Rejected(
        "r2", "unknown_worker", "unknown worker 'zz'"
    )
    bad_rank = r.route(req("r3", toks(1, 8), backend_instance_id="a", dp_rank=3), now=0.0)
    assert isinstance(bad_rank, Rejected) and bad_rank.reason == "unknown_worker"


def test_direct_mode_needs_a_target() -> None:
    r = router("ab", router_mode="direct")
    assert isinstance(r.route(req("r1", toks(1, 2)), now=0.0), Rejected)
    d = r.route(req("r2", toks(1, 2), backend_instance_id="b"), now=0.0)
    assert isinstance(d, Decision) and d.worker == ("b", 0)


def test_round_robin_and_random_modes() -> None:
    r = router("abc", router_mode="round-robin")
    workers = [r.route(req(f"r{i}", toks(i, 2)), now=0.0).worker for i in range(6)]  # type: ignore[union-attr]
    assert [w[0] for w in workers] == list("abcabc")
    r = router("abc", router_mode="random")
    picks = {r.route(req(f"r{i}", toks(i, 2)), now=0.0).worker[0] for i in range(30)}  # type: ignore[union-attr]
    assert picks == set("abc")


def test_queue_holds_while_every_worker_is_saturated_and_releases_in_order() -> None:
    r = router("a", router_queue_threshold=0.5)  # saturated above 32 active prefill tokens
    first = r.route(req("r0", toks(0, 10)), now=0.0)
    assert isinstance(first, Decision)
    q1 = r.route(req("r1", toks(1, 2), arrival=1.0), now=1.0)
    q2 = r.route(req("r2", toks(2, 2), arrival=2.0, priority=5), now=2.0)
    assert q1 == Queued("r1", 0, 1)
    assert q2 == Queued("r2", 0, 2)  # the priority jump puts it first
    assert r.queue_pending == (2, 16)
    assert r.release(now=3.0) == []
    r.first_token("r0", now=4.0)
    released = r.release(now=5.0)
    assert [d.request_id for d in released] == ["r2", "r1"]
    assert released[0].waited == 3.0
    # the decision history (GET /kvmesh/decisions) shows each one's wait in the queue too
    recent = {d.request_id: (at, d.waited) for at, d in r.recent_decisions()}
    assert recent == {"r1": (5.0, 4.0), "r2": (5.0, 3.0), "r0": (0.0, 0.0)}


def test_queue_full_and_cancel_of_a_waiting_request() -> None:
    r = router("a", router_queue_threshold=0.0, router_queue_max_length=1)
    r.route(req("r0", toks(0, 4)), now=0.0)
    assert isinstance(r.route(req("r1", toks(1, 2)), now=0.0), Queued)
    full = r.route(req("r2", toks(2, 2)), now=0.0)
    assert isinstance(full, Rejected) and full.reason == "queue_full" and full.retry_after == 1.0
    assert r.cancel("r1", now=1.0) is True
    assert r.queue_pending == (0, 0)
    assert r.stats.queue_rejected == 1


def test_sessions_stick_slide_and_expire() -> None:
    r = router("ab")
    store(r, "a", toks(1, 8))
    opened = r.route(req("r1", toks(2, 8), session_id="s", session_action="open", session_timeout=10), 0.0)
    assert isinstance(opened, Decision)
    home = opened.worker
    store(r, "a" if home[0] == "b" else "b", toks(3, 8))
    again = r.route(req("r2", toks(3, 8), session_id="s"), now=5.0)
    assert isinstance(again, Decision) and (again.worker, again.reason) == (home, "session")
    assert r.expire(now=14.0) == []  # slid to 15
    assert r.expire(now=15.0) == [ExpiredSession("s", home)]


def test_a_session_the_client_gave_no_timeout_lives_for_the_configured_default() -> None:
    r = router("ab", router_session_timeout_secs=20.0)
    nv = parse_nvext({"nvext": {"session_control": {"session_id": "s", "action": "open"}}})
    assert nv.session is not None and nv.session.timeout is None
    opened = r.route(
        req("r1", toks(1, 4), session_id="s", session_action="open", session_timeout=nv.session.timeout), 0.0
    )
    assert isinstance(opened, Decision)
    assert r.expire(now=19.0) == []
    assert r.expire(now=20.0) == [ExpiredSession("s", opened.worker)]


def test_session_close_routes_home_once_more() -> None:
    r = router("ab")
    d = r.route(req("r1", toks(1, 2), session_id="s", session_action="bind"), now=0.0)
    closing = r.route(req("r2", toks(2, 2), session_id="s", session_action="close"), now=1.0)
    assert isinstance(d, Decision) and isinstance(closing, Decision) and closing.worker == d.worker
    assert r.expire(now=10_000.0) == []


def test_removing_a_worker_returns_its_sessions_and_drops_its_state() -> None:
    r = router("ab")
    d = r.route(req("r1", toks(1, 4), session_id="s", session_action="open", backend_instance_id="a"), 0.0)
    assert isinstance(d, Decision)
    store(r, "a", toks(1, 4))
    assert r.remove_worker("a") == [ExpiredSession("s", ("a", 0))]
    assert r.workers == [("b", 0)]
    d2 = r.route(req("r2", toks(1, 4)), now=1.0)
    assert isinstance(d2, Decision) and d2.overlap_blocks == 0


def test_per_request_overlap_credit_override() -> None:
    r = router("ab")
    t = toks(1, 10)
    store(r, "a", t)
    # a: 8 active prefill tokens + 2 decode blocks. r1 on a: 2 + 12 = 14 (b: 20);
    # without credit: 12 + 12 = 24 on a, so b wins
    r.route(req("busy", toks(9, 2), backend_instance_id="a"), now=0.0)
    d = r.route(req("r1", t), now=0.0)
    assert isinstance(d, Decision) and d.worker == ("a", 0)
    d = r.route(req("r2", t, overlap_score_credit=0.0), now=0.0)
    assert isinstance(d, Decision) and d.worker == ("b", 0)


def test_a_prompt_the_engine_computes_whole_counts_no_cached_block() -> None:
    """``reads_no_cache`` (vLLM's prompt logprobs): no worker holds any of the prompt, for the
    choice, the prediction of cached tokens and the prefill counted as load; amended the same."""
    r = router("ab")
    t = toks(1, 10)
    store(r, "a", t)
    r.route(req("busy", toks(9, 2), backend_instance_id="a"), now=0.0)
    d = r.route(req("r1", t), now=0.0)
    assert isinstance(d, Decision) and d.worker == ("a", 0) and d.cached_tokens == 40
    d = r.route(req("r2", t, reads_no_cache=True), now=0.0)
    assert isinstance(d, Decision) and (d.worker, d.cached_tokens, d.overlap_blocks) == (("b", 0), 0, 0)
    pinned = r.route(req("r3", t[:B], backend_instance_id="a", reads_no_cache=True), now=0.0)
    assert isinstance(pinned, Decision) and pinned.cached_tokens == 0
    assert r.amend("r3", block_hashes(t, B), len(t), 0.0, reads_no_cache=True)
    # the latency cost likewise: the cache holder's credit is gone
    r = router("ab", router_cost_model="latency")
    store(r, "a", t)
    d = r.route(req("r1", t), now=0.0)
    assert isinstance(d, Decision) and d.cached_tokens == 40
    d = r.route(req("r2", t, reads_no_cache=True), now=0.0)
    assert isinstance(d, Decision) and (d.cached_tokens, d.overlap_blocks) == (0, 0)
    assert all(s.overlap_blocks == 0 for s in d.breakdown)


def test_approximate_mode_learns_from_its_own_decisions_and_forgets_after_ttl() -> None:
    r = router("abc", use_kv_events=False, router_ttl_secs=60)
    t = toks(1, 10)
    first = r.route(req("r1", t), now=0.0)
    assert isinstance(first, Decision)
    r.finished("r1", now=1.0)
    second = r.route(req("r2", t), now=2.0)
    assert isinstance(second, Decision) and second.worker == first.worker and second.overlap_blocks == 10
    r.finished("r2", now=3.0)
    r.expire(now=63.0)
    third = r.route(req("r3", t), now=63.0)
    assert isinstance(third, Decision) and third.overlap_blocks == 0


def test_predict_on_route_colocates_a_burst_before_events_arrive() -> None:
    t = toks(1, 20)
    r = router("ab", router_predicted_ttl_secs=5.0)
    first = r.route(req("r1", t), now=0.0)
    second = r.route(req("r2", t), now=0.1)
    assert isinstance(first, Decision) and isinstance(second, Decision)
    assert second.worker == first.worker and second.overlap_blocks == 20
    r.expire(now=6.0)
    r.finished("r1", 6.0)
    r.finished("r2", 6.0)
    third = r.route(req("r3", t), now=6.0)
    assert isinstance(third, Decision) and third.overlap_blocks == 0


def test_load_aware_preset_ignores_the_cache() -> None:
    r = router("ab", load_aware=True)
    store(r, "a", toks(1, 8))
    d = r.route(req("r1", toks(1, 8)), now=0.0)
    assert isinstance(d, Decision) and d.overlap_blocks == 0


def test_requests_that_never_finish_expire() -> None:
    r = router("a", router_request_timeout_secs=30)
    r.route(req("r1", toks(1, 4)), now=0.0)
    r.expire(now=31.0)
    assert r.worker_snapshot()[0].active_requests == 0
    assert r.stats.requests_expired == 1


def test_tracked_peer_decisions_count_as_load() -> None:
    r = router("ab")
    r.track("peer-1", ("a", 0), block_hashes(toks(1, 10), B), 40, now=0.0)
    assert r.worker_snapshot()[0].active_decode_blocks == 10
    d = r.route(req("r1", toks(2, 10)), now=0.0)
    assert isinstance(d, Decision) and d.worker == ("b", 0)


class Heard:
    """A RoutingObserver that writes down what it hears, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def routed(self, request_id: str, worker: object, *_: object) -> None:
        self.log.append(("routed", request_id))

    def prefill_done(self, request_id: str) -> None:
        self.log.append(("prefill_done", request_id))

    def freed(self, request_id: str) -> None:
        self.log.append(("freed", request_id))

    def session(self, *_: object) -> None:
        pass


def test_the_observer_hears_of_the_routers_own_requests_and_not_of_its_peers() -> None:
    r = router("ab")
    r.observer = heard = Heard()
    r.track("peer-1", ("a", 0), block_hashes(toks(1, 10), B), 160, now=0.0)  # a peer's decision
    r.track("copy-1", ("b", 0), block_hashes(toks(2, 10), B), 160, now=0.0, own=True)  # its own
    r.route(req("r1", toks(3, 10)), now=0.0)
    for rid in ("peer-1", "copy-1", "r1"):
        r.finished(rid, now=1.0)
    assert heard.log == [
        ("routed", "copy-1"),
        ("routed", "r1"),
        ("freed", "peer-1"),
        ("freed", "copy-1"),
        ("freed", "r1"),
    ]


def test_a_fleet_shares_one_block_size() -> None:
    r = router("a")
    with pytest.raises(WorkerError, match="block size 8"):
        r.add_worker("z", total_blocks=1, max_num_batched_tokens=1, block_size=8)


def test_no_workers() -> None:
    r = KvRouter(RouterConfig(), random.Random(0))
    assert r.route(req("r1", toks(1, 1)), now=0.0) == Rejected(
        "r1", "no_workers", "no workers are registered"
    )


def test_event_statistics_are_exposed() -> None:
    r = router("a")
    store(r, "a", toks(1, 2))
    assert r.stats.events_applied == {("stored", "ok"): 1}
    assert r.worker_snapshot()[0].indexed_blocks == 2


def test_prediction_prunes_are_counted_once_however_often_stats_are_read() -> None:
    r = router("a", router_predicted_ttl_secs=5.0, router_max_tree_size=10)
    r.route(req("r1", toks(1, 20)), now=0.0)  # 20 predicted entries > 10 -> pruned down to 8
    assert r.stats.approx_pruned_blocks == 12
    assert r.stats.approx_pruned_blocks == 12
    assert r.stats.index_pruned_blocks == 0


@pytest.mark.parametrize("model", ["dynamo", "latency"])
def test_a_prompt_routed_on_an_estimate_is_counted_whole_once_amended(model: str) -> None:
    # a prompt no worker held, routed before its tokens were known (the front sends it and then
    # tokenizes it: ParsedRequest.deferred), on an estimated length and no blocks
    r = router("ab", router_cost_model=model)
    t = toks(5, 12)
    assert not r.holds_any(block_hashes(t, B)[0])
    d = r.route(RouteRequest("cold", [], 40, estimated_blocks=10), now=0.0)
    assert isinstance(d, Decision)
    other = ("b", 0) if d.worker == ("a", 0) else ("a", 0)
    # until then its estimated blocks count there as new ones
    before = {s.worker: s for s in r.worker_snapshot()}
    assert before[d.worker].active_prefill_tokens == 40
    assert before[d.worker].active_decode_blocks >= (10 if model == "latency" else 1)
    assert not r.holds_any(block_hashes(t, B)[0])
    assert r.amend("cold", block_hashes(t, B), len(t), 0.002)
    # now a request in flight carries its first block, and its whole prompt is that worker's load
    assert r.holds_any(block_hashes(t, B)[0])
    snapshot = {s.worker: s for s in r.worker_snapshot()}
    assert snapshot[d.worker].active_prefill_tokens == len(t)
    assert snapshot[other].active_prefill_tokens == 0
    # too late once its first token is in (the load already moved on); unknown ids are ignored
    r.first_token("cold", 0.01)
    assert not r.amend("cold", block_hashes(t, B), len(t), 0.011)
    assert not r.amend("nobody", block_hashes(t, B), len(t), 0.011)
    r.finished("cold", 0.02)
    assert not r.holds_any(block_hashes(t, B)[0])  # gone with it (nothing cached it: no events)


@pytest.mark.parametrize("model", ["dynamo", "latency"])
def test_a_later_turn_known_by_its_earlier_turn_counts_the_answer_decoded_after_it(model: str) -> None:
    # both hold the earlier prompt; only a decoded its answer, whose blocks follow the prompt's there
    # (the later prompt repeats the answer after the earlier prompt, then adds its own message)
    r = router("ab", router_cost_model=model)
    first, answer = toks(7, 40), toks(9, 6)
    store(r, "a", first)
    store(r, "b", first)
    r.apply_events("a", EventBatch(0.0, [BlockStored(list(range(40, 46)), 39, answer, B)], 0))
    later = first + answer + toks(8, 10)
    known = block_hashes(first, B)
    d = r.route(RouteRequest("t2", known, len(later), estimated_blocks=len(later) // B), now=1.0)
    assert isinstance(d, Decision) and d.worker == ("a", 0) and d.overlap_blocks == 46
    # no more than the estimate says the later turn adds (each candidate as the decision read it)
    d = r.route(RouteRequest("t3", known, 43 * B, estimated_blocks=43), now=1.0)
    assert isinstance(d, Decision)
    assert {s.worker: s.overlap_blocks for s in d.breakdown} == {("a", 0): 43, ("b", 0): 40}
    # a prompt known whole is matched as it is (what follows it is another request's)
    d = r.route(RouteRequest("t4", known, len(first)), now=1.0)
    assert isinstance(d, Decision) and d.overlap_blocks == 40


def test_a_later_turn_routed_on_its_earlier_turn_s_blocks_goes_home_and_counts_its_estimate() -> None:
    # the front routes a conversation's later turn on the blocks of the turn before it (known by
    # its messages) and an estimated length, and tokenizes it once sent (ParsedRequest.deferred)
    r = router("ab", router_cost_model="latency")
    first = toks(7, 40)  # 40 blocks: two whole chunks and eight more
    store(r, "a", first)
    d1 = r.route(req("t1", first), now=0.0)
    assert isinstance(d1, Decision) and d1.worker == ("a", 0)
    r.first_token("t1", 0.01)
    r.finished("t1", 0.02)
    later = first + toks(8, 30)
    d2 = r.route(
        RouteRequest("t2", block_hashes(first, B), len(later), estimated_blocks=len(later) // B), now=1.0
    )
    assert isinstance(d2, Decision) and d2.worker == ("a", 0)  # where its history is cached
    assert d2.overlap_blocks == 40
    # the blocks beyond the earlier turn's count as new there until then: all 70, not 40
    load = {s.worker: s for s in r.worker_snapshot()}[("a", 0)]
    assert load.active_decode_blocks >= 70
    assert load.active_prefill_tokens == (70 - 40) * B
    # a later turn of its conversation, as the conversations know it (the turn before replaced)
    assert r.conversation_stats()["deepest_turn"] == 2
    assert r.amend("t2", block_hashes(later, B), len(later), 1.001)
    after = {s.worker: s for s in r.worker_snapshot()}[("a", 0)]
    assert after.active_prefill_tokens == (70 - 40) * B
    stats = r.conversation_stats()
    assert stats["deepest_turn"] == 2 and stats["live"] == 1  # still one conversation, at turn 2
