"""TurnMemo: recent chat prompts' block hashes, found again by the messages of a later turn."""

from __future__ import annotations

from kvmesh.router.request.continuation import TurnMemo

SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "What is a KV cache?"}
ANSWER = {"role": "assistant", "content": "Attention's keys and values, kept."}
MORE = {"role": "user", "content": "And a prefix cache?"}


def test_a_fingerprint_names_a_prefix_of_the_messages_with_their_tools_and_namespace() -> None:
    two = TurnMemo.fingerprints([SYSTEM, ASK], None, None)
    four = TurnMemo.fingerprints([SYSTEM, ASK, ANSWER, MORE], None, None)
    assert two is not None and four is not None
    assert four[:2] == two and len(set(four)) == 4
    # the same messages for another adapter, with tools, or with a changed word are other prompts
    assert TurnMemo.fingerprints([SYSTEM, ASK], None, "lora-a") != two
    assert TurnMemo.fingerprints([SYSTEM, ASK], [{"type": "function"}], None) != two
    assert TurnMemo.fingerprints([SYSTEM, {**ASK, "content": "What is a KV cache!"}], None, None)[1] != two[1]
    # a message that is not JSON has no fingerprint (the tokenizer's own check refuses it)
    assert TurnMemo.fingerprints([SYSTEM, {"role": "user", "content": object()}], None, None) is None


def test_a_later_turn_finds_the_longest_earlier_prompt_it_answers() -> None:
    memo = TurnMemo()
    first = TurnMemo.fingerprints([SYSTEM, ASK], None, None)
    assert first is not None
    memo.remember(first[-1], [11, 12, 13], 50, 400)
    later = [SYSTEM, ASK, ANSWER, MORE]
    keys = TurnMemo.fingerprints(later, None, None)
    assert keys is not None
    found = memo.find(keys, later)
    assert found is not None
    earlier, whole = found
    assert (earlier.hashes, earlier.isl, earlier.body_bytes, whole) == ((11, 12, 13), 50, 400, False)
    # the turn after finds that one, not the first: the longest kept prefix answered
    memo.remember(keys[-1], [11, 12, 13, 14, 15], 90, 700)
    third = [
        *later,
        {"role": "assistant", "content": "Blocks kept by hash."},
        {"role": "user", "content": "Ok."},
    ]
    third_keys = TurnMemo.fingerprints(third, None, None)
    assert third_keys is not None
    again = memo.find(third_keys, third)
    assert again is not None and again[0].isl == 90 and not again[1]
    assert memo.found == 2 and memo.same == 0 and memo.describe()["kept"] == 2


def test_only_an_answer_continues_a_prompt() -> None:
    # the earlier prompt ended in its generation prompt: only an assistant message follows it as
    # the template rendered it; a user message sent after it again is not that turn's answer
    memo = TurnMemo()
    first = TurnMemo.fingerprints([SYSTEM, ASK], None, None)
    assert first is not None
    memo.remember(first[-1], [1, 2], 40, 300)
    resent = [SYSTEM, ASK, MORE]
    keys = TurnMemo.fingerprints(resent, None, None)
    assert keys is not None and memo.find(keys, resent) is None
    assert memo.found == 0


def test_the_same_messages_again_find_their_own_prompt_whole() -> None:
    # a best-of-n sibling of a request routed a moment ago, or a retry: the same prompt, all of it
    memo = TurnMemo()
    first = TurnMemo.fingerprints([SYSTEM, ASK], None, None)
    assert first is not None
    memo.remember(first[-1], [1, 2, 3], 52, 300)
    again = memo.find(first, [SYSTEM, ASK])
    assert again is not None
    assert (again[0].hashes, again[0].isl, again[1]) == ((1, 2, 3), 52, True)
    assert memo.found == 1 and memo.same == 1
    # the same messages without the generation prompt are another prompt: it ends before it
    assert memo.find(first, [SYSTEM, ASK], generation_prompt=False) is None


def test_the_memo_keeps_its_budget_of_blocks_oldest_first() -> None:
    memo = TurnMemo(max_blocks=10)
    memo.remember(1, [0] * 4, 64, 100)
    memo.remember(2, [0] * 4, 64, 100)
    memo.remember(3, [0] * 4, 64, 100)  # 12 > 10: the oldest goes
    assert memo.describe() == {"found": 0, "same": 0, "kept": 2, "blocks": 8, "stopped": None}
    memo.remember(3, [0] * 6, 96, 150)  # the same prompt again: replaced, not kept twice
    assert memo.describe()["blocks"] == 10
    memo.remember(4, [0] * 11, 176, 300)  # longer than the whole budget: not kept
    assert memo.describe()["kept"] == 2


def test_a_stopped_memo_keeps_and_finds_nothing() -> None:
    memo = TurnMemo()
    first = TurnMemo.fingerprints([SYSTEM, ASK], None, None)
    assert first is not None
    memo.remember(first[-1], [1, 2], 40, 300)
    memo.stop("a prompt did not begin with its earlier turn's blocks")
    later = [SYSTEM, ASK, ANSWER, MORE]
    keys = TurnMemo.fingerprints(later, None, None)
    assert keys is not None and memo.find(keys, later) is None
    memo.remember(keys[-1], [1, 2, 3], 60, 500)
    assert memo.describe() == {
        "found": 0,
        "same": 0,
        "kept": 0,
        "blocks": 0,
        "stopped": "a prompt did not begin with its earlier turn's blocks",
    }


def test_a_deferred_count_runs_once_and_first_for_the_same_messages_again() -> None:
    memo = TurnMemo()
    keys = TurnMemo.fingerprints([SYSTEM, ASK], None, None)
    assert keys is not None
    runs: list[str] = []

    def count() -> None:  # what the front defers: tokenize the prompt sent, then keep it
        runs.append("counted")
        memo.remember(keys[-1], [11, 12], 40, 300)

    memo.defer(keys[-1], count)
    # the same messages again: the count runs before the lookup, which finds the prompt whole
    found = memo.find(keys, [SYSTEM, ASK])
    assert runs == ["counted"] and found is not None and found[1] is True
    memo.settle(keys[-1])  # the front's own callback, later: nothing left to run
    assert runs == ["counted"]
    # other messages leave it waiting; deferring a second count for one prompt runs the first
    memo.defer(keys[-1], count)
    other = TurnMemo.fingerprints([SYSTEM, MORE], None, None)
    assert other is not None and memo.find(other, [SYSTEM, MORE]) is None
    assert runs == ["counted"]
    memo.defer(keys[-1], lambda: runs.append("second"))
    assert runs == ["counted", "counted"]
    memo.settle(keys[-1])
    assert runs == ["counted", "counted", "second"]
