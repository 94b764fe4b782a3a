"""`kvmesh events tap` as a user runs it (a subprocess), and the custom-engine example it reads."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvmesh.events.publisher import BatchPublisher
from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.mock.testing import run_mock
from tests.events.eventkit import free_tcp_port, make_batch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_engine_publisher.py"


def tap(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "events", "tap", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def feed_until_exit(
    proc: subprocess.Popen[str], pub: BatchPublisher, batches: list[EventBatch]
) -> tuple[str, str]:
    """Publish ``batches`` one every 50 ms (the tap needs a moment to start), then keep the
    publisher up until the tap has exited."""
    deadline = time.monotonic() + 30
    pending = list(batches)
    while proc.poll() is None and time.monotonic() < deadline:
        if pending:
            pub.publish(pending.pop(0))
        time.sleep(0.05)
    out, err = proc.communicate(timeout=10)
    return out, err


@contextmanager
def publisher(**kwargs: object) -> Iterator[BatchPublisher]:
    pub = BatchPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True, **kwargs)  # type: ignore[arg-type]
    try:
        yield pub
    finally:
        pub.close()


def stored_json(i: int) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": [i, 1_000_000_000],
        "parent_block_hash": i - 1 if i else None,
        "token_ids": [i] * 8,
        "block_size": 4,
        "lora_name": None,
        "medium": "GPU",
    }


def test_tap_json_from_seq_0_replays_then_follows() -> None:
    special = EventBatch(
        7.5,
        [
            BlockStored(
                block_hashes=[2**64 - 1, b"\xab" * 32],
                parent_block_hash=None,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium="CPU_PINNED",
                lora_name="adapter-x",
            ),
            BlockRemoved(block_hashes=[-5], medium="GPU"),
            AllBlocksCleared(),
        ],
        None,
    )
    with publisher() as pub:
        pub.publish(make_batch(0))
        pub.publish(make_batch(1))  # both sent before the tap starts: it must replay them
        proc = tap(
            pub.endpoint,
            "--replay-endpoint",
            str(pub.replay_endpoint),
            "--from-seq",
            "0",
            "--count",
            "4",
            "--json",
            "--timeout",
            "20",
        )
        out, err = feed_until_exit(
            proc, pub, [make_batch(2), special, *[make_batch(i) for i in range(4, 40)]]
        )
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines == [
        {"seq": 0, "dp_rank": 0, "ts": 0.0, "events": [stored_json(0)]},
        {"seq": 1, "dp_rank": 0, "ts": 1.0, "events": [stored_json(1)]},
        {"seq": 2, "dp_rank": 0, "ts": 2.0, "events": [stored_json(2)]},
        {
            "seq": 3,
            "dp_rank": None,
            "ts": 7.5,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [18446744073709551615, "ab" * 32],
                    "parent_block_hash": None,
                    "token_ids": list(range(8)),
                    "block_size": 4,
                    "lora_name": "adapter-x",
                    "medium": "CPU_PINNED",
                },
                {"type": "BlockRemoved", "block_hashes": [-5], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
        },
    ]


def test_tap_summary_lines() -> None:
    many = EventBatch(
        1.0,
        [
            BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=[0] * 16, block_size=4),
            BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=4, token_ids=[0] * 4, block_size=4),
            BlockRemoved(block_hashes=[9]),
        ],
        3,
    )
    with publisher() as pub:
        pub.publish(make_batch(0))
        pub.publish(many)
        proc = tap(
            pub.endpoint,
            "--replay-endpoint",
            str(pub.replay_endpoint),
            "--from-seq",
            "0",
            "--count",
            "3",
            "--timeout",
            "20",
        )
        out, err = feed_until_exit(proc, pub, [EventBatch(2.0, [AllBlocksCleared()], 0)])
    assert proc.returncode == 0, err
    assert out.splitlines() == [
        "seq=0 rank=0 stored=1 removed=0 cleared=0 +blocks=2 [0, 1000000000]",
        "seq=1 rank=3 stored=2 removed=1 cleared=0 +blocks=5 [1, 2, 3, ...] -blocks=1 [9]",
        "seq=2 rank=0 stored=0 removed=0 cleared=1",
    ]


def test_tap_live_by_default_and_bind_mode() -> None:
    port = free_tcp_port()
    proc = tap(f"tcp://127.0.0.1:{port}", "--bind", "--count", "3", "--json", "--timeout", "20")
    # The publisher connects to the bound tap (a concrete tcp address means connect, like vLLM).
    with BatchPublisher(f"tcp://127.0.0.1:{port}") as pub:
        out, err = feed_until_exit(proc, pub, [make_batch(i) for i in range(200)])
    assert proc.returncode == 0, err
    seqs = [json.loads(line)["seq"] for line in out.splitlines()]
    assert len(seqs) == 3 and seqs == list(range(seqs[0], seqs[0] + 3))  # no replay asked: starts live


def test_tap_topic_filter() -> None:
    with publisher(topic="rank-0") as pub:
        wrong = tap(pub.endpoint, "--topic", "rank-1", "--json", "--timeout", "1.5")
        right = tap(pub.endpoint, "--topic", "rank-0", "--json", "--count", "1", "--timeout", "20")
        feed_until_exit(right, pub, [make_batch(i) for i in range(100)])
        out, err = wrong.communicate(timeout=20)
    assert right.returncode == 0 and wrong.returncode == 0, err
    assert out == ""


def test_tap_bad_endpoint_is_a_clear_error() -> None:
    proc = tap("tcp://nonsense", "--count", "1")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and out == ""
    assert err.startswith(
        "kvmesh events tap: KV-event endpoint 'tcp://nonsense' must look like tcp://host:port"
    )


def test_tap_timeout_before_count() -> None:
    proc = tap(f"tcp://127.0.0.1:{free_tcp_port()}", "--count", "2", "--timeout", "0.3")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1 and out == ""
    assert err == "kvmesh events tap: timed out after 0.3 s with 0 of 2 batches\n"


@pytest.mark.parametrize("args", [["--count", "0"], ["--from-seq", "-1"], ["--timeout", "0"], []])
def test_tap_argument_errors(args: list[str]) -> None:
    proc = tap(*([*args, "tcp://127.0.0.1:1"] if args else []))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "usage: kvmesh events tap" in err


def test_tap_help_explains_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh", "events", "tap", "--help"],
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout
    for flag in (
        "ENDPOINT",
        "--replay-endpoint E",
        "--from-seq N",
        "--count N",
        "--json",
        "--bind",
        "--topic T",
        "--timeout S",
    ):
        line = next(line for line in out.splitlines() if line.startswith(f"  {flag} "))
        assert len(line.strip()) > len(flag) + 10, f"{flag} has no explanation"


# --- the custom-engine example, read by the tap ---------------------------------------------

EXAMPLE_LINE = re.compile(r"^seq (\d+): stored \[([\d, ]*)\] removed \[([\d, ]*)\]( cleared)?$")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def test_custom_engine_example_is_read_back_by_the_tap() -> None:
    command = [
        sys.executable,
        str(EXAMPLE),
        "--endpoint",
        "tcp://127.0.0.1:0",
        "--replay-endpoint",
        "tcp://127.0.0.1:0",
    ]
    command += ["--steps", "30", "--step-interval", "0.03", "--linger", "3"]
    engine = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert engine.stdout is not None
        banner = engine.stdout.readline()
        match = re.match(r"^publishing on (\S+) \(replay (\S+)\)$", banner.strip())
        assert match, banner
        reader = tap(
            match[1],
            "--replay-endpoint",
            match[2],
            "--from-seq",
            "0",
            "--count",
            "12",
            "--json",
            "--timeout",
            "20",
        )
        tapped, tap_err = reader.communicate(timeout=30)
        # Not communicate(): with two pipes it reads the raw fds and would lose what readline()
        # above already buffered (the first "seq" line arrives with the banner under load).
        rest = engine.stdout.read()
        assert engine.stderr is not None
        engine_err = engine.stderr.read()
        engine.wait(timeout=30)
    finally:
        engine.kill() if engine.poll() is None else None
    assert reader.returncode == 0, tap_err
    assert engine.returncode == 0, engine_err
    published = {}
    for line in rest.splitlines()[:-1]:
        m = EXAMPLE_LINE.match(line)
        assert m, line
        published[int(m[1])] = (_ints(m[2]), _ints(m[3]), bool(m[4]))
    assert rest.splitlines()[-1] == f"done: {len(published)} batches"
    assert len(published) >= 12 and sorted(published) == list(range(len(published)))
    for line in tapped.splitlines():
        batch = json.loads(line)
        stored = [h for e in batch["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]]
        removed = [h for e in batch["events"] if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        cleared = any(e["type"] == "AllBlocksCleared" for e in batch["events"])
        assert published[batch["seq"]] == (stored, removed, cleared)
    assert [json.loads(line)["seq"] for line in tapped.splitlines()] == list(range(12))


async def _tap_async(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvmesh", "events", "tap", *args,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_tap_follows_an_engine_given_by_its_url() -> None:
    """``kvmesh events tap URL``: the stream of an engine without kvmesh's RPCs (a stock vLLM's
    routes, served by the mock), its endpoints read from its ``/kv_event_sources``, its first
    batch replayed from sequence 0. Before, the URL was refused as no ZMQ endpoint."""
    async with run_mock(block_size=16, speedup=50.0, worker_rpc=False) as mock, httpx.AsyncClient() as http:
        body = {"model": mock.config.model, "prompt": "tap me " * 40, "max_tokens": 1}
        assert (await http.post(mock.base_url + "/v1/completions", json=body)).status_code == 200
        code, out, err = await _tap_async(
            mock.base_url, "--from-seq", "0", "--count", "1", "--json", "--timeout", "20"
        )
        assert code == 0, err
        told = f"rank 0 of {mock.base_url} (read from /kv_event_sources): {mock.engine.events_endpoint}, "
        assert told + f"replay {mock.engine.replay_endpoint}" in err, err
        first = json.loads(out.splitlines()[0])
        assert first["seq"] == 0 and first["events"][0]["type"] == "BlockStored", first


async def test_tap_of_a_url_says_what_it_cannot_follow() -> None:
    async with (
        run_mock(block_size=16, worker_rpc=False) as mock,
        run_mock(worker_rpc=False, events=False) as quiet,
    ):
        code, _, err = await _tap_async(mock.base_url, "--rank", "1", "--timeout", "5")
        assert (code, err.strip()) == (
            2,
            f"kvmesh events tap: --rank 1: {mock.base_url} has 1 data-parallel rank(s)",
        )
        code, _, err = await _tap_async(quiet.base_url, "--timeout", "5")
        assert code == 2 and "a vLLM without kvmesh's plugin that publishes no KV events" in err, err
        code, _, err = await _tap_async("tcp://127.0.0.1:5557", "--rank", "0", "--timeout", "5")
        assert code == 2 and "--rank picks a stream of an engine's URL" in err, err
        code, _, err = await _tap_async(mock.base_url, "--bind", "--timeout", "5")
        assert code == 2 and "--bind binds an endpoint" in err, err
