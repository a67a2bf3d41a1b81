"""The release notification D sends P over NIXL once a pull is over (data in place, or given up).

    b"hpdkv1|release|<P epoch>|<ok 1/0>|<request id>"

P's worker drains them with `TransferAgent.poll_releases()` and passes each to `LeaseTable.release(request_id,
epoch)`, which refuses a stale epoch (a release meant for P's previous incarnation must not free a new request that
reuses the id). A request id may contain "|": it is the last field.
"""

from __future__ import annotations

from typing import NamedTuple

_PREFIX = b"hpdkv1|release|"


class ReleaseNotice(NamedTuple):
    """D is done with P's blocks of `request_id` (`ok`: the data arrived; else D gave up and recomputes)."""

    request_id: str
    epoch: str
    ok: bool


def encode_release(request_id: str, epoch: str, ok: bool) -> bytes:
    if "|" in epoch:
        raise ValueError(f"epoch {epoch!r} must not contain '|'")
    return _PREFIX + f"{epoch}|{int(ok)}|{request_id}".encode()


def decode_release(msg: bytes) -> ReleaseNotice | None:
    """The notice in `msg`, or None if `msg` is not a release notification (other traffic is ignored)."""
    if not msg.startswith(_PREFIX):
        return None
    try:
        epoch, ok, request_id = msg[len(_PREFIX) :].decode().split("|", 2)
    except ValueError:
        return None
    return ReleaseNotice(request_id, epoch, ok == "1")
