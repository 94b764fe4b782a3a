"""The mock's worker RPCs under /kvmesh/: info, kv_state, pin_prefix, session_control, admin token."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import httpx
import pytest

from kvmesh.mock.testing import RunningMock, run_mock

pytestmark = pytest.mark.e2e

BS = 8


def _prompt(tag: int, n_tokens: int) -> list[int]:
    return [1000 + tag * 1000 + i for i in range(n_tokens)]


async def _complete(http: httpx.AsyncClient, tokens: list[int], **extra: Any) -> dict[str, Any]:
    r = await http.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def _cached_token_sets(http: httpx.AsyncClient) -> set[tuple[int, ...]]:
    state = (await http.get("/kvmesh/kv_state")).json()
    return {tuple(e["token_ids"]) for e in state["ranks"][0]["events"]}


def _blocks(tokens: list[int]) -> set[tuple[int, ...]]:
    return {tuple(tokens[i : i + BS]) for i in range(0, len(tokens) - BS + 1, BS)}


async def _flood(http: httpx.AsyncClient, first_tag: int, count: int) -> None:
    """Fill the cache with unrelated prompts, one after another (forces eviction of free blocks)."""
    for tag in range(first_tag, first_tag + count):
        await _complete(http, _prompt(tag, 6 * BS))


async def test_info_describes_the_worker() -> None:
    async with (
        run_mock(
            block_size=BS, num_blocks=32, max_num_batched_tokens=512, scheduling_policy="priority"
        ) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        info = (await http.get("/kvmesh/info")).json()
    assert info == {
        "backend": "mock",
        "model": "kvmesh-mock",
        "block_size": BS,
        "dp_size": 1,
        "kv_events_endpoints": [mock.events_endpoint],
        "kv_replay_endpoints": [mock.replay_endpoint],
        "max_num_batched_tokens": 512,
        "total_kv_blocks": 32,
        "priority_polarity": "lower_first",
        "max_model_len": 32 * BS,
        "role": "aggregated",
        "tokens_api": True,
    }
    assert mock.events_endpoint is not None and mock.events_endpoint.startswith("tcp://127.0.0.1:")
    assert not mock.events_endpoint.endswith(":0")


async def test_kv_state_lists_cached_blocks_parents_first() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=32, speedup=50) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        empty = (await http.get("/kvmesh/kv_state")).json()
        assert empty == {"block_size": BS, "ranks": [{"dp_rank": 0, "last_seq": None, "events": []}]}
        tokens = _prompt(1, 3 * BS + 2)
        await _complete(http, tokens)
        state = (await http.get("/kvmesh/kv_state")).json()
        rank = state["ranks"][0]
        assert rank["last_seq"] == 0
        events = rank["events"]
        assert [e["token_ids"] for e in events] == [tokens[i : i + BS] for i in range(0, 3 * BS, BS)]
        assert events[0]["parent_block_hash"] is None
        for parent, child in itertools.pairwise(events):
            assert child["parent_block_hash"] == parent["block_hashes"][0]
        assert all(
            e["type"] == "BlockStored" and e["medium"] == "GPU" and e["block_size"] == BS for e in events
        )
        assert all(0 <= e["block_hashes"][0] < 2**64 for e in events)


async def test_pinned_prefix_survives_cache_pressure_until_its_ttl() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=32, speedup=50, pin_budget=0.5) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        pinned = _prompt(1, 5 * BS)
        unpinned = _prompt(2, 5 * BS)
        await _complete(http, pinned)
        await _complete(http, unpinned)
        r = await http.post("/kvmesh/pin_prefix", json={"token_ids": pinned, "ttl_seconds": 1.0})
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["blocks_pinned"] == 5

        await _flood(http, 10, 12)
        cached = await _cached_token_sets(http)
        assert _blocks(pinned) <= cached
        assert not (_blocks(unpinned) & cached)  # the same pressure evicted what was not pinned
        again = await _complete(http, pinned)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS

        await asyncio.sleep(1.1)
        await _flood(http, 30, 12)
        assert not (_blocks(pinned) & await _cached_token_sets(http))


async def test_a_token_id_a_block_hash_cannot_take_is_a_400_naming_token_ids() -> None:
    """A block hash takes token ids as 32 bits: a full block ending in 2**53 + 1 (found by `make
    fuzz`) was an OverflowError out of the mock's hashing, a 500."""
    async with (
        run_mock(block_size=BS, num_blocks=32, speedup=50) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        for last in (2**32, 2**53 + 1):
            r = await http.post(
                "/kvmesh/pin_prefix", json={"token_ids": [0] * (BS - 1) + [last], "ttl_seconds": 1}
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "token_ids"
        top = await http.post("/kvmesh/pin_prefix", json={"token_ids": [2**32 - 1] * BS, "ttl_seconds": 1})
        assert top.status_code == 200, top.text


async def test_the_pin_budget_caps_what_can_be_pinned() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=32, speedup=50, pin_budget=0.25) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        first, second = _prompt(1, 5 * BS), _prompt(2, 5 * BS)
        await _complete(http, first)
        await _complete(http, second)
        ok = await http.post("/kvmesh/pin_prefix", json={"token_ids": first, "ttl_seconds": 30})
        assert ok.json()["blocks_pinned"] == 5
        # re-pinning the same prefix costs nothing more
        assert (
            await http.post("/kvmesh/pin_prefix", json={"token_ids": first, "ttl_seconds": 30})
        ).status_code == 200
        over = await http.post("/kvmesh/pin_prefix", json={"token_ids": second, "ttl_seconds": 30})
        assert over.status_code == 409
        assert over.json()["error"]["message"] == (
            "pin budget exceeded: pinning 5 more blocks would retain 10 of 32 blocks; the limit is 8 (--pin-budget)"
        )
        bad = await http.post("/kvmesh/pin_prefix", json={"token_ids": first, "ttl_seconds": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl_seconds"
        bad = await http.post("/kvmesh/pin_prefix", json={"token_ids": "abc", "ttl_seconds": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "token_ids"


async def _open(http: httpx.AsyncClient, session_id: str, timeout: float) -> dict[str, Any]:
    r = await http.post(
        "/kvmesh/session_control",
        json={"action": "open_session", "session_id": session_id, "timeout": timeout},
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_an_open_session_retains_its_prefix_and_closes_on_timeout() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=32, speedup=50) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        opened = await _open(http, "agent-1", 0.8)
        assert opened == {
            "status": "ok",
            "session_id": "agent-1",
            "action": "open_session",
            "created": True,
            "timeout": 0.8,
        }
        turn = _prompt(1, 5 * BS)
        await _complete(http, turn, session_params={"id": "agent-1"})
        await _flood(http, 10, 12)
        assert _blocks(turn) <= await _cached_token_sets(http)
        assert mock.engine.retention.num_retained == 5

        await asyncio.sleep(0.9)
        await _flood(http, 30, 12)
        assert "agent-1" not in mock.engine.retention.sessions
        assert mock.engine.retention.num_retained == 0
        assert not (_blocks(turn) & await _cached_token_sets(http))


async def test_closing_a_session_releases_it() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=32, speedup=50) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        await _open(http, "s", 60)
        again = await _open(http, "s", 60)
        assert again["created"] is False
        await _complete(http, _prompt(1, 4 * BS), nvext={"session_control": {"session_id": "s"}})
        assert mock.engine.retention.num_retained == 4
        close = {"action": "close_session", "session_id": "s"}
        assert (await http.post("/kvmesh/session_control", json=close)).json()["closed"] is True
        assert (await http.post("/kvmesh/session_control", json=close)).json()["closed"] is False
        assert mock.engine.retention.num_retained == 0
        bad = await http.post("/kvmesh/session_control", json={"action": "pause", "session_id": "s"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "action"


async def test_reset_prefix_cache_publishes_all_blocks_cleared() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=32, speedup=50) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        await _complete(http, _prompt(1, 3 * BS))
        assert (await http.post("/kvmesh/reset_prefix_cache")).json() == {"status": "ok"}
        state = (await http.get("/kvmesh/kv_state")).json()["ranks"][0]
        assert state["events"] == [] and state["last_seq"] == 1


async def _admin_statuses(mock: RunningMock, headers: dict[str, str]) -> list[int]:
    async with httpx.AsyncClient(base_url=mock.base_url, headers=headers) as http:
        return [
            (await http.get("/kvmesh/info")).status_code,
            (await http.get("/kvmesh/kv_state")).status_code,
            (await http.post("/kvmesh/pin_prefix", json={"token_ids": [1], "ttl_seconds": 1})).status_code,
            (
                await http.post(
                    "/kvmesh/session_control", json={"action": "close_session", "session_id": "x"}
                )
            ).status_code,
        ]


async def test_the_admin_token_guards_the_worker_rpcs() -> None:
    async with run_mock(block_size=BS, num_blocks=32, speedup=50, admin_token="s3cret") as mock:
        assert await _admin_statuses(mock, {}) == [401] * 4
        assert await _admin_statuses(mock, {"authorization": "Bearer wrong"}) == [401] * 4
        assert await _admin_statuses(mock, {"authorization": "Bearer s3cret"}) == [200] * 4
        assert await _admin_statuses(mock, {"x-kvmesh-admin-token": "s3cret"}) == [200] * 4
        async with httpx.AsyncClient(base_url=mock.base_url) as http:
            r = await http.get("/kvmesh/info")
            assert r.json()["error"]["type"] == "AuthenticationError"
            # the OpenAI API itself is not guarded
            assert (
                await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            ).status_code == 200
    async with run_mock(block_size=BS, num_blocks=32, speedup=50) as open_mock:
        assert await _admin_statuses(open_mock, {}) == [200] * 4
