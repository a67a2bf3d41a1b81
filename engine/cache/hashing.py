"""Chained block hashes for prefix caching.

    hash(block i) = sha256(SEED | hash(block i-1) | token ids of block i | extra keys)[:16]

Extra keys hold the per-request `cache_salt` (requests with different salts never share blocks). The seed is a
fixed constant, so separate processes and machines compute equal hashes for equal token prefixes — a decode worker
can recognise blocks a prefill worker computed. Only *full* blocks are hashed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_SEED = b"hybridpd/prefix-cache/v1"
_ROOT = hashlib.sha256(HASH_SEED).digest()[:16]


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x00salt\x00")
        h.update(extra)
    return h.digest()[:16]


def extra_keys(cache_salt: str | None) -> bytes:
    return cache_salt.encode() if cache_salt else b""


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> None:
    """Append hashes for every newly full block of `token_ids` (the request's tokens so far) to `hashes`."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
