"""Errors raised by the transfer layer. Every one is a `TransferError`, so a worker can catch one type and apply
its failure policy (recompute or fail); the subclasses say what went wrong and the messages name what differs."""

from __future__ import annotations


class TransferError(Exception):
    """Base class of everything kvtransfer raises on purpose."""


class MetadataError(TransferError):
    """Peer metadata is malformed, truncated or corrupted (bad magic, checksum, lengths or JSON)."""


class ProtocolMismatchError(MetadataError):
    """Peer metadata was written by another protocol version."""


class CompatibilityError(TransferError):
    """Peer caches are laid out differently (model, dtypes, block sizes, page bytes, layer specs)."""


class StaleEpochError(TransferError):
    """A request or release names a worker epoch other than the live one (the worker restarted)."""


class UnknownPeerError(TransferError):
    """No handshake has been made with this worker id."""
