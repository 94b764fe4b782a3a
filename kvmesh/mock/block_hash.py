"""The mock engine's own block hashes: salted per process, chained like vLLM's, opaque to routers.

``hash[i] = xxh3_64(le64(hash[i-1]) + u32-LE tokens of block i, seed=salt)`` with ``hash[-1] = 0``.
The salt is drawn from the OS at start-up (mixed with ``--seed``), so two engines, or one engine
after a restart, never publish the same hash for the same tokens - exactly like vLLM with its
random ``NONE_HASH``. A router therefore cannot recompute these values; it must keep its own
(Dynamo-compatible) hashes and map the engine's onto them. The values are unsigned 64-bit ints,
so they exercise the ``> 2**63`` range real vLLM hashes use.
"""

from __future__ import annotations

import os
import struct

from xxhash import xxh3_64_intdigest

from kvmesh.hashing import token_bytes

_PARENT = struct.Struct("<Q")


def new_salt(seed: int) -> int:
    """A fresh 64-bit salt: OS randomness mixed with the seed (different on every start)."""
    return xxh3_64_intdigest(os.urandom(16), seed & 0xFFFFFFFFFFFFFFFF)


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int, salt: int) -> None:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` does not cover yet."""
    n_full = len(token_ids) // block_size
    start = len(hashes)
    if start >= n_full:
        return
    data = memoryview(token_bytes(token_ids[start * block_size : n_full * block_size]))
    parent = hashes[-1] if hashes else 0
    step = 4 * block_size
    pack = _PARENT.pack
    for off in range(0, (n_full - start) * step, step):
        parent = xxh3_64_intdigest(pack(parent) + data[off : off + step], salt)
        hashes.append(parent)
