"""HolderSearch on its own: one search per key at a time, a miss remembered for a while."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.router.mesh.holder_search import HolderSearch, SearchCounts, Unanswered


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """A search that answers ``holder`` after ``release`` is set, counting its runs."""

    def __init__(self, holder: str | None = None) -> None:
        self.holder = holder
        self.runs = 0
        self.release = asyncio.Event()
        self.release.set()

    async def search(self) -> str | None:
        self.runs += 1
        await self.release.wait()
        return self.holder


async def test_requests_for_one_key_share_its_search() -> None:
    fleet = Fleet("w2")
    fleet.release.clear()
    search = HolderSearch(clock=Clock())
    waiting = [asyncio.create_task(search.find("response", "r1", fleet.search)) for _ in range(5)]
    other = asyncio.create_task(search.find("response", "r2", fleet.search))
    await asyncio.sleep(0)
    fleet.release.set()
    assert await asyncio.gather(*waiting, other) == ["w2"] * 6
    assert fleet.runs == 2  # (one per key)
    assert search.counts["response"] == SearchCounts(searched=2, found=2, joined=4, remembered=0)
    assert await search.find("response", "r1", fleet.search) == "w2"  # a holder is not kept here
    assert fleet.runs == 3


async def test_a_miss_is_remembered_until_its_time_is_up() -> None:
    clock, fleet = Clock(), Fleet(None)
    search = HolderSearch(miss_memory_s=2.0, clock=clock)
    assert await search.find("session", "s", fleet.search) is None
    clock.now += 1.9
    assert await search.find("session", "s", fleet.search) is None
    assert fleet.runs == 1
    assert await search.find("response", "s", fleet.search) is None  # (another kind: its own)
    assert fleet.runs == 2
    clock.now += 0.2
    fleet.holder = "w1"
    assert await search.find("session", "s", fleet.search) == "w1"
    assert search.counts["session"] == SearchCounts(searched=2, found=1, joined=0, remembered=1)


@pytest.mark.parametrize(
    ("error", "heard"),
    [
        (OSError("unreachable"), OSError),  # (a fault: each waiter gets it)
        (Unanswered("r"), None),  # (a worker did not answer and may hold it: "not found", no miss)
    ],
    ids=["failed", "unanswered"],
)
async def test_a_search_without_an_answer_is_not_remembered(error: Exception, heard: type | None) -> None:
    runs = 0

    async def failing() -> str | None:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0)
        raise error

    search = HolderSearch(clock=Clock())
    results = await asyncio.gather(
        *(search.find("response", "r", failing) for _ in range(3)), return_exceptions=True
    )
    assert [type(r) if heard else r for r in results] == [heard] * 3
    if heard:
        with pytest.raises(heard):
            await search.find("response", "r", failing)
    else:
        assert await search.find("response", "r", failing) is None
    assert runs == 2 and len(search) == 0


async def test_a_caller_leaving_does_not_stop_a_search_another_waits_for() -> None:
    fleet = Fleet("w3")
    fleet.release.clear()
    search = HolderSearch(clock=Clock())
    leaving = asyncio.create_task(search.find("response", "r", fleet.search))
    staying = asyncio.create_task(search.find("response", "r", fleet.search))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.sleep(0)
    fleet.release.set()
    assert await staying == "w3"
    assert leaving.cancelled() and fleet.runs == 1


async def test_misses_kept_are_bounded_oldest_first() -> None:
    fleet = Fleet(None)
    search = HolderSearch(capacity=3, clock=Clock())
    for key in "abcd":
        await search.find("response", key, fleet.search)
    assert len(search) == 3
    await search.find("response", "a", fleet.search)  # (forgotten: searched again)
    await search.find("response", "d", fleet.search)  # (remembered)
    assert fleet.runs == 5
