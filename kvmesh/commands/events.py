"""``kvmesh events tap ENDPOINT``: print a KV-event stream as it arrives, one line per batch; or
``kvmesh events tap URL``: an engine's stream, its endpoints read from the engine
(:mod:`kvmesh.commands.engine_facts`).
(``kvmesh events relay`` is in :mod:`kvmesh.commands.events_relay`, ``kvmesh events trtllm`` in
:mod:`kvmesh.commands.events_trtllm`.)

It uses the same subscriber as the router (gap detection, replay, reconnect), so what it prints
is what the router would apply. Exit status: 0 after ``--count`` batches (or at ``--timeout``
without ``--count``), 1 when ``--timeout`` expires before ``--count`` batches, 2 for a bad
endpoint or argument.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter

from kvmesh.commands.argtypes import (
    connect_endpoint,
    http_url,
    non_negative_int,
    positive_float,
    positive_int,
)
from kvmesh.commands.engine_facts import event_endpoints, read_engine
from kvmesh.commands.exits import run_async
from kvmesh.errors import ConfigError
from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import MAX_SEQ, BlockRemoved, BlockStored, EngineHashT, EventBatch, event_to_json

_SHOWN_HASHES = 3


def sequence_number(text: str) -> int:
    """A batch's sequence number: 8 unsigned bytes on the wire. (Past them, the replay request
    failed with a traceback at every reconnection.)"""
    value = non_negative_int(text)
    if value > MAX_SEQ:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SEQ} (2**64 - 1), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="events_command", metavar="ACTION", required=True)
    tap = actions.add_parser(
        "tap",
        help="print the batches a KV-event publisher sends",
        description="Subscribe to a KV-event publisher (vLLM, SGLang, kvmesh's mock or KvEventPublisher) "
        "and print each batch, in sequence order, repairing gaps through the replay endpoint.",
    )
    tap.add_argument(
        "endpoint",
        metavar="ENDPOINT",
        help="the publisher's PUB endpoint, e.g. tcp://127.0.0.1:5557 (connected to, unless --bind); "
        "or an engine's URL, e.g. http://10.0.0.1:8000, whose events (and replay) are read from its "
        "/kvmesh/info, or a stock vLLM's /kv_event_sources or SGLang's /server_info",
    )
    tap.add_argument(
        "--rank",
        type=non_negative_int,
        metavar="N",
        help="with an engine's URL: the data-parallel rank whose stream to follow [0]",
    )
    tap.add_argument(
        "--replay-endpoint",
        type=connect_endpoint,
        metavar="E",
        help="the publisher's ROUTER replay endpoint; without it, missed batches cannot be recovered",
    )
    tap.add_argument(
        "--from-seq",
        type=sequence_number,
        metavar="N",
        help="start at sequence N, replaying what the publisher still buffers (default: start with "
        "the first batch that arrives live)",
    )
    tap.add_argument(
        "--count", type=positive_int, metavar="N", help="exit (status 0) after printing N batches"
    )
    tap.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object per line: {"seq", "dp_rank", "ts", "events"} (bytes hashes as hex)',
    )
    tap.add_argument(
        "--bind",
        action="store_true",
        help="bind ENDPOINT and wait for the publisher to connect (for publishers given a concrete "
        "tcp://host:port, which they connect to)",
    )
    tap.add_argument(
        "--topic", default="", metavar="T", help="only batches whose topic starts with T (default: all)"
    )
    tap.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="stop after S seconds; exit status 1 if --count batches have not arrived by then",
    )
    tap.set_defaults(_run=run)
    from kvmesh.commands import events_relay, events_trtllm

    events_relay.add_parser(actions)
    events_trtllm.add_parser(actions)


def run(args: argparse.Namespace) -> int:
    return run_async("kvmesh events tap", _tap(args))


async def _tap(args: argparse.Namespace) -> int:
    endpoint, replay = await _stream(args)
    printed = 0
    enough = asyncio.Event()

    def on_batch(seq: int, batch: EventBatch) -> None:
        nonlocal printed
        if enough.is_set():
            return
        print(format_json(seq, batch) if args.json else format_summary(seq, batch), flush=True)
        printed += 1
        if args.count is not None and printed >= args.count:
            enough.set()

    def on_reset(reason: str) -> None:
        print(f"kvmesh events tap: stream reset: {reason}", file=sys.stderr, flush=True)

    subscriber = EventSubscriber(
        endpoint,
        on_batch,
        replay_endpoint=replay,
        topic=args.topic.encode(),
        bind=args.bind,
        on_reset=on_reset,
        name="tap",
        from_beginning=False,
    )
    if args.from_seq is not None:
        subscriber.resume_from(args.from_seq - 1)
    task = subscriber.start()
    waiter = asyncio.ensure_future(enough.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=args.timeout, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # re-raises ConfigError for a bad endpoint
    finally:
        waiter.cancel()
        await subscriber.stop()
    if args.count is not None and printed < args.count:
        print(
            f"kvmesh events tap: timed out after {args.timeout} s with {printed} of {args.count} batches",
            file=sys.stderr,
        )
        return 1
    return 0


async def _stream(args: argparse.Namespace) -> tuple[str, str | None]:
    """(the PUB endpoint, the replay endpoint) to follow: as given, or read from the engine whose
    URL was given (its rank ``--rank``, told on stderr)."""
    if not args.endpoint.startswith(("http://", "https://")):
        if args.rank is not None:
            raise ConfigError("--rank picks a stream of an engine's URL: give the URL, not an endpoint")
        return args.endpoint, args.replay_endpoint
    if args.bind:
        raise ConfigError("--bind binds an endpoint; an engine's URL names the engine's own publisher")
    try:
        url = http_url(args.endpoint)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(str(e)) from None
    facts, where = await read_engine(url)
    endpoints, replays = event_endpoints(facts, url, where)
    rank = args.rank or 0
    if rank >= len(endpoints):
        raise ConfigError(f"--rank {rank}: {url} has {len(endpoints)} data-parallel rank(s)")
    endpoint, replay = endpoints[rank], args.replay_endpoint or replays[rank]
    print(
        f"kvmesh events tap: rank {rank} of {url} (read from {where}): {endpoint}"
        + (f", replay {replay}" if replay else ", no replay"),
        file=sys.stderr,
        flush=True,
    )
    return endpoint, replay


def format_json(seq: int, batch: EventBatch) -> str:
    return json.dumps(
        {
            "seq": seq,
            "dp_rank": batch.data_parallel_rank,
            "ts": batch.ts,
            "events": [event_to_json(e) for e in batch.events],
        }
    )


def format_summary(seq: int, batch: EventBatch) -> str:
    kinds = Counter(type(e).__name__ for e in batch.events)
    stored = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    parts = [
        f"seq={seq}",
        f"rank={batch.data_parallel_rank}",
        f"stored={kinds['BlockStored']}",
        f"removed={kinds['BlockRemoved']}",
        f"cleared={kinds['AllBlocksCleared']}",
    ]
    if stored:
        parts.append(f"+blocks={len(stored)} [{_first_hashes(stored)}]")
    if removed:
        parts.append(f"-blocks={len(removed)} [{_first_hashes(removed)}]")
    return " ".join(parts)


def _first_hashes(hashes: list[EngineHashT]) -> str:
    shown = ", ".join(h.hex()[:16] if isinstance(h, bytes) else str(h) for h in hashes[:_SHOWN_HASHES])
    return shown + (", ..." if len(hashes) > _SHOWN_HASHES else "")
