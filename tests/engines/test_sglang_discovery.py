"""An SGLang 0.5.23 server without kvmesh's adapter behind the standalone router, told only its URL
(engine tier; kvmesh/router/mesh/engine_discovery.py).

What is SGLang's own here: the server arguments (its ``prepare_server_args``), the ``/server_info``
body its route builds from them (``build_server_info``, with its ``kv_events`` description of the
publisher for KV-aware routers), and the KV events (its ``ZmqEventPublisher``, bound to every
interface, publishing the batches of ``test_events_sglang``). What is not: the model, and the rest
of the server (the route's body is served by a small app, as SGLang's route returns it).

Run inside the env from ``scripts/engine-env.sh sglang`` (``make test-engines``).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.engine_discovery import described_sglang
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.engines import sglang_env
from tests.engines.enginekit import router_rows, until_indexed, until_up
from tests.engines.test_events_sglang import PAGE, sglang, sglang_publisher  # noqa: F401
from tests.events.eventkit import free_tcp_port
from tests.router.servers import serve

pytestmark = [pytest.mark.engine_sglang, pytest.mark.timeout(300)]


def server_info(*argv: str, scheduler_info: dict[str, Any]) -> Any:
    """SGLang's ``/server_info`` body for a server launched with ``argv``: its route's own builder
    over its own parsed arguments, made plain data as the route makes it."""
    sglang_env.prepare()
    server_args = sglang_env.engine("sglang.srt.server_args")
    common = sglang_env.engine("sglang.srt.utils.common")
    args = server_args.prepare_server_args(["--model-path", "dummy", *argv])
    body = common.build_server_info(args, scheduler_info)
    return json.loads(json.dumps(body, default=str))  # (what the route's JSON answer reads back as)


def test_sglangs_description_of_two_ranks_is_read_as_the_adapter_reports_them() -> None:
    config = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567"}
    info = server_info(
        *("--page-size", "16", "--dp-size", "2", "--chunked-prefill-size", "4096"),
        *("--enable-priority-scheduling", "--served-model-name", "served"),
        *("--kv-events-config", json.dumps(config)),
        scheduler_info={"max_total_num_tokens": 32000},
    )
    facts = described_sglang(info, "http://10.0.0.9:30000")
    assert facts == {
        "backend": "sglang",
        "block_size": 16,
        "dp_size": 2,
        "kv_events_endpoints": ["tcp://10.0.0.9:5557", "tcp://10.0.0.9:5558"],
        "kv_replay_endpoints": ["tcp://10.0.0.9:5567", "tcp://10.0.0.9:5568"],
        "priority_polarity": "higher_first",
        "total_kv_blocks": 2000,
        "max_num_batched_tokens": 4096,
        "model": "served",
    }


def test_without_kv_events_sglang_is_told_how_to_start() -> None:
    info = server_info("--page-size", "16", scheduler_info={"max_total_num_tokens": 32000})
    assert info["kv_events"] is None
    with pytest.raises(Exception, match="--kv-events-config"):
        described_sglang(info, "http://h:1")


def chained_pages(sglang: SimpleNamespace, count: int) -> list[Any]:  # noqa: F811
    """``count`` batches of one page each, as SGLang's radix cache records a growing prefix: each
    page's parent is the page before it."""
    kv = sglang.kv_events
    batches, tip = [], None
    for n in range(count):
        page_hash = 1000 + n
        page = kv.BlockStored(
            block_hashes=[page_hash],
            parent_block_hash=tip,
            token_ids=[7 * n + t for t in range(PAGE)],
            block_size=PAGE,
            lora_id=None,
        )
        batches.append(kv.KVEventBatch(ts=1.8e9 + n, events=[page], attn_dp_rank=0))
        tip = page_hash
    return batches


async def test_a_plain_sglang_told_by_url_is_followed_through_its_own_publisher(
    sglang: SimpleNamespace,  # noqa: F811
) -> None:
    """The router reads the publisher from SGLang's ``/server_info`` description (a wildcard
    host, dialled at the worker's) and follows SGLang's publisher: every page is indexed, those
    sent before it joined through SGLang's replay socket."""
    pub, replay = free_tcp_port(), free_tcp_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    info = server_info(
        "--page-size", str(PAGE), "--kv-events-config", json.dumps(config),
        scheduler_info={"max_total_num_tokens": 64 * PAGE},
    )  # fmt: skip
    app = Starlette(
        routes=[
            Route("/server_info", lambda _: JSONResponse(info)),
            Route("/health", lambda _: Response(status_code=200)),
        ]
    )
    batches = chained_pages(sglang, 60)
    with sglang_publisher(sglang, config["endpoint"], config["replay_endpoint"]) as publisher:
        for batch in batches[:20]:  # (before any router listens)
            publisher.publish(batch)
        async with serve(app) as engine:
            settings = MeshSettings(workers=(WorkerSpec(engine.url, "plain"),), health_interval=0.1)
            async with serve(build_router_app(settings)) as front:
                await until_up(front.url, engine.url)
                row = (await router_rows(front.url))[engine.url]
                assert (row["backend"], row["block_size"], row["dp_size"]) == ("sglang", PAGE, 1), row
                assert row["kv_events_endpoints"] == [f"tcp://127.0.0.1:{pub}"], row
                assert row["described_by"] == "/server_info", row
                for batch in batches[20:]:
                    publisher.publish(batch)
                row = await until_indexed(front.url, engine.url, len(batches))
                assert row["indexed_blocks"] == len(batches), row
