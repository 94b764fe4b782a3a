"""GET /kvmesh/decisions: the last routing decisions, each with every candidate's cost terms."""

from __future__ import annotations

import aiohttp

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve

TOKEN = {"x-kvmesh-admin-token": "s3cret"}


async def test_the_last_decisions_explain_where_each_request_went() -> None:
    async with (
        run_mock(block_size=16, speedup=50.0) as m0,
        run_mock(block_size=16, speedup=50.0, seed=1) as m1,
        aiohttp.ClientSession() as http,
    ):
        settings = MeshSettings(
            workers=(WorkerSpec(m0.base_url, "m0"), WorkerSpec(m1.base_url, "m1")), admin_token="s3cret"
        )
        async with serve(build_router_app(settings)) as front:
            served = []
            for i in range(3):
                body = {
                    "model": m0.config.model,
                    "messages": [
                        {"role": "user", "content": f"question {i}: " + "why is the sky blue " * 20}
                    ],
                    "max_tokens": 2,
                }
                async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    served.append(r.headers["x-kvmesh-worker-id"])
            async with http.get(front.url + "/kvmesh/decisions?limit=2", headers=TOKEN) as r:
                assert r.status == 200
                doc = await r.json()
            assert doc["cost_model"] == "latency" and doc["block_size"] == 16
            decisions = doc["decisions"]
            assert len(decisions) == 2
            # newest first: the third request, then the second (the router numbers its requests)
            assert [d["worker_id"] for d in decisions] == [served[2], served[1]]
            numbers = [int(d["request_id"].rsplit("-", 1)[-1]) for d in decisions]
            assert numbers[0] == numbers[1] + 1
            assert decisions[0]["age_s"] <= decisions[1]["age_s"]
            for d in decisions:
                assert d["reason"] == "kv"
                assert d["queued_s"] == 0.0  # no admission queue on this router
                candidates = {c["worker_id"]: c for c in d["candidates"]}
                assert set(candidates) == {"m0", "m1"}
                assert [w for w, c in candidates.items() if c["chosen"]] == [d["worker_id"]]
                for c in candidates.values():
                    # the latency cost's terms: its predicted TTFT is part of its cost
                    assert c["predicted_ttft_ms"] > 0
                    terms = (
                        c["predicted_ttft_ms"]
                        + c["eviction_ms"]
                        + c["delay_to_others_ms"]
                        + c["turns_overlap_ms"]
                        - c["copy_credit_ms"]
                    )
                    assert abs(terms - c["cost"]) < 0.01
                    assert c["prefill_tokens"] > 0
                    assert 0.0 <= c["memory_wait_ms"] <= c["predicted_ttft_ms"]
            # the default is 20, and there were 3
            async with http.get(front.url + "/kvmesh/decisions", headers=TOKEN) as r:
                assert len((await r.json())["decisions"]) == 3


async def test_decisions_want_the_admin_token_and_a_sane_limit() -> None:
    async with run_mock(block_size=16, speedup=50.0) as m0, aiohttp.ClientSession() as http:
        settings = MeshSettings(workers=(WorkerSpec(m0.base_url, "m0"),), admin_token="s3cret")
        async with serve(build_router_app(settings)) as front:
            async with http.get(front.url + "/kvmesh/decisions") as r:
                assert r.status == 401
            for bad in ("0", "65", "ten", "-3", "2.5"):
                async with http.get(front.url + "/kvmesh/decisions?limit=" + bad, headers=TOKEN) as r:
                    assert r.status == 400, bad
                    error = (await r.json())["error"]
                    assert error["param"] == "limit" and repr(bad) in error["message"]
            async with http.get(front.url + "/kvmesh/decisions?limit=64", headers=TOKEN) as r:
                assert (r.status, (await r.json())["decisions"]) == (200, [])
