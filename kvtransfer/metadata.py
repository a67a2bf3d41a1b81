"""The handshake blob a worker publishes (gRPC `GetTransferMetadata.agent_metadata`) and its peers load.

Wire format (big-endian), versioned and checksummed so a truncated or corrupted blob is refused, never loaded:

    | magic "HPDKVMD\\0" (8) | protocol u16 | json_len u32 | nixl_len u32 | json | nixl agent metadata | sha256 (32) |

The JSON holds the worker id, its NIXL agent name, its epoch and its `CacheLayout` (regions with addresses, page
bytes/strides and counts; group kinds; compatibility fingerprint and hash). The sha256 covers everything before it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

from .errors import MetadataError, ProtocolMismatchError
from .layout import PROTOCOL_VERSION, CacheLayout, compat_hash

MAGIC = b"HPDKVMD\x00"
_HEAD = struct.Struct(">8sHII")
_DIGEST = 32


@dataclass(frozen=True)
class WorkerMetadata:
    """What one worker process tells its peers about itself. A new process start means a new `epoch`."""

    worker: str
    agent_name: str
    epoch: str
    layout: CacheLayout
    nixl_metadata: bytes
    protocol: int = PROTOCOL_VERSION


def encode(md: WorkerMetadata) -> bytes:
    body = json.dumps(
        {"worker": md.worker, "agent_name": md.agent_name, "epoch": md.epoch, "layout": md.layout.to_dict()},
        separators=(",", ":"),
    ).encode()
    head = _HEAD.pack(MAGIC, md.protocol, len(body), len(md.nixl_metadata))
    blob = head + body + md.nixl_metadata
    return blob + hashlib.sha256(blob).digest()


def decode(blob: bytes) -> WorkerMetadata:
    """Parse and verify a blob. Raises `ProtocolMismatchError` for another protocol version and `MetadataError`
    for anything malformed (wrong type, magic, lengths, checksum, JSON, fields)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise MetadataError(f"metadata must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < _HEAD.size + _DIGEST:
        raise MetadataError(f"metadata truncated: {len(blob)} bytes, need at least {_HEAD.size + _DIGEST}")
    magic, protocol, json_len, nixl_len = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise MetadataError(f"not hybridpd transfer metadata (magic {magic!r}, expected {MAGIC!r})")
    if protocol != PROTOCOL_VERSION:
        raise ProtocolMismatchError(f"peer speaks transfer protocol v{protocol}, this worker v{PROTOCOL_VERSION}")
    expected = _HEAD.size + json_len + nixl_len + _DIGEST
    if len(blob) != expected:
        raise MetadataError(f"metadata length {len(blob)} != {expected} announced by its header (truncated?)")
    payload, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(payload).digest() != digest:
        raise MetadataError("metadata checksum mismatch (corrupted in transit?)")
    try:
        body = json.loads(payload[_HEAD.size : _HEAD.size + json_len])
        layout = CacheLayout.from_dict(body["layout"])
        md = WorkerMetadata(
            worker=str(body["worker"]),
            agent_name=str(body["agent_name"]),
            epoch=str(body["epoch"]),
            layout=layout,
            nixl_metadata=payload[_HEAD.size + json_len :],
            protocol=protocol,
        )
    except (ValueError, KeyError, TypeError) as e:
        raise MetadataError(f"metadata body malformed: {e!r}") from e
    if compat_hash(layout.fingerprint) != layout.compat_hash:
        raise MetadataError("metadata compat hash does not match its fingerprint")
    return md
