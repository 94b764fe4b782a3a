"""The limits on what one client can make the router hold: sessions in total and per client, and
cache_control pins per worker. Each refusal is a 429 naming the field, and frees what it took."""

from __future__ import annotations

from typing import Any

import aiohttp

from kvmesh.router.core.config import RouterConfig
from tests.router.fleet import chat, fleet


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


def _session(sid: str) -> dict[str, Any]:
    return {"session_control": {"session_id": sid, "action": "open"}}


async def _load(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/kvmesh/workers") as r:
        return sum(row["active_requests"] for row in (await r.json())["workers"])


async def test_sessions_per_client_are_bounded(http: aiohttp.ClientSession) -> None:
    config = RouterConfig(use_kv_events=False, router_max_sessions_per_client=2)
    async with fleet(1, router=config) as (front, _, _):
        for sid in ("a", "b"):
            assert (await _post(http, front.url, chat("hi", nvext=_session(sid))))[0] == 200
        status, doc = await _post(http, front.url, chat("hi", nvext=_session("c")))
        assert status == 429 and doc["error"]["param"] == "nvext.session_control"
        assert "this client holds its maximum of 2 sessions" in doc["error"]["message"]
        # a session it holds still routes; closing one makes room
        assert (await _post(http, front.url, chat("hi", nvext=_session("a"))))[0] == 200
        close = {"session_control": {"session_id": "b", "action": "close"}}
        assert (await _post(http, front.url, chat("hi", nvext=close)))[0] == 200
        assert (await _post(http, front.url, chat("hi", nvext=_session("c"))))[0] == 200
        assert await _load(http, front.url) == 0


async def test_sessions_in_total_are_bounded(http: aiohttp.ClientSession) -> None:
    config = RouterConfig(use_kv_events=False, router_max_sessions=1)
    async with fleet(1, router=config) as (front, _, _):
        assert (await _post(http, front.url, chat("hi", nvext=_session("a"))))[0] == 200
        status, doc = await _post(http, front.url, chat("hi", nvext=_session("b")))
        assert status == 429 and "maximum of 1 sessions" in doc["error"]["message"]


async def test_pins_per_worker_are_bounded(http: aiohttp.ClientSession) -> None:
    config = RouterConfig(use_kv_events=False, router_max_pins_per_worker=1, enable_cache_control=True)
    pin = {"cache_control": {"type": "ephemeral", "ttl": "5m"}}
    async with fleet(1, router=config) as (front, states, _):
        assert (await _post(http, front.url, chat("hi", nvext=pin)))[0] == 200
        status, doc = await _post(http, front.url, chat("again", nvext=pin))
        assert status == 429 and doc["error"]["param"] == "nvext.cache_control"
        assert len(states[0].received) == 1  # the refused request never reached the engine
        assert (await _post(http, front.url, chat("no pin")))[0] == 200
        assert await _load(http, front.url) == 0
