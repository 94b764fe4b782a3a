"""Replica sync: engines embedding the middleware share their routing decisions over ZMQ."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.commands.demo import start_mesh
from kvmesh.errors import ConfigError
from kvmesh.mock.config import MockConfig
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.replica_sync import Envelope, Freed, Heartbeat, Routed, Session, encode
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec, add_arguments
from kvmesh.router.mesh.sync_seal import seal, sync_key
from tests.events.eventkit import ipv6_loopback
from tests.events.natskit import nats_server
from tests.router.engines import EngineState, engine_app
from tests.router.fleet import mock_finished
from tests.router.servers import serve

needs_ipv6_loopback = pytest.mark.skipif(not ipv6_loopback(), reason="this host has no IPv6 loopback")

MOCK = MockConfig(block_size=16, num_blocks=4096, speedup=1.0)
SYNC = RouterConfig(router_replica_sync=True)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MOCK.model, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


async def _json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _load(http: aiohttp.ClientSession, replica: str) -> dict[str, dict[str, Any]]:
    """Replica ``replica``'s view: worker url -> its row (state, active requests, ranks)."""
    doc = await _json(http, replica + "/kvmesh/workers")
    return {row["url"]: row for row in doc["workers"]}


async def _until(check: Callable[[], Any], timeout: float = 5.0) -> None:
    """Poll an async predicate until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.03)


async def _following_everyone(http: aiohttp.ClientSession, urls: list[str]) -> None:
    async def check() -> bool:
        docs = [await _json(http, u + "/kvmesh/router") for u in urls]
        return all(len(d["sync"]["following"]) == len(urls) - 1 for d in docs)

    await _until(check)


async def _burst(
    http: aiohttp.ClientSession,
    stack: contextlib.AsyncExitStack,
    via: str,
    target: str,
    n: int,
    max_tokens: int = 250,
) -> list[aiohttp.ClientResponse]:
    """``n`` long streaming requests sent to replica ``via``, pinned to worker ``target``; returns
    once each has streamed its first token (so they are in flight, past prefill)."""
    streams = []
    for i in range(n):
        body = chat(
            f"burst {i}: " + "summarise the quarterly report in detail " * 12,
            max_tokens=max_tokens,
            stream=True,
            nvext={"backend_instance_id": target},
        )
        r = await stack.enter_async_context(http.post(via + "/v1/chat/completions", json=body))
        assert r.status == 200
        assert r.headers["x-kvmesh-worker-id"] == target
        await r.content.readuntil(b"\n\n")  # the assistant role, announced at once
        await r.content.readuntil(b"\n\n")  # a token: past prefill
        streams.append(r)
    return streams


async def test_a_burst_through_one_replica_is_load_in_every_replica_and_steers_their_routing() -> None:
    async with start_mesh(3, SYNC, MOCK) as nodes, aiohttp.ClientSession() as http:
        a, x, c = (n.url for n in nodes)
        await _following_everyone(http, [a, x, c])
        assert [(await _json(http, u + "/kvmesh/router"))["sync"]["sealed"] for u in (a, x, c)] == [True] * 3
        async with contextlib.AsyncExitStack() as stack:
            streams = await _burst(http, stack, a, x, 4)

            async def everyone_sees_the_burst() -> bool:
                views = [await _load(http, r) for r in (a, x, c)]
                return all(
                    v[x]["active_requests"] == 4 and v[x]["ranks"][0]["active_prefill_tokens"] == 0
                    for v in views
                )

            # In x's own view the burst counts once, though it arrives both as forwarded requests
            # and through a's decision stream. (Each first token reaches the other replicas in a
            # message of its own, after the decision: wait for both, not just the decisions.)
            await _until(everyone_sees_the_burst)
            ranks = [(await _load(http, r))[x]["ranks"][0] for r in (a, x, c)]
            # the views agree: the same blocks, and no prefill left (a told them of first tokens)
            assert ranks[0]["active_decode_blocks"] >= 4 * 10
            assert [r["active_decode_blocks"] for r in ranks] == [ranks[0]["active_decode_blocks"]] * 3
            assert [r["active_prefill_tokens"] for r in ranks] == [0, 0, 0]
            # c routes fresh prompts away from the worker a just loaded
            for i in range(4):
                async with http.post(c + "/v1/chat/completions", json=chat(f"unrelated question {i}")) as r:
                    assert r.status == 200
                    assert r.headers["x-kvmesh-worker-id"] != x
            for s in streams:
                await s.read()

        async def load_is_gone() -> bool:
            views = [await _load(http, r) for r in (a, x, c)]
            return all(row["active_requests"] == 0 and row["ranks"][0]["active_decode_blocks"] == 0
                       for v in views for row in v.values())  # fmt: skip

        await _until(load_is_gone)
        for u in (a, x, c):  # (start_mesh gives the replicas one mesh secret: every message checked)
            stats = (await _json(http, u + "/kvmesh/router"))["sync"]["stats"]
            assert stats["unauthenticated"] == 0 and stats["counted"] > 0, stats


async def test_a_warm_up_a_replica_makes_itself_is_load_in_every_replica() -> None:
    """A speculative prefill is a request no client sent: the replica that starts it tells its peers,
    as it tells them of its decisions, and they count it on the worker it runs on until it ends."""
    async with start_mesh(3, SYNC, MOCK) as nodes, aiohttp.ClientSession() as http:
        a, x, c = (n.url for n in nodes)
        await _following_everyone(http, [a, x, c])
        hints = {"backend_instance_id": x, "agent_hints": {"speculative_prefill": True}}
        body = chat("plan the migration of the billing service, step by step " * 8, nvext=hints)
        async with http.post(a + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["x-kvmesh-worker-id"] == x

        async def warmed() -> bool:  # the turn and its warm-up, both done on x's engine
            return mock_finished(nodes[1].engine) == 2

        async def load_is_gone() -> bool:
            views = [await _load(http, r) for r in (a, x, c)]
            return all(row["active_requests"] == 0 for v in views for row in v.values())

        async def c_counted_both() -> bool:  # the turn a routed, then the warm-up a sent after it
            stats = (await _json(http, c + "/kvmesh/router"))["sync"]["stats"]
            return bool(stats["counted"] == 2)

        await _until(warmed)
        await _until(c_counted_both)
        await _until(load_is_gone)  # and each counted until it ended


async def test_without_replica_sync_other_replicas_see_only_their_own_load() -> None:
    async with start_mesh(3, RouterConfig(), MOCK) as nodes, aiohttp.ClientSession() as http:
        a, x, c = (n.url for n in nodes)
        doc = await _json(http, a + "/kvmesh/router")
        assert doc["replica_sync"] is False and doc["router_sync_endpoint"] is None
        async with contextlib.AsyncExitStack() as stack:
            streams = await _burst(http, stack, a, x, 2, max_tokens=100)
            assert (await _load(http, a))[x]["active_requests"] == 2
            assert (await _load(http, c))[x]["active_requests"] == 0
            for s in streams:
                await s.read()


@dataclass
class _PeerAndFront:
    """A standalone router over two test engines (``w0`` and ``w1``) that follows one peer, a plain
    ZMQ PUB socket speaking the sync protocol as replica ``peer-router``."""

    peer: str
    front: str
    e0: str
    e1: str
    http: aiohttp.ClientSession
    publish: Callable[..., bytes]
    """Send a message as the peer (sealed with ``secret=`` when given); returns the frame sent."""
    send: Callable[[bytes], None]
    """Send a frame as it is (a replay)."""

    async def router_doc(self) -> dict[str, Any]:
        return dict(await _json(self.http, self.front + "/kvmesh/router"))

    async def load(self) -> dict[str, dict[str, Any]]:
        return await _load(self.http, self.front)


@contextlib.asynccontextmanager
async def _front_following_a_peer(
    host: str = "127.0.0.1", mesh_secret: str | None = None
) -> AsyncIterator[_PeerAndFront]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    peer = ctx.socket(zmq.PUB)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.IPV6, host.startswith("["))
    port = peer.bind_to_random_port(f"tcp://{host}")
    seq = 0

    def publish(message: Any, secret: str | None = None) -> bytes:
        nonlocal seq
        seq += 1
        frame = encode(Envelope("peer-router", 7, seq, message))
        if secret is not None:
            frame = seal(sync_key(secret), frame)
        peer.send(frame)
        return frame

    try:
        async with serve(engine_app(EngineState("e0"))) as e0, serve(engine_app(EngineState("e1"))) as e1:
            settings = MeshSettings(
                workers=(WorkerSpec(e0.url, "w0"), WorkerSpec(e1.url, "w1")),
                router=RouterConfig(use_kv_events=False, router_replica_sync=True),
                sync_peers=(f"tcp://{host}:{port}",),
                sync_endpoint=f"tcp://{host}:0",
                health_interval=0.1,
                mesh_secret=mesh_secret,
            )
            async with serve(build_router_app(settings)) as front, aiohttp.ClientSession() as http:
                yield _PeerAndFront(
                    f"tcp://{host}:{port}", front.url, e0.url, e1.url, http, publish, peer.send
                )
    finally:
        peer.close(linger=0)


async def test_a_standalone_replica_follows_a_configured_peer_and_drops_it_when_it_goes_silent() -> None:
    """A peer speaking the sync protocol on a plain ZMQ socket: its decisions become load in the
    router's view; a heartbeat that no longer lists one frees it; silence drops the rest."""
    async with _front_following_a_peer() as m:
        doc = await m.router_doc()
        assert doc["router_sync_endpoint"].startswith("tcp://127.0.0.1:")
        assert doc["sync"]["following"] == [m.peer]
        hashes = list(range(1000, 1040))

        async def peer_known() -> bool:
            m.publish(Heartbeat([]))  # the SUB connects asynchronously: repeat until heard
            return any(p["replica"] == "peer-router" for p in (await m.router_doc())["sync"]["peers"])

        async def two_on_w0() -> bool:
            m.publish(Heartbeat(["p-1", "p-2"]))
            return bool((await m.load())[m.e0]["active_requests"] == 2)

        await _until(peer_known)
        m.publish(Routed("p-1", "w0", 0, hashes, 640, 0))
        m.publish(Routed("p-2", "w0", 0, hashes, 640, 0))
        m.publish(Routed("p-3", "nobody", 0, hashes, 640, 0))  # not a worker here: ignored
        await _until(two_on_w0)
        # the router's own choice avoids w0 now
        for i in range(3):
            async with m.http.post(m.front + "/v1/chat/completions", json=chat(f"q{i} " * 40)) as r:
                assert r.status == 200
                assert r.headers["x-kvmesh-worker-id"] == "w1"
        m.publish(Heartbeat(["p-1"]))  # p-2's Freed was lost; the heartbeat says it is gone

        async def one_left() -> bool:
            return bool((await m.load())[m.e0]["active_requests"] == 1)

        await _until(one_left)
        # the peer falls silent: after its timeout its requests are dropped

        async def peer_dropped() -> bool:
            sync = (await m.router_doc())["sync"]
            return bool(
                sync["stats"]["peers_expired"] == 1 and (await m.load())[m.e0]["active_requests"] == 0
            )

        await _until(peer_dropped)
        stats = (await m.router_doc())["sync"]["stats"]
        assert stats["unknown_worker"] == 1
        assert stats["reconciled"] == 1
        assert stats["counted"] == 2


@needs_ipv6_loopback
async def test_replicas_follow_each_other_over_ipv6() -> None:
    """ZMQ sockets speak IPv4 alone unless told: the sync endpoint ``tcp://[::1]:0`` was refused
    at start ("No such device"), and a peer at an IPv6 address was never heard."""
    async with _front_following_a_peer("[::1]") as m:
        doc = await m.router_doc()
        assert doc["router_sync_endpoint"].startswith("tcp://[::1]:")

        async def peer_known() -> bool:
            m.publish(Heartbeat([]))
            return any(p["replica"] == "peer-router" for p in (await m.router_doc())["sync"]["peers"])

        await _until(peer_known)


async def test_a_peer_message_with_a_value_no_replica_sends_is_dropped_as_malformed() -> None:
    """A session bound through a peer with a NaN or infinite timeout never expired: requests of
    that session kept going to its worker, however loaded. Such a message, and a decision with a
    negative length, is counted as malformed and changes nothing; a sane bind still holds."""
    async with _front_following_a_peer() as m:

        async def stats() -> dict[str, Any]:
            return dict((await m.router_doc())["sync"]["stats"])

        async def peer_known() -> bool:
            m.publish(Heartbeat(["p-1", "p-2"]))  # the SUB connects asynchronously
            return bool((await stats())["received"] > 0)

        await _until(peer_known)
        m.publish(Session("nan", "w0", 0, float("nan")))
        m.publish(Session("inf", "w0", 0, float("inf")))
        m.publish(Session("zero", "w0", 0, 0.0))
        m.publish(Routed("p-0", "w1", 0, list(range(40)), -640, 0))
        m.publish(Session("sane", "w0", 0, 60.0))
        m.publish(Routed("p-1", "w0", 0, list(range(1000, 1040)), 640, 0))
        m.publish(Routed("p-2", "w0", 0, list(range(1000, 1040)), 640, 0))

        async def two_on_w0() -> bool:
            m.publish(Heartbeat(["p-0", "p-1", "p-2"]))
            return bool((await m.load())[m.e0]["active_requests"] == 2)

        await _until(two_on_w0)
        assert (await stats())["malformed"] == 4
        assert (await m.load())[m.e1]["active_requests"] == 0
        for session, worker in (("sane", "w0"), ("nan", "w1"), ("inf", "w1"), ("zero", "w1")):
            body = chat(f"a question for {session} " * 40, nvext={"session_control": {"session_id": session}})
            async with m.http.post(m.front + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                assert r.headers["x-kvmesh-worker-id"] == worker, session


async def test_with_a_mesh_secret_only_sealed_messages_are_heard_and_a_replay_counts_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A party that reached the sync socket (a process at a peer's old address, a configured peer
    that is no replica) could count load on any worker and bind sessions. With a mesh secret,
    a message not sealed with it is dropped, said once; a sealed one already passed is dropped."""
    async with _front_following_a_peer(mesh_secret="s3") as m:

        async def sync() -> dict[str, Any]:
            return dict((await m.router_doc())["sync"])

        async def unsealed_refused() -> bool:
            m.publish(Heartbeat(["p-1"]))  # the SUB connects asynchronously: repeat until heard
            return bool((await sync())["stats"]["unauthenticated"] > 0)

        await _until(unsealed_refused)
        hashes = list(range(1000, 1040))
        m.publish(Routed("p-1", "w0", 0, hashes, 640, 0))
        m.publish(Routed("p-2", "w0", 0, hashes, 640, 0), secret="another secret")
        m.publish(Session("s-1", "w0", 0, 60.0), secret="another secret")
        m.publish(Heartbeat(["p-1", "p-2"]), secret="another secret")

        async def heard() -> bool:
            m.publish(Heartbeat(["p-3"]), secret="s3")
            return bool((await sync())["peers"])

        await _until(heard)
        routed = m.publish(Routed("p-3", "w0", 0, hashes, 640, 0), secret="s3")

        async def one_on_w0() -> bool:
            return bool((await m.load())[m.e0]["active_requests"] == 1)

        await _until(one_on_w0)
        doc = await sync()
        assert doc["sealed"] is True
        assert [p["requests"] for p in doc["peers"]] == [1]  # p-3 alone: the others were not heard
        assert doc["stats"]["counted"] == 1
        assert doc["stats"]["unauthenticated"] >= 5
        # the session bound by the wrong secret is no bind: the router places s-1 on its own
        body = chat("a question " * 40, nvext={"session_control": {"session_id": "s-1"}})
        async with m.http.post(m.front + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["x-kvmesh-worker-id"] == "w1"  # (w0 carries p-3)
        m.publish(Freed("p-3"), secret="s3")

        async def none_on_w0() -> bool:
            return bool((await m.load())[m.e0]["active_requests"] == 0)

        await _until(none_on_w0)
        m.send(routed)  # a replay of the decision, proof and all
        m.publish(Heartbeat([]), secret="s3")

        async def replay_dropped() -> bool:
            return bool((await sync())["stats"]["duplicates"] == 1)

        await _until(replay_dropped)
        assert (await m.load())[m.e0]["active_requests"] == 0
        stats = (await sync())["stats"]
        assert stats["counted"] == 1
        # the same counts in the Prometheus exposition, beside the peers heard
        replica = (await m.router_doc())["replica"]
        async with m.http.get(m.front + "/metrics") as r:
            exposition = await r.text()
        samples = {
            (s.name, s.labels.get("kind")): s.value
            for family in text_string_to_metric_families(exposition)
            for s in family.samples
            if s.labels.get("replica") == replica
        }
        for kind in ("unauthenticated", "duplicates", "counted"):
            assert samples[("kvmesh_replica_sync_messages_total", kind)] == stats[kind], kind
        assert samples[("kvmesh_replica_sync_peers", None)] == 1
    refusals = [
        r.getMessage() for r in caplog.records if "replica sync: dropping a message" in r.getMessage()
    ]
    assert len(refusals) == 2, refusals  # once per reason: unsealed, then a wrong proof
    assert "(unsealed)" in refusals[0] and "(bad proof)" in refusals[1]


async def test_without_a_mesh_secret_a_sealed_message_is_refused_naming_the_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Replicas whose secrets differ hear nothing of each other; one without a secret says which
    setting it lacks rather than counting the messages as malformed."""
    async with _front_following_a_peer() as m:

        async def refused() -> bool:
            m.publish(Heartbeat([]), secret="s3")
            return bool((await m.router_doc())["sync"]["stats"]["unauthenticated"] > 0)

        await _until(refused)
        m.publish(Routed("p-1", "w0", 0, list(range(40)), 640, 0), secret="s3")
        doc = (await m.router_doc())["sync"]
        assert doc["sealed"] is False and doc["peers"] == []
        assert doc["stats"]["malformed"] == 0
        assert (await m.load())[m.e0]["active_requests"] == 0
    assert any("set KVMESH_MESH_SECRET" in r.getMessage() for r in caplog.records)


async def test_replicas_on_nats_hear_each_other_only_with_the_same_mesh_secret() -> None:
    """On the NATS event plane every replica listens on every other's subject: a replica with
    another secret (or a stray publisher) was heard as a replica."""
    with nats_server() as node:
        async with (
            serve(engine_app(EngineState("e0", hold=3.0))) as e0,
            serve(engine_app(EngineState("e1"))) as e1,
            aiohttp.ClientSession() as http,
            contextlib.AsyncExitStack() as stack,
        ):

            def replica(secret: str) -> MeshSettings:
                return MeshSettings(
                    workers=(WorkerSpec(e0.url, "w0"), WorkerSpec(e1.url, "w1")),
                    router=RouterConfig(use_kv_events=False, router_replica_sync=True),
                    event_plane=node.url,
                    health_interval=0.1,
                    mesh_secret=secret,
                )

            a, b, c = [
                (await stack.enter_async_context(serve(build_router_app(replica(s))))).url
                for s in ("s3", "s3", "another secret")
            ]

            async def heard(via: str) -> bool:
                return bool((await _json(http, via + "/kvmesh/router"))["sync"]["peers"])

            async def b_hears_a_and_c_refuses() -> bool:
                stats = (await _json(http, c + "/kvmesh/router"))["sync"]["stats"]
                return await heard(b) and stats["unauthenticated"] > 0

            await _until(b_hears_a_and_c_refuses, timeout=15.0)
            body = chat("a long prefill " * 30, nvext={"backend_instance_id": "w0"})
            sent = asyncio.ensure_future(http.post(a + "/v1/chat/completions", json=body))

            async def b_counts_it() -> bool:
                return bool((await _load(http, b))[e0.url]["active_requests"] == 1)

            await _until(b_counts_it)
            assert (await _load(http, c))[e0.url]["active_requests"] == 0
            assert not await heard(c)
            async with await sent as r:
                assert r.status == 200
                assert r.headers["x-kvmesh-worker-id"] == "w0"


def test_sync_settings_from_env_and_flags() -> None:
    env = {
        "KVMESH_ROUTER_REPLICA_SYNC": "true",
        "KVMESH_SYNC_ENDPOINT": "tcp://127.0.0.1:5600",
        "KVMESH_SYNC_PEERS": "tcp://127.0.0.1:5601, tcp://127.0.0.1:5602",
    }
    s = MeshSettings.load(env)
    assert s.router.router_replica_sync is True
    assert s.sync_endpoint == "tcp://127.0.0.1:5600"
    assert s.sync_peers == ("tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    RouterConfig.add_arguments(parser)
    args = parser.parse_args(
        ["--router-replica-sync", "--router-sync-endpoint", "tcp://127.0.0.1:*",
         "--router-sync-peers", "tcp://127.0.0.1:7001"]
    )  # fmt: skip
    s = MeshSettings.load({}, args)
    assert (s.router.router_replica_sync, s.sync_endpoint, s.sync_peers) == (
        True, "tcp://127.0.0.1:*", ("tcp://127.0.0.1:7001",)
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"KVMESH_SYNC_ENDPOINT 'http://x:1' must look like tcp://host:port"
    ):
        MeshSettings.load({"KVMESH_SYNC_ENDPOINT": "http://x:1"})
