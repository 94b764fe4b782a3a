"""Live conversations: continuation detection, live blocks per worker, the learned turn statistics,
and the decision they change (a new conversation placed where its growth fits)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.events.wire import BlockRemoved, BlockStored, EventBatch
from kvmesh.hashing import block_hashes
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.conversations import EXPIRE_CYCLES, LAPSE_CYCLES, MAX_TURNS_TO_COME, Conversations
from kvmesh.router.core.kv_router import Decision, KvRouter, RouteRequest
from kvmesh.router.core.load import CHUNK, PromptBlocks

B = 16
A, W = ("a", 0), ("b", 0)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def route(
    conv: Conversations, rid: str, worker: tuple[str, int], tokens: list[int], now: float
) -> str | None:
    hashes = block_hashes(tokens, B)
    return conv.routed(rid, worker, PromptBlocks(hashes), hashes, now)


SYSTEM = toks(1, 2 * CHUNK * B)  # two whole chunks: sessions share exactly these identities


def test_a_turn_continues_the_request_whose_whole_prompt_it_extends() -> None:
    conv = Conversations()
    first = SYSTEM + toks(2, 10 * B)
    second = first + toks(3, 40 * B)
    assert route(conv, "s1-t1", A, first, 0.0) is None
    assert route(conv, "s2-t1", A, SYSTEM + toks(4, 10 * B), 0.1) is None  # same system prompt, other task
    assert route(conv, "s1-t2", A, second, 1.0) == "s1-t1"
    assert route(conv, "s1-t2-sibling", A, second, 1.0) is None  # the same prompt again is a sibling
    assert route(conv, "s1-t3", A, second[:-B] + toks(5, 30 * B), 2.0) is None  # drops a block of it
    assert conv.growth_blocks == 40
    assert conv.cycle_s == pytest.approx(1.0)
    # turns reached: s1-t1, s2-t1 and s1-t3 are first turns, s1-t2 a second (its sibling is the
    # same turn again, not a conversation more)
    assert conv.continued_share() == pytest.approx(1 / 4)
    # of the three first turns, s2-t1 and s1-t3 still wait for their next turns: the one whose
    # fate is known went on
    assert conv.turns_to_come(1) == pytest.approx(1)
    assert conv.turns_to_come(2) == 0
    conv.expire(2.0 + EXPIRE_CYCLES * conv.cycle_s + 0.01)  # overdue: those two were over
    assert conv.turns_to_come(1) == pytest.approx(1 / 3)


def test_a_request_routed_again_on_its_whole_prompt_is_not_its_own_earlier_turn() -> None:
    """Routed on its earlier turn's blocks (the router had not tokenized it yet), then again on all
    of its own once counted: the second lookup must not take the request itself for the turn it
    continues. It did where the earlier turn's tip had been replaced by one the request does not
    extend (a warm-up of the history ending in a generation prompt), and the KeyError left the
    request's blocks held on its worker for ever."""
    conv = Conversations()
    first = SYSTEM + toks(2, 10 * B)
    answer = toks(3, 3 * B)
    warm = first + answer + toks(4, B)  # the first turn and its answer, warmed, ending elsewhere
    later = first + answer + toks(5, 6 * B)
    route(conv, "t1", A, first, 0.0)
    assert route(conv, "warm", A, warm, 0.5) == "t1"
    assert route(conv, "t2", A, first, 1.0) is None  # routed on t1's blocks
    assert route(conv, "t2", A, later, 1.1) is None  # amended with its own: still no earlier turn
    # its blocks held once, as if it had been routed once beside the warm-up
    alone = Conversations()
    route(alone, "warm", A, warm, 0.5)
    route(alone, "t2", A, later, 1.1)
    assert conv.live_blocks(A) == alone.live_blocks(A) > 0
    assert route(conv, "t3", A, later + toks(6, 4 * B), 2.0) == "t2"


def test_an_amended_request_continues_its_earlier_turn_and_never_its_twin() -> None:
    """Later turns routed on their earlier turn's blocks are twins until amended. Amended, one
    continues the earlier turn if it is still a tip; a twin routed after it is no turn of its."""
    conv = Conversations()
    first = SYSTEM + toks(2, 10 * B)
    x, y = first + toks(3, 5 * B), first + toks(4, 5 * B)
    route(conv, "t1", A, first, 0.0)
    route(conv, "s1", A, first, 1.0)
    route(conv, "s2", A, first, 1.01)
    assert route(conv, "s1", A, x, 1.1) == "t1"
    assert route(conv, "s2", A, y, 1.2) is None
    # with the earlier turn gone (a warm-up replaced it), the first amended takes no twin's place
    conv = Conversations()
    route(conv, "t1", A, first, 0.0)
    route(conv, "warm", A, first + toks(5, 2 * B), 0.5)
    route(conv, "s1", A, first, 1.0)
    route(conv, "s2", A, first, 1.01)
    assert route(conv, "s1", A, x, 1.1) is None
    assert route(conv, "s2", A, y, 1.2) is None  # still its own tip: routed again, not anew
    assert route(conv, "s1-next", A, x + toks(6, 3 * B), 2.0) == "s1"
    assert route(conv, "s2-next", A, y + toks(7, 3 * B), 2.0) == "s2"


def test_a_sibling_shares_its_twins_turn_number() -> None:
    conv = Conversations()
    first = SYSTEM + toks(2, 10 * B)
    second = first + toks(3, 10 * B)
    route(conv, "t1", A, first, 0.0)
    route(conv, "t2", A, second, 1.0)
    hashes = block_hashes(second, B)
    turn = conv.lookup(PromptBlocks(hashes), hashes, 1.0)
    assert (turn.previous, turn.number, turn.sibling) == (None, 2, True)
    third = second + toks(4, 10 * B)
    hashes = block_hashes(third, B)
    turn = conv.lookup(PromptBlocks(hashes), hashes, 2.0)
    assert (turn.previous, turn.number, turn.sibling) == ("t2", 3, False)


def test_a_turn_after_identical_siblings_continues_the_oldest_whatever_the_string_hashing() -> None:
    """Which twin a turn continues decides which worker's history it moves: the oldest, never an
    order that changes between processes (string hashes are salted per process)."""
    conv = Conversations()
    first = SYSTEM + toks(2, 10 * B)
    for i in range(20):
        route(conv, f"twin-{19 - i}", A if i % 2 else W, first, 0.0)
    assert route(conv, "next", A, first + toks(3, 5 * B), 1.0) == "twin-19"


def test_the_longest_earlier_prompt_is_the_one_continued_whatever_its_length() -> None:
    conv = Conversations()
    base = toks(2, 3 * B)  # shorter than a chunk
    route(conv, "short", A, base, 0.0)
    for i in range(200):  # many other short prompts, some sharing its first blocks
        route(conv, f"other{i}", A, base[: B * (i % 3)] + toks(100 + i, 5 * B), 0.0)
    assert route(conv, "short-2", A, base + toks(3, 20 * B), 1.0) == "short"  # crosses a chunk
    longer = base + toks(3, 20 * B)
    route(conv, "mid", A, longer[: 18 * B], 1.0)  # an unrelated tip inside the same chunk
    assert route(conv, "short-3", A, longer + toks(4, 2 * B), 2.0) == "short-2"  # the longest
    assert route(conv, "mid-2", A, longer[: 18 * B] + toks(5, B), 2.0) == "mid"


def test_live_blocks_count_a_shared_prefix_once_and_follow_the_conversation() -> None:
    conv = Conversations()
    one, two = SYSTEM + toks(2, 10 * B), SYSTEM + toks(3, 10 * B)
    route(conv, "one", A, one, 0.0)
    route(conv, "two", A, two, 0.0)
    assert conv.live_blocks(A) == 2 * CHUNK + 10 + 10
    # the conversation's next turn went to b: its history lives there now
    route(conv, "one-2", W, one + toks(4, 6 * B), 1.0)
    assert conv.live_blocks(A) == 2 * CHUNK + 10
    assert conv.live_blocks(W) == 2 * CHUNK + 16
    # nothing comes back for EXPIRE_CYCLES typical gaps (1 s): both conversations are over
    assert conv.expire(1.0 + EXPIRE_CYCLES - 0.01) == 1  # "two", routed at 0
    assert conv.expire(1.0 + EXPIRE_CYCLES + 0.01) == 1
    assert conv.live_blocks(A) == conv.live_blocks(W) == 0


def test_a_removed_worker_takes_its_conversations_with_it() -> None:
    conv = Conversations()
    first = SYSTEM + toks(2, 10 * B)
    route(conv, "on-a", A, first, 0.0)
    route(conv, "on-b", W, SYSTEM + toks(3, 10 * B), 0.0)
    conv.remove_worker(A)
    assert conv.live_blocks(A) == 0
    assert conv.live_blocks(W) == 2 * CHUNK + 10
    assert route(conv, "next", W, first + toks(4, 4 * B), 1.0) is None  # nothing left to continue


def six_turn_conversations(conv: Conversations, worker: tuple[str, int]) -> float:
    """40 conversations of 6 turns adding 4 blocks each, one after another a second apart, all
    over by the time returned."""
    now = 0.0
    for s in range(40):
        prompt = toks(100 + s, 8 * B)
        for t in range(6):
            route(conv, f"{s}-{t}", worker, prompt, now)
            prompt = prompt + toks(1000 * s + t, 4 * B)
            now += 1.0
    now += 10 * EXPIRE_CYCLES
    conv.expire(now)
    return now


def test_the_turns_conversations_reached_give_the_turns_to_come() -> None:
    conv = Conversations()
    assert conv.turns_to_come() == 0  # nothing learned: no future is priced
    six_turn_conversations(conv, A)
    assert conv.turns_to_come(1) == pytest.approx(5)
    assert conv.turns_to_come(4) == pytest.approx(2)
    assert conv.turns_to_come(6) == 0  # no conversation went past its sixth turn
    assert conv.continued_share() == pytest.approx(5 / 6)
    assert conv.growth_blocks == pytest.approx(4)


def one_wave_at_turn_3() -> Conversations:
    """Thirty conversations side by side on ``A``, a turn a second, each turn adding 4 blocks; all
    live at their third turn."""
    conv = Conversations()
    prompts = {s: toks(100 + s, 8 * B) for s in range(30)}
    for t in range(3):
        for s in range(30):
            route(conv, f"{s}-{t}", A, prompts[s], float(t))
            prompts[s] = prompts[s] + toks(1000 * s + t, 4 * B)
    return conv


def test_conversations_still_going_count_only_the_turns_they_reached() -> None:
    """One wave of conversations, all live at their third turn: nothing says they go on, so no
    more than two turns to come are priced (the share of turns continued, learned from the tips'
    fates, read 19 here: continuations are seen at once, endings only after expiry)."""
    conv = one_wave_at_turn_3()
    assert conv.turns_to_come(1) == pytest.approx(2)
    assert conv.turns_to_come(3) == 0


def test_a_cache_is_held_for_as_many_turns_again_while_none_at_the_deepest_turn_ended() -> None:
    """Thirty conversations live at their third turn, none seen to end: the turns to come count on
    no fourth turn, but the cache is held for as many turns again as they have had (three at the
    deepest turn, and from turn 1 the two seen plus those three). Once the third turns are
    overdue, they ended there, and the cache is held for the turns seen, no more."""
    conv = one_wave_at_turn_3()
    assert conv.turns_to_come(3) == 0
    assert conv.turns_to_hold(3) == pytest.approx(3)
    assert conv.turns_to_hold(1) == pytest.approx(2 + 3)
    assert conv.turns_held_ahead(A) == pytest.approx(30 * 3)
    assert conv.growth_ahead_blocks(A) == pytest.approx(30 * 3 * 4)  # 4 blocks a turn
    conv.expire(2.0 + 10 * EXPIRE_CYCLES)
    assert conv.turns_to_hold(1) == conv.turns_to_come(1) == pytest.approx(2)
    assert conv.turns_to_hold(3) == 0


def test_the_young_fleets_forecast_lapses_when_no_conversation_goes_past_the_deepest_turn() -> None:
    """Thirty conversations reached their third turn at 2 s, a turn a second, and none comes back:
    as many turns again are counted on for LAPSE_CYCLES gaps, then none past the third, while the
    conversations are still live (their blocks still held) until they expire. A conversation that
    goes on past the deepest turn starts the forecast again, from the new deepest turn."""
    conv = one_wave_at_turn_3()
    assert conv.cycle_s == pytest.approx(1.0)
    live = conv.live_blocks(A)
    conv.expire(2.0 + LAPSE_CYCLES - 0.1)
    assert conv.turns_to_hold(3) == pytest.approx(3)
    conv.expire(2.0 + LAPSE_CYCLES + 0.1)
    assert conv.turns_to_hold(3) == 0
    assert conv.turns_to_hold(1) == conv.turns_to_come(1) == pytest.approx(2)
    assert conv.growth_ahead_blocks(A) == 0
    assert conv.live_blocks(A) == live  # lapsed, not expired
    # one of them comes back after all: a fourth turn is the deepest now, and young again
    prompt = toks(100, 8 * B) + toks(0, 4 * B) + toks(1, 4 * B) + toks(2, 4 * B)
    assert route(conv, "0-3", A, prompt, 2.0 + LAPSE_CYCLES + 0.2) == "0-2"
    assert conv.turns_to_hold(4) == pytest.approx(4)


def test_conversations_still_starting_up_are_not_read_as_short_ones() -> None:
    """Six-turn sessions starting one every 0.1 s, a turn a second: 1.5 s in, the first five are
    at their second turn and ten more wait at their first. Counted as having ended there, those ten
    read as conversations of one turn (5/15 turns to come); they have not ended, and every
    conversation whose next turn could have come went on."""
    conv = Conversations()
    prompts = {s: toks(100 + s, 8 * B) for s in range(15)}
    events = sorted([(0.1 * s, s, 0) for s in range(15)] + [(0.1 * s + 1.0, s, 1) for s in range(5)])
    for at, s, t in events:
        route(conv, f"{s}-{t}", A, prompts[s], at)
        prompts[s] = prompts[s] + toks(1000 * s + t, 4 * B)
    assert conv.turns_to_come(1) == pytest.approx(1)  # no turn past the second seen yet
    assert conv.turns_per_cycle(A) == pytest.approx(10)  # the ten at turn 1 come back


def test_conversations_that_ended_count_once_their_next_turn_is_overdue() -> None:
    """Half the conversations end after two turns, half go on to four: once the short ones'
    third turns are overdue, going on from turn 2 reads one in two."""
    conv = Conversations()
    prompts = {s: toks(100 + s, 8 * B) for s in range(20)}
    for t in range(4):  # all twenty side by side, a turn a second
        for s in range(20):
            if t < (2 if s % 2 else 4):
                route(conv, f"{s}-{t}", A, prompts[s], float(t))
                prompts[s] = prompts[s] + toks(1000 * s + t, 4 * B)
    # at 3 s the short ones' third turns are a second late, not yet overdue
    assert conv.turns_to_come(2) == pytest.approx(2)
    conv.expire(3.0 + 10 * EXPIRE_CYCLES)
    assert conv.turns_to_come(2) == pytest.approx(0.5 * 2)
    assert conv.turns_to_come(1) == pytest.approx(1 + 0.5 * 2)


def test_endless_conversations_are_priced_a_bounded_future() -> None:
    conv = Conversations()
    prompt = toks(5, 2 * B)
    for t in range(60):
        route(conv, f"t{t}", A, prompt, float(t))
        prompt = prompt + toks(t, B)
    route(conv, "other", A, toks(6, 2 * B), 60.0)  # a second conversation, just begun
    assert conv.turns_to_come(1) == MAX_TURNS_TO_COME


# --- the decision ------------------------------------------------------------------------------


def router() -> KvRouter:
    r = KvRouter(RouterConfig(), random.Random(0))
    for w in "ab":
        r.add_worker(w, total_blocks=1000, max_num_batched_tokens=8192, block_size=B)
    return r


def answered(r: KvRouter, rid: str, worker: str, tokens: list[int], now: float) -> None:
    d = r.route(RouteRequest(rid, block_hashes(tokens, B), len(tokens), backend_instance_id=worker), now)
    assert isinstance(d, Decision)
    r.first_token(rid, now + 0.05, timed=False)  # the worker's timing model stays on its prior
    r.finished(rid, now + 0.3)


def held_by_a(system: list[int], conversations: bool) -> tuple[KvRouter, float]:
    """a holds ``system`` (its KV events say so) and has served traffic over it: six agent
    sessions of 2k-token turns that have ended and six still going (``conversations``), or as
    many single questions of the same sizes. Returns the router and the time after them."""
    r = router()
    n = len(system) // B
    r.apply_events("a", EventBatch(0.0, [BlockStored(list(range(n)), None, system[: n * B], B)], 0))
    now = 0.0
    for batch in range(2):
        prompts = {s: system + toks(10 * batch + s, 200) for s in range(6)}
        for turn in range(6):
            for s, prompt in prompts.items():
                tokens = prompt if conversations else toks(500 + 100 * batch + 10 * turn + s, len(prompt))
                answered(r, f"{batch}-{s}-{turn}", "a", tokens, now)
                prompts[s] = prompt + toks(1000 + 100 * batch + 10 * turn + s, 2000)
                now += 0.1
        if batch == 0:
            now += 20.0  # the first six end
            r.expire(now)
    return r, now


@pytest.mark.parametrize(("conversations", "worker"), [(True, "b"), (False, "a")])
def test_a_new_conversation_goes_where_its_growth_fits(conversations: bool, worker: str) -> None:
    """The six sessions living on a hold more blocks than its cache: a new session's later turns
    there would push theirs out, so it starts on b, paying its 2k-token system prompt once. When
    a's traffic is single questions, nothing comes back and a's cached prompt wins."""
    system = toks(7, 2000)
    r, now = held_by_a(system, conversations)
    d = r.route(RouteRequest("new", block_hashes(system + toks(9, 200), B), 2200), now)
    assert isinstance(d, Decision)
    assert d.worker == (worker, 0)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms  # a answers this turn sooner
    assert (by["a"].eviction_ms > 0) is conversations


def test_the_growth_ahead_of_a_workers_conversations_counts_each_at_its_turn() -> None:
    conv = Conversations()
    now = six_turn_conversations(conv, W)  # 5 turns to come after the first, 4 blocks each
    assert conv.growth_ahead_blocks(A) == 0  # nothing lives on a
    young = toks(7, 8 * B)
    route(conv, "young", A, young, now)  # turn 1: 5 turns of 4 blocks to come
    route(conv, "older-1", A, toks(8, 8 * B), now)
    route(conv, "older-2", A, toks(8, 8 * B) + toks(9, 4 * B), now)  # older-1's turn 2: the tip moves
    first, second = conv.turns_to_come(1) * 4, conv.turns_to_come(2) * 4  # ~5 and ~4 turns of 4 blocks
    assert conv.growth_blocks == pytest.approx(4)
    assert first == pytest.approx(20, rel=0.1) and second == pytest.approx(16, rel=0.1)
    assert conv.growth_ahead_blocks(A) == pytest.approx(first + second)  # young, and older-2
    # the tip a turn continues is left out: its growth is the turn's own
    assert conv.growth_ahead_blocks(A, exclude="older-2") == pytest.approx(first)
    assert conv.growth_ahead_blocks(A, exclude="young") == pytest.approx(second)
    assert conv.growth_ahead_blocks(W, exclude="young") == 0  # not a tip there
    conv.expire(now + 1e6)
    assert conv.growth_ahead_blocks(A) == 0


def test_the_outlook_of_a_worker_is_its_three_readings_in_one() -> None:
    """What the latency cost reads of each candidate in one pass: live blocks, the turns held
    ahead and the turns a gap brings, each as its own method gives it, the excluded tip left out
    of the two counts and only where it lives; a decision's candidates all in one call."""
    conv = Conversations()
    now = six_turn_conversations(conv, W)
    route(conv, "young", A, toks(7, 8 * B), now)
    route(conv, "older-1", A, toks(8, 8 * B), now)
    route(conv, "older-2", A, toks(8, 8 * B) + toks(9, 4 * B), now)
    for worker in (A, W, ("idle", 0)):
        for exclude in (None, "young", "older-2", "nobody"):
            live, ahead, per_cycle = conv.outlook(worker, exclude)
            assert live == conv.live_blocks(worker)
            assert ahead == conv.turns_held_ahead(worker, exclude)
            assert per_cycle == conv.turns_per_cycle(worker, exclude)
    live, ahead, per_cycle = conv.outlook(A)
    assert live > 0 and ahead > 0 and per_cycle > 0
    assert conv.outlook(A, "young")[1] < ahead  # young is a tip on a: left out
    assert conv.outlook(W, "young")[1] == conv.outlook(W)[1]  # not a tip there
    assert conv.outlook(("idle", 0)) == (0, 0.0, 0.0)
    # every candidate of a decision in one call: each as if asked alone
    fleet = [W, ("idle", 0), A]
    for exclude in (None, "young", "older-2"):
        assert conv.outlooks(fleet, exclude) == [conv.outlook(w, exclude) for w in fleet]


def test_a_new_conversation_leaves_a_worker_whose_young_conversations_will_fill_it() -> None:
    """Three sessions at their first turn hold little of a's cache now, but each will grow by as
    much as the ended ones did: with theirs, a fourth session's growth has no room there, so it
    starts on b although a holds its system prompt. Counted from their blocks now, a looked
    empty enough to take it."""
    system = toks(7, 2000)
    r, now = held_by_a(system, conversations=True)
    now += 20.0
    r.expire(now)  # the second six end as well: only the three below live on a
    for s in range(3):
        answered(r, f"young-{s}", "a", system + toks(200 + s, 200), now)
        now += 0.1
    conv = r._conversations
    live = conv.live_blocks(("a", 0))
    assert live < 200 < conv.growth_ahead_blocks(("a", 0)) - 1000  # little now, a cache's worth ahead
    d = r.route(RouteRequest("new", block_hashes(system + toks(9, 200), B), 2200), now)
    assert isinstance(d, Decision)
    assert d.worker == ("b", 0)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms  # a answers this turn sooner
    assert by["a"].eviction_ms > by["b"].predicted_ttft_ms - by["a"].predicted_ttft_ms


SYSTEM_2K = toks(7, 2000)


def _six_young_sessions_on_a(
    turn_tokens: int, *, one_at_turn_three: bool
) -> tuple[KvRouter, dict[int, list[int]], float]:
    """Six sessions sharing a 2k-token system prompt (``SYSTEM_2K``), all on a (of 1,200 blocks,
    as b), each through two turns of ``turn_tokens`` more, none seen to end (a fleet starting
    up); b holds nothing. ``one_at_turn_three``: the last session has had a third turn as well."""
    r = KvRouter(RouterConfig(), random.Random(0))
    for w in "ab":
        r.add_worker(w, total_blocks=1200, max_num_batched_tokens=8192, block_size=B)
    system = SYSTEM_2K
    n = len(system) // B
    r.apply_events("a", EventBatch(0.0, [BlockStored(list(range(n)), None, system[: n * B], B)], 0))
    prompts = {s: system + toks(100 + s, 200) for s in range(6)}
    now = 0.0
    for turn in range(2):
        for s in range(6):
            answered(r, f"{s}-{turn}", "a", prompts[s], now)
            prompts[s] = prompts[s] + toks(1000 + 10 * turn + s, turn_tokens)
            now += 0.1
        now += 0.4
    if one_at_turn_three:  # held as long again from then on
        answered(r, "5-2", "a", prompts[5], now)
        prompts[5] = prompts[5] + toks(1020 + 5, turn_tokens)
        now += 0.1
    return r, prompts, now


def test_a_new_session_does_not_push_out_the_histories_of_a_fleet_still_starting_up() -> None:
    """Six sessions on a, each turn adding 2k tokens, all at their second turn and none seen to
    end. A new session's 5k tokens would push part of their histories out of a's cache. Read as
    ending at the deepest turn seen, they were to bring no turn back and the push cost nothing:
    the new session went where its system prompt was cached. Held for as many turns again, every
    turn they bring back recomputes what it pushed, and it starts on b."""
    r, _, now = _six_young_sessions_on_a(2000, one_at_turn_three=False)
    system = SYSTEM_2K
    conv = r._conversations
    assert conv.turns_to_come(2) == 0 and conv.turns_to_hold(2) == 2  # none went past turn 2 yet
    assert (
        conv.turns_per_cycle(("a", 0)) == 0 < conv.held_turns_per_cycle(("a", 0)) == pytest.approx(6 * 2 / 3)
    )
    new = system + toks(9, 5000)
    d = r.route(RouteRequest("new", block_hashes(new, B), len(new)), now)
    assert isinstance(d, Decision)
    assert d.worker == ("b", 0)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms  # a answers this turn sooner


def test_the_router_follows_at_most_max_tips_conversations(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvmesh.router.core.conversations as module

    monkeypatch.setattr(module, "MAX_TIPS", 3)
    conv = Conversations()
    prompts = [SYSTEM + toks(10 + i, 4 * B) for i in range(5)]
    for i, p in enumerate(prompts):
        route(conv, f"c{i}", A, p, 0.0)
    assert conv.describe()["live"] == 3
    assert conv.live_blocks(A) == 2 * CHUNK + 3 * 4  # the two oldest were let go, blocks and all
    assert route(conv, "c0-2", A, prompts[0] + toks(99, B), 1.0) is None  # no longer followed
    assert route(conv, "c4-2", A, prompts[4] + toks(98, B), 1.0) == "c4"


# --- bookkeeping under any sequence of events -------------------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["turn", "sibling", "retry", "new", "wait"]),
        st.integers(0, 3),  # conversation
        st.sampled_from([A, W]),
        st.integers(1, 40),  # blocks a turn adds / seconds waited
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_live_blocks_and_turn_counts_stay_consistent(
    ops: list[tuple[str, int, tuple[str, int], int]],
) -> None:
    """Whatever arrives (turns, siblings, retries on another worker, new conversations, gaps long
    enough to end them), each worker's live blocks are the distinct blocks of the tips placed there,
    the learned turn statistics stay in range, and once every conversation is over nothing is held."""
    conv = Conversations()
    prompts = {c: SYSTEM + toks(50 + c, 3 * B) for c in range(4)}
    sent: dict[str, tuple[list[int], tuple[str, int]]] = {}
    now, n, last = 0.0, 0, ""
    for op, c, worker, k in ops:
        n += 1
        if op == "wait":
            now += k
            conv.expire(now)
            continue
        if op == "turn":
            prompts[c] = prompts[c] + toks(1000 * n, k * B // 4 + B)
        elif op == "new":
            prompts[c] = SYSTEM + toks(2000 * n, k * B // 4 + B)
        if op == "retry" and sent:
            rid = last if c == 0 else sorted(sent)[c % len(sent)]  # c == 0: the request just sent
            tokens = sent[rid][0]
        else:
            rid, tokens = f"r{n}", prompts[c]
        route(conv, rid, worker, tokens, now)
        sent[rid] = (tokens, worker)
        last = rid
        now += 0.1
        for w in (A, W):
            held: dict[int, int] = {}
            for tip in conv._tips.values():
                if tip.worker == w:
                    held.update((ident, CHUNK if i < tip.anchors else 1) for i, ident in enumerate(tip.ids))
            assert conv.live_blocks(w) == sum(held.values())
        assert all(tip.number >= 1 for tip in conv._tips.values())
        # the depths a lookup probes: one per last-chunk identity the tips end on
        ends = {(tip.ids[tip.anchors - 1] if tip.anchors else 0, tip.anchors) for tip in conv._tips.values()}
        depths: dict[int, int] = {}
        for _, depth in ends:
            depths[depth] = depths.get(depth, 0) + 1
        assert conv._depths == depths
        # the turns still waiting for their next are the live tips counted at them, no more
        waiting = [0.0] * len(conv._waiting)
        for tip in conv._tips.values():
            waiting[tip.number - 1] += tip.counted
        assert conv._waiting == pytest.approx(waiting)
        for w in (A, W):
            to_come = sum(conv.turns_to_come(t.number) for t in conv._tips.values() if t.worker == w)
            assert conv.turns_ahead(w) == pytest.approx(to_come)
            to_hold = sum(conv.turns_to_hold(t.number) for t in conv._tips.values() if t.worker == w)
            assert conv.turns_held_ahead(w) == pytest.approx(to_hold)
            assert conv.growth_ahead_blocks(w) == pytest.approx(to_hold * conv.growth_blocks)
        assert 0.0 <= conv.turns_to_come() <= conv.turns_to_hold() <= MAX_TURNS_TO_COME
        assert 0.0 <= conv.continued_share() < 1.0
    conv.expire(now + 1e6)  # every conversation over: nothing may stay held
    assert conv.live_blocks(A) == conv.live_blocks(W) == 0
    assert conv.growth_ahead_blocks(A) == conv.growth_ahead_blocks(W) == 0
    assert not any(conv._waiting)  # and every turn's fate is known
    assert not conv._depths


def test_the_turns_conversations_send_a_worker_come_from_those_living_there() -> None:
    conv = Conversations()
    assert conv.turns_per_cycle(A) == 0 and conv.cycle_s == 0  # nothing seen yet
    now = six_turn_conversations(conv, W)  # a turn a second; every conversation went on to turn 6
    route(conv, "first", A, toks(7, 8 * B), now)
    route(conv, "second-1", A, toks(8, 8 * B), now)
    route(conv, "second-2", A, toks(8, 8 * B) + toks(9, 4 * B), now + 0.9)  # turn 2: the tip moves
    assert conv.cycle_s == pytest.approx(1.0, rel=0.01)
    # two tips, each back once a gap between turns with the chance that a conversation at its turn
    # went on: every one whose next turn came or was overdue did (these two still wait)
    assert conv.turns_per_cycle(A) == pytest.approx(2)  # a gap's worth of them
    # the tip a turn being priced continues is that turn
    assert conv.turns_per_cycle(A, exclude="first") == pytest.approx(1)
    assert conv.turns_per_cycle(W) == 0  # its conversations are over
    # a tip at the deepest turn seen is a conversation's last: it does not come back
    prompt = toks(10, 8 * B)
    for t in range(6):
        route(conv, f"last-{t}", W, prompt, now + t)
        prompt = prompt + toks(2000 + t, 4 * B)
    assert conv.turns_per_cycle(W) == 0


def test_a_conversation_left_out_of_live_blocks_keeps_what_others_share() -> None:
    conv = Conversations()
    route(conv, "one", A, SYSTEM + toks(2, 10 * B), 0.0)
    route(conv, "two", A, SYSTEM + toks(3, 10 * B), 0.0)
    assert conv.live_blocks(A) == 2 * CHUNK + 20
    assert conv.live_blocks(A, exclude="one") == 2 * CHUNK + 10  # the system prompt is two's too
    assert conv.live_blocks(W, exclude="one") == 0 and conv.live_blocks(A, exclude="gone") == 2 * CHUNK + 20
    route(conv, "two-2", W, SYSTEM + toks(3, 10 * B) + toks(4, 4 * B), 1.0)  # two moved to b
    assert conv.live_blocks(A, exclude="one") == 0


def learned_conversations(r: KvRouter, turns: int, cache: str | None = None) -> float:
    """The router learns ``turns``-turn conversations (12 of them, a block added a turn, a turn
    every 0.6 s, each answered in 0.3 s) on a worker c that is then removed: what it learned stays
    (turns reached, the gap between turns, how long a request stays). c publishes no KV events,
    unless ``cache`` says what they tell: "kept", each turn's prompt cached until its next turn;
    "evicted", cached and evicted before the next turn came back (a 48-block system prompt the
    conversations share stays). Returns the time after."""
    r.add_worker("c", total_blocks=1000, max_num_batched_tokens=8192, block_size=B)
    now = 0.0
    engine_ids = iter(range(10**6))
    system = toks(99, 48 * B)
    if cache is not None:
        shared = [next(engine_ids) for _ in range(48)]
        r.apply_events("c", EventBatch(0.0, [BlockStored(shared, None, system, B)], 0))
    for s in range(12):
        prompt = toks(100 + s, 50 * B) if cache is None else system + toks(100 + s, 12 * B)
        own: list[int] = []  # the engine's ids of this conversation's blocks cached on c
        for turn in range(turns):
            rid, at = f"past-{s}-{turn}", now + 0.6 * turn
            d = r.route(RouteRequest(rid, block_hashes(prompt, B), len(prompt), backend_instance_id="c"), at)
            assert isinstance(d, Decision)
            if cache is not None:
                added = [next(engine_ids) for _ in range(len(prompt) // B - 48 - len(own))]
                parent = own[-1] if own else shared[-1]
                r.apply_events(
                    "c", EventBatch(at, [BlockStored(added, parent, prompt[(48 + len(own)) * B :], B)], 0)
                )
                own += added
            # (with events, what the engine cached changes no fit: the two caches differ in that alone)
            r.first_token(rid, at + 0.05, timed=cache is None)
            r.finished(rid, at + 0.3)
            if cache == "evicted":
                r.apply_events("c", EventBatch(at + 0.4, [BlockRemoved(own)], 0))
                own = []
            prompt = prompt + toks(1000 + 10 * s + turn, B)
        now += 0.1
    now += 60.0
    r.expire(now)
    r.remove_worker("c")
    return now


def test_a_worker_whose_conversations_are_between_turns_is_not_empty() -> None:
    """Three conversations live on a, between turns, with 330 blocks each; nothing is in flight
    anywhere. A new 525-block request would be answered sooner on a, which holds its first 125
    blocks, but a's conversations come back (the router learned they do, a turn every 0.6 s) and
    hold 990 of a's 1,000 blocks: this request's would push their histories out, to be prefilled
    again at their turns, and its prefill and blocks would slow those turns: it goes to b.
    Counted from the requests in flight alone, a was idle and took it. Once a's conversations
    are over, a wins again."""
    r = router()
    now = learned_conversations(r, 4)
    system = toks(7, 125 * B)
    r.apply_events("a", EventBatch(0.0, [BlockStored(list(range(125)), None, system, B)], 0))
    for s in range(3):
        answered(r, f"living-{s}", "a", toks(200 + s, 330 * B), now)
        now += 0.1
    now += 0.2  # every one of them answered and between turns
    request = system + toks(9, 400 * B)

    def decide(rid: str) -> Decision:
        d = r.route(RouteRequest(rid, block_hashes(request, B), len(request)), now)
        assert isinstance(d, Decision)
        r.cancel(rid, now)
        return d

    d = decide("new")
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms  # a's cached 125 blocks
    assert by["a"].delay_to_others_ms > by["b"].predicted_ttft_ms - by["a"].predicted_ttft_ms
    assert by["b"].delay_to_others_ms == 0 == by["b"].eviction_ms
    assert by["a"].eviction_ms > 0  # and the histories it would push out of a's cache (below)
    assert d.worker == ("b", 0)
    now += 60.0
    r.expire(now)  # a's conversations are over: nothing comes back there
    assert decide("later").worker == ("a", 0)


def test_a_turn_stays_with_its_history_where_the_conversations_outgrow_the_cache() -> None:
    """Four conversations live on a, between turns, with 300 blocks each: more than a's 1,000
    blocks. The next turn of one of them adds 20 blocks to its history, cached on a. The others'
    histories are cached, not in flight: the engine evicts what it needs of them, and no one
    waits for that memory. So the turn stays on a, 30 ms sooner than prefilling its history
    again on b. (Priced as memory the others' turns would wait for, the 300 blocks this turn
    holds during its decode sent it to b.)"""
    r = router()
    now = learned_conversations(r, 6)
    prompts = [toks(300 + s, 300 * B) for s in range(4)]
    for s in range(4):
        answered(r, f"living-{s}", "a", prompts[s], now)
        now += 0.1
    for s in range(3):  # b's own: the fleet cannot hold every history, a move only shifts the overflow
        answered(r, f"elsewhere-{s}", "b", toks(400 + s, 300 * B), now)
        now += 0.1
    r.apply_events("a", EventBatch(0.0, [BlockStored(list(range(300)), None, prompts[0], B)], 0))
    request = prompts[0] + toks(9, 20 * B)
    d = r.route(RouteRequest("next", block_hashes(request, B), len(request)), now + 0.2)
    assert isinstance(d, Decision)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms - 25.0
    assert d.worker == ("a", 0)


def conversations_living_on_a(turns: int, cache: str | None = None) -> tuple[KvRouter, float]:
    """a and b, 1,000 blocks each. The router has learned 6-turn conversations
    (:func:`learned_conversations`, with ``cache``); three of them live on a, between turns,
    after ``turns`` turns, 300 blocks each; b is prefilling a 600-block request."""
    r = router()
    now = learned_conversations(r, 6, cache)
    prompts = [toks(200 + s, 297 * B) for s in range(3)]
    for turn in range(turns):
        for s in range(3):
            prompts[s] = prompts[s] + toks(3000 + 10 * s + turn, B)
            answered(r, f"living-{s}-{turn}", "a", prompts[s], now)
            now += 0.1
        now += 0.3
    busy = toks(5, 600 * B)
    d = r.route(RouteRequest("busy", block_hashes(busy, B), len(busy), backend_instance_id="b"), now)
    assert isinstance(d, Decision)
    return r, now


@pytest.mark.parametrize(("turns", "worker"), [(1, "b"), (6, "a")])
def test_a_request_does_not_push_out_histories_that_will_come_back_again_and_again(
    turns: int, worker: str
) -> None:
    """A new 400-block request would be answered sooner on a, idle, than on b, busy prefilling;
    but a's three conversations hold 900 of its 1,000 blocks, and the request's would push 300 of
    theirs out. Each conversation that comes back prefills what was pushed out of it, and pushes
    as much out of the next one's history: at their first turn, with five turns each to come, that
    is 300 blocks again at every one of fifteen turns, and the request goes to b. At their last
    turn nothing comes back for them, and a wins."""
    r, now = conversations_living_on_a(turns)
    conv = r._conversations
    assert conv.turns_ahead(A) == pytest.approx(3 * conv.turns_to_come(turns), rel=0.01)
    request = toks(9, 400 * B)
    d = r.route(RouteRequest("new", block_hashes(request, B), len(request)), now)
    assert isinstance(d, Decision)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms  # a answers it sooner
    assert d.worker == (worker, 0)
    if turns == 1:
        assert by["a"].eviction_ms > by["b"].cost - by["a"].predicted_ttft_ms
    else:
        assert by["a"].eviction_ms < 1.0  # (its own conversation's growth, a block a turn)


@pytest.mark.parametrize(("cache", "worker"), [("kept", "b"), ("evicted", "a")])
def test_histories_pushed_out_are_priced_at_the_share_later_turns_find(cache: str, worker: str) -> None:
    """The test above at the conversations' first turn, where the router learned its conversations
    from KV events. Where their later turns found their histories cached ("kept"), the 400-block
    request would push 300 blocks out of a's conversations at each of their turns to come, and it
    goes to b. Where the later turns found theirs evicted every time ("evicted": a cache past
    its conversations), a push comes to nothing that would not have happened anyway: the request
    goes to a, where it is answered sooner."""
    r, now = conversations_living_on_a(1, cache)
    found = r._conversations.history_found
    assert found == 1.0 if cache == "kept" else found < 0.1
    request = toks(9, 400 * B)
    d = r.route(RouteRequest("new", block_hashes(request, B), len(request)), now)
    assert isinstance(d, Decision)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms
    assert d.worker == (worker, 0)


def conversations_between_turns_on_a(living: int) -> tuple[KvRouter, float, list[int]]:
    """a holds a 960-token system prompt; ``living`` conversations over it live on a, answered and
    between turns. The router has learned 6-turn conversations that spend about two fifths of
    each gap between turns in flight (:func:`learned_conversations`). b holds nothing and serves
    nothing. Returns the router, the time and the system prompt."""
    r = router()
    now = learned_conversations(r, 6)
    system = toks(7, 60 * B)
    r.apply_events("a", EventBatch(0.0, [BlockStored(list(range(60)), None, system, B)], 0))
    for s in range(living):
        answered(r, f"living-{s}", "a", system + toks(200 + s, 30 * B), now)
        now += 0.1
    return r, now + 0.3, system


@pytest.mark.parametrize(("living", "worker"), [(4, "b"), (2, "b"), (0, "a")])
def test_a_new_conversation_does_not_crowd_its_turns_onto_a_worker_for_a_shared_prompt(
    living: int, worker: str
) -> None:
    """A new conversation's first turn would be answered sooner on a, which holds its 960-token
    system prompt. But it has five turns to come there, and the conversations living on a will be
    in flight there for two fifths of the time: many of its turns would find a decoding and wait
    for the pass in progress, and slow theirs the same way. With four living there, and with two,
    that makes a dearer than b by more than the fits are unsure of, and it starts on b, paying the
    prompt once. With no conversation living on a, a wins. (Without the price it took a either way:
    the conversations' own arrivals made a's cost no dearer than the tie its cached prompt wins.
    With two living there, how often they meet is a matter of a few turns that may or may not
    coincide, and its spread once made a tie of it, which a won with its cached prompt. But a new
    conversation keeps no history on a, so only the fits' uncertainty makes a tie for it: with the
    spread, 8-12 of `chat-fits`' 16 new chats started on the engine holding their system prompt,
    each predicted slower there, and their later turns moved away when they met, recomputing
    their histories.)"""
    r, now, system = conversations_between_turns_on_a(living)
    prompt = system + toks(9, 30 * B)
    d = r.route(RouteRequest("new", block_hashes(prompt, B), len(prompt)), now)
    assert isinstance(d, Decision)
    assert d.worker == (worker, 0)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms  # a answers this turn sooner
    if living:  # dearer on a by more than the fits' uncertainty: no tie
        fit = r._timing[W].uncertainty_ms(by["b"].prefill_tokens)
        assert by["a"].cost - by["b"].cost > fit
    assert by["b"].turns_overlap_ms == 0  # nobody lives there
    assert (by["a"].turns_overlap_ms > 0) is (living > 0)
    for s in d.breakdown:
        assert s.cost == pytest.approx(
            s.predicted_ttft_ms + s.delay_to_others_ms + s.eviction_ms + s.turns_overlap_ms - s.copy_credit_ms
        )


def test_a_later_turn_keeps_its_history_where_its_effect_on_others_is_a_matter_of_chance() -> None:
    """Three conversations live on a; the next turn of one of them adds two blocks to its history
    there. Its expected effect on the others there (their arrivals it delays, the turns that will
    meet) makes a dearer than b by more than the fits are unsure of, but those are a few events
    that may or may not happen, and within their spread the two are a tie: the turn stays where
    its history is cached, rather than recompute it on b. (A new conversation's first turn, which
    keeps no history anywhere, has no such tie: the test above.)"""
    r, now, system = conversations_between_turns_on_a(3)
    prompt = system + toks(200, 30 * B) + toks(300, 2 * B)  # living-0's next turn
    d = r.route(RouteRequest("next", block_hashes(prompt, B), len(prompt)), now)
    assert isinstance(d, Decision)
    by = {s.worker[0]: s for s in d.breakdown}
    assert by["a"].delay_to_others_ms > 0 and by["a"].turns_overlap_ms > 0
    assert by["a"].cost - by["b"].cost > r._timing[W].uncertainty_ms(by["b"].prefill_tokens)
    assert d.worker == A


def test_the_overlap_grows_with_the_conversations_living_there_and_spares_a_conversation_alone() -> None:
    """A new conversation pays more overlap on a the more conversations live there; a sibling of
    a live turn pays none (its twin's turns are its turns), nor does a conversation's next turn
    on the worker where it lives alone."""

    def priced(living: int, tokens: list[int]) -> float:
        r, now, _ = conversations_between_turns_on_a(living)
        d = r.route(RouteRequest("probe", block_hashes(tokens, B), len(tokens)), now)
        assert isinstance(d, Decision)
        return next(s for s in d.breakdown if s.worker == A).turns_overlap_ms

    system = toks(7, 60 * B)  # as conversations_between_turns_on_a's
    new = [priced(living, system + toks(9, 30 * B)) for living in (1, 2, 4)]
    assert 0 < new[0] < new[1] < new[2]
    for living in (1, 2, 4):
        assert priced(living, system + toks(200 + living - 1, 30 * B)) == 0  # a live turn again
        alone = priced(living, system + toks(200, 30 * B) + toks(300, 5 * B))  # living-0's next turn
        assert (alone == 0) is (living == 1)


def test_turns_leave_a_worker_their_neighbours_will_outgrow_while_their_histories_are_short() -> None:
    """Six young sessions on a fit its cache now, but held for as many turns again they will not.
    Staying, a third turn's history takes room their growth needs, and each of their turns that
    comes back once a overflows prefills what it lost again. Priced on a (where its history is)
    as well as on b (where it would land), the first third turns move while their histories are
    1.2k tokens, not when they no longer fit; each move relieves a, and once a's sessions fit
    there the rest stay."""
    r, prompts, now = _six_young_sessions_on_a(1000, one_at_turn_three=True)
    conv = r._conversations
    assert conv.live_blocks(A) < 1200 < conv.live_blocks(A) + conv.growth_ahead_blocks(A)
    went = []
    for s in range(5):
        d = r.route(RouteRequest(f"{s}-2", block_hashes(prompts[s], B), len(prompts[s])), now)
        assert isinstance(d, Decision)
        if s == 0:
            by = {c.worker[0]: c for c in d.breakdown}
            assert by["a"].predicted_ttft_ms < by["b"].predicted_ttft_ms  # a answers this turn sooner
        went.append(d.worker[0])
        r.first_token(f"{s}-2", now + 0.1, timed=False)
        r.finished(f"{s}-2", now + 0.3)
        now += 0.4
    assert went[0] == "b"
    assert went[-1] == "a"
    assert 1 <= went.count("b") <= 3


def test_where_the_fleet_cannot_hold_its_conversations_staying_home_costs_nothing_more() -> None:
    """The same six sessions on a, and six like them on b: both will overflow, and the fleet
    cannot hold what its conversations will grow into. Leaving a would only move the overflow to
    b, so staying is not priced for it (alone, a's price ran to ~400 ms here)."""
    r, prompts, now = _six_young_sessions_on_a(1000, one_at_turn_three=True)
    system = SYSTEM_2K
    n = len(system) // B
    r.apply_events("b", EventBatch(now, [BlockStored(list(range(n)), None, system[: n * B], B)], 0))
    others = {s: system + toks(300 + s, 200) for s in range(6)}
    for turn in range(2):
        for s in range(6):
            answered(r, f"b{s}-{turn}", "b", others[s], now)
            others[s] = others[s] + toks(3000 + 10 * turn + s, 1000)
            now += 0.1
        now += 0.4
    d = r.route(RouteRequest("0-2", block_hashes(prompts[0], B), len(prompts[0])), now)
    assert isinstance(d, Decision)
    by = {c.worker[0]: c for c in d.breakdown}
    assert by["a"].eviction_ms <= by["b"].eviction_ms
    assert by["a"].eviction_ms < by["a"].predicted_ttft_ms  # no staying price: ~400 ms where counted
