"""Active sequences: hand-computed loads, dedup, output decay, and the return-to-zero property."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.hashing import block_hashes
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import Decision, KvRouter, RouteRequest
from kvmesh.router.core.load import (
    CHUNK,
    CHUNK_TOKENS,
    ActiveSequences,
    PromptBlocks,
    chunk_blocks,
    output_blocks,
)

B = 4
W = ("a", 0)


def prompt(seed: int, n_blocks: int, prefix: list[int] | None = None) -> tuple[PromptBlocks, list[int]]:
    rng = random.Random(seed)
    toks = (prefix or []) + [rng.randrange(1000) for _ in range(n_blocks * B)]
    return PromptBlocks(block_hashes(toks, B)), toks


def test_prefill_tokens_are_the_uncached_prompt_until_the_first_token() -> None:
    load = ActiveSequences(block_size=B)
    p, _ = prompt(1, 10)
    load.add("r1", W, p, 42, overlap_blocks=5, now=0.0)  # 42 - 5*4 = 22 tokens; 10 full + 1 partial block
    assert load.prefill_tokens(W) == 22
    assert load.decode_blocks(W) == 11
    load.prefill_done("r1", 1.0)
    assert load.prefill_tokens(W) == 0
    assert load.decode_blocks(W) == 11


def test_shared_prefix_blocks_count_once() -> None:
    load = ActiveSequences(block_size=B)
    p1, toks = prompt(1, 10)
    p2, _ = prompt(2, 2, prefix=toks[: 8 * B])  # shares 8 blocks, adds 2
    load.add("r1", W, p1, 40, 0, 0.0)
    assert load.new_blocks(W, p2, 40) == 2
    load.add("r2", W, p2, 40, 0, 0.0)
    assert load.decode_blocks(W) == 12
    load.free("r1")
    assert load.decode_blocks(W) == 10
    load.free("r2")
    assert load.decode_blocks(W) == 0


def test_dedup_across_full_chunks() -> None:
    load = ActiveSequences(block_size=B)
    p1, toks = prompt(1, 40)
    p2, _ = prompt(2, 8, prefix=toks[: 32 * B])  # 32 shared blocks = two full chunks
    load.add("r1", W, p1, 40 * B, 0, 0.0)
    assert load.decode_blocks(W) == 40
    assert load.new_blocks(W, p2, 40 * B) == 8
    assert load.new_blocks(("b", 0), p2, 40 * B) == 40


def test_prompts_parting_after_the_last_whole_chunk_share_every_block_before_it() -> None:
    """After the last whole chunk each block is an identity of its own, chained to the one before:
    two prompts that part there share exactly the blocks they have in common, whichever block
    they part at, and nothing after it."""
    base, toks = prompt(1, 16 + 10)  # one whole chunk, then a partial one of 10 blocks
    for shared in range(16, 26):
        load = ActiveSequences(block_size=B)
        load.add("r1", W, base, 26 * B, 0, 0.0)
        other, _ = prompt(100 + shared, 26 - shared, prefix=toks[: shared * B])
        assert load.new_blocks(W, other, 26 * B) == 26 - shared
    again = PromptBlocks(block_hashes(toks, B))
    assert again.ids == base.ids  # the same prompt, the same identities


@pytest.mark.parametrize("n", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + CHUNK // 2])
def test_each_identity_names_its_whole_prefix_and_nothing_after_it(n: int) -> None:
    """One identity per whole chunk, then one per block of the partial chunk; a prompt cut at a
    chunk boundary has the first identities of the whole one, and changing any one block changes
    the identity that covers it and every one after it, never one before."""
    rng = random.Random(n)
    hashes = [rng.getrandbits(64) for _ in range(n)]
    p = PromptBlocks(hashes)
    assert (p.n_blocks, p.n_anchors, len(p.ids)) == (n, n // CHUNK, n // CHUNK + n % CHUNK)
    assert len(set(p.ids)) == len(p.ids)
    for cut in range(0, n + 1, CHUNK):
        assert PromptBlocks(hashes[:cut]).ids[: cut // CHUNK] == p.ids[: cut // CHUNK]
    for changed in range(n):
        other = PromptBlocks([*hashes[:changed], hashes[changed] ^ 1, *hashes[changed + 1 :]])
        # the identity covering block ``changed``: its chunk's, or its own after the whole chunks
        first = changed // CHUNK if changed < p.n_anchors * CHUNK else p.n_anchors + changed % CHUNK
        assert other.ids[:first] == p.ids[:first]
        assert all(a != b for a, b in zip(other.ids[first:], p.ids[first:], strict=True))


def test_without_kv_reuse_every_request_counts_all_its_blocks() -> None:
    load = ActiveSequences(block_size=B, assume_kv_reuse=False)
    p, _ = prompt(1, 10)
    load.add("r1", W, p, 40, 0, 0.0)
    load.add("r2", W, p, 40, 0, 0.0)
    assert load.decode_blocks(W) == 20
    assert load.new_blocks(W, p, 40) == 10


def test_tracking_switches() -> None:
    load = ActiveSequences(block_size=B, track_prefill_tokens=False, track_active_blocks=False)
    p, _ = prompt(1, 10)
    load.add("r1", W, p, 40, 0, 0.0)
    assert (load.prefill_tokens(W), load.decode_blocks(W), load.requests(W)) == (0, 0, 1)


def test_an_osl_counts_the_whole_answer_from_routing_and_decays_toward_it() -> None:
    load = ActiveSequences(block_size=B)  # no output tracking needed: the osl is the client's word
    p, _ = prompt(1, 1)
    load.add("r1", W, p, 4, 0, 0.0, osl=16)
    assert load.decode_blocks(W) == 1 + 4.0  # ceil(16 / 4) answer blocks before any token
    load.generated("r1", 8, 1.0)  # 4 blocks * (1 - 8/16)
    assert load.decode_blocks(W) == 1 + 2.0
    load.generated("r1", 4, 2.0)  # 4 blocks * (1 - 12/16)
    assert load.decode_blocks(W) == 1 + 1.0
    load.generated("r1", 8, 3.0)  # past osl: decays to nothing
    assert load.decode_blocks(W) == 1


def test_output_blocks_without_an_osl_grow_per_generated_block() -> None:
    load = ActiveSequences(block_size=B, track_output_blocks=True)
    p, _ = prompt(1, 1)
    load.add("r1", W, p, 4, 0, 0.0)
    load.generated("r1", 9, 1.0)
    assert load.decode_blocks(W) == 1 + 2.0


def test_requests_whose_finish_never_came_expire() -> None:
    load = ActiveSequences(block_size=B)
    p, _ = prompt(1, 2)
    load.add("old", W, p, 8, 0, now=0.0)
    load.add("live", W, p, 8, 0, now=0.0)
    load.generated("live", 1, now=50.0)
    assert load.expire(now=70.0, timeout=60.0) == ["old"]
    assert load.requests(W) == 1


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "prefill", "gen", "free"]),
        st.integers(0, 6),  # request
        st.integers(0, 2),  # worker
        st.integers(0, 40),  # prompt blocks
        st.integers(0, 3),  # prompt family (shared prefixes)
        st.integers(0, 30),  # overlap or tokens
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.booleans(), st.booleans())
def test_load_returns_to_exactly_zero(ops: list, reuse: bool, output: bool) -> None:
    load = ActiveSequences(block_size=B, assume_kv_reuse=reuse, track_output_blocks=output)
    families = [prompt(f, 40)[1] for f in range(4)]
    for op, rid, w, n, fam, x in ops:
        r, worker = f"r{rid}", (f"w{w}", 0)
        if op == "add":
            p = PromptBlocks(block_hashes(families[fam][: n * B], B))
            load.add(r, worker, p, n * B + x % B, x % (n + 1), 0.0, osl=x or None)
        elif op == "prefill":
            load.prefill_done(r, 0.0)
        elif op == "gen":
            load.generated(r, x, 0.0)
        else:
            load.free(r)
        for wk in (("w0", 0), ("w1", 0), ("w2", 0)):
            assert load.prefill_tokens(wk) >= 0
            assert load.decode_blocks(wk) >= 0
            # once every request there has finished, every block it holds is back
            ends = load.releases(wk, 1.0, stay_s=1.0, out_tokens=10)
            assert len(ends) == load.requests(wk)
            assert (ends[-1][1] if ends else 0.0) == pytest.approx(load.decode_blocks(wk))
    for r in load.request_ids():
        load.free(r)
    for wk in (("w0", 0), ("w1", 0), ("w2", 0)):
        assert load.prefill_tokens(wk) == 0
        assert load.decode_blocks(wk) == 0
        assert load.requests(wk) == 0


def _decoding(
    load: ActiveSequences, rid: str, p: PromptBlocks, first: float, tokens: int, now: float
) -> None:
    """``rid`` routed at 0, first token at ``first``, ``tokens`` generated by ``now`` at an even pace."""
    load.add(rid, W, p, p.n_blocks * B, 0, 0.0)
    load.prefill_done(rid, first)
    load.generated(rid, 1, first)
    load.generated(rid, tokens - 1, now)


def test_blocks_come_back_when_whole_requests_finish_soonest_first() -> None:
    load = ActiveSequences(block_size=B)
    p1, toks = prompt(1, 10)
    p2, _ = prompt(2, 2, prefix=toks[: 8 * B])  # shares r1's first 8 blocks
    _decoding(load, "r1", p1, first=1.0, tokens=11, now=2.0)  # 0.1 s a token, 9 of 20 to go
    _decoding(load, "r2", p2, first=1.5, tokens=6, now=2.0)  # 0.1 s a token, 14 to go
    fast = ActiveSequences(block_size=B)
    _decoding(fast, "r2", p2, first=1.5, tokens=11, now=2.0)  # 0.05 s a token, 9 to go

    # r1 ends first and gives back only its own 2 blocks: the shared 8 wait for r2
    assert load.releases(W, 2.0, stay_s=9.0, out_tokens=20) == [
        pytest.approx((0.9, 2)),
        pytest.approx((1.4, 12)),
    ]
    assert fast.releases(W, 2.0, stay_s=9.0, out_tokens=20) == [pytest.approx((0.45, 10))]


def test_a_release_uses_the_osl_the_stay_and_the_predicted_prefill_when_it_has_no_pace() -> None:
    load = ActiveSequences(block_size=B)
    p1, _ = prompt(1, 4)
    p2, _ = prompt(2, 4)
    p3, _ = prompt(3, 4)
    load.add("osl", W, p1, 4 * B, 0, 0.0, osl=30)
    load.prefill_done("osl", 1.0)
    load.generated("osl", 1, 1.0)
    load.generated("osl", 12, 2.2)  # 0.1 s a token, 17 to its osl
    load.add("new", W, p2, 4 * B, 0, 2.0)
    load.prefill_done("new", 2.1)
    load.generated("new", 1, 2.1)  # one token: no pace yet, 20 tokens over a 4 s stay
    load.add("queued", W, p3, 4 * B, 0, 1.8, expected_prefill=0.5)  # 0.3 s of prefill left
    got = dict(zip(("a", "b", "c"), load.releases(W, 2.2, stay_s=4.0, out_tokens=20), strict=True))
    assert got["a"][0] == pytest.approx(1.7)  # osl's 17 tokens at its pace
    assert got["b"][0] == pytest.approx(3.8)  # new's 19 tokens at 0.2 s each
    assert got["c"][0] == pytest.approx(4.1)  # the rest of queued's prefill, then a stay
    answer = output_blocks(30, 13, B)  # the blocks osl's answer holds, freed with it
    assert [g[1] for g in got.values()] == pytest.approx([4 + answer, 8 + answer, 12 + answer])


def test_requests_the_engine_reports_beyond_the_routers_count_as_the_ones_in_flight() -> None:
    load = ActiveSequences(block_size=B)
    other = ("b", 0)
    load.add_worker(other)
    p, _ = prompt(3, 10)
    load.add("r1", W, p, 40, overlap_blocks=0, now=0.0)  # 10 blocks, 40 uncached tokens: in prefill
    assert load.candidate_view(W, 0.0)[1:] == (40, 10, 1, 0)
    # the engine counts this router's request: nothing unseen
    load.set_unseen([W], running=1, waiting=0, now=0.0)
    assert load.unseen_requests(W) == 0.0
    assert load.candidate_view(W, 0.0)[1:] == (40, 10, 1, 0)
    # 3 running and 2 waiting on b, none of them this router's, each the size of r1
    load.set_unseen([other], running=3, waiting=2, now=0.0)
    assert load.unseen_requests(other) == 5.0
    assert load.candidate_view(other, 0.0) == (0.0, 2 * 40, 5 * 10, 5, 3)
    # on a, 4 waiting: one is this router's request (in prefill), 3 are unseen queued prefills
    load.set_unseen([W], running=1, waiting=4, now=0.0)
    assert load.candidate_view(W, 0.0)[1:] == (40 + 3 * 40, 10 + 4 * 10, 5, 1)
    # the size is measured again at most every half second, from the requests in flight then: a
    # 20-block request that has its first token makes an unseen one 15 blocks, and leaves the
    # waiting one's size to the one still in prefill
    q, _ = prompt(5, 20)
    load.add("r2", W, q, 80, overlap_blocks=20, now=0.0)
    load.prefill_done("r2", 0.1)
    load.set_unseen([other], running=3, waiting=2, now=0.2)
    assert load.candidate_view(other, 0.2)[1:3] == (2 * 40, 5 * 10)  # not yet measured again
    load.set_unseen([other], running=3, waiting=2, now=0.5)
    assert load.candidate_view(other, 0.5)[1:3] == (2 * 40, pytest.approx(5 * 15))
    # with nothing of its own in flight, the router has no size to give them: they count as
    # requests only
    load.free("r1", 0.6)
    load.free("r2", 0.6)
    load.set_unseen([other], running=1, waiting=1, now=1.5)
    assert load.candidate_view(other, 1.5) == (0.0, 0, 0.0, 2, 1)
    # a report of nothing clears it; a worker the router does not know is ignored
    load.set_unseen([other], running=0, waiting=0, now=1.5)
    assert load.candidate_view(other, 1.5) == (0.0, 0, 0.0, 0, 0)
    load.set_unseen([("c", 0)], running=5, waiting=5, now=1.5)
    assert load.unseen_requests(("c", 0)) == 0.0


def test_unseen_load_spreads_over_the_ranks_of_one_engine() -> None:
    load = ActiveSequences(block_size=B)
    ranks = [("dp", 0), ("dp", 1)]
    for key in ranks:
        load.add_worker(key)
    p, _ = prompt(4, 8)
    load.add("r1", ranks[0], p, 32, overlap_blocks=0, now=0.0)
    load.prefill_done("r1", 0.1)  # generating on rank 0
    load.set_unseen(ranks, running=4, waiting=0, now=0.2)  # summed over the ranks, as the gauges are
    assert [load.unseen_requests(k) for k in ranks] == [1.5, 1.5]
    assert load.candidate_view(ranks[1], 0.2)[2:] == (pytest.approx(1.5 * 8), 2, 2)  # rounded up


def test_an_estimated_prompt_keeps_its_known_chunks_and_counts_the_rest_as_its_own() -> None:
    whole, toks = prompt(21, 3 * CHUNK + 5)
    known = block_hashes(toks, B)[: 2 * CHUNK + 3]  # its earlier turn: two whole chunks and three
    est = PromptBlocks.estimated(known, 4 * CHUNK + 2, salt=1)
    assert (est.n_blocks, est.n_anchors) == (4 * CHUNK + 2, 4)
    assert len(est.ids) == 4 + 2
    assert est.ids[:2] == whole.ids[:2]  # the known whole chunks are the prompt's own
    assert not set(est.ids[2:]) & set(whole.ids)  # the rest matches nothing
    assert not set(est.ids[2:]) & set(PromptBlocks.estimated(known, 4 * CHUNK + 2, salt=2).ids[2:])
    # held where the whole prompt is in flight: its known chunks count as active, the rest new
    load = ActiveSequences(block_size=B)
    load.add("whole", W, whole, len(toks), 0, 0.0)
    assert load.new_blocks(W, est, est.n_blocks * B) == est.n_blocks - 2 * CHUNK
    # with nothing known it is the prompt no worker held: every identity its own
    cold = PromptBlocks.estimated([], 2 * CHUNK + 1, salt=3)
    assert (cold.n_anchors, len(cold.ids)) == (2, 3) and not set(cold.ids) & set(whole.ids)


def test_a_replaced_request_keeps_its_place_in_the_queue_and_the_step_it_started() -> None:
    # KvRouter.amend replaces a request routed on an estimate with its whole prompt: the engine has
    # had it since it was routed, so the step it started goes on and its place behind others holds
    load = ActiveSequences(block_size=B)
    p1, _ = prompt(31, 10)
    p2, _ = prompt(32, 10)
    load.add("first", W, p1, 40, 0, now=0.0, expected_prefill=0.1)
    load.add("second", W, p2, 40, 0, now=0.01, expected_prefill=0.1)
    assert load.anchor(W) == ("first", 0.0, 40)
    load.add("first", W, PromptBlocks.estimated([], 12, salt=1), 48, 0, now=0.02, expected_prefill=0.12)
    assert load.anchor(W) == ("first", 0.0, 48)  # still the step running, since 0.0
    assert load.step_in_progress(W, 0.05) == pytest.approx((0.12 - 0.05, 40))
    load.add("second", W, p2, 44, 0, now=0.03, expected_prefill=0.1)
    assert load.anchor(W) == ("first", 0.0, 48) and load.prefill_tokens(W) == 48 + 44
    # alone on its worker, replaced: its step is not restarted
    alone = ("b", 0)
    load.add("solo", alone, p1, 40, 0, now=1.0, expected_prefill=0.1)
    load.add("solo", alone, p1, 40, 0, now=1.002, expected_prefill=0.1)
    assert load.anchor(alone) == ("solo", 1.0, 40)
    # moved to another worker, it is new there (and gone from the first)
    load.add("second", alone, p2, 44, 0, now=1.01)
    assert load.anchor(alone) == ("solo", 1.0, 40) and load.prefill_tokens(W) == 48


def test_the_blocks_other_requests_carry_leave_a_request_s_own_out() -> None:
    load = ActiveSequences(block_size=B)
    twin, toks = prompt(41, 3 * CHUNK + 5)
    load.add("sibling", W, twin, len(toks), 0, now=0.0)
    load.add("twin", W, twin, len(toks), 0, now=0.0)
    # the twin carries every block of the sibling's prompt; its own count does not
    assert load.carried_by_others("sibling", twin, len(toks)) == twin.n_blocks
    load.free("twin")
    assert load.carried_by_others("sibling", twin, len(toks)) == 0
    assert load.new_blocks(W, twin, len(toks)) == 0  # (its own identities are still held)
    assert load.carried_by_others("gone", twin, len(toks)) == 0


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_a_shared_prefix_is_double_counted_by_the_same_tokens_on_any_block_size(block_size: int) -> None:
    """Two conversations share a 448-token system prompt, then part. Their prefix identities are
    whole chunks, so the system prompt's blocks inside the chunk where they part are counted once
    for each. A chunk spans the same tokens on any block size (``chunk_blocks``), so that double
    count is the same tokens however large the blocks: 192 here (448 less the 256 of the one
    chunk they share). With a chunk fixed at 16 blocks, 32- and 64-token blocks double-counted
    all 448, and 8-token blocks 64."""
    load = ActiveSequences(block_size=block_size)
    chunk = chunk_blocks(block_size)
    assert chunk * block_size == CHUNK_TOKENS == 256
    rng = random.Random(7)
    system = [rng.randrange(1000) for _ in range(448)]  # whole blocks on every size here
    for rid in ("one", "two"):
        toks = system + [rng.randrange(1000) for _ in range(1024)]
        load.add(rid, W, PromptBlocks(block_hashes(toks, block_size), chunk), len(toks), 0, 0.0)
    exact = 448 + 2 * 1024  # every token once
    assert load.decode_blocks(W) * block_size - exact == 192
    for rid in ("one", "two"):
        load.free(rid)
    assert load.decode_blocks(W) == 0


def test_the_router_builds_prompts_in_chunks_of_its_fleet_s_block_size() -> None:
    """A router learns the block size from its first worker; every prompt it counts as load then
    chunks the same 256 tokens: a second request sharing a 448-token system prompt with one in
    flight adds its own 1,024 tokens and the 192 of the system prompt past the shared chunk, on
    32-token blocks as on 16."""
    for block_size in (16, 32):
        r = KvRouter(RouterConfig(), random.Random(0))
        r.add_worker("a", total_blocks=4096, max_num_batched_tokens=8192, block_size=block_size)
        rng = random.Random(3)
        system = [rng.randrange(1000) for _ in range(448)]
        for rid in ("one", "two"):
            toks = system + [rng.randrange(1000) for _ in range(1024)]
            d = r.route(RouteRequest(rid, block_hashes(toks, block_size), len(toks)), 0.0)
            assert isinstance(d, Decision)
        (score,) = d.breakdown
        held_before = (448 + 1024) // block_size  # the first request's blocks, active there
        assert (score.decode_blocks - held_before) * block_size == 1024 + 192
