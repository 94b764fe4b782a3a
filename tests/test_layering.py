"""DESIGN.md's layering, enforced by walking every import in the package.

Levels (imports only go down or stay inside the same package):

    5  kvmesh.cli, kvmesh.commands
    4  kvmesh.adapters.<engine>      (the only place an engine is imported, and only in functions)
    3  kvmesh.mock, kvmesh.bench     (siblings: neither imports the other)
    2  kvmesh.router, kvmesh.worker  (siblings: neither imports the other)
    1  kvmesh.events
    0  kvmesh.hashing, kvmesh.errors, kvmesh._types, kvmesh._http, kvmesh._native

Inside ``kvmesh.router`` the layers are folders, imports again only going down:

    core < request < upstream < mesh < asgi

``core`` and ``request`` are pure (no clock, no I/O, no randomness of their own). Only the package's
face (``kvmesh/router/__init__.py`` and the public ``settings`` alias) sits outside the folders.

``kvmesh.worker`` is the engine-agnostic worker side (the ``/kvmesh/*`` RPC routes, the pin and
session retention ledger, the cached-block state behind ``kv_state``) that every backend serves:
the mock engine and each adapter import it, and it needs only the events package and the leaves.
The router and the worker side are the two ends of one protocol (HTTP RPCs and ZMQ events), so
neither imports the other: the router can run without any engine code, and a worker without the
routing core. (The mock engine, a level up, still uses the router's built-in tokenizer.)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvmesh"
ENGINES = {"vllm", "sglang", "tensorrt_llm"}
ADAPTERS = {"vllm", "sglang", "trtllm"}
LEVELS = {
    "kvmesh.cli": 5,
    "kvmesh.commands": 5,
    "kvmesh.__main__": 5,
    "kvmesh.adapters": 4,
    "kvmesh.mock": 3,
    "kvmesh.bench": 3,
    "kvmesh.router": 2,
    "kvmesh.worker": 2,
    "kvmesh.events": 1,
    "kvmesh.hashing": 0,
    "kvmesh.errors": 0,
    "kvmesh._types": 0,
    "kvmesh._http": 0,
    "kvmesh._native": 0,  # (the compiled router layers' loader, which core and request call)
    "kvmesh": 0,  # the package root re-exports leaves only
}
SIBLINGS = [
    {"kvmesh.mock", "kvmesh.bench"},
    {"kvmesh.router", "kvmesh.worker"},
]
ROUTER_LAYERS = ("core", "request", "upstream", "mesh", "asgi")
PURE_ROUTER_LAYERS = {"core", "request"}
ROUTER_FACE = {"kvmesh.router", "kvmesh.router.settings"}
IMPURE_MODULES = {
    "time",
    "asyncio",
    "socket",
    "threading",
    "zmq",
    "aiohttp",
    "starlette",
    "uvicorn",
    "random",
    "datetime",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The layering unit a module belongs to: the longest LEVELS key that prefixes it; each engine's
    adapter is a unit of its own (``kvmesh.adapters.vllm``), so adapters cannot import each other."""
    best = ""
    for key in LEVELS:
        if (module == key or module.startswith(key + ".")) and len(key) > len(best):
            best = key
    if best == "kvmesh.adapters":
        parts = module.split(".")
        if len(parts) > 2 and (parts[2] in ADAPTERS or (PACKAGE / "adapters" / parts[2]).is_dir()):
            return ".".join(parts[:3])
    return best


def _level_key(unit: str) -> str:
    return "kvmesh.adapters" if unit.startswith("kvmesh.adapters.") else unit


def _router_layer(module: str) -> str | None:
    """The folder of kvmesh.router a module lives in (None outside the router or for its face)."""
    parts = module.split(".")
    if parts[:2] != ["kvmesh", "router"] or module in ROUTER_FACE or len(parts) < 3:
        return None
    return parts[2]


def _imports(tree: ast.AST, module: str) -> list[tuple[str, int, bool, bool]]:
    """(imported module, line, runs at import time, only for type checking) for every import."""
    out = []
    top_level = {id(n) for n in getattr(tree, "body", [])}
    # imports under `if TYPE_CHECKING:` never run, so they count as lazy.
    type_checking = set()
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_checking.update(id(n) for n in ast.walk(node))
    package = (
        module
        if (PACKAGE / Path(*module.split(".")[1:]) / "__init__.py").exists()
        else module.rpartition(".")[0]
    )
    for node in ast.walk(tree):
        eager = id(node) in top_level and id(node) not in type_checking
        typing_only = id(node) in type_checking
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno, eager, typing_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.append((name, node.lineno, eager, typing_only))
    return out


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _violations() -> list[str]:
    problems = []
    for path in _sources():
        module = _module_name(path)
        unit = _unit(module)
        level = LEVELS[_level_key(unit)]
        tree = ast.parse(path.read_text(), filename=str(path))
        for imported, line, eager, typing_only in _imports(tree, module):
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
            root = imported.split(".")[0]
            if root in ENGINES:
                engine_dir = "kvmesh.adapters." + ("trtllm" if root == "tensorrt_llm" else root)
                if not module.startswith(engine_dir):
                    problems.append(f"{where}: only {engine_dir} may import {root}")
                elif eager:
                    problems.append(f"{where}: engines are imported inside functions, never at module top")
            layer = _router_layer(module)
            if root != "kvmesh":
                if layer in PURE_ROUTER_LAYERS and root in IMPURE_MODULES and not typing_only:
                    problems.append(f"{where}: the pure routing core does no I/O and reads no clock")
                continue
            target_layer = _router_layer(imported)
            if layer and target_layer and layer in ROUTER_LAYERS and target_layer in ROUTER_LAYERS:
                if ROUTER_LAYERS.index(target_layer) > ROUTER_LAYERS.index(layer):
                    problems.append(
                        f"{where}: router/{layer} must not import router/{target_layer} (above it)"
                    )
                continue
            if layer and imported in ROUTER_FACE:
                problems.append(f"{where}: router/{layer} imports the package face; import the layer module")
            target = _unit(imported)
            if target == "kvmesh" and imported != "kvmesh":
                continue  # an unknown kvmesh.* module: reported by test_every_module_has_a_level
            if target == unit:
                continue
            if {unit, target} in SIBLINGS:
                a, b = sorted({unit, target})
                problems.append(f"{where}: {a} and {b} are siblings and must not import each other")
            elif unit.startswith("kvmesh.adapters.") and target.startswith("kvmesh.adapters."):
                problems.append(f"{where}: one adapter must not import another")
            elif LEVELS[_level_key(target)] > level:
                problems.append(
                    f"{where}: {unit} (level {level}) must not import {target} (level {LEVELS[_level_key(target)]})"
                )
    return problems


def test_every_module_has_a_level() -> None:
    unknown = [p for p in _sources() if _unit(_module_name(p)) == "kvmesh" and _module_name(p) != "kvmesh"]
    assert not unknown, f"modules outside every layer of DESIGN.md: {unknown}; add them to LEVELS"


def test_every_router_module_lives_in_a_layer_folder() -> None:
    strays = [
        m
        for m in map(_module_name, _sources())
        if m.startswith("kvmesh.router") and m not in ROUTER_FACE and _router_layer(m) not in ROUTER_LAYERS
    ]
    assert not strays, f"router modules outside core/request/upstream/mesh/asgi: {strays}"


def test_imports_only_go_down() -> None:
    problems = _violations()
    assert not problems, "layering violations:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "module", "expected"),
    [
        pytest.param(
            "from kvmesh.router.core import kv_router\n",
            "kvmesh.events.subscriber",
            "must not import",
            id="up",
        ),
        pytest.param(
            "import vllm\n",
            "kvmesh.router.upstream.forwarder",
            "only kvmesh.adapters.vllm",
            id="engine-outside",
        ),
        pytest.param("import vllm\n", "kvmesh.adapters.vllm.plugin", "inside functions", id="engine-eager"),
        pytest.param(
            "from kvmesh.adapters.vllm import middleware\n",
            "kvmesh.adapters.trtllm.middleware",
            "one adapter must not import another",
            id="adapter-adapter",
        ),
        pytest.param("import time\n", "kvmesh.router.core.event_index", "pure routing core", id="clock"),
        pytest.param("import asyncio\n", "kvmesh.router.request.nvext", "pure routing core", id="request-io"),
        pytest.param(
            "from kvmesh.router.mesh import runtime\n", "kvmesh.router.core.load", "above it", id="core-up"
        ),
        pytest.param(
            "from kvmesh.router.asgi import tap\n",
            "kvmesh.router.upstream.http1",
            "above it",
            id="upstream-up",
        ),
        pytest.param("from kvmesh.router import settings\n", "kvmesh.router.mesh.x", "face", id="face"),
        pytest.param("from kvmesh.bench import x\n", "kvmesh.mock.server", "siblings", id="siblings"),
        pytest.param(
            "from kvmesh.router.request import tokenizer\n",
            "kvmesh.worker.rpc",
            "siblings",
            id="worker-router",
        ),
        pytest.param(
            "from kvmesh.worker import rpc\n",
            "kvmesh.router.upstream.forwarder",
            "siblings",
            id="router-worker",
        ),
        pytest.param(
            "from kvmesh.mock import engine\n", "kvmesh.worker.retention", "must not import", id="worker-up"
        ),
    ],
)
def test_the_checker_catches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, module: str, expected: str
) -> None:
    """The checker itself must fail on each kind of violation (a layering test that cannot fail is useless)."""
    fake = tmp_path / "kvmesh" / Path(*module.split(".")[1:]).with_suffix(".py")
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "kvmesh")
    problems = _violations()
    assert any(expected in p for p in problems), problems
