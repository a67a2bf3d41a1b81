"""Transfer params as a holder of the cluster token could alter them before handing them to a decode worker.

with_pages_of(tp, other)   tp carrying other's block ids, state slots and checkpoint pages (another prompt's KV
                           under tp's lease) when tp's prompt is no longer than other's
ALTERATIONS                name -> in-place change of one field of a TransferParams (every field, and the mac)
"""

from __future__ import annotations

from collections.abc import Callable

from hybridpd.proto import hybridpd_pb2 as pb


def with_pages_of(tp: pb.TransferParams, other: pb.TransferParams) -> pb.TransferParams:
    """`tp` with `other`'s block ids and state slots (the attack: another prompt's KV under this lease). Each group
    keeps its block count: `other`'s first ids, then `tp`'s own past the end of `other`'s."""
    out = pb.TransferParams()
    out.CopyFrom(tp)
    for g, o in zip(out.groups, other.groups, strict=True):
        n = len(g.block_ids)
        ids = list(o.block_ids[:n]) + list(g.block_ids[len(o.block_ids) : n])
        del g.block_ids[:]
        g.block_ids.extend(ids)
    for s, o in zip(out.states, other.states, strict=True):
        s.state_slot = o.state_slot
    if tp.checkpoint_pages and other.checkpoint_pages:  # params without one stay so: D refuses a half-named one
        del out.checkpoint_pages[:]
        out.checkpoint_pages.extend(other.checkpoint_pages)
    return out


def _bump(field: str, delta: float = 1) -> Callable[[pb.TransferParams], None]:
    def alter(tp: pb.TransferParams) -> None:
        setattr(tp, field, type(getattr(tp, field))(getattr(tp, field) + delta))

    return alter


def _retext(field: str) -> Callable[[pb.TransferParams], None]:
    def alter(tp: pb.TransferParams) -> None:
        setattr(tp, field, getattr(tp, field) + "x")

    return alter


def _first_block(tp: pb.TransferParams) -> None:
    ids = tp.groups[0].block_ids
    ids[0], ids[-1] = ids[-1], ids[0]


def _state(attr: str) -> Callable[[pb.TransferParams], None]:
    def alter(tp: pb.TransferParams) -> None:
        setattr(tp.states[0], attr, getattr(tp.states[0], attr) + 1)

    return alter


def _checkpoint_page(tp: pb.TransferParams) -> None:
    if tp.checkpoint_pages:
        tp.checkpoint_pages[0] += 1
    else:
        tp.checkpoint_pages.append(max(b for g in tp.groups for b in g.block_ids) + 1)


def _flip_mac(tp: pb.TransferParams) -> None:
    tp.mac = bytes([tp.mac[0] ^ 1]) + tp.mac[1:]


ALTERATIONS: dict[str, Callable[[pb.TransferParams], None]] = {
    "worker_id": _retext("worker_id"),
    "epoch": _retext("epoch"),
    "prefill_address": _retext("prefill_address"),
    "block_ids (swapped)": _first_block,
    "block_ids (one more)": lambda tp: tp.groups[0].block_ids.append(max(tp.groups[0].block_ids) + 1),
    "block_ids (other group id)": lambda tp: setattr(tp.groups[0], "group_id", tp.groups[0].group_id + 7),
    "states.state_slot": _state("state_slot"),
    "checkpoint_pages": _checkpoint_page,
    "checkpoint_num_tokens": _bump("checkpoint_num_tokens", -16),
    "num_computed_tokens": _bump("num_computed_tokens", -1),
    "num_prompt_tokens": _bump("num_prompt_tokens"),
    "lease_expiry_unix": _bump("lease_expiry_unix", 3600.0),
    "lease_token": _retext("lease_token"),
    "prompt_digest": lambda tp: setattr(tp, "prompt_digest", bytes(32)),
    "mac (one bit)": _flip_mac,
    "mac (removed)": lambda tp: setattr(tp, "mac", b""),
}
