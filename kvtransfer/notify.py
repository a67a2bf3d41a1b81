"""The release notification D sends P over NIXL once a pull is over (data in place, or given up).

    b"hpdkv2|release|<P epoch>|<ok 1/0>|<lease token>|<request id>"

P's worker drains them with `TransferAgent.poll_releases()` and passes each to `LeaseTable.release(request_id,
epoch, token)`, which refuses a stale epoch (a release meant for P's previous incarnation must not free a new request
that reuses the id) and a wrong lease token (NIXL notifications are not authenticated: only the holder of the
transfer params can end a lease early). A request id may contain "|": it is the last field.
"""

from __future__ import annotations

from typing import NamedTuple

_PREFIX = b"hpdkv2|release|"


class ReleaseNotice(NamedTuple):
    """D is done with P's blocks of `request_id` (`ok`: the data arrived; else D gave up and recomputes)."""

    request_id: str
    epoch: str
    ok: bool
    token: str = ""


def encode_release(request_id: str, epoch: str, ok: bool, token: str = "") -> bytes:
    if "|" in epoch or "|" in token:
        raise ValueError(f"epoch {epoch!r} and lease token {token!r} must not contain '|'")
    return _PREFIX + f"{epoch}|{int(ok)}|{token}|{request_id}".encode()


def decode_release(msg: bytes) -> ReleaseNotice | None:
    """The notice in `msg`, or None if `msg` is not a release notification (other traffic is ignored)."""
    if not msg.startswith(_PREFIX):
        return None
    try:
        epoch, ok, token, request_id = msg[len(_PREFIX) :].decode().split("|", 3)
    except ValueError:
        return None
    return ReleaseNotice(request_id, epoch, ok == "1", token)
