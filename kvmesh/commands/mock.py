"""``kvmesh mock --port P``: a simulated OpenAI-compatible engine that publishes real KV events."""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.commands.argtypes import bind_endpoint, listen_host, log_level, port
    from kvmesh.mock.config import DEFAULT_MODEL, MAX_NUM_BLOCKS, MockConfig

    d = MockConfig()
    parser.add_argument(
        "--host",
        type=listen_host,
        default="127.0.0.1",
        help="address to listen on; only this one is bound [%(default)s]",
    )
    parser.add_argument(
        "--port", type=port, default=8000, help="HTTP port of the OpenAI-compatible API [%(default)s]"
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="model name to serve and to expect in requests [%(default)s]"
    )
    parser.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens per KV block [%(default)s]"
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=d.num_blocks,
        help=f"KV blocks in the simulated cache, at most {MAX_NUM_BLOCKS} [%(default)s]",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once [%(default)s]"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of one step; longer prompts are prefilled in chunks [%(default)s]",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output in tokens [whole cache]"
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=d.speedup,
        help="divide every modelled step time by this (10 = ten times faster than the fitted GPU) [%(default)s]",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        type=bind_endpoint,
        default=None,
        help="bind a ZMQ PUB socket here and publish KV events, e.g. tcp://127.0.0.1:5557 [no events]",
    )
    parser.add_argument(
        "--kv-replay-endpoint",
        type=bind_endpoint,
        default=None,
        help="bind a ZMQ ROUTER socket here that replays missed event batches, e.g. tcp://127.0.0.1:5558 [none]",
    )
    parser.add_argument(
        "--advertise-host",
        default=None,
        metavar="HOST",
        help="the host /kvmesh/info names for event sockets bound to every interface (tcp://*:P), "
        "which a router on another host cannot dial [$KVMESH_ADVERTISE_HOST, else $KVMESH_SELF_URL's "
        "host, else the bound address]",
    )
    parser.add_argument(
        "--event-plane",
        default=os.environ.get("KVMESH_EVENT_PLANE") or "zmq",
        help="zmq, or nats://host:port[,...]: publish KV events to the NATS stream and register this "
        "engine in the worker bucket (needs kvmesh[nats]) [$KVMESH_EVENT_PLANE, else zmq]",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=d.scheduling_policy,
        help="fcfs, or priority: lower request 'priority' values run first, ties by arrival (vLLM) [%(default)s]",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the generated tokens (requests may override) [%(default)s]",
    )
    parser.add_argument(
        "--pin-budget",
        type=float,
        default=d.pin_budget,
        help="largest share of the cache that pinned prefixes and open sessions may hold [%(default)s]",
    )
    parser.add_argument(
        "--report-profile",
        action="store_true",
        help="serve the step-time model as timing_profile in /kvmesh/info, so a router can seed its "
        "latency model from it (real engines report none) [off]",
    )
    parser.add_argument(
        "--no-worker-rpc",
        dest="worker_rpc",
        action="store_false",
        help="serve no /kvmesh/* worker RPCs, as a vLLM without kvmesh's plugin: a router then reads "
        "it from /kv_event_sources and /metrics [served]",
    )
    parser.add_argument(
        "--request-log",
        default=None,
        metavar="PATH",
        help="append one JSON line per ended request to PATH: its arrival, the step that took it in, "
        "its first token and end on the engine's clock, prompt, cached and output tokens (for "
        "benchmarks: the engine's own time, apart from the time in front of it) [off]",
    )
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("KVMESH_ADMIN_TOKEN"),
        help="require this token on the /kvmesh/* worker RPCs [$KVMESH_ADMIN_TOKEN, else none]",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="local Hugging Face tokenizer directory for prompts (needs kvmesh[hf]) [built-in tokenizer]",
    )
    parser.add_argument(
        "--middleware",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="ASGI middleware class or @app.middleware('http') function to add, like vLLM's --middleware (repeatable)",
    )
    parser.add_argument(
        "--role",
        choices=("aggregated", "prefill", "decode"),
        default=d.role,
        help="part in disaggregated serving, reported in /kvmesh/info; every role speaks vLLM's "
        "kv_transfer_params hand-off [%(default)s]",
    )
    parser.add_argument(
        "--transfer-ms-per-block",
        type=float,
        default=d.transfer_ms_per_block,
        help="simulated time to pull one KV block from the prefill engine, in ms [%(default)s]",
    )
    parser.add_argument(
        "--transfer-fixed-ms",
        type=float,
        default=d.transfer_fixed_ms,
        help="simulated fixed cost of one KV hand-off, in ms [%(default)s]",
    )
    parser.add_argument(
        "--log-level", type=log_level, default="warning", help="uvicorn log level [%(default)s]"
    )


def run(args: argparse.Namespace) -> int:
    from kvmesh.commands.exits import refuse
    from kvmesh.commands.serving import base_url, listening_socket, serve
    from kvmesh.errors import ConfigError
    from kvmesh.events.endpoint import bound_to_every_interface
    from kvmesh.mock.config import MockConfig
    from kvmesh.mock.engine import MockEngine
    from kvmesh.mock.server import add_middleware, build_app
    from kvmesh.worker.advertise import advertise_host_from_env

    try:
        if args.advertise_host and not any(
            bound_to_every_interface(e) for e in (args.kv_events_endpoint, args.kv_replay_endpoint) if e
        ):
            raise ConfigError(
                "--advertise-host names the host told for event sockets bound to every interface: "
                "give --kv-events-endpoint tcp://*:PORT (or 0.0.0.0, [::]) with it"
            )
        config = MockConfig(
            model=args.model,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            speedup=args.speedup,
            kv_events_endpoint=args.kv_events_endpoint,
            kv_replay_endpoint=args.kv_replay_endpoint,
            event_plane=args.event_plane,
            event_name=f"{args.host}:{args.port}",
            advertise_host=advertise_host_from_env(
                {"KVMESH_ADVERTISE_HOST": args.advertise_host} if args.advertise_host else None
            ),
            advertise_url=base_url(args.host, args.port) if args.event_plane != "zmq" else None,
            scheduling_policy=args.scheduling_policy,
            seed=args.seed,
            pin_budget=args.pin_budget,
            admin_token=args.admin_token or None,
            report_profile=args.report_profile,
            worker_rpc=args.worker_rpc,
            request_log=args.request_log,
            role=args.role,
            transfer_ms_per_block=args.transfer_ms_per_block,
            transfer_fixed_ms=args.transfer_fixed_ms,
        ).validate()
        tokenizer = None
        if args.tokenizer:
            from kvmesh.router.request.tokenizer import HfTokenizer

            tokenizer = HfTokenizer(args.tokenizer)
        engine = MockEngine(config, tokenizer=tokenizer)
        engine.open_request_log()
        engine.open_events()  # bind errors surface here, before the HTTP server starts
        app = build_app(engine)
        for spec in args.middleware:
            add_middleware(app, spec)
        sock = listening_socket(args.host, args.port)
    except (ConfigError, ImportError) as e:
        return refuse("kvmesh mock", e)
    events = f", KV events on {engine.events_endpoint}" if engine.events_endpoint else ""
    replay = f" (replay {engine.replay_endpoint})" if engine.replay_endpoint else ""
    print(
        f"kvmesh mock: serving {config.model!r} on {base_url(args.host, args.port)}{events}{replay}",
        file=sys.stderr,
        flush=True,
    )
    serve(app, sock, log_level=args.log_level, access_log=False)
    return 0
