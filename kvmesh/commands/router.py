"""``kvmesh router --workers URL[,URL...]``: the standalone KV-aware router in front of remote workers."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING, Any

from kvmesh.errors import ConfigError

if TYPE_CHECKING:
    from kvmesh.router.asgi.cors import CorsPolicy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.commands.argtypes import listen_host, log_level, port, positive_float
    from kvmesh.router.core.config import RouterConfig
    from kvmesh.router.mesh.settings import add_arguments as add_mesh_arguments

    parser.add_argument(
        "--host", type=listen_host, default="127.0.0.1", help="address to listen on [127.0.0.1]"
    )
    parser.add_argument("--port", type=port, default=8000, help="port to listen on [8000]")
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="info",
        help="log level of the server and of kvmesh's own messages (worker state, --log-requests) [info]",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=positive_float,
        default=75.0,
        help="seconds an idle client connection stays open; keep it above the idle timeout of "
        "whatever sends to the router (client pools, load balancers): when the router closes "
        "first, a request sent on the closing connection fails with 'server disconnected' [75]",
    )
    _add_cors_arguments(parser)
    add_mesh_arguments(parser)
    RouterConfig.add_arguments(parser)


def _add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's four CORS flags, with its meanings and defaults (see kvmesh.router.asgi.cors)."""
    from kvmesh.router.asgi.cors import check_origin, check_token

    def listed(check: Any) -> Any:
        def parse(text: str) -> list[str]:
            try:
                items = [check(part) for part in text.split(",") if part.strip()]
            except ConfigError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            if not items:
                raise argparse.ArgumentTypeError("must name at least one, or * for any")
            return items

        return parse

    group = parser.add_argument_group("cross-origin requests (a client in a browser page)")
    group.add_argument(
        "--allowed-origins",
        type=listed(check_origin),
        action="extend",
        metavar="ORIGIN[,ORIGIN...]",
        help="origins whose pages may call the router (scheme://host[:port], comma-separated or "
        "repeated; * for any); the router then answers CORS preflights and its answers carry "
        "Access-Control-Allow-* headers [none: cross-origin access off, as in vLLM]",
    )
    for flag, what, name, allowed in (
        ("--allowed-methods", "method", "METHOD", "methods a page from an allowed origin may use"),
        (
            "--allowed-headers",
            "header name",
            "HEADER",
            "request headers a page from an allowed origin may send",
        ),
    ):
        group.add_argument(
            flag,
            type=listed(functools.partial(check_token, what=what)),
            action="extend",
            metavar=f"{name}[,{name}...]",
            help=f"{allowed} [*]",
        )
    group.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let a page from an allowed origin send cookies and authorization [off]",
    )


def _log_to_stderr(level: str) -> None:
    """kvmesh's own messages at the server's ``--log-level``, beside uvicorn's lines. uvicorn's
    logging config gives only its own loggers a handler: kvmesh's messages below WARNING (a worker
    taking requests again, a worker discovered through NATS, ``--log-requests``' lines) were
    dropped whatever the level asked for."""
    import logging

    from uvicorn.config import LOG_LEVELS
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    log = logging.getLogger("kvmesh")
    log.addHandler(handler)
    log.setLevel(LOG_LEVELS[level])
    log.propagate = False


def cors_policy(args: argparse.Namespace) -> CorsPolicy:
    """The CORS policy the flags ask for; ConfigError for a setting given without origins (it
    would change nothing)."""
    from kvmesh.router.asgi.cors import CorsPolicy

    origins = tuple(dict.fromkeys(args.allowed_origins or ()))
    if not origins:
        given = [
            flag
            for flag, value in (
                ("--allowed-methods", args.allowed_methods),
                ("--allowed-headers", args.allowed_headers),
                ("--allow-credentials", args.allow_credentials),
            )
            if value
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} needs --allowed-origins (cross-origin access is off without it)"
            )
        return CorsPolicy()
    return CorsPolicy(
        origins=origins,
        methods=tuple(args.allowed_methods or ("*",)),
        headers=tuple(args.allowed_headers or ("*",)),
        credentials=args.allow_credentials,
    )


def run(args: argparse.Namespace) -> int:
    from kvmesh.commands.exits import refuse
    from kvmesh.commands.serving import base_url, listening_socket, serve
    from kvmesh.router.asgi.cors import with_cors
    from kvmesh.router.asgi.standalone import build_router_app
    from kvmesh.router.mesh.settings import MeshSettings

    try:
        settings = MeshSettings.load(args=args, self_url=None, self_worker_id=None)
        cors = cors_policy(args)
    except ConfigError as e:
        return refuse("kvmesh router", e)
    if not settings.workers and settings.event_plane == "zmq":  # on NATS, workers register themselves
        print(
            "kvmesh router: no workers; pass --workers URL[,URL...], set KVMESH_WORKERS, or use "
            "--event-plane nats://... where workers register themselves",
            file=sys.stderr,
        )
        return 2
    _log_to_stderr(args.log_level)
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
    serve(
        with_cors(app, cors),
        sock,
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=args.timeout_keep_alive,
    )
    return 0
