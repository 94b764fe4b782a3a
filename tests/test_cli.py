"""The `kvmesh` console script as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from kvmesh.cli import COMMANDS


def _kvmesh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmesh", *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_subcommand() -> None:
    result = _kvmesh("--help")
    assert result.returncode == 0, result.stderr
    for name in ("router", "mock", "demo", "bench", "events"):
        assert name in COMMANDS
        assert f"    {name}" in result.stdout


def test_every_subcommand_has_help_for_every_flag() -> None:
    for name in COMMANDS:
        args = ("events", "tap", "--help") if name == "events" else (name, "--help")
        result = _kvmesh(*args)
        assert result.returncode == 0, f"kvmesh {' '.join(args)}: {result.stderr}"
        assert "is not available" not in result.stdout + result.stderr
        flags = [line.split()[0] for line in result.stdout.splitlines() if line.strip().startswith("--")]
        assert flags, f"kvmesh {name} --help shows no flags"
        for line in result.stdout.splitlines():
            stripped = line.strip()
            if stripped.startswith("--") and len(stripped.split("  ")) == 1:
                # The description may wrap onto the next line; a flag with no text at all is a defect.
                index = result.stdout.splitlines().index(line)
                following = (
                    result.stdout.splitlines()[index + 1]
                    if index + 1 < len(result.stdout.splitlines())
                    else ""
                )
                assert following.startswith(" " * 10), f"kvmesh {name}: flag without help: {stripped}"


def test_missing_subcommand_is_a_usage_error() -> None:
    result = _kvmesh()
    assert result.returncode == 2
    assert "COMMAND" in result.stderr
