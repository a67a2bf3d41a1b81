"""Handoffs between workers of different tensor-parallel sizes: which bytes of which P rank's page a D rank reads.

Each rank of a worker holds, for every cache tensor, a slice of one axis of the whole model's page (engine.parallel
.partition decides which indices, the same code that cut the model):

    attention page   [layers, 2, block_size, KV heads, head_dim]   axis 3: its KV heads
    Mamba-2 conv     [layers, conv_dim, K-1]                       axis 1: | x of its heads | B, C of its groups |
    Mamba-2 SSM      [layers, heads, head_dim, state]              axis 1: its heads
    GDN conv         [layers, conv_dim, K-1]                       axis 1: | q, k of its key heads | v of its values |
    GDN state        [layers, value heads, dk, dv]                 axis 1: its value heads

A D rank's page is rebuilt from pieces: for each index it holds (in its order), a P rank that holds the same index
(replicated indices: the lowest such rank), at that rank's position. Runs of consecutive positions on both sides
coalesce into one piece per outer index (layers, K/V, token), so the plan is a short list of
(p_rank, src_offset, dst_offset, nbytes) byte ranges inside one page, made once per peer pair; a transfer applies
it to every page it moves (page base addresses differ, offsets don't).

`ShardedTensor`, one tensor's slicing as both workers describe it in their handshake, and `incompatibilities` (the
handshake check) are here too: anything but the TP size and the slicing that follows from it must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ShardedTensor:
    """One cache tensor's page, as the ranks of one worker hold it.

    `page_shape` is the whole model's page (the axis at full size); `held[r]` the global indices along `axis` that
    rank r holds, in its local order (its local page is page_shape with that axis of len(held[r]))."""

    name: str
    page_shape: tuple[int, ...]
    axis: int
    itemsize: int
    dtype: str
    held: tuple[tuple[int, ...], ...]

    @property
    def tp_size(self) -> int:
        return len(self.held)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.page_shape)
        shape[self.axis] = len(self.held[rank])
        return tuple(shape)

    def describe(self) -> dict[str, str]:
        """What the handshake compares (the TP size and held indices may differ between P and D)."""
        return {
            f"{self.name}.page_shape": str(self.page_shape),
            f"{self.name}.axis": str(self.axis),
            f"{self.name}.dtype": self.dtype,
        }


class Piece(NamedTuple):
    """Bytes [src_offset, src_offset + nbytes) of the P rank's page go to [dst_offset, ...) of the D rank's page."""

    src_rank: int
    src_offset: int
    dst_offset: int
    nbytes: int


def incompatibilities(mine: list[ShardedTensor], peer: list[ShardedTensor]) -> list[str]:
    """Why two workers cannot trade pages across TP sizes (empty: they can): tensors, global page shapes, sliced
    axes and dtypes must agree; every index a rank of mine holds must be held by some rank of the peer."""
    out: list[str] = []
    if [t.name for t in mine] != [t.name for t in peer]:
        return [f"cache tensors differ: {[t.name for t in mine]} (here) != {[t.name for t in peer]} (peer)"]
    for a, b in zip(mine, peer, strict=True):
        da, db = a.describe(), b.describe()
        out += [f"{k}: {da[k]!r} (here) != {db[k]!r} (peer)" for k in da if da[k] != db[k]]
        if da == db:
            have = {i for held in b.held for i in held}
            missing = sorted({i for held in a.held for i in held} - have)
            if missing:
                out.append(f"{a.name}: indices {missing[:8]} held by no peer rank")
    return out


def in_group_order(tensors: dict[int, list[ShardedTensor]]) -> list[ShardedTensor]:
    """Every cache group's tensors, group by group in id order: how two workers' tensors are paired."""
    return [t for g in sorted(tensors) for t in tensors[g]]


def same_slicing(mine: list[ShardedTensor], peer: list[ShardedTensor]) -> bool:
    """Whether two workers cut every cache tensor alike (equal TP sizes, each rank holding the same indices): a page
    then moves whole, rank r to rank r, and a checkpoint's pages with it (they cut the state at page bounds)."""
    return len(mine) == len(peer) and all(
        (a.name, a.page_shape, a.axis, a.dtype, a.held) == (b.name, b.page_shape, b.axis, b.dtype, b.held)
        for a, b in zip(mine, peer, strict=True)
    )


def plan_pieces(src: ShardedTensor, dst: ShardedTensor, dst_rank: int) -> list[Piece]:
    """The pieces that rebuild D rank `dst_rank`'s page of this tensor from the P ranks' pages (sorted by P rank,
    then destination offset). Raises ValueError if the two describe different tensors."""
    bad = incompatibilities([dst], [src])
    if bad:
        raise ValueError("; ".join(bad))
    owner: dict[int, tuple[int, int]] = {}  # global index -> (P rank, position there); lowest rank wins
    for rank in reversed(range(src.tp_size)):
        for pos, i in enumerate(src.held[rank]):
            owner[i] = (rank, pos)
    runs = _runs([owner[i] for i in dst.held[dst_rank]])
    shape = src.page_shape
    outer = math.prod(shape[: src.axis])
    inner = math.prod(shape[src.axis + 1 :]) * src.itemsize
    n_src = {r: len(h) for r, h in enumerate(src.held)}
    n_dst = len(dst.held[dst_rank])
    pieces = []
    for o in range(outer):
        for rank, src_pos, dst_pos, count in runs:
            pieces.append(
                Piece(rank, (o * n_src[rank] + src_pos) * inner, (o * n_dst + dst_pos) * inner, count * inner)
            )
    return _coalesce(sorted(pieces, key=lambda p: (p.src_rank, p.dst_offset)))


def _runs(sources: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """(P rank, first P position, first D position, count) for runs of consecutive D positions whose sources are
    consecutive positions of one P rank."""
    runs: list[tuple[int, int, int, int]] = []
    for d, (rank, pos) in enumerate(sources):
        if runs:
            r, p0, d0, n = runs[-1]
            if r == rank and p0 + n == pos and d0 + n == d:
                runs[-1] = (r, p0, d0, n + 1)
                continue
        runs.append((rank, pos, d, 1))
    return runs


def _coalesce(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if out:
            q = out[-1]
            if (
                q.src_rank == p.src_rank
                and q.src_offset + q.nbytes == p.src_offset
                and q.dst_offset + q.nbytes == p.dst_offset
            ):
                out[-1] = q._replace(nbytes=q.nbytes + p.nbytes)
                continue
        out.append(p)
    return out


def plan_peer(src: list[ShardedTensor], dst: list[ShardedTensor], dst_rank: int) -> dict[str, dict[int, list[Piece]]]:
    """Every tensor's pieces for one D rank, grouped by the P rank they are read from: {tensor: {p_rank: pieces}}
    (a D rank opens a connection only to the P ranks that appear)."""
    out: dict[str, dict[int, list[Piece]]] = {}
    for s, d in zip(src, dst, strict=True):
        by_rank: dict[int, list[Piece]] = {}
        for p in plan_pieces(s, d, dst_rank):
            by_rank.setdefault(p.src_rank, []).append(p)
        out[d.name] = by_rank
    return out


__all__ = ["Piece", "ShardedTensor", "in_group_order", "incompatibilities", "plan_peer", "plan_pieces", "same_slicing"]
