"""The tensor-parallel part of a worker's handshake (gRPC `TransferMetadata.tp_layout`): how many ranks it has,
every rank's NIXL handshake blob (kvtransfer.metadata; rank 0's is also `agent_metadata`) and how its ranks slice
each cache tensor (kvtransfer.tp_layout). A D worker checks it against its own at connect time (`problems`): a
mismatch refuses the peer with the differing keys, before any request reads from it.

Wire format: b"HPDKVTP\\0" + JSON {"tp": n, "ranks": [base64 blob, ...], "tensors": {group: [tensor, ...]},
"extra": {...}}. The membership proof of GetTransferMetadata covers these bytes too (worker.context).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from .errors import MetadataError
from .tp_slices import ShardedTensor, in_group_order, incompatibilities

MAGIC = b"HPDKVTP\x00"


@dataclass(frozen=True)
class TPLayout:
    """One worker's ranks as its peers see them. `tensors` maps a cache group id to its tensors (runner order:
    attention (kv,), recurrent (conv, ssm)); `extra` holds what must match besides the tensors (model id,
    checkpoint interval, group kinds)."""

    tp_size: int
    rank_blobs: tuple[bytes, ...]
    tensors: dict[int, list[ShardedTensor]]
    extra: dict[str, str]

    def encode(self) -> bytes:
        body = {
            "tp": self.tp_size,
            "ranks": [base64.b64encode(b).decode() for b in self.rank_blobs],
            "tensors": {str(g): [_tensor_dict(t) for t in ts] for g, ts in self.tensors.items()},
            "extra": self.extra,
        }
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes) -> TPLayout:
        """Raises MetadataError for anything malformed."""
        if not blob.startswith(MAGIC):
            raise MetadataError("not a hybridpd tensor-parallel layout (magic)")
        try:
            body = json.loads(blob[len(MAGIC) :])
            out = cls(
                int(body["tp"]),
                tuple(base64.b64decode(b) for b in body["ranks"]),
                {int(g): [_tensor_of(t) for t in ts] for g, ts in body["tensors"].items()},
                {str(k): str(v) for k, v in body["extra"].items()},
            )
        except (ValueError, KeyError, TypeError) as e:
            raise MetadataError(f"tensor-parallel layout malformed: {e!r}") from e
        if out.tp_size < 1 or len(out.rank_blobs) != out.tp_size:
            raise MetadataError(f"tensor-parallel layout: {len(out.rank_blobs)} rank blobs for tp {out.tp_size}")
        for ts in out.tensors.values():
            if any(t.tp_size != out.tp_size for t in ts):
                raise MetadataError("tensor-parallel layout: a tensor's slicing disagrees with the tp size")
        return out

    def flat(self) -> list[ShardedTensor]:
        return in_group_order(self.tensors)


def problems(mine: TPLayout, peer: TPLayout) -> list[str]:
    """Why a worker with `mine` cannot read pages from `peer` (empty: it can). The TP sizes may differ."""
    out = [
        f"{k}: {mine.extra.get(k, '<absent>')!r} (here) != {peer.extra.get(k, '<absent>')!r} (peer)"
        for k in sorted(set(mine.extra) | set(peer.extra))
        if mine.extra.get(k) != peer.extra.get(k)
    ]
    if sorted(mine.tensors) != sorted(peer.tensors):
        return [*out, f"cache groups differ: {sorted(mine.tensors)} (here) != {sorted(peer.tensors)} (peer)"]
    return out + incompatibilities(mine.flat(), peer.flat())


def _tensor_dict(t: ShardedTensor) -> dict[str, Any]:
    return {
        "name": t.name,
        "page_shape": list(t.page_shape),
        "axis": t.axis,
        "itemsize": t.itemsize,
        "dtype": t.dtype,
        "held": [list(h) for h in t.held],
    }


def _tensor_of(d: dict[str, Any]) -> ShardedTensor:
    return ShardedTensor(
        str(d["name"]),
        tuple(int(x) for x in d["page_shape"]),
        int(d["axis"]),
        int(d["itemsize"]),
        str(d["dtype"]),
        tuple(tuple(int(i) for i in h) for h in d["held"]),
    )


__all__ = ["TPLayout", "problems"]
