"""``kvmesh router --workers URL[,URL...]``: the standalone KV-aware router in front of remote workers."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.commands.argtypes import listen_host, log_level, port, positive_float
    from kvmesh.router.core.config import RouterConfig
    from kvmesh.router.mesh.settings import add_arguments as add_mesh_arguments

    parser.add_argument(
        "--host", type=listen_host, default="127.0.0.1", help="address to listen on [127.0.0.1]"
    )
    parser.add_argument("--port", type=port, default=8000, help="port to listen on [8000]")
    parser.add_argument("--log-level", type=log_level, default="info", help="uvicorn log level [info]")
    parser.add_argument(
        "--timeout-keep-alive",
        type=positive_float,
        default=75.0,
        help="seconds an idle client connection stays open; keep it above the idle timeout of "
        "whatever sends to the router (client pools, load balancers): when the router closes "
        "first, a request sent on the closing connection fails with 'server disconnected' [75]",
    )
    add_mesh_arguments(parser)
    RouterConfig.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvmesh.commands.exits import refuse
    from kvmesh.commands.serving import base_url, listening_socket, serve
    from kvmesh.errors import ConfigError
    from kvmesh.router.asgi.standalone import build_router_app
    from kvmesh.router.mesh.settings import MeshSettings

    try:
        settings = MeshSettings.load(args=args, self_url=None, self_worker_id=None)
    except ConfigError as e:
        return refuse("kvmesh router", e)
    if not settings.workers and settings.event_plane == "zmq":  # on NATS, workers register themselves
        print(
            "kvmesh router: no workers; pass --workers URL[,URL...], set KVMESH_WORKERS, or use "
            "--event-plane nats://... where workers register themselves",
            file=sys.stderr,
        )
        return 2
    # What the settings alone cannot tell: a tokenizer that will not load, an address in use.
    try:
        app = build_router_app(settings, freeze_heap=True)
        sock = listening_socket(args.host, args.port)
    except ConfigError as e:
        return refuse("kvmesh router", e)
    from kvmesh._native import summary

    print(
        f"kvmesh router on {base_url(args.host, args.port)} -> {len(settings.workers)} worker(s), "
        f"mode {settings.router.router_mode}\n{summary()}",
        file=sys.stderr,
        flush=True,
    )
    serve(app, sock, log_level=args.log_level, access_log=False, timeout_keep_alive=args.timeout_keep_alive)
    return 0
