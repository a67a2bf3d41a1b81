"""Moving an import's pages between engines of different tensor-parallel sizes with the planned pieces
(kvtransfer.tp_slices): each D rank's slice of every page is rebuilt from the P ranks' slices, byte range by byte
range, as a per-rank NIXL READ would. The transport here is the ranks' control channel (pages gathered from the P
ranks, scattered to the D ranks): the in-process reference that tests the plan on the real caches, not a serving
path.

    P ranks: read_pages(ids) ---gather---> pieces per D rank ---broadcast---> D ranks: write_pages(ids)
"""

from __future__ import annotations

from typing import Any

import torch
from hybridpd.engine.cache.specs import FullAttentionSpec
from hybridpd.engine.parallel.executor import LeaderRunner
from hybridpd.kvtransfer.tp_layout import (
    AttentionShape,
    GDNShape,
    Mamba2Shape,
    attention_tensors,
    gdn_tensors,
    mamba2_tensors,
)
from hybridpd.kvtransfer.tp_slices import (
    ShardedTensor,
    in_group_order,
    incompatibilities,
    plan_pieces,
    same_slicing,
)


def cache_tensors(core: Any) -> dict[int, list[ShardedTensor]]:
    """Every cache group's tensors (in the runner's order: attention (kv,), recurrent (conv, ssm)) as ShardedTensors
    of the engine's TP size, from the whole model's shapes."""
    return sharded_tensors(core.model, core.groups, core.tp.world if core.tp is not None else 1)


def sharded_tensors(model: Any, groups: Any, tp: int) -> dict[int, list[ShardedTensor]]:
    """`cache_tensors` from a model (any rank's: the whole model's shapes are kept in `full_args`), its cache
    groups and the TP size."""
    a = getattr(model, "full_args", model.args)
    out: dict[int, list[ShardedTensor]] = {}
    for g in groups:
        n, spec, name = len(g.layer_ids), g.spec, f"g{g.group_id}"
        if isinstance(spec, FullAttentionSpec):
            shape = AttentionShape(n, spec.block_size, a.num_key_value_heads, a.head_dim, spec.dtype)
            out[g.group_id] = attention_tensors(name, shape, tp)
        elif spec.kind == "mamba2":
            m = a.mamba
            out[g.group_id] = mamba2_tensors(
                name,
                Mamba2Shape(
                    n, m.num_heads, m.head_dim, m.n_groups, m.state_size, m.conv_kernel, spec.conv_dtype, spec.ssm_dtype
                ),
                tp,
            )
        else:
            c = a.gdn
            shape_gdn = GDNShape(
                n, c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.conv_kernel, spec.conv_dtype
            )
            out[g.group_id] = gdn_tensors(name, shape_gdn, tp)
    return out


def read_pages(runner: Any, rank: int, group_id: int, ids: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(ids, dtype=torch.int64)
    return [t.index_select(0, index.to(t.device)).cpu() for t in runner.group_tensors[group_id]]


def write_pages(runner: Any, rank: int, group_id: int, ids: list[int], payload: list[list[torch.Tensor]]) -> None:
    index = torch.tensor(ids, dtype=torch.int64)
    for t, pages in zip(runner.group_tensors[group_id], payload[rank], strict=True):
        t.index_copy_(0, index.to(t.device), pages.to(t.device))


def on_ranks(core: Any, fn: Any, *args: Any) -> list[Any]:
    """fn(runner, rank, *args) on every rank of the engine, results in rank order."""
    runner = core.runner
    if isinstance(runner, LeaderRunner):
        return runner.on_all(fn, *args)
    return [fn(runner, 0, *args)]


def _as_bytes(pages: torch.Tensor) -> torch.Tensor:
    return pages.reshape(pages.shape[0], -1).view(torch.uint8)


def _rebuild(src: ShardedTensor, dst: ShardedTensor, rank: int, pages: list[torch.Tensor]) -> torch.Tensor:
    """D rank `rank`'s pages of one tensor from every P rank's pages of it ([n, *local shape] each)."""
    n = pages[0].shape[0]
    out = torch.empty((n, *dst.local_shape(rank)), dtype=pages[0].dtype)
    out_bytes, src_bytes = _as_bytes(out), [_as_bytes(p) for p in pages]
    for p in plan_pieces(src, dst, rank):
        out_bytes[:, p.dst_offset : p.dst_offset + p.nbytes] = src_bytes[p.src_rank][
            :, p.src_offset : p.src_offset + p.nbytes
        ]
    return out


def copy_import(src_core: Any, dst_core: Any, imp: Any) -> None:
    """Fill `imp`'s destination pages on every rank of `dst_core` from its source pages on the ranks of `src_core`
    (engine.transfer.Import; any two TP sizes the model's heads allow). Raises ValueError if the two engines'
    layouts cannot trade pages (the handshake's refusal)."""
    src_t, dst_t = cache_tensors(src_core), cache_tensors(dst_core)
    flat_src, flat_dst = in_group_order(src_t), in_group_order(dst_t)
    bad = incompatibilities(flat_dst, flat_src)
    if bad:
        raise ValueError("peer refused: " + "; ".join(bad))
    if imp.src_checkpoint_pages and not same_slicing(flat_dst, flat_src):
        raise ValueError("a checkpoint's pages move whole only between engines that slice every tensor alike")
    d_world = dst_core.tp.world if dst_core.tp is not None else 1
    for src_map, dst_map in (imp.read_blocks(), (imp.src_state_slots, imp.dst_state_slots)):
        for gid, src_ids in src_map.items():
            if not src_ids:
                continue
            pages = on_ranks(src_core, read_pages, gid, list(src_ids))  # [P rank][tensor]
            payload = [
                [
                    _rebuild(s, d, rank, [p[k] for p in pages])
                    for k, (s, d) in enumerate(zip(src_t[gid], dst_t[gid], strict=True))
                ]
                for rank in range(d_world)
            ]
            on_ranks(dst_core, write_pages, gid, list(dst_map[gid]), payload)


__all__ = ["cache_tensors", "copy_import", "on_ranks", "sharded_tensors"]
