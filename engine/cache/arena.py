"""One arena backs every cache: where each group's pages live in it, described without tensors.

The runner allocates one byte buffer per device (engine/arena.py); every cache tensor the kernels index is a strided
view of it (`ArenaPart`). Two regions:

    byte 0                                  R = num_slots * slot_stride
    | slot 0 (null) | slot 1 | ... | slot n |  page 0 (null) | page 1 | page 2 | ...        | page P-1 |
      running and staging state slots          attention blocks and checkpoints, one page at a time

- A *page* (`page_bytes`) is block j of every attention group, back to back: an attention block, or one of the k =
  ceil(state_bytes / page_bytes) pieces of a checkpoint (the state of every recurrent group), in any k free pages.
- A *slot* is one state of every recurrent group in k page-sized rows (slot_stride = k * page_bytes). Kernels read
  and write slots only: a request's running state, and (staging) a checkpoint inside a prefill chunk. A save copies
  a slot's k rows to its checkpoint's pages after the step, a restore copies them back before it: one row copy over
  the arena seen as [rows, page_bytes] (slot s = rows s*k .. s*k+k-1, page j = row num_slots*k + j).
- A model without attention: a page is one state (k = 1); pages hold checkpoints only.

Parts start at multiples of 16 bytes and pages are padded to 16 (no gap between attention parts a transfer skips).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec, dtype_bytes

PART_ALIGN = 16
STAGING_SLOTS = 2
"""State slots beyond max_num_seqs: a checkpoint inside a prefill chunk is written into a free slot first."""


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
    page_bytes: int
    """One page: block j of every attention group (a model without attention: one state)."""
    state_bytes: int
    """One state of every recurrent group (0: no recurrent group)."""
    pages_per_state: int
    """k: the pages one checkpoint takes (0: no recurrent group)."""
    num_slots: int
    """State slots: null, running, staging (0: no recurrent group)."""
    num_pages: int
    """P: pages, the null page 0 included."""
    parts: tuple[ArenaPart, ...]

    @property
    def slot_stride(self) -> int:
        return self.pages_per_state * self.page_bytes

    @property
    def pages_offset(self) -> int:
        """R: where page 0 starts."""
        return self.num_slots * self.slot_stride

    @property
    def first_page_row(self) -> int:
        """Row (of page_bytes) of page 0."""
        return self.num_slots * self.pages_per_state

    @property
    def total_bytes(self) -> int:
        return self.pages_offset + self.num_pages * self.page_bytes

    @property
    def pages_are_blocks(self) -> bool:
        """Whether block j of every attention group, together, is all of page j (no gap between the parts)."""
        kv = [p for p in self.parts if p.name == "kv"]
        return bool(kv) and sum(p.page_bytes for p in kv) == self.page_bytes

    def slot_rows(self, slot: int) -> range:
        k = self.pages_per_state
        return range(slot * k, slot * k + k)


def _align(n: int) -> int:
    return -(-n // PART_ALIGN) * PART_ALIGN


def _page_parts(groups: list[CacheGroup]) -> tuple[list[tuple[CacheGroup, str, str, tuple[int, ...], int]], int]:
    """[(group, name, dtype, shape, offset within the page)], page bytes (aligned)."""
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
    return out, _align(pos)


def plan_arena(groups: list[CacheGroup], budget_bytes: int, max_num_seqs: int) -> ArenaLayout:
    """The largest arena within `budget_bytes`: 1 + max_num_seqs + STAGING_SLOTS state slots, pages for the rest."""
    a_parts, block_bytes = _page_parts([g for g in groups if g.is_attention])
    s_parts, state_bytes = _page_parts([g for g in groups if not g.is_attention])
    page_bytes = block_bytes or state_bytes
    k = -(-state_bytes // page_bytes) if state_bytes else 0
    num_slots = 1 + max_num_seqs + STAGING_SLOTS if state_bytes else 0
    reserved = num_slots * k * page_bytes
    pages = max(0, (budget_bytes - reserved) // page_bytes) if page_bytes else 0
    layout = ArenaLayout(page_bytes, state_bytes, k, num_slots, pages, ())
    parts = [
        ArenaPart(g.group_id, name, dtype, layout.pages_offset + off, page_bytes, pages, shape)
        for g, name, dtype, shape, off in a_parts
    ]
    parts += [
        ArenaPart(g.group_id, name, dtype, off, layout.slot_stride, num_slots, shape)
        for g, name, dtype, shape, off in s_parts
    ]
    for p in parts:
        elem = dtype_bytes(p.dtype)
        if p.offset % elem or p.page_stride % elem:
            raise ValueError(
                f"arena part g{p.group_id}.{p.name}: offset {p.offset} / stride {p.page_stride} B are "
                f"not multiples of its {elem}-byte dtype"
            )
    return ArenaLayout(page_bytes, state_bytes, k, num_slots, pages, tuple(parts))
