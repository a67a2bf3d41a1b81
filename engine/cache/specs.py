"""Cache specs: what one layer needs cached, described without tensors. Layers with equal specs form a *group*
(its part of every arena page or state slot: arena.py). Dtypes are strings ("float32", "bfloat16", "float16") so the
control plane stays tensor-free; the runner maps them to torch dtypes when it allocates."""

from __future__ import annotations

import math
from dataclasses import dataclass

PAD_SLOT_ID = -1
"""Index of padded rows in every kernel index tensor (slot mapping, state indices): kernels skip it."""
NULL_BLOCK_ID = 0
"""Page 0 and slot 0 are null: never handed out, never hold data anyone reads."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unsupported cache dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class FullAttentionSpec:
    """Paged K/V for one attention layer: a block is K and V of `block_size` tokens, [2, block_size, heads, dim]."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    kind = "attention"

    @property
    def page_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.block_size


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Fixed-size recurrent state of one Mamba-2 or Gated-DeltaNet layer: a conv state and an SSM state."""

    kind: str  # "mamba2" | "gated_deltanet"
    conv_shape: tuple[int, ...]
    conv_dtype: str
    ssm_shape: tuple[int, ...]
    ssm_dtype: str

    @property
    def page_bytes(self) -> int:
        conv, ssm = math.prod(self.conv_shape), math.prod(self.ssm_shape)
        return conv * dtype_bytes(self.conv_dtype) + ssm * dtype_bytes(self.ssm_dtype)


CacheSpec = FullAttentionSpec | RecurrentStateSpec


@dataclass(frozen=True)
class CacheGroup:
    """Layers sharing one spec."""

    group_id: int
    spec: CacheSpec
    layer_ids: tuple[int, ...]

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def is_attention(self) -> bool:
        return isinstance(self.spec, FullAttentionSpec)

    @property
    def page_bytes_all_layers(self) -> int:
        """Bytes of one block (attention) or one state (recurrent) over all layers of the group."""
        return self.spec.page_bytes * len(self.layer_ids)


def group_layers(layer_specs: dict[int, CacheSpec]) -> list[CacheGroup]:
    """Group layers by equal spec, attention groups first, in layer order within a group."""
    by_spec: dict[CacheSpec, list[int]] = {}
    for layer_id in sorted(layer_specs):
        by_spec.setdefault(layer_specs[layer_id], []).append(layer_id)
    ordered = sorted(by_spec.items(), key=lambda kv: (not isinstance(kv[0], FullAttentionSpec), kv[1][0]))
    return [CacheGroup(i, spec, tuple(layers)) for i, (spec, layers) in enumerate(ordered)]
