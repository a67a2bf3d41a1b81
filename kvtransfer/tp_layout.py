"""A model's cache tensors as `ShardedTensor`s for a given TP size: what a worker puts in its handshake so that a
peer of another TP size can plan its reads (kvtransfer.tp_slices). Built from the model's config numbers alone
(no torch), with the same index rules that cut the model (engine.parallel.partition)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.engine.parallel.partition import flat, gdn_conv_channels, group_share, mamba_conv_channels, split_range
from hybridpd.kvtransfer.tp_slices import ShardedTensor

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class AttentionShape:
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True)
class Mamba2Shape:
    layers: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_dtype: str
    ssm_dtype: str


@dataclass(frozen=True)
class GDNShape:
    layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    conv_dtype: str


def _tensor(name: str, shape: tuple[int, ...], axis: int, dtype: str, held: list[list[int]]) -> ShardedTensor:
    return ShardedTensor(name, shape, axis, ITEMSIZE[dtype], dtype, tuple(tuple(h) for h in held))


def attention_tensors(name: str, a: AttentionShape, tp: int) -> list[ShardedTensor]:
    held = [list(group_share(a.kv_heads, tp, r)) for r in range(tp)]
    return [_tensor(f"{name}.kv", (a.layers, 2, a.block_size, a.kv_heads, a.head_dim), 3, a.dtype, held)]


def mamba2_tensors(name: str, m: Mamba2Shape, tp: int) -> list[ShardedTensor]:
    conv_dim = m.num_heads * m.head_dim + 2 * m.n_groups * m.state_size
    heads = [split_range(m.num_heads, tp, r) for r in range(tp)]
    conv = [
        flat(
            mamba_conv_channels(
                m.num_heads, m.head_dim, m.n_groups, m.state_size, heads[r], group_share(m.n_groups, tp, r)
            )
        )
        for r in range(tp)
    ]
    return [
        _tensor(f"{name}.conv", (m.layers, conv_dim, m.conv_kernel - 1), 1, m.conv_dtype, conv),
        _tensor(
            f"{name}.ssm", (m.layers, m.num_heads, m.head_dim, m.state_size), 1, m.ssm_dtype, [list(h) for h in heads]
        ),
    ]


def gdn_tensors(name: str, g: GDNShape, tp: int) -> list[ShardedTensor]:
    conv_dim = 2 * g.num_k_heads * g.head_k_dim + g.num_v_heads * g.head_v_dim
    values = [split_range(g.num_v_heads, tp, r) for r in range(tp)]
    conv = [
        flat(gdn_conv_channels(g.num_k_heads, g.head_k_dim, g.head_v_dim, group_share(g.num_k_heads, tp, r), values[r]))
        for r in range(tp)
    ]
    return [
        _tensor(f"{name}.conv", (g.layers, conv_dim, g.conv_kernel - 1), 1, g.conv_dtype, conv),
        _tensor(
            f"{name}.ssm",
            (g.layers, g.num_v_heads, g.head_k_dim, g.head_v_dim),
            1,
            "float32",
            [list(v) for v in values],
        ),
    ]


__all__ = ["AttentionShape", "GDNShape", "Mamba2Shape", "attention_tensors", "gdn_tensors", "mamba2_tensors"]
