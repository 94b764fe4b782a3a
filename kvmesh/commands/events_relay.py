"""``kvmesh events relay ENDPOINT... --nats nats://...``: an engine's ZMQ KV events into NATS.

Runs until SIGINT / SIGTERM (or ``--duration``), then stores what is queued, deletes the engine's
registration and prints one summary line on stderr. Exit status: 0, or 2 for a bad argument or
an endpoint that cannot be opened.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any

from kvmesh.commands.argtypes import connect_endpoint, http_url, positive_float, positive_int
from kvmesh.commands.engine_facts import event_endpoints, read_engine
from kvmesh.commands.exits import run_async
from kvmesh.errors import ConfigError
from kvmesh.events.nats_link import MAX_REPLICAS, MAX_SECONDS, NatsOptions, parse_event_plane

# Facts a registration may carry (the keys of a [[workers]] table besides url / id / endpoints).
_INT_FACTS = ("block_size", "max_num_batched_tokens", "total_kv_blocks", "bootstrap_port")
_STR_FACTS = ("backend", "model", "priority_polarity", "role")
_BOOL_FACTS = ("tokens_api",)


def add_parser(actions: Any) -> None:
    relay = actions.add_parser(
        "relay",
        help="republish an engine's ZMQ KV-event stream into the NATS event plane",
        description="Follow an engine's own ZMQ KV-event publisher (vLLM, SGLang, TRT-LLM bridge, "
        "KvEventPublisher), repairing gaps through its replay socket, and store every batch in the "
        "NATS JetStream event stream with the engine's sequence numbers and DP rank. With --register "
        "the engine is also registered in the worker bucket, its events pointing at NATS.",
    )
    relay.add_argument(
        "endpoints",
        nargs="*",
        type=connect_endpoint,
        metavar="ENDPOINT",
        help="the engine's PUB endpoint(s), one per data-parallel rank in rank order "
        "(e.g. tcp://10.0.0.1:5557 tcp://10.0.0.1:5558 for dp 2); none with --register URL: read "
        "from the engine, with its replay endpoints (its /kvmesh/info, or a stock vLLM's "
        "/kv_event_sources or SGLang's /server_info)",
    )
    relay.add_argument(
        "--replay-endpoint",
        action="append",
        type=connect_endpoint,
        default=[],
        metavar="E",
        help="the engine's ROUTER replay endpoint, once per ENDPOINT in the same order; without it a "
        "missed batch cannot be recovered and routers re-sync that rank from kv_state",
    )
    relay.add_argument(
        "--nats",
        required=True,
        metavar="URLS",
        help="the NATS servers, nats://host:4222[,nats://host2:4222] (tls:// for TLS)",
    )
    relay.add_argument(
        "--name",
        help="the publisher name in the subjects <prefix>.events.<name>.<rank> (default: the --register "
        "URL; required without it)",
    )
    relay.add_argument("--topic", default="", metavar="T", help="only batches whose topic starts with T")
    relay.add_argument(
        "--buffer-batches",
        type=positive_int,
        default=10_000,
        metavar="N",
        help="batches kept per rank while NATS is away; beyond that the oldest are dropped [10000]",
    )
    reg = relay.add_argument_group("registration in the worker bucket")
    reg.add_argument(
        "--register",
        type=http_url,
        metavar="URL",
        help="register the engine at URL (its OpenAI server) in the worker bucket, renewed while the "
        "relay runs and deleted when it stops",
    )
    reg.add_argument("--worker-id", metavar="ID", help="the worker id in the bucket (default: the URL)")
    reg.add_argument(
        "--no-engine-info",
        action="store_true",
        help="do not read URL/kvmesh/info (an engine without the kvmesh plugin); give --fact instead",
    )
    reg.add_argument(
        "--fact",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a worker fact for the registration, over what /kvmesh/info says: "
        + ", ".join(_INT_FACTS + _STR_FACTS + _BOOL_FACTS)
        + " (KV routing without /kvmesh/info needs block_size, max_num_batched_tokens, total_kv_blocks;"
        + " tokens_api=true: vLLM serves /inference/v1/generate, started with --enable-scale-out)",
    )
    reg.add_argument(
        "--nats-worker-ttl",
        type=positive_float,
        default=None,
        metavar="S",
        help="the registration's lifetime without renewal; renewed every S/3 seconds [6]",
    )
    auth = relay.add_argument_group("NATS connection and stream (use the routers' values)")
    auth.add_argument(
        "--nats-token", default=os.environ.get("KVMESH_NATS_TOKEN"), help="token [KVMESH_NATS_TOKEN]"
    )
    auth.add_argument(
        "--nats-user", default=os.environ.get("KVMESH_NATS_USER"), help="user [KVMESH_NATS_USER]"
    )
    auth.add_argument(
        "--nats-password",
        default=os.environ.get("KVMESH_NATS_PASSWORD"),
        help="password, with --nats-user [KVMESH_NATS_PASSWORD]",
    )
    auth.add_argument(
        "--nats-creds", default=os.environ.get("KVMESH_NATS_CREDS"), help="a .creds file [KVMESH_NATS_CREDS]"
    )
    auth.add_argument("--nats-tls-ca", metavar="FILE", help="CA bundle to verify the server")
    auth.add_argument("--nats-tls-cert", metavar="FILE", help="client certificate (with --nats-tls-key)")
    auth.add_argument("--nats-tls-key", metavar="FILE", help="client key (with --nats-tls-cert)")
    auth.add_argument(
        "--nats-prefix", default="kvmesh", help="first subject token: letters, digits, _ and - [kvmesh]"
    )
    auth.add_argument(
        "--nats-stream-max-age",
        type=positive_float,
        default=600.0,
        metavar="S",
        help="seconds a batch stays replayable in the stream [600]",
    )
    auth.add_argument(
        "--nats-stream-max-bytes", type=positive_int, default=1 << 30, metavar="N", help="stream size [1 GiB]"
    )
    auth.add_argument(
        "--nats-replicas",
        type=positive_int,
        default=1,
        metavar="N",
        help=f"JetStream replicas, at most {MAX_REPLICAS} [1]",
    )
    relay.add_argument(
        "--duration", type=positive_float, metavar="S", help="stop after S seconds (default: until a signal)"
    )
    relay.set_defaults(_run=run)


def run(args: argparse.Namespace) -> int:
    return run_async("kvmesh events relay", _relay(args))


def _options(args: argparse.Namespace) -> NatsOptions:
    servers = parse_event_plane(args.nats)
    if not servers:
        raise ConfigError("--nats must name NATS servers (nats://host:port[,...])")
    return NatsOptions(
        servers,
        token=args.nats_token,
        user=args.nats_user,
        password=args.nats_password,
        creds_file=args.nats_creds,
        tls_ca=args.nats_tls_ca,
        tls_cert=args.nats_tls_cert,
        tls_key=args.nats_tls_key,
        prefix=args.nats_prefix,
        stream_max_age=args.nats_stream_max_age,
        stream_max_bytes=args.nats_stream_max_bytes,
        stream_replicas=args.nats_replicas,
    )


def parse_facts(items: list[str]) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--fact {item!r} must be KEY=VALUE")
        if key in _INT_FACTS:
            try:
                number = int(value)
            except ValueError:
                number = 0
            if number <= 0:
                raise ConfigError(f"--fact {key} must be a positive integer, got {value!r}")
            facts[key] = number
        elif key in _STR_FACTS:
            facts[key] = value
        elif key in _BOOL_FACTS:
            if value not in ("true", "false"):
                raise ConfigError(f"--fact {key} must be true or false, got {value!r}")
            facts[key] = value == "true"
        else:
            known = ", ".join(_INT_FACTS + _STR_FACTS + _BOOL_FACTS)
            raise ConfigError(f"--fact {key!r} is not one of {known}")
    return facts


async def _relay(args: argparse.Namespace) -> int:
    from kvmesh.events.relay import EventRelay, RelaySource
    from kvmesh.router.mesh.settings import MeshSettings  # (its default registration lifetime)

    options = _options(args)  # its limits before anything is read or opened
    ttl = MeshSettings.nats_worker_ttl if args.nats_worker_ttl is None else args.nats_worker_ttl
    if ttl > MAX_SECONDS:
        raise ConfigError(f"--nats-worker-ttl must be at most {MAX_SECONDS}, got {ttl}")
    registering = args.register is not None
    if not registering and (
        args.worker_id or args.no_engine_info or args.fact or args.nats_worker_ttl is not None
    ):  # (each was taken and changed nothing)
        raise ConfigError(
            "--worker-id, --no-engine-info, --fact and --nats-worker-ttl describe a registration: "
            "add --register URL"
        )
    name = args.name or args.register
    if not name:
        raise ConfigError("give --name (or --register URL, whose URL names the subjects)")
    facts = parse_facts(args.fact)
    told: dict[str, Any] = {}
    where = ""
    if registering and not args.no_engine_info:
        told, where = await read_engine(args.register)
    endpoints, replays = list(args.endpoints), list(args.replay_endpoint)
    if not endpoints:
        if not told:
            raise ConfigError(
                "give the engine's ENDPOINT(s), or --register URL (without --no-engine-info) to read "
                "them from the engine"
            )
        endpoints, found = event_endpoints(told, args.register, where)
        replays = replays or found
    if replays and len(replays) != len(endpoints):
        raise ConfigError(f"give --replay-endpoint once per ENDPOINT ({len(endpoints)}), got {len(replays)}")
    info = {**{k: v for k, v in told.items() if k != "kv_replay_endpoints"}, **facts}
    replays = replays or [None] * len(endpoints)
    sources = [RelaySource(e, r) for e, r in zip(endpoints, replays, strict=True)]
    relay = EventRelay(options, name, sources, topic=args.topic.encode(), buffer_batches=args.buffer_batches)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = relay.start()
    try:
        if registering:
            relay.register(args.worker_id or args.register, args.register, info, ttl=ttl)
        print(
            f"kvmesh events relay: {', '.join(endpoints)} -> {', '.join(relay.nats_endpoints)}",
            file=sys.stderr,
            flush=True,
        )
        waiter = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait(
            {waiter, *tasks}, timeout=args.duration, return_when=asyncio.FIRST_COMPLETED
        )
        waiter.cancel()
        for task in done:
            if task is not waiter:
                task.result()  # a bad endpoint: ConfigError
    finally:
        with contextlib.suppress(Exception):
            await relay.stop()
    print(f"kvmesh events relay: stopped {json.dumps(relay.stats())}", file=sys.stderr, flush=True)
    return 0
