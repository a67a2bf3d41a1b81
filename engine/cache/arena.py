"""One arena backs every cache pool: where each group's pages live in it, described without tensors.

The runner allocates one byte buffer per device (engine/arena.py) and every cache tensor the kernels index is a
strided view of it, described here by an `ArenaPart`. State slot `s` is one page of `slot_stride = k * block_bytes`
bytes (the state of every recurrent group, conv then ssm per group, rounded up to k whole attention blocks);
attention block `j` is one page of `block_bytes` (block j of every attention group, back to back):

    byte 0                                  R = F * slot_stride
    | slot 0 (null) | slot 1 | ... | slot S |  block 0 (null) ... block k-1 | block k ... block 2k-1 | ...
                     running slots (reserved)  \\_______ slot F (pinned) ___/ \\___ slot F + 1 ____/   ...
    F = 1 + S (S = max_num_seqs): slot s starts at s * slot_stride for every s, so checkpoint slot F + c
    (c = 1 .. C) is the same memory as attention blocks [c * k, (c + 1) * k).

Slot F would cover the null block 0, so it is pinned (never handed out) and blocks 1 .. k-1 are plain attention
blocks; with the null block on that side no slot ever touches it (a uniform slot stride makes this the only
placement where the last running slot and block 0 do not overlap). C = A // k - 1 (A attention blocks), capped by
`num_checkpoint_slots`. The control plane (overlay.py) never lets a held checkpoint slot and a held or cached
attention block share memory.

Alignment: each group's part of a page starts at a multiple of 16 bytes (the page strides are whatever the
natural pages give: one attention group keeps its contiguous [blocks, layers, 2, bs, heads, dim] tensor).
Tensor-free: dtypes are strings; the runner maps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec, dtype_bytes

PART_ALIGN = 16


@dataclass(frozen=True)
class ArenaPart:
    """One tensor view: page `i` (a block or a slot id) is `shape` (layers first, contiguous) at
    `offset + i * page_stride` bytes into the arena."""

    group_id: int
    name: str
    """"kv" (attention), "conv" or "ssm" (recurrent)."""
    dtype: str
    offset: int
    page_stride: int
    num_pages: int
    shape: tuple[int, ...]

    @property
    def page_bytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class ArenaLayout:
    block_bytes: int
    """One attention block id across every attention group (parts aligned), the unit of the attention region."""
    state_bytes: int
    """One state slot id across every recurrent group (parts aligned)."""
    blocks_per_slot: int
    """k = ceil(state_bytes / block_bytes): the attention blocks one checkpoint slot covers."""
    attention_blocks: int
    running_slots: int
    """S: slots 1 .. S are reserved for running requests (never overlay anything)."""
    checkpoint_slots: int
    """C: checkpoint ids F + 1 .. F + C (F = 1 + S), each covering k attention blocks."""
    parts: tuple[ArenaPart, ...]

    @property
    def first_overlay_slot(self) -> int:
        """F: the pinned slot over blocks [0, k); checkpoint c is slot F + c."""
        return 1 + self.running_slots

    @property
    def state_slots(self) -> int:
        """Ids of every state pool: null, running, the pinned F, checkpoints."""
        return self.first_overlay_slot + 1 + self.checkpoint_slots if self.state_bytes else 0

    @property
    def slot_stride(self) -> int:
        return self.blocks_per_slot * self.block_bytes

    @property
    def attention_offset(self) -> int:
        """R: where block 0 starts."""
        return self.first_overlay_slot * self.slot_stride if self.state_bytes else 0

    @property
    def total_bytes(self) -> int:
        """The arena's size: the attention region's end (or the last slot's, when fewer than k blocks fit)."""
        end = self.attention_offset + self.attention_blocks * self.block_bytes
        if self.state_bytes:
            end = max(end, (self.state_slots - 1) * self.slot_stride + self.state_bytes)
        return end


def _align(n: int) -> int:
    return -(-n // PART_ALIGN) * PART_ALIGN


def _page_parts(groups: list[CacheGroup]) -> tuple[list[tuple[CacheGroup, str, str, tuple[int, ...], int]], int]:
    """[(group, name, dtype, shape, offset within the page)], page bytes (parts aligned, the last not padded)."""
    out: list[tuple[CacheGroup, str, str, tuple[int, ...], int]] = []
    pos = 0
    for g in groups:
        n, spec = len(g.layer_ids), g.spec
        items: list[tuple[str, str, tuple[int, ...]]]
        if isinstance(spec, FullAttentionSpec):
            items = [("kv", spec.dtype, (n, 2, spec.block_size, spec.num_kv_heads, spec.head_dim))]
        else:
            assert isinstance(spec, RecurrentStateSpec)
            items = [("conv", spec.conv_dtype, (n, *spec.conv_shape)), ("ssm", spec.ssm_dtype, (n, *spec.ssm_shape))]
        for name, dtype, shape in items:
            pos = _align(pos)
            out.append((g, name, dtype, shape, pos))
            pos += math.prod(shape) * dtype_bytes(dtype)
    return out, pos


def plan_arena(
    groups: list[CacheGroup], budget_bytes: int, max_num_seqs: int, max_checkpoint_slots: int | None
) -> ArenaLayout:
    """The largest arena within `budget_bytes`: S = max_num_seqs running slots reserved, the rest attention blocks,
    checkpoint ids over them. Raises ValueError for a layout without attention (nothing to overlay)."""
    attn = [g for g in groups if g.is_attention]
    rec = [g for g in groups if not g.is_attention]
    if not attn:
        raise ValueError("the arena needs an attention group (a states-only model keeps separate state slots)")
    a_parts, block_bytes = _page_parts(attn)
    s_parts, state_bytes = _page_parts(rec)
    k = -(-state_bytes // block_bytes) if rec else 0
    reserved = (1 + max_num_seqs) * k * block_bytes
    blocks = max(0, (budget_bytes - reserved) // block_bytes)
    ckpt = max(0, blocks // k - 1) if rec else 0
    if max_checkpoint_slots is not None:
        ckpt = min(ckpt, max_checkpoint_slots)
    layout = ArenaLayout(block_bytes, state_bytes, k, blocks, max_num_seqs if rec else 0, ckpt, ())
    parts = [
        ArenaPart(g.group_id, name, dtype, layout.attention_offset + off, block_bytes, blocks, shape)
        for g, name, dtype, shape, off in a_parts
    ]
    parts += [
        ArenaPart(g.group_id, name, dtype, off, layout.slot_stride, layout.state_slots, shape)
        for g, name, dtype, shape, off in s_parts
    ]
    for p in parts:
        elem = dtype_bytes(p.dtype)
        if p.offset % elem or p.page_stride % elem:
            raise ValueError(
                f"arena part g{p.group_id}.{p.name}: offset {p.offset} / stride {p.page_stride} B are "
                f"not multiples of its {elem}-byte dtype"
            )
    return ArenaLayout(block_bytes, state_bytes, k, blocks, layout.running_slots, ckpt, tuple(parts))
