"""The ``kvmesh`` command. Each sub-command lives in ``kvmesh/commands/<name>.py`` and provides
``add_arguments(parser)`` and ``run(args) -> int``; they are imported only when the command line
is parsed, so ``kvmesh --help`` stays fast and never touches an engine."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). The order is the order of ``kvmesh --help``.
COMMANDS: dict[str, tuple[str, str]] = {
    "router": ("kvmesh.commands.router", "run the standalone KV-aware router in front of remote workers"),
    "mock": ("kvmesh.commands.mock", "run a simulated OpenAI-compatible engine that publishes KV events"),
    "demo": (
        "kvmesh.commands.demo",
        "start a simulated 4-engine mesh and compare KV routing (the default cost, Dynamo's cost) with round-robin",
    ),
    "bench": (
        "kvmesh.commands.bench",
        "load-test any OpenAI-compatible endpoint with prefix-heavy workloads",
    ),
    "events": (
        "kvmesh.commands.events",
        "inspect a KV-event stream (`kvmesh events tap`) or relay it into NATS (`kvmesh events relay`)",
    ),
    "native": (
        "kvmesh.commands.native",
        "compile the router's pure layers with mypyc (`kvmesh native build`) or say whether they run compiled",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="KV-cache-aware routing for inference fleets, inside the engines themselves.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            p.set_defaults(_unavailable=name)
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvmesh")
    except PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(f"kvmesh: the '{args._unavailable}' command is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
