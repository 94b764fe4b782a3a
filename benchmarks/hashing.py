"""Block hashing: kvmesh.hashing.block_hashes vs NVIDIA Dynamo's compiled binding, same run.

    .venv/bin/python benchmarks/hashing.py [--tokens 32768] [--block-size 16] [--repeat 2000]

Dynamo's binding comes from the `bench` extra (`pip install -e '.[bench]'`); without it only
kvmesh's numbers print. Both take the same Python list of ints, so list conversion is included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, median, percentile, table, time_calls

from kvmesh.commands.argtypes import positive_int
from kvmesh.hashing import block_hashes, sequence_hashes

ROUNDS = 10


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=positive_int, default=32768, help="prompt length in tokens")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument("--repeat", type=positive_int, default=2000, help="timed calls per implementation")
    args = parser.parse_args()
    if args.tokens < args.block_size:  # no full block: nothing would be hashed
        parser.error(f"--tokens must be at least --block-size ({args.block_size}), got {args.tokens}")
    if args.repeat < ROUNDS:
        parser.error(
            f"--repeat must be at least {ROUNDS} (one call in each of {ROUNDS} rounds), got {args.repeat}"
        )

    tokens = [(7 * i + 11) % 151_000 for i in range(args.tokens)]
    candidates = {"kvmesh block_hashes": lambda: block_hashes(tokens, args.block_size)}
    try:
        from dynamo._core import compute_block_hash_for_seq
    except ImportError:
        print(
            "dynamo binding not installed (pip install -e '.[bench]'): reporting kvmesh only", file=sys.stderr
        )
    else:
        assert compute_block_hash_for_seq(tokens, args.block_size) == block_hashes(tokens, args.block_size)
        candidates["dynamo compute_block_hash_for_seq"] = lambda: compute_block_hash_for_seq(
            tokens, args.block_size
        )
    local = block_hashes(tokens, args.block_size)
    candidates["kvmesh sequence_hashes (rolling)"] = lambda: sequence_hashes(local)

    # Interleave the implementations in rounds so that machine noise hits both alike.
    results: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(ROUNDS):
        for name, fn in candidates.items():
            results[name] += time_calls(fn, repeat=args.repeat // ROUNDS, warmup=5)

    baseline = median(results.get("dynamo compute_block_hash_for_seq", [float("nan")]))
    rows = []
    for name, samples in results.items():
        ratio = median(samples) / baseline
        rows.append(
            [name, f"{median(samples) * 1e3:.3f}", f"{percentile(samples, 99) * 1e3:.3f}", f"{ratio:.2f}x"]
        )
    print(f"machine: {machine()}")
    print(
        f"workload: {args.tokens} tokens, block size {args.block_size} ({args.tokens // args.block_size} blocks)\n"
    )
    print(table(["implementation", "median ms", "p99 ms", "time vs dynamo"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
