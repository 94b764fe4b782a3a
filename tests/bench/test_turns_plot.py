"""`benchmarks/turns_plot.py`: a case's cost turn by turn, from the suite's `--requests` files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "turns_plot.py"
CASE = "agent-long x4 (turns=2)"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )


def _requests(path: Path, router: str, rows: list[tuple[int, int, float, int, int]]) -> Path:
    """Rows as `routing_quality.py --requests` writes them: (round, turn, TTFT ms, prompt, cached)."""
    with path.open("w") as f:
        for rnd, turn, ttft, prompt, cached in rows:
            row = {
                "case": CASE, "router": router, "round": rnd, "session": f"s{turn}", "turn": turn,
                "start_s": 0.0, "ttft_ms": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
                "worker": "http://127.0.0.1:1", "engine": 0, "error": None,
            }  # fmt: skip
            f.write(json.dumps(row) + "\n")
        other = {"case": "chat-fits x4", "router": router, "round": 1, "turn": 1, "ttft_ms": 1e6}
        f.write(json.dumps(other | {"prompt_tokens": 1, "cached_tokens": 0, "error": None}) + "\n")
    return path


def test_each_turn_gets_its_mean_ttft_and_the_tokens_prefilled_per_round(tmp_path: Path) -> None:
    before = _requests(
        tmp_path / "before.jsonl",
        "kvmesh",
        [
            (1, 1, 100.0, 5000, 0),
            (2, 1, 300.0, 5000, 1000),
            (1, 2, 50.0, 6000, 5000),
            (2, 2, 70.0, 6000, 4000),
        ],
    )
    after = _requests(
        tmp_path / "after.jsonl", "kvmesh", [(1, 1, 80.0, 5000, 2000), (1, 2, 40.0, 6000, 6000)]
    )
    png = tmp_path / "turns.png"
    done = _run("--case", CASE, f"before={before}", f"after={after}", "--out", str(png))
    assert done.returncode == 0, done.stderr
    first_table = done.stdout.split("requests moved", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in first_table.splitlines() if line.startswith("| ")}
    # turn 1 before: TTFT (100 + 300) / 2; prefilled (5000 + 4000) over 2 rounds; the other case is left out
    assert "| 200 / 4.5k | 60 / 1.5k | 6.0k |" in rows["before kvmesh"]
    assert "| 80 / 3.0k | 40 / 0.0k | 3.0k |" in rows["after kvmesh"]
    assert png.stat().st_size > 10_000


def test_files_under_one_label_are_more_rounds(tmp_path: Path) -> None:
    one = _requests(tmp_path / "1.jsonl", "kvmesh", [(1, 1, 100.0, 5000, 0)])
    two = _requests(tmp_path / "2.jsonl", "kvmesh", [(1, 1, 300.0, 5000, 1000)])  # its round 1 too
    done = _run("--case", CASE, f"new={one},{two}")
    assert done.returncode == 0, done.stderr
    assert "| new kvmesh | 200 / 4.5k | 4.5k |" in done.stdout


def test_a_router_can_be_left_out(tmp_path: Path) -> None:
    both = tmp_path / "both.jsonl"
    _requests(both, "kvmesh", [(1, 1, 80.0, 5000, 2000)])
    with both.open("a") as f, _requests(tmp_path / "s.jsonl", "sglang", [(1, 1, 90.0, 5000, 0)]).open() as g:
        f.write(g.read())
    done = _run("--case", CASE, "--routers", "sglang", f"run={both}")
    assert done.returncode == 0, done.stderr
    assert "run sglang" in done.stdout and "run kvmesh" not in done.stdout


def test_a_bad_run_or_a_case_not_in_the_files_is_a_usage_error(tmp_path: Path) -> None:
    path = _requests(tmp_path / "r.jsonl", "kvmesh", [(1, 1, 80.0, 5000, 2000)])
    for args, says in (
        ([str(path)], "expected LABEL=PATH"),
        (["x="], "expected LABEL=PATH"),
        ([f"x={tmp_path / 'missing.jsonl'}"], "no such file"),
        ([f"x={path}", "--case", "hot-prefix x4"], "no request of case 'hot-prefix x4'"),
        ([f"x={path}", "--case", CASE, "--routers", "dynamo"], f"no request of case {CASE!r} by dynamo"),
    ):
        done = _run("--case", CASE, *args) if "--case" not in args else _run(*args)
        assert done.returncode == 2, (args, done.stdout)
        assert says in done.stderr


def _served(path: Path, router: str, rows: list[tuple[int, str, int, int | None, int, int]]) -> Path:
    """Rows of one round: (turn, session, request index, engine or None, prompt, cached)."""
    with path.open("a") as f:
        for turn, session, _, engine, prompt, cached in rows:
            row = {
                "case": CASE, "router": router, "round": 1, "session": session, "turn": turn,
                "start_s": 0.0, "ttft_ms": 50.0, "prompt_tokens": prompt, "cached_tokens": cached,
                "worker": None, "engine": engine, "error": None,
            }  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path


def _moved_rows(stdout: str) -> dict[str, str]:
    table = stdout.split("requests moved", 1)[1]
    return {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}


def test_a_request_served_where_its_session_s_previous_turn_was_not_is_moved(tmp_path: Path) -> None:
    path = _served(
        tmp_path / "r.jsonl",
        "kvmesh",
        [
            (2, "a", 0, 1, 6000, 1000),  # moved from engine 0: 5000 tokens prefilled again
            (1, "a", 0, 0, 5000, 0),  # (out of order in the file, as rounds interleave)
            (1, "b", 0, 2, 5000, 0),
            (2, "b", 0, 2, 6000, 5000),  # stayed
            (2, "b", 1, 3, 6000, 0),  # a sibling of the same step, sent to another engine: moved
        ],
    )
    done = _run("--case", CASE, f"run={path}")
    assert done.returncode == 0, done.stderr
    row = _moved_rows(done.stdout)["run kvmesh"]
    assert "| 0 / 0.0k | 2 / 11.0k | 2 / 11.0k |" in row


def test_a_router_that_does_not_name_its_engines_has_no_move_count(tmp_path: Path) -> None:
    path = _served(
        tmp_path / "r.jsonl",
        "sglang",
        [(1, "a", 0, None, 5000, 0), (2, "a", 0, None, 6000, 5000)],
    )
    _served(path, "kvmesh", [(1, "a", 0, 0, 5000, 0), (2, "a", 0, 0, 6000, 5000)])
    done = _run("--case", CASE, f"run={path}")
    assert done.returncode == 0, done.stderr
    rows = _moved_rows(done.stdout)
    assert "| - | - | - |" in rows["run sglang"]
    assert "| 0 / 0.0k | 0 / 0.0k | 0 / 0.0k |" in rows["run kvmesh"]


def test_moves_over_rounds_are_counted_per_round(tmp_path: Path) -> None:
    one = _served(tmp_path / "1.jsonl", "kvmesh", [(1, "a", 0, 0, 5000, 0), (2, "a", 0, 1, 6000, 1000)])
    two = _served(tmp_path / "2.jsonl", "kvmesh", [(1, "a", 0, 0, 5000, 0), (2, "a", 0, 0, 6000, 5000)])
    three = _served(tmp_path / "3.jsonl", "kvmesh", [(1, "a", 0, 0, 5000, 0), (2, "a", 0, 0, 6000, 5000)])
    done = _run("--case", CASE, f"run={one},{two},{three}")
    assert done.returncode == 0, done.stderr
    # one move of 5000 tokens over three rounds
    assert "| 0 / 0.0k | 0.3 / 1.7k | 0.3 / 1.7k |" in _moved_rows(done.stdout)["run kvmesh"]


def test_moves_that_add_up_to_whole_ones_print_whole(tmp_path: Path) -> None:
    files = []
    for n, engines in enumerate(((0, 1, 0, 1, 1), (0, 1, 0, 0, 1), (0, 0, 0, 0, 0))):  # 3, 3, 0 moves
        rows = [(t, "a", 0, e, 1000 * t, 0) for t, e in enumerate(engines, start=1)]
        files.append(str(_served(tmp_path / f"{n}.jsonl", "kvmesh", rows)))
    done = _run("--case", CASE, "run=" + ",".join(files))
    assert done.returncode == 0, done.stderr
    row = _moved_rows(done.stdout)["run kvmesh"]
    # 2/3 + 2/3 + 1/3 + 1/3 moves a round is 2 (and not 2.0, as floats add it up to 1.9999...)
    assert row.endswith("| 0 / 0.0k | 0.7 / 1.3k | 0.7 / 2.0k | 0.3 / 1.3k | 0.3 / 1.7k | 2 / 6.3k |")
