"""``kvmesh native build|status``: compile the router's pure layers with mypyc, and say whether this
interpreter runs them compiled (see :mod:`kvmesh._native`).

``build`` needs mypy (it brings mypyc; ``pip install 'kvmesh[native]'``) and a C compiler. It
writes a new build only when none exists for these sources and this interpreter, keeps the
``--keep`` newest builds and removes older ones. Exit status: 0 built (or already there), 1 the
compile failed (the compiler's last lines are printed), 2 it cannot run here (no mypyc or no C
compiler; 0 with ``--if-possible``, for scripts that run on machines without them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

from kvmesh import _native
from kvmesh.commands.argtypes import positive_int

# Run in a child process, in the directory that holds the kvmesh package, so mypy names the
# modules from their paths. setuptools' Distribution runs build_ext without reading any project
# file there.
_BUILD = """
import json, sys
from mypyc.build import mypycify
from setuptools import Distribution
cfg = json.loads(sys.argv[1])
ext = mypycify(cfg["paths"], group_name=cfg["group"], target_dir=cfg["c_dir"], opt_level="3", multi_file=True)
dist = Distribution({"name": "kvmesh-native", "ext_modules": ext})
dist.script_args = ["build_ext", "--build-lib", cfg["out"], "--build-temp", cfg["temp"], "--parallel", str(cfg["jobs"])]
dist.parse_command_line()
dist.run_commands()
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="native_command", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build",
        help="compile kvmesh.router.core and kvmesh.router.request with mypyc (a minute or two: one C "
        "file per module, compiled in parallel)",
        description="Compile the router's pure layers with mypyc into "
        "${KVMESH_CACHE:-~/.cache/kvmesh}/native/, keyed by interpreter and source digest. Every "
        "kvmesh process on this interpreter then imports them compiled, as long as the sources "
        "are unchanged.",
    )
    build.add_argument(
        "--force", action="store_true", help="build again even if a build of these sources exists"
    )
    build.add_argument(
        "--keep",
        type=positive_int,
        default=3,
        metavar="N",
        help="builds to keep per interpreter, newest first; older ones are removed (default 3)",
    )
    build.add_argument(
        "--if-possible",
        action="store_true",
        help="exit 0 with a note when this machine cannot compile (no mypyc or no C compiler)",
    )
    status = actions.add_parser(
        "status",
        help="whether this interpreter imports the router's pure layers compiled, and why not",
        description="Print whether kvmesh.router.core and kvmesh.router.request are imported "
        "compiled here. Exit status 0 when they are, 1 when they are not.",
    )
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.native_command == "status":
        return _status(args)
    return _build(args)


def _status(args: argparse.Namespace) -> int:
    # import the packages so their activation runs, as it would in the router
    import kvmesh.router.core.kv_router
    import kvmesh.router.request.parse  # noqa: F401

    s = _native.status()
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        print(_native.summary())
        if not s["compiled"]:
            print(f"  a build for these sources would be at {s['expected_build']}")
        elif s["loaded_python"]:
            print(f"  loaded as Python all the same: {', '.join(s['loaded_python'])}")
    return 0 if s["compiled"] else 1


def _cannot(args: argparse.Namespace, why: str) -> int:
    print(f"kvmesh native build: {why}; the router runs its Python modules", file=sys.stderr)
    return 0 if args.if_possible else 2


def _build(args: argparse.Namespace) -> int:
    target = _native.build_dir()
    if _native.library(target) is not None and not args.force:
        print(f"kvmesh native build: up to date ({target})")
        return 0
    try:
        import mypy.version
        import mypyc  # noqa: F401
    except ImportError:
        return _cannot(args, "mypyc is not installed (pip install 'kvmesh[native]')")
    compiler = str(sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return _cannot(args, f"no C compiler ({compiler!r} is not on PATH)")
    root = _native.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    modules = _native.compiled_modules()
    with tempfile.TemporaryDirectory(prefix="build-", dir=root) as scratch:
        work = Path(scratch)
        out = work / "out"
        cfg = {
            "paths": [name.replace(".", "/") + ".py" for name in modules],
            "group": _native.GROUP,
            "c_dir": str(work / "c"),
            "out": str(out),
            "temp": str(work / "temp"),
            "jobs": os.cpu_count() or 1,  # (one C file per module: the compiler runs them side by side)
        }
        log = work / "build.log"
        env = {**os.environ, "MYPY_CACHE_DIR": str(root / "mypy-cache"), _native.ENV: "0"}
        print(
            f"kvmesh native build: compiling {len(modules)} modules with mypyc {mypy.version.__version__} ..."
        )
        with log.open("w") as sink:
            child = subprocess.Popen(
                [sys.executable, "-c", _BUILD, json.dumps(cfg)],
                cwd=_native.SOURCE_ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
            )
            _wait(child, log)
        if child.returncode != 0:
            lines = log.read_text(errors="replace").splitlines()
            errors = [line for line in lines if "error:" in line][:20]  # the compiler's or mypy's own
            print("\n".join([*errors, "...", *lines[-15:]] if errors else lines[-25:]), file=sys.stderr)
            print(f"kvmesh native build: failed (exit {child.returncode}); the router runs its Python modules",
                  file=sys.stderr)  # fmt: skip
            return 1
        _native.write_manifest(out, mypy.version.__version__)
        if target.exists():  # --force: the old build goes
            shutil.rmtree(target)
        try:
            out.rename(target)
        except OSError:
            # another build of the same sources finished first: its result is this one's
            if not (target / "manifest.json").is_file():
                raise
    _prune(root, args.keep)
    print(f"kvmesh native build: done ({target})")
    return 0


def _wait(child: subprocess.Popen[bytes], log: Path) -> None:
    """Wait for the compile, showing what it is doing (mypy's analysis, then the C compiler) with
    the time so far, on one line that redraws itself on a terminal."""
    start = time.monotonic()
    tty = sys.stdout.isatty()
    done = threading.Event()

    def show() -> None:
        last = ""
        while not done.wait(1.0 if tty else 15.0):
            text = log.read_text(errors="replace")
            stage = (
                "compiling C" if "gcc" in text or "building '" in text else "type-checking and generating C"
            )
            line = f"  {stage} ... {time.monotonic() - start:.0f} s"
            if tty:
                print("\r" + line.ljust(len(last)), end="", flush=True)
            elif line != last:
                print(line, flush=True)
            last = line
        if tty:
            print(f"\r  finished in {time.monotonic() - start:.0f} s".ljust(40), flush=True)

    shower = threading.Thread(target=show, daemon=True)
    shower.start()
    try:
        child.wait()
    finally:
        done.set()
        shower.join()


def _prune(root: Path, keep: int) -> None:
    """Keep this interpreter's ``keep`` newest builds (another interpreter's are its own business)."""
    tag = _native.interpreter_tag() + "-"
    builds = sorted(
        (p for p in root.iterdir() if p.name.startswith(tag) and (p / "manifest.json").is_file()),
        key=lambda p: (p / "manifest.json").stat().st_mtime,
        reverse=True,
    )
    for old in builds[keep:]:
        shutil.rmtree(old, ignore_errors=True)
