"""Every module of every engine adapter imports without its engine (core tier, no engine installed).

An adapter imports its engine only inside functions (docs/ARCHITECTURE.md), so a user's
``--middleware kvmesh.adapters.vllm.KvMeshMiddleware``, SGLang's app path or an entry point can
load any module before the engine is touched, and a module that names a moved or renamed kvmesh
path fails here instead of in a user's server. Each import runs in a fresh interpreter with the
engines made unimportable (``sys.modules[name] = None``), so an engine that happens to be installed
cannot hide a top-level engine import, and no module is satisfied by an earlier test's imports.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvmesh.adapters

ADAPTERS = ("sglang", "trtllm", "vllm")
ENGINES = ("sglang", "tensorrt_llm", "vllm")

_PROBE = """
import importlib, json, sys, traceback
for engine in {engines!r}:
    sys.modules[engine] = None
failures = {{}}
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except BaseException:
        failures[name] = traceback.format_exc(limit=3)
print(json.dumps(failures))
"""


def adapter_modules(adapter: str) -> list[str]:
    """Every module of ``kvmesh.adapters.<adapter>`` (sub-packages included), found on disk."""
    package = f"kvmesh.adapters.{adapter}"
    root = Path(kvmesh.adapters.__file__).parent / adapter
    found = [package]
    for info in pkgutil.walk_packages([str(root)], prefix=package + "."):
        found.append(info.name)
    return sorted(found)


def test_the_walk_finds_the_modules_that_exist() -> None:
    """Guards the test itself: an empty walk would pass every import check below."""
    modules = adapter_modules("sglang")
    for name in ("middleware", "tokenizer", "app", "pins", "scheduler_hooks", "launcher"):
        assert f"kvmesh.adapters.sglang.{name}" in modules
    assert "kvmesh.adapters.vllm.middleware" in adapter_modules("vllm")
    assert "kvmesh.adapters.trtllm.middleware" in adapter_modules("trtllm")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_every_adapter_module_imports_without_its_engine(adapter: str) -> None:
    # ``__main__`` runs its command when imported (the TRT-LLM one unconditionally); it is compiled
    # here, and what it imports is one of the modules imported below.
    modules = [m for m in adapter_modules(adapter) if not m.endswith(".__main__")]
    for main in (m for m in adapter_modules(adapter) if m.endswith(".__main__")):
        path = Path(kvmesh.adapters.__file__).parent / adapter / "__main__.py"
        compile(path.read_text(), str(path), "exec")
        assert main.rsplit(".", 1)[0] in modules
    probe = _PROBE.format(engines=ENGINES, modules=modules)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(f"{name}:\n{tb}" for name, tb in failures.items())
