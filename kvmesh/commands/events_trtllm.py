"""``kvmesh events trtllm URL``: a stock trtllm-serve's KV events on kvmesh's ZMQ wire.

trtllm-serve without kvmesh's launcher keeps its KV events in a queue that ``POST
/kv_cache_events`` drains, which no router can share. This command is its one reader: it polls the
route (every 5 ms while events come, backing off to 50 ms when idle, to 1 s while the engine does
not answer), converts the events with the in-engine bridge's rules
(:mod:`kvmesh.adapters.trtllm.bridge`) and publishes vLLM's frames per attention-DP rank, with a
replay socket, where any number of routers (or ``kvmesh events tap``, or ``relay``) follow them.
It prints the router's worker entry for the engine on stderr.

Runs until SIGINT / SIGTERM (or ``--duration``), then prints one summary line on stderr. Exit status:
0; 2 for a bad argument, an endpoint that cannot be bound, a URL that is no trtllm-serve, an engine
whose blocks hold another number of tokens than ``--block-size``, or one with more attention-DP
ranks than ``--dp-size``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
from typing import Any

from kvmesh.adapters.trtllm._trtllm import DEFAULT_BLOCK_SIZE
from kvmesh.commands.argtypes import bind_endpoint, http_url, positive_float, positive_int
from kvmesh.commands.exits import run_async
from kvmesh.errors import ConfigError

_IDLE_DELAYS = (0.005, 0.05)
"""(after events came, the longest while none come): the in-engine bridge's."""
_DOWN_DELAY = 1.0
"""Between polls of an engine that does not answer."""


def add_parser(actions: Any) -> None:
    bridge = actions.add_parser(
        "trtllm",
        help="publish a stock trtllm-serve's KV events (POST /kv_cache_events) on kvmesh's ZMQ wire",
        description="Be the one reader of a trtllm-serve's KV-event queue (started without kvmesh's "
        "launcher, with kv_cache_config.event_buffer_max_size > 0 and block reuse on), and publish its "
        "events as vLLM's ZMQ frames, one PUB and replay socket per attention-DP rank, for routers to "
        "follow. Nothing else may post to URL/kv_cache_events: each answer drains the queue.",
    )
    bridge.add_argument(
        "url", type=http_url, metavar="URL", help="the trtllm-serve, e.g. http://10.0.0.1:8000"
    )
    bridge.add_argument(
        "--endpoint",
        type=bind_endpoint,
        default="tcp://*:5557",
        metavar="E",
        help="the PUB socket to bind; attention-DP rank r binds the port + r [tcp://*:5557]",
    )
    bridge.add_argument(
        "--replay-endpoint",
        default="tcp://*:5567",
        metavar="E",
        help="the replay socket to bind (port + r per rank), or 'none' [tcp://*:5567]",
    )
    bridge.add_argument(
        "--block-size",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="N",
        help="the engine's kv_cache_config.tokens_per_block; a mismatch seen in its events stops the "
        f"command [{DEFAULT_BLOCK_SIZE}, TensorRT-LLM's default]",
    )
    bridge.add_argument(
        "--dp-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="attention data-parallel ranks (enable_attention_dp: the tensor-parallel size) [1]",
    )
    bridge.add_argument(
        "--advertise-host",
        metavar="H",
        help="the host routers dial for endpoints bound to every interface, in the printed entry "
        "[this machine's name]",
    )
    bridge.add_argument(
        "--timeout",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="seconds one POST /kv_cache_events may take (1.0 and 1.1 hold it up to 2 s when idle) [10]",
    )
    bridge.add_argument(
        "--duration", type=positive_float, metavar="S", help="stop after S seconds (default: until a signal)"
    )
    bridge.set_defaults(_run=run)


def run(args: argparse.Namespace) -> int:
    return run_async("kvmesh events trtllm", _bridge(args))


def _replay(text: str) -> str | None:
    if text == "none":
        return None
    try:
        return bind_endpoint(text)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"--replay-endpoint {e}") from None


def worker_entry(
    url: str, block_size: int, endpoints: list[str], replays: list[str | None], host: str
) -> str:
    """The router's ``[[workers]]`` TOML entry for the engine, its endpoints as a router dials them."""
    from kvmesh.worker.advertise import reachable

    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    lines = [
        "[[workers]]",
        f"url = {json.dumps(url)}",
        'backend = "trtllm"',
        f"block_size = {block_size}",
        f"kv_events_endpoints = {toml_list([reachable(e, host) for e in endpoints])}",
    ]
    if all(replays):
        lines.append(f"kv_replay_endpoints = {toml_list([reachable(str(r), host) for r in replays])}")
    return "\n".join(lines)


async def _bridge(args: argparse.Namespace) -> int:
    from kvmesh.adapters.trtllm.bridge import KvEventBridge
    from kvmesh.adapters.trtllm.served_queue import EngineUnreachable, NotServingEvents, ServedEventQueue

    replay = _replay(args.replay_endpoint)
    host = args.advertise_host or socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    queue = ServedEventQueue(args.url, timeout=args.timeout)
    try:
        bridge = KvEventBridge(
            None,
            block_size=args.block_size,
            dp_size=args.dp_size,
            endpoint=args.endpoint,
            replay_endpoint=replay,
        )
    except ConfigError:
        await queue.close()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _say(
        f"following {args.url} (POST /kv_cache_events); "
        + "; ".join(
            f"rank {r} publishes on {e}" + (f", replay {p}" if p else "")
            for r, (e, p) in enumerate(zip(bridge.endpoints, bridge.replay_endpoints, strict=True))
        )
    )
    entry = worker_entry(args.url, args.block_size, bridge.endpoints, bridge.replay_endpoints, host)
    _say(f"the router's entry for this engine:\n{entry}")
    delay, events, down = _IDLE_DELAYS[0], 0, False
    capacity: dict[int, int] = {}
    deadline = None if args.duration is None else loop.time() + args.duration
    try:
        while not stop.is_set() and (deadline is None or loop.time() < deadline):
            try:
                raw = await queue.drain()
            except EngineUnreachable as e:
                if not down:
                    _say(f"{e}; polling every {_DOWN_DELAY:g} s until it answers")
                down, delay = True, _DOWN_DELAY
            else:
                if down:
                    _say(f"{args.url} answers again")
                    down = False
                check_events(raw, args)
                if raw:
                    bridge.publish(raw)
                    events += len(raw)
                if bridge.converter.capacity_blocks != capacity:
                    capacity = dict(bridge.converter.capacity_blocks)
                    blocks = min(capacity.values())
                    _say(
                        f"its cache holds {blocks} blocks per rank: add total_kv_blocks = {blocks} to the entry"
                    )
                delay = _IDLE_DELAYS[0] if raw else min(delay * 2, _IDLE_DELAYS[1])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
    except NotServingEvents as e:
        raise ConfigError(str(e)) from None
    finally:
        await bridge.stop()
        await queue.close()
    converter = bridge.converter
    summary = {
        "events": events,
        "bridged": converter.bridged,
        "resyncs": converter.resyncs,
        "dropped": dict(sorted(converter.dropped.items())),
        "capacity_blocks": converter.capacity_blocks,
        "last_seq": [bridge.publishers[r].last_seq for r in range(args.dp_size)],
    }
    _say(f"stopped {json.dumps(summary)}")
    return 0


def check_events(raw: list[Any], args: argparse.Namespace) -> None:
    """ConfigError when the engine's events show another block size, or more attention-DP ranks,
    than the command was given: it would publish nothing, or leave the other ranks' events out."""
    from kvmesh.adapters.trtllm.served_queue import block_size_seen

    seen = block_size_seen(raw, args.block_size)
    if seen is not None:
        raise ConfigError(
            f"{args.url} stores blocks of {seen} tokens, not --block-size {args.block_size}: "
            f"give --block-size {seen} (and the router's entry block_size = {seen})"
        )
    top = max((_rank(e) for e in raw), default=0)
    if top >= args.dp_size:
        raise ConfigError(
            f"{args.url} sent events of attention-DP rank {top}: give --dp-size {top + 1} (or more)"
        )


def _rank(event: Any) -> int:
    """An event's attention-DP rank as the converter reads it (0 where it can read none: the
    converter drops that event as malformed)."""
    from kvmesh.adapters.trtllm.convert import event_rank

    try:
        return event_rank(event)
    except (AttributeError, TypeError, ValueError):
        return 0


def _say(text: str) -> None:
    print(f"kvmesh events trtllm: {text}", file=sys.stderr, flush=True)
