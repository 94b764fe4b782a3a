"""The router's pure layers compiled with mypyc (``kvmesh native build``): used only for exactly the
sources they were built from, and deciding exactly as the Python does."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh import _native

REPO = Path(__file__).resolve().parent.parent
# the environment of the children below, whatever this run's own switch says
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != _native.ENV}
BUILT = (_native.build_dir() / "manifest.json").is_file()
needs_build = pytest.mark.skipif(not BUILT, reason="no compiled build of these sources (kvmesh native build)")

_FINGERPRINT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from decision_fingerprint import fingerprint
from kvmesh import _native
prints = [fingerprint(3, 300, model=m, workers=w, temperature=t)
          for m, w, t in (("latency", 6, 0.0), ("dynamo", 6, 0.0), ("latency", 8, 0.5))]
print(json.dumps({"prints": prints, "status": _native.status()}))
"""


def _run(code: str, *args: str, env: dict[str, str] | None = None, root: Path = REPO) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=300, check=False, cwd=root,
        env={**CLEAN_ENV, "PYTHONPATH": str(root), **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


_STATUS = """
import json
import kvmesh.router.core.kv_router, kvmesh.router.request.parse
from kvmesh import _native
print(json.dumps(_native.status()))
"""


@needs_build
def test_compiled_and_python_decide_the_same() -> None:
    compiled = _run(_FINGERPRINT, str(REPO / "scripts"))
    python = _run(_FINGERPRINT, str(REPO / "scripts"), env={_native.ENV: "0"})
    assert compiled["status"]["compiled"] and not python["status"]["compiled"]
    # the decisions were made by the compiled router and load model, then by the Python ones
    assert "kvmesh.router.core.kv_router" in compiled["status"]["loaded_compiled"]
    assert "kvmesh.router.core.load" in compiled["status"]["loaded_compiled"]
    assert compiled["status"]["loaded_python"] == []
    assert python["status"]["loaded_compiled"] == []
    assert all(decisions > 250 for _, decisions in compiled["prints"])
    assert compiled["prints"] == python["prints"]


@needs_build
def test_an_edited_source_runs_as_python_until_it_is_built_again(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "kvmesh", tree / "kvmesh", ignore=shutil.ignore_patterns("__pycache__"))
    same = _run(_STATUS, root=tree)
    assert same["compiled"] and same["build"] == str(_native.build_dir())  # the same sources
    load = tree / "kvmesh" / "router" / "core" / "load.py"
    load.write_text(load.read_text() + "\n# an edit\n")
    edited = _run(_STATUS, root=tree)
    assert not edited["compiled"]
    assert "no build of these sources" in edited["reason"]
    assert edited["build"] is None and edited["expected_build"] != same["build"]
    assert edited["loaded_compiled"] == [] and "kvmesh.router.core.load" in edited["loaded_python"]
    # a module outside the compiled packages that they are built against counts as well
    tree_types = tree / "kvmesh" / "_types.py"
    load.write_text(load.read_text().removesuffix("\n# an edit\n"))
    assert _run(_STATUS, root=tree)["compiled"]
    tree_types.write_text(tree_types.read_text() + "\n# an edit\n")
    assert not _run(_STATUS, root=tree)["compiled"]


def test_without_a_build_or_when_turned_off_the_layers_are_python(tmp_path: Path) -> None:
    empty = _run(_STATUS, env={"KVMESH_CACHE": str(tmp_path)})
    assert not empty["compiled"] and empty["loaded_compiled"] == []
    assert empty["expected_build"].startswith(str(tmp_path / "native" / _native.interpreter_tag()))
    assert "kvmesh native build" in empty["reason"]
    off = _run(_STATUS, env={_native.ENV: "0"})
    assert not off["compiled"] and off["reason"] == f"turned off ({_native.ENV}=0)"
    assert "kvmesh.router.request.parse" in off["loaded_python"]


def test_a_build_that_does_not_load_is_reported_and_python_runs(tmp_path: Path) -> None:
    # a build directory for these sources whose library is not a library (a disk that lost it)
    where = tmp_path / "native" / _native.build_dir().name
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    library = where / (_native.GROUP.replace(".", "/") + "__mypyc" + suffix)
    library.parent.mkdir(parents=True)
    library.write_bytes(b"not an ELF file")
    (where / "manifest.json").write_text("{}")
    broken = _run(_STATUS, env={"KVMESH_CACHE": str(tmp_path)})
    assert not broken["compiled"] and broken["reason"].startswith("the build could not be loaded")
    assert "kvmesh.router.core.kv_router" in broken["loaded_python"]


def test_the_digest_covers_every_kvmesh_module_the_compiled_code_imports() -> None:
    covered = {p.relative_to(REPO).as_posix() for p in _native.source_files()}

    def source(module: str) -> str | None:
        """The file of a kvmesh module (None: a name inside a module, not a module)."""
        target = module.replace(".", "/")
        for file in (f"{target}.py", f"{target}/__init__.py"):
            if (REPO / file).is_file():
                return file
        return None

    for name in _native.compiled_modules():
        path = REPO / (name.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # ``from kvmesh.pkg import mod`` imports the module ``kvmesh.pkg.mod`` too
                imported = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for module in imported:
                file = source(module) if module.startswith("kvmesh") else None
                assert file is None or file in covered, (
                    f"{name} imports {module}, which the digest leaves out"
                )


def test_the_command_line() -> None:
    def kvmesh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvmesh", "native", *args],
            capture_output=True, text=True, timeout=120, check=False,
            env={**CLEAN_ENV, **(env or {})},
        )  # fmt: skip

    helped = kvmesh("build", "--help")
    assert helped.returncode == 0 and "--keep" in helped.stdout and "--if-possible" in helped.stdout
    bad = kvmesh("build", "--keep", "0")
    assert bad.returncode == 2 and "--keep" in bad.stderr
    off = kvmesh("status", env={_native.ENV: "0"})
    assert off.returncode == 1 and off.stdout.startswith("router core: Python (turned off")
    status = kvmesh("status", "--json")
    assert status.returncode == (0 if BUILT else 1)
    assert json.loads(status.stdout)["compiled"] is BUILT
    if BUILT:  # nothing to do for sources already built: no compiler runs
        again = kvmesh("build")
        assert again.returncode == 0 and again.stdout.startswith("kvmesh native build: up to date")
