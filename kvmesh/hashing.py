"""Block hashing, bit-compatible with NVIDIA Dynamo's KV router.

A prompt's token ids are cut into blocks of ``block_size``; only full blocks are hashed.

* local hash of block k: ``xxh3_64(u32-LE bytes of tokens[k*B:(k+1)*B], seed)`` with
  ``seed = 1337``, or ``(1337 + xxh3_64(lora_name, seed=0)) mod 2**64`` for a LoRA adapter.
* sequence hash: ``seq[0] = local[0]``, ``seq[i] = xxh3_64(le64(seq[i-1]) + le64(local[i]), 1337)``.

This sits on the routing hot path (every request), so it converts the token list to bytes once
(``array.fromlist`` is the fastest pure-Python path) and hashes slices through ``map`` over cached
slice objects, which keeps the per-block loop out of the interpreter (measured: benchmarks/hashing.py).
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from functools import lru_cache
from itertools import repeat

from xxhash import xxh3_64_intdigest

BASE_SEED = 1337
MAX_TOKEN_ID = 2**32 - 1
"""The largest token id a block hash takes: ids are hashed as unsigned 32-bit integers."""
_U64 = 1 << 64
_PAIR = struct.Struct("<QQ")

if array.array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports today
    raise ImportError("kvmesh.hashing needs a 4-byte array typecode 'I'")


@lru_cache(maxsize=256)
def seed_for(lora_name: str | None) -> int:
    """The xxh3 seed for a block's adapter: the base seed, shifted by the LoRA name's hash."""
    if not lora_name:
        return BASE_SEED
    return (BASE_SEED + xxh3_64_intdigest(lora_name.encode("utf-8"), 0)) % _U64


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as unsigned 32-bit little-endian bytes (raises OverflowError past MAX_TOKEN_ID)."""
    buf = array.array("I")
    buf.fromlist(tokens if isinstance(tokens, list) else list(tokens))
    if sys.byteorder != "little":  # pragma: no cover
        buf.byteswap()
    return buf.tobytes()


def block_hashes(tokens: Sequence[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Per-block local hashes of every full block of ``tokens``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    buf = array.array("I")
    if isinstance(tokens, list):
        # Converted whole, without a copy first: the partial last block's bytes are never sliced
        # below. (Cut off first, a chat prompt, which almost never ends on a block boundary, was
        # copied twice: a quarter of the hashing time.)
        try:
            buf.fromlist(tokens)
        except OverflowError:  # an id out of range, perhaps only past the last whole block
            buf = array.array("I")
    if not buf:
        buf.fromlist(list(tokens[: n_blocks * block_size]))
    if sys.byteorder != "little":  # pragma: no cover
        buf.byteswap()
    data = buf.tobytes()
    slices = _SLICES.get(block_size)
    if slices is None or len(slices) < n_blocks:
        slices = _block_slices(block_size, n_blocks)
    seed = seed_for(lora_name) if lora_name else BASE_SEED
    # ``repeat`` bounds the outer map (the cached slice list may be longer than this prompt)
    return list(map(xxh3_64_intdigest, map(data.__getitem__, slices), repeat(seed, n_blocks)))


_SLICES: dict[int, list[slice]] = {}


def _block_slices(block_size: int, n_blocks: int) -> list[slice]:
    """Byte slices of consecutive blocks, built once per block size and grown on demand."""
    slices = _SLICES.setdefault(block_size, [])
    if len(slices) < n_blocks:
        step = 4 * block_size
        slices.extend(slice(i * step, (i + 1) * step) for i in range(len(slices), n_blocks))
    return slices


def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    """Rolling hashes: each block's hash covers its whole prefix, so equal values mean equal prefixes."""
    if not local_hashes:
        return []
    out = [local_hashes[0]]
    prev = local_hashes[0]
    pack = _PAIR.pack
    for h in local_hashes[1:]:
        prev = xxh3_64_intdigest(pack(prev, h), BASE_SEED)
        out.append(prev)
    return out
