"""Allocate the caches: one byte arena per device, every group's tensors strided views of it (engine/cache/arena.py
says where each lives and why; engine/cache/overlay.py keeps checkpoint slots off held attention blocks).

    arena (uint8, zeroed)  ->  typed view (arena.view(dtype))  ->  as_strided(per-part shape, strides, offset)
    attention group:  [blocks, layers, 2, block_size, kv_heads, head_dim]   block stride = block_bytes
    recurrent group:  conv [slots, layers, ...], ssm [slots, layers, ...]   slot stride  = k * block_bytes

One page (tensor[i]) is contiguous, so kernels, copies and transfers index blocks and slots by id exactly as with
separate tensors; only dim 0's stride differs. Nothing may make a cache tensor contiguous (that would copy it).
A plan without an arena (no policy, or a model without attention) gets one zeroed tensor per group and kind.

Ownership: the runner calls `allocate_caches` once at start-up and keeps the tensors (and so the arena) alive for
the engine's life; the transfer agent registers their spans (overlapping views merge into one registration).
"""

from __future__ import annotations

import torch
from hybridpd.engine.cache.planner import CapacityPlan
from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.models.layers import TORCH_DTYPES

ARENA_ALIGN = 16


def allocate_caches(groups: list[CacheGroup], plan: CapacityPlan, device: torch.device
                    ) -> dict[int, tuple[torch.Tensor, ...]]:
    """Group id -> its tensors: (kv,) for attention, (conv, ssm) for recurrent groups."""
    if plan.arena is None:
        return {g.group_id: _separate(g, plan, device) for g in groups}
    arena = plan.arena
    size = -(-arena.total_bytes // ARENA_ALIGN) * ARENA_ALIGN
    raw = torch.zeros(size, dtype=torch.uint8, device=device)
    views: dict[int, list[torch.Tensor]] = {g.group_id: [] for g in groups}
    for part in arena.parts:
        dtype = TORCH_DTYPES[part.dtype]
        typed = raw.view(dtype)
        elem = typed.element_size()
        inner = _contiguous_strides(part.shape)
        t = typed.as_strided((part.num_pages, *part.shape), (part.page_stride // elem, *inner), part.offset // elem)
        views[part.group_id].append(t)
    out = {gid: tuple(ts) for gid, ts in views.items()}
    for g in groups:
        assert len(out[g.group_id]) == (1 if g.is_attention else 2), (g.group_id, "missing from the arena")
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _separate(g: CacheGroup, plan: CapacityPlan, device: torch.device) -> tuple[torch.Tensor, ...]:
    spec, n = g.spec, len(g.layer_ids)
    if isinstance(spec, FullAttentionSpec):
        return (torch.zeros(plan.attention_blocks, n, 2, spec.block_size, spec.num_kv_heads, spec.head_dim,
                            dtype=TORCH_DTYPES[spec.dtype], device=device),)
    assert isinstance(spec, RecurrentStateSpec)
    slots = plan.state_slots
    return (torch.zeros(slots, n, *spec.conv_shape, dtype=TORCH_DTYPES[spec.conv_dtype], device=device),
            torch.zeros(slots, n, *spec.ssm_shape, dtype=TORCH_DTYPES[spec.ssm_dtype], device=device))
