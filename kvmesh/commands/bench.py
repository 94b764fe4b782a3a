"""``kvmesh bench --url URL``: load-test any OpenAI-compatible endpoint with prefix-heavy workloads."""

from __future__ import annotations

import argparse
import asyncio
import json
import string
import sys
from collections.abc import Callable
from pathlib import Path

from kvmesh._http import HEADER_SAFE_RULE, header_safe
from kvmesh.commands.argtypes import (
    http_url,
    non_negative_float,
    output_path,
    positive_float,
    positive_int,
    share,
)

WORKLOAD_KNOBS: dict[str, Callable[[str], int | float]] = {
    "sessions": positive_int,
    "turns": positive_int,
    "burst": positive_int,
    "groups": positive_int,
    "prefix_words": positive_int,
    "question_words": positive_int,
    "max_tokens": positive_int,
    "hot_share": share,
    "long_share": share,
}
"""The workload's knobs (``WorkloadSpec`` fields) a user may set, with the values each takes: the
flags below and ``benchmarks/routing_quality.py --set`` read them from here."""
LOAD_KNOBS: dict[str, Callable[[str], int | float]] = {
    "concurrency": positive_int,
    "rate": positive_float,
    "think_time": non_negative_float,
    "ramp": non_negative_float,
}
"""The load's knobs, likewise."""


def base_urls(text: str) -> tuple[str, ...]:
    """``--url``: comma-separated base URLs, each as :func:`http_url` takes it. (An empty list was a
    traceback; a URL with no scheme or a bad port failed each request of the run, or the question
    for the model after the workload was made.)"""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("must name at least one server, e.g. http://127.0.0.1:8000")
    return tuple(http_url(item) for item in items)


_TOKEN = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)
"""The characters of an HTTP header name (RFC 9110's ``tchar``)."""


def request_header(text: str) -> tuple[str, str]:
    """``--header NAME:VALUE``. (A name with a space in it, or an empty one, had every request
    refused by the server; a CR or LF in the value was a traceback from the HTTP client; a
    ``Content-Length`` of the user's broke every body.)"""
    name, sep, value = (part.strip() for part in text.partition(":"))
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} must look like NAME:VALUE")
    if not name or not set(name) <= _TOKEN:
        raise argparse.ArgumentTypeError(
            f"{name!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~)"
        )
    if name.lower() in ("content-length", "transfer-encoding"):
        raise argparse.ArgumentTypeError(f"{name} frames the request, which kvmesh bench writes itself")
    if value and not header_safe(value):
        raise argparse.ArgumentTypeError(f"the value of {name} must be {HEADER_SAFE_RULE}")
    return name, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.workloads import WORKLOADS

    parser.add_argument(
        "--url",
        required=True,
        type=base_urls,
        help="base URL(s), comma-separated (host:port or http://host:port); sessions are spread round-robin",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="agentic",
        help="what to send (default: agentic); each has preset sizes and load, which the flags below override",
    )
    parser.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=LOAD_KNOBS["concurrency"],
        default=None,
        help="closed loop: sessions in flight [preset]",
    )
    load.add_argument(
        "--rate",
        type=LOAD_KNOBS["rate"],
        default=None,
        help="open loop: sessions started per second (Poisson) [preset]",
    )
    parser.add_argument(
        "--sessions",
        type=WORKLOAD_KNOBS["sessions"],
        default=None,
        help="conversations / groups / bursts [preset]",
    )
    parser.add_argument(
        "--turns", type=WORKLOAD_KNOBS["turns"], default=None, help="turns (steps) per session [preset]"
    )
    parser.add_argument(
        "--burst", type=WORKLOAD_KNOBS["burst"], default=None, help="siblings per burst (best-of-n, siblings)"
    )
    parser.add_argument(
        "--groups",
        type=WORKLOAD_KNOBS["groups"],
        default=None,
        help="distinct shared prefixes (agents / documents / personas)",
    )
    parser.add_argument(
        "--prefix-words",
        type=WORKLOAD_KNOBS["prefix_words"],
        default=None,
        help="length of shared prefixes in words",
    )
    parser.add_argument(
        "--question-words",
        type=WORKLOAD_KNOBS["question_words"],
        default=None,
        help="words of per-turn text (user message, tool output) [preset]",
    )
    parser.add_argument(
        "--max-tokens",
        type=WORKLOAD_KNOBS["max_tokens"],
        default=None,
        help="max_tokens of every request [preset]",
    )
    parser.add_argument(
        "--hot-share",
        type=WORKLOAD_KNOBS["hot_share"],
        default=None,
        help="hot-prefix: share of requests on the hot prefix",
    )
    parser.add_argument(
        "--long-share",
        type=WORKLOAD_KNOBS["long_share"],
        default=None,
        help="mixed: share of sessions that are long agents",
    )
    parser.add_argument(
        "--think-time",
        type=LOAD_KNOBS["think_time"],
        default=None,
        help="mean seconds between an answer and the next step (exponential, seeded) [preset]",
    )
    parser.add_argument(
        "--ramp",
        type=LOAD_KNOBS["ramp"],
        default=None,
        help="closed loop: spread the first starts over this many seconds",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="workload and arrival seed (same seed, same prompts)"
    )
    parser.add_argument(
        "--header",
        action="append",
        type=request_header,
        default=[],
        metavar="NAME:VALUE",
        help="extra request header (repeatable)",
    )
    parser.add_argument(
        "--no-nvext", action="store_true", help="do not ask for nvext.worker_id (plain servers)"
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        type=output_path,
        default=None,
        help="write every request and the summary here (checked before the run)",
    )
    parser.add_argument(
        "--plot", type=output_path, default=None, help="write a PNG plot here (checked before the run)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from kvmesh.bench import report
    from kvmesh.bench.runner import LoadSpec, NoModel, Progress, first_model, run_workload
    from kvmesh.bench.workloads import build, ignored_load_knobs, knob_matters, preset, sessions_of

    urls: tuple[str, ...] = args.url
    headers: list[tuple[str, str]] = args.header
    chosen = preset(args.workload)
    overrides = {name: getattr(args, name) for name in WORKLOAD_KNOBS if getattr(args, name) is not None}
    spec = chosen.spec.replace(seed=args.seed, **overrides)
    rate = args.rate if args.rate is not None else (None if args.concurrency else chosen.rate)
    # A flag that changes nothing in what is sent is refused rather than silently ignored, before
    # the server is asked and the workload made. (How many steps a session takes does not depend
    # on how many sessions there are, so one session tells which load knobs it ignores.)
    ignored = [name for name in overrides if not knob_matters(args.workload, name)]
    idle = ignored_load_knobs(build(spec.replace(sessions=1)), open_loop=rate is not None)
    ignored += [name for name in ("think_time", "ramp") if getattr(args, name) is not None and name in idle]
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        verb = "has" if len(ignored) == 1 else "have"
        print(f"kvmesh bench: {flags} {verb} no effect on workload {args.workload!r}", file=sys.stderr)
        return 2
    model = args.model
    if model is None:  # asked before the workload is made, which takes a minute at 100,000 sessions
        try:
            model = asyncio.run(first_model(urls[0]))
        except NoModel as e:
            print(f"kvmesh bench: {e}", file=sys.stderr)
            return 1
    preparing = Progress(
        spec.sessions,
        f"{args.workload}: preparing",
        enabled=False if args.no_progress else None,
        unit="sessions",
        delay=0.5,
    )
    sessions = []
    for session in sessions_of(spec):
        sessions.append(session)
        preparing.update()
    preparing.close()
    load = LoadSpec(
        urls=urls,
        model=model,
        concurrency=None if rate else (args.concurrency or chosen.concurrency or 8),
        rate=rate,
        think_time=chosen.think_time if args.think_time is None else args.think_time,
        ramp=chosen.ramp if args.ramp is None else args.ramp,
        ask_worker_id=not args.no_nvext,
        headers=tuple(headers),
        seed=args.seed,
    )
    total = sum(s.total_requests for s in sessions)
    progress = Progress(total, args.workload, enabled=False if args.no_progress else None)
    try:
        result = asyncio.run(run_workload(args.workload, sessions, load, progress=progress))
    except NoModel as e:
        print(f"kvmesh bench: {e}", file=sys.stderr)
        return 1
    summary = report.summarize(result)
    print(report.format_table([summary]))
    for kind, n in summary["error_kinds"].items():  # what failed, not only how many
        print(f"kvmesh bench: {n} request(s) failed: {kind}", file=sys.stderr)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report.to_json([result], [summary]), indent=1))
        print(f"wrote {args.json_path}")
    if args.plot:
        print(f"wrote {report.write_plot([result], [summary], args.plot)}")
    return 0 if summary["ok"] else 1
