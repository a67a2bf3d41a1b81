"""Allocate the caches: one byte arena per device, every group's tensors strided views of it (engine/cache/arena.py
says where each lives and why).

    arena (uint8, zeroed)  ->  typed view (arena.view(dtype))  ->  as_strided(per-part shape, strides, offset)
    attention group:  [pages, layers, 2, block_size, kv_heads, head_dim]   page stride = page_bytes
    recurrent group:  conv [slots, layers, ...], ssm [slots, layers, ...]   slot stride = k * page_bytes
    rows:             [slots * k + pages, page_bytes]                        checkpoint saves and restores

One page (tensor[i]) is contiguous, so kernels, copies and transfers index blocks and slots by id exactly as with
separate tensors; only dim 0's stride differs. Nothing may make a cache tensor contiguous (that would copy it).

Ownership: the runner calls `allocate_caches` once at start-up and keeps the tensors (and so the arena) alive for
the engine's life; the transfer agent registers their spans (overlapping views merge into one registration).
"""

from __future__ import annotations

import torch
from hybridpd.engine.cache.planner import CapacityPlan
from hybridpd.engine.cache.specs import CacheGroup
from hybridpd.engine.models.layers import TORCH_DTYPES


def allocate_caches(groups: list[CacheGroup], plan: CapacityPlan, device: torch.device
                    ) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, ...]]]:
    """The arena's rows ([rows, page_bytes / 8] int64: slot s is rows s*k .. s*k+k-1, page j row num_slots*k + j)
    and group id -> its tensors: (kv,) for attention, (conv, ssm) for recurrent groups."""
    arena = plan.arena
    assert arena is not None and arena.page_bytes % 16 == 0, "pages are padded to 16 bytes"
    raw = torch.zeros(arena.total_bytes, dtype=torch.uint8, device=device)
    views: dict[int, list[torch.Tensor]] = {g.group_id: [] for g in groups}
    for part in arena.parts:
        typed = raw.view(TORCH_DTYPES[part.dtype])
        elem = typed.element_size()
        inner = _contiguous_strides(part.shape)
        t = typed.as_strided((part.num_pages, *part.shape), (part.page_stride // elem, *inner), part.offset // elem)
        views[part.group_id].append(t)
    out = {gid: tuple(ts) for gid, ts in views.items()}
    for g in groups:
        assert len(out[g.group_id]) == (1 if g.is_attention else 2), (g.group_id, "missing from the arena")
    return raw.view(torch.int64).view(-1, arena.page_bytes // 8), out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))
