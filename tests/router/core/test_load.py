"""Active sequences: hand-computed loads, dedup, output decay, and the return-to-zero property."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.hashing import block_hashes
from kvmesh.router.core.load import ActiveSequences, PromptBlocks

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
    for r in load.request_ids():
        load.free(r)
    for wk in (("w0", 0), ("w1", 0), ("w2", 0)):
        assert load.prefill_tokens(wk) == 0
        assert load.decode_blocks(wk) == 0
        assert load.requests(wk) == 0
