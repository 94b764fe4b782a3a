"""A standalone router on the NATS event plane, over HTTP: workers found in the bucket (mixed with a
static --workers entry), their KV events in the index, NATS lost and back without a failed request."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.events.natskit import nats_server
from tests.router.servers import serve


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as r:
        return await r.json()


async def _rows(http: aiohttp.ClientSession, front: str) -> dict[str, dict[str, Any]]:
    return {row["url"]: row for row in (await _get(http, front + "/kvmesh/workers"))["workers"]}


async def _until(check: Any, what: str, timeout: float = 15.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def _chat(http: aiohttp.ClientSession, front: str, model: str, text: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with http.post(front + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()


async def test_bucket_discovery_events_and_a_nats_outage(http: aiohttp.ClientSession) -> None:
    with nats_server() as node:
        async with (
            run_mock(block_size=16, speedup=50.0) as static,
            run_mock(block_size=16, speedup=50.0, event_plane=node.url, announce_interval=0.3) as found,
        ):
            settings = MeshSettings(
                workers=(WorkerSpec(static.base_url, static.base_url),),
                event_plane=node.url,
                nats_worker_ttl=1.0,
                health_interval=0.2,
            )
            async with serve(build_router_app(settings)) as front:

                async def both_up() -> bool:
                    rows = await _rows(http, front.url)
                    return all(rows.get(m.base_url, {}).get("state") == "up" for m in (static, found))

                await _until(both_up, "the static and the discovered worker are up")
                router = await _get(http, front.url + "/kvmesh/router")
                assert router["event_plane"]["connected"] is True
                assert router["event_plane"]["discovered"] == [found.base_url]

                # Its KV events come through the stream into the index, block for block.
                for i in range(4):
                    await _chat(http, front.url, found.config.model, f"conversation {i} " * 40)

                async def indexed() -> bool:
                    row = (await _rows(http, front.url))[found.base_url]
                    return row["events_applied"] > 0 and row["indexed_blocks"] == len(
                        found.engine.pool.snapshot()
                    )

                await _until(indexed, "the discovered worker's blocks are indexed")

                node.stop()  # NATS goes away: the router says so and keeps routing
                await _until(lambda: _plane_connected(http, front.url, False), "the router reports NATS down")
                health = await _get(http, front.url + "/health")
                assert (
                    health["event_plane"]["connected"] is False
                    and "last known state" in health["event_plane"]["note"]
                )
                async with http.get(front.url + "/metrics") as r:
                    gauge = [
                        ln
                        for ln in (await r.text()).splitlines()
                        if ln.startswith("kvmesh_event_plane_connected{")
                    ]
                assert any('plane="nats"' in ln and ln.endswith(" 0.0") for ln in gauge), gauge
                for i in range(6):  # every request still succeeds, on either worker
                    await _chat(http, front.url, found.config.model, f"while down {i} " * 30)
                assert (await _rows(http, front.url))[found.base_url]["state"] == "up"

                node.start()
                await _until(lambda: _plane_connected(http, front.url, True), "the router reconnects")
                await _chat(http, front.url, found.config.model, "after the outage " * 50)
                await _until(indexed, "events published during and after the outage are indexed")

            # The discovered mock stops: its entry is deleted and it leaves the registry.
        async with serve(build_router_app(MeshSettings(event_plane=node.url, nats_worker_ttl=1.0))) as front:
            async with run_mock(
                block_size=16, speedup=50.0, event_plane=node.url, announce_interval=0.3
            ) as m:

                async def present() -> bool:
                    return m.base_url in await _rows(http, front.url)

                await _until(present, "a worker appears through the bucket")
                url = m.base_url

            async def absent() -> bool:
                return url not in await _rows(http, front.url)

            await _until(absent, "a stopped worker disappears from the registry")


async def _plane_connected(http: aiohttp.ClientSession, front: str, want: bool) -> bool:
    doc = await _get(http, front + "/kvmesh/router")
    return bool(doc["event_plane"]["connected"] is want)


async def test_a_stream_the_server_refuses_is_shown_as_that_not_as_nats_away(
    http: aiohttp.ClientSession,
) -> None:
    """Three replicas asked of a single node: the server refuses the stream. The router had said
    "NATS unreachable" with the refusal only in ``last_error``, and logged nothing."""
    with nats_server() as node:
        settings = MeshSettings(event_plane=node.url, nats_replicas=3)
        async with serve(build_router_app(settings)) as front:

            async def refused() -> bool:
                plane = (await _get(http, front.url + "/kvmesh/router"))["event_plane"]
                return bool(plane.get("stream_problem"))

            await _until(refused, "the router shows the stream's refusal")
            plane = (await _get(http, front.url + "/kvmesh/router"))["event_plane"]
            assert plane["connected"] is False
            assert "replicas" in plane["stream_problem"]
            assert plane["note"].startswith("NATS answers, but the event stream is not ready")
            health = await _get(http, front.url + "/health")
            assert "replicas" in health["event_plane"]["stream_problem"]
