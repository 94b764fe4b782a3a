"""The router's pure layers compiled to C with mypyc, used only where a build of exactly these
sources exists for this interpreter.

``kvmesh.router.core`` and ``kvmesh.router.request`` are plain, fully typed Python with no I/O:
what mypyc compiles well. Compiled, a decision takes about a third less time
(``benchmarks/router_core.py``) and decides exactly as the Python does
(``scripts/decision_fingerprint.py``, ``tests/test_native.py``).

``kvmesh native build`` (the Makefile runs it) compiles :data:`PACKAGES` into
``${KVMESH_CACHE:-~/.cache/kvmesh}/native/<interpreter>-<digest>/``, where the digest covers the
source of every module the compiled code was built against (:func:`source_files`). Each of the two
packages calls :func:`activate` from its ``__init__``: where that directory exists for these very
sources, it goes first on the package's ``__path__``, so Python's own import finds the extension
modules there before the ``.py`` files beside them. An edited source changes the digest, and the
Python modules are used until the next build: never stale C. ``KVMESH_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

PACKAGES = ("kvmesh.router.core", "kvmesh.router.request")
"""The packages whose modules are compiled (every module but ``__init__`` and :data:`LEFT_PURE`)."""
LEFT_PURE = {
    "kvmesh.router.request.tokenizer": "its Tokenizer is a runtime-checkable Protocol, which mypyc "
    "does not compile",
}
DEPENDS = (
    "kvmesh/_types.py",
    "kvmesh/errors.py",
    "kvmesh/hashing.py",
    "kvmesh/events/wire.py",
    "kvmesh/_http.py",
)
"""The modules outside :data:`PACKAGES` that the compiled code imports (``tests/test_native.py``
checks the list): their types are compiled in, so they are part of the digest."""
GROUP = "kvmesh_native"
"""mypyc's name for the build; its shared library is the module ``kvmesh_native__mypyc``, loaded
from the build's top directory by :func:`_load` (mypyc's C files split per module do not find
their group's header under a dotted name)."""
ENV = "KVMESH_NATIVE"

SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The directory holding the kvmesh package (mypyc names the modules from their paths below it)."""
_state: dict[str, Any] = {}


def cache_root() -> Path:
    return Path(os.environ.get("KVMESH_CACHE") or Path.home() / ".cache" / "kvmesh") / "native"


def interpreter_tag() -> str:
    """What an extension module must match: the interpreter's ABI and platform."""
    return str(sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag)


def compiled_modules() -> list[str]:
    out = []
    for package in PACKAGES:
        folder = SOURCE_ROOT / package.replace(".", "/")
        for path in sorted(folder.glob("*.py")):
            name = f"{package}.{path.stem}"
            if path.stem != "__init__" and name not in LEFT_PURE:
                out.append(name)
    return out


def source_files() -> list[Path]:
    """Every source the build depends on: the compiled packages' (their ``__init__`` and the modules
    left pure included, as the compiled code reads their types) and :data:`DEPENDS`."""
    files: list[Path] = []
    for package in PACKAGES:
        files += sorted((SOURCE_ROOT / package.replace(".", "/")).glob("*.py"))
    return files + [SOURCE_ROOT / name for name in DEPENDS]


BUILD_FORMAT = 2
"""Part of the digest: a change to how builds are laid out makes the old ones unfindable."""


def source_digest() -> str:
    h = hashlib.sha256(f"{BUILD_FORMAT} {GROUP}".encode())
    for path in source_files():
        h.update(path.relative_to(SOURCE_ROOT).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:20]


def build_dir() -> Path:
    """Where the build of these sources for this interpreter is (or would be)."""
    return cache_root() / f"{interpreter_tag()}-{source_digest()}"


def _extension(stem: Path) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = stem.with_name(stem.name + suffix)
        if candidate.is_file():
            return candidate
    return None


def library(where: Path) -> Path | None:
    """The build's shared library, if ``where`` holds a finished build (its manifest is written last)."""
    if not (where / "manifest.json").is_file():
        return None
    return _extension(where / (GROUP.replace(".", "/") + "__mypyc"))


def _load() -> Path | None:
    """The build to use (its shared library loaded), or None with the reason in ``_state``."""
    if "build" in _state:
        return _state["build"]  # type: ignore[no-any-return]
    build = None
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        _state["reason"] = f"turned off ({ENV}={os.environ[ENV]})"
    else:
        try:
            where = build_dir()
            shared = library(where)
            if shared is None:
                _state["reason"] = "no build of these sources for this interpreter (kvmesh native build)"
            else:
                name = GROUP + "__mypyc"
                if name not in sys.modules:
                    loader = importlib.machinery.ExtensionFileLoader(name, str(shared))
                    spec = importlib.util.spec_from_file_location(name, shared, loader=loader)
                    assert spec is not None
                    sys.modules[name] = importlib.util.module_from_spec(spec)
                build = where
                _state["reason"] = "compiled"
        except Exception as e:  # an unreadable cache, a library that does not load: Python it is
            _state["reason"] = f"the build could not be loaded: {e!r}"
    _state["build"] = build
    return build


def activate(package: str, path: list[str]) -> None:
    """Called by each compiled package's ``__init__``: its compiled modules come first, if built."""
    build = _load()
    if build is not None:
        folder = build / package.replace(".", "/")
        if folder.is_dir() and str(folder) not in path:
            path.insert(0, str(folder))


def status() -> dict[str, Any]:
    """Whether the compiled modules are in use here, why not, and which of them are loaded."""
    build = _load()
    loaded = {
        name: getattr(sys.modules[name], "__file__", "") or ""
        for name in compiled_modules()
        if name in sys.modules
    }
    return {
        "compiled": build is not None,
        "reason": _state.get("reason", ""),
        "build": str(build) if build is not None else None,
        "expected_build": str(build_dir()),
        "modules": compiled_modules(),
        "loaded_compiled": sorted(n for n, f in loaded.items() if not f.endswith(".py")),
        "loaded_python": sorted(n for n, f in loaded.items() if f.endswith(".py")),
    }


def summary() -> str:
    """One line for a log: compiled or not, and why."""
    s = status()
    if s["compiled"]:
        return f"router core: compiled ({len(s['modules'])} modules, {s['build']})"
    return f"router core: Python ({s['reason']})"


def write_manifest(where: Path, mypy_version: str) -> None:
    manifest = {
        "digest": source_digest(),
        "interpreter": interpreter_tag(),
        "python": sys.version.split()[0],
        "mypy": mypy_version,
        "modules": compiled_modules(),
        "sources": [p.relative_to(SOURCE_ROOT).as_posix() for p in source_files()],
    }
    (where / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
