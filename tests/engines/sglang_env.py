"""Set-up shared by the SGLang engine tests (tests/engines/test_sglang_*.py).

* :func:`prepare` makes SGLang 0.5.23 importable on CPU: the registry's torchvision wheels need
  CUDA torch, so when no working torchvision is installed the TEST-ONLY stand-in in
  ``tests/engines/sglang_stubs`` goes on ``sys.path`` (after transformers has recorded that
  torchvision is unavailable, so transformers keeps its torchvision-free code paths). Every
  function of the stand-in raises: no test here touches image code.
* :func:`install_entry_point` makes kvmesh's ``sglang.srt.plugins`` entry point visible to
  ``importlib.metadata`` without installing kvmesh into the engine environment: a
  ``kvmesh-<version>.dist-info`` whose ``entry_points.txt`` is generated from *this checkout's*
  pyproject.toml, in a temporary directory put on ``sys.path`` (kvmesh itself is on PYTHONPATH).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import warnings
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "sglang_stubs"
_prepared = False


def prepare() -> None:
    global _prepared
    if _prepared:
        return
    _prepared = True
    try:
        importlib.import_module("torchvision")
        return  # a working torchvision: nothing to stand in for
    except Exception:
        sys.modules.pop("torchvision", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        import_utils.is_torchvision_v2_available()
    sys.path.insert(0, str(STUBS))


def install_entry_point(directory: Path) -> Path:
    """A dist-info for kvmesh with the entry points of pyproject.toml, on ``sys.path``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dist = directory / f"kvmesh-{project['version']}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvmesh\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in entries.items())
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    return dist


def engine(name: str) -> object:
    prepare()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)
