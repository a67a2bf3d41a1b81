"""Chained block hashes for prefix caching.

    hash(block i) = sha256(SEED | hash(block i-1) | token ids of block i | extra keys)[:16]

Extra keys hold the request's `cache_salt`. The seed is fixed, so every process and machine computes equal hashes
for equal full blocks (a decode worker recognises what a prefill worker computed).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_SEED = b"hybridpd/prefix-cache/v1"
_ROOT = hashlib.sha256(HASH_SEED).digest()[:16]


def extra_keys(cache_salt: str | None) -> bytes:
    return cache_salt.encode() if cache_salt else b""


def append_block_hashes(hashes: list[bytes], new_blocks: Sequence[int], block_size: int, extra: bytes = b"") -> None:
    """Append the hashes of the full blocks `new_blocks` (the tokens of the blocks after the last hashed one, a
    multiple of block_size) to `hashes`."""
    data = struct.pack(f"{len(new_blocks)}q", *new_blocks)  # the tokens as int64, packed in one go
    step = block_size * 8  # bytes per block: tokens are packed as int64
    salt = b"\x00salt\x00" + extra if extra else b""
    parent = hashes[-1] if hashes else _ROOT
    sha256, append = hashlib.sha256, hashes.append
    for off in range(0, len(data), step):  # one message per block: sha256(a | b) == sha256(a).update(b)
        parent = sha256(parent + data[off : off + step] + salt).digest()[:16]
        append(parent)
