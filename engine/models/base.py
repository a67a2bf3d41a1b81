"""The contract between the runner and a model family.

Ownership: the runner allocates every cache tensor (from `cache_specs`) once at start-up and passes them to
`forward` each step; the model reads and writes them in place and never allocates cache memory itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from hybridpd.engine.cache.specs import CacheSpec
from hybridpd.engine.models.batch import ForwardBatch

if TYPE_CHECKING:
    from hybridpd.engine.models.varlen import VarlenBatch


@dataclass
class AttentionCache:
    kv: torch.Tensor
    """[num_blocks, 2, block_size, num_kv_heads, head_dim]; [:, 0] is K, [:, 1] is V. Block 0 = null block."""


@dataclass
class StateCache:
    conv: torch.Tensor
    """[num_slots, *conv_shape]. Slot 0 = null slot, never read or written."""
    ssm: torch.Tensor
    """[num_slots, *ssm_shape]."""


LayerCache = AttentionCache | StateCache | None
"""Per layer: AttentionCache for attention layers, StateCache for recurrent layers, None for MLP/MoE layers."""


class CausalLM(Protocol):
    """What every model family provides (see engine.models.registry.load_model). Two forwards compute the same
    thing: the readable reference (per-sequence loops, any device) and the batched path (engine.models.fast_path,
    CUDA kernels); the runner picks one at construction and calls only that one."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def cache_specs(self, block_size: int) -> dict[int, CacheSpec]:
        """Cache spec for every layer that needs a cache, keyed by layer index."""
        ...

    def forward_reference(self, batch: ForwardBatch, caches: list[LayerCache]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every flat token of the batch."""
        ...

    def forward_varlen(self, batch: VarlenBatch, caches: list[LayerCache]) -> torch.Tensor:
        """The same on the batched path (after `enable_fast_path`)."""
        ...

    def enable_fast_path(self) -> None:
        """Prepare the weights for `forward_varlen` (fused GEMMs, stacked experts); once, before its first call."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32, [n, vocab]."""
        ...


def residual_norms(model: Any, rows: int, dtype: torch.dtype) -> Any:
    """A context giving the batched forward its residual norm, with `rms_norm`'s call: the kernel itself, or under
    tensor parallelism with a fused all-reduce (engine.parallel.fused_allreduce) one that also sums the block's
    partial output over the ranks."""
    from hybridpd.engine.kernels.fused import rms_norm

    reduce = getattr(model, "block_reduce", None)
    return contextlib.nullcontext(rms_norm) if reduce is None else reduce.scope(rows, dtype)
