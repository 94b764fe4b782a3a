"""What the NATS event plane is told: a prefix and limits the server takes, and a stream that stays
its own fleet's. Against a real nats-server where the server is the one that would refuse."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from kvmesh.errors import ConfigError
from kvmesh.events.nats_link import MAX_BYTES, MAX_SECONDS, NatsLink, NatsOptions, ensure_stream
from tests.events.natskit import NatsNode, nats_server

SERVER = ("nats://127.0.0.1:4222",)


@pytest.mark.parametrize("prefix", ["kvmesh", "fleet-2", "Fleet_3", "a"])
def test_a_prefix_of_one_token_is_taken(prefix: str) -> None:
    options = NatsOptions(SERVER, prefix=prefix)
    assert options.events_subject("w", 0) == f"{prefix}.events.w.0"


@pytest.mark.parametrize(
    "prefix",
    [
        "a b",  # a space splits the protocol line: the server refused the stream as "invalid subject"
        "*",  # a wildcard: the stream's subjects overlapped JetStream's own API and were refused
        ">",
        "a.b",  # two tokens: the same stream and bucket names as the prefix a_b
        "",
        "fleet\n",
        "flotte-é",
    ],
)
def test_a_prefix_the_subjects_cannot_carry_is_refused(prefix: str) -> None:
    with pytest.raises(ConfigError, match="--nats-prefix must be one NATS subject token"):
        NatsOptions(SERVER, prefix=prefix)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"stream_max_age": MAX_SECONDS + 1}, "--nats-stream-max-age must be in"),
        ({"stream_max_age": 1e300}, "--nats-stream-max-age must be in"),
        ({"stream_max_age": 0.0}, "--nats-stream-max-age must be in"),
        ({"stream_max_bytes": MAX_BYTES + 1}, "--nats-stream-max-bytes must be in"),
        ({"stream_max_bytes": 0}, "--nats-stream-max-bytes must be in"),
        ({"stream_replicas": 6}, "--nats-replicas must be in"),
        ({"stream_replicas": 0}, "--nats-replicas must be in"),
    ],
)
def test_limits_past_what_jetstream_takes_are_refused(limits: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NatsOptions(SERVER, **limits)  # type: ignore[arg-type]


@pytest.fixture
def node() -> Iterator[NatsNode]:
    with nats_server() as n:
        yield n


async def test_the_longest_age_is_one_the_server_takes(node: NatsNode) -> None:
    # (The largest size, 2**63 - 1 bytes, passes the server's JSON but not its storage check: a
    # size past the server's store is refused, and shown as the replicas below are.)
    link = NatsLink(NatsOptions((node.url,), prefix="far", stream_max_age=MAX_SECONDS))
    link.start()
    try:
        assert await link.wait_connected(10), link.describe()
        info = await link.js.stream_info("FAR_EVENTS")
        assert info.config.max_age == MAX_SECONDS
    finally:
        await link.close()


async def _problem(link: NatsLink, timeout: float = 10.0) -> str:
    for _ in range(int(timeout / 0.05)):
        if link.stream_problem:
            return link.stream_problem
        await asyncio.sleep(0.05)
    raise AssertionError(f"no stream problem reported: {link.describe()}")


async def test_a_prefix_differing_in_case_does_not_take_another_fleets_stream(
    node: NatsNode, caplog: pytest.LogCaptureFixture
) -> None:
    first = NatsLink(NatsOptions((node.url,), prefix="Fleet"), name="first")
    first.start()
    second = NatsLink(NatsOptions((node.url,), prefix="fleet"), name="second")
    try:
        assert await first.wait_connected(10), first.describe()
        with caplog.at_level(logging.WARNING, logger="kvmesh.events"):
            second.start()
            problem = await _problem(second)
            await asyncio.sleep(1.0)  # four more tries, none of them logged again
        assert "stream FLEET_EVENTS holds Fleet.events.>, another fleet's" in problem
        assert "--nats-prefix" in problem
        assert not second.connected
        assert second.describe()["stream_problem"] == problem
        said = [r for r in caplog.records if "FLEET_EVENTS not ready" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]

        # The first fleet's stream still stores the first fleet's events, and only those.
        info = await first.js.stream_info("FLEET_EVENTS")
        assert info.config.subjects == ["Fleet.events.>"]
        ack = await first.js.publish(first.options.events_subject("w", 0), b"batch")
        assert ack.stream == "FLEET_EVENTS"
    finally:
        await second.close()
        await first.close()


async def test_the_same_fleet_with_new_limits_updates_its_stream(node: NatsNode) -> None:
    old = NatsLink(NatsOptions((node.url,), stream_max_age=600.0))
    old.start()
    try:
        assert await old.wait_connected(10)
        await ensure_stream(old.js, NatsOptions((node.url,), stream_max_age=60.0))
        info = await old.js.stream_info("KVMESH_EVENTS")
        assert info.config.max_age == 60.0
        assert info.config.subjects == ["kvmesh.events.>"]
    finally:
        await old.close()


async def test_a_stream_the_server_refuses_is_said_once_and_shown(
    node: NatsNode, caplog: pytest.LogCaptureFixture
) -> None:
    link = NatsLink(NatsOptions((node.url,), stream_replicas=3), name="router")
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.events"):
            link.start()
            problem = await _problem(link)
            await asyncio.sleep(1.0)
        assert "replicas" in problem
        said = [r for r in caplog.records if "KVMESH_EVENTS not ready" in r.getMessage()]
        assert len(said) == 1 and "replicas" in said[0].getMessage()
        assert link.describe()["stream_problem"] == problem
    finally:
        await link.close()
