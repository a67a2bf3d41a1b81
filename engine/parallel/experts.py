"""Expert parallelism inside a tensor-parallel worker: each rank keeps whole routed experts instead of a slice of
every expert (`--enable-expert-parallel`).

    rank r of tp holds routed experts [r * E/tp, (r+1) * E/tp), whole, plus a slice of the shared expert
    every rank routes every token (the router is replicated): a token's choice of a remote expert becomes the
    rank's "no expert" slot with weight 0, so the rank adds only its own experts' contributions; the block's
    output (routed + shared partial sums) is summed over ranks by the same one all-reduce as TP inside experts

Why: at decode, a batch touches a subset of the experts; whole experts give each grouped GEMM full rows of work
and let a rank skip the weights of experts nobody chose, where TP inside experts reads a 1/tp slice of every
chosen expert on every rank. The "no expert" slot is one zero-weight expert appended to the rank's list, so the
model's routed paths (grouped GEMM, masked, per-expert loop) run unchanged: its rows cost one expert's work and
contribute exactly 0.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from hybridpd.engine.parallel.group import TPGroup
from torch import nn


class LocalRouter(nn.Module):
    """The replicated router, its choices renumbered to the rank's experts: (weights with remote choices zeroed,
    local ids with remote choices sent to the no-expert slot `per`)."""

    def __init__(self, router: nn.Module, first: int, per: int) -> None:
        super().__init__()
        self.router, self.first, self.per = router, first, per

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, idx = self.router(h)
        local = (idx >= self.first) & (idx < self.first + self.per)
        return weights * local, torch.where(local, idx - self.first, self.per)


def shard_moe_experts(
    m: nn.Module, tp: TPGroup, split_mlp: Callable[[list[nn.Linear], nn.Linear, TPGroup], None]
) -> None:
    """Expert parallelism for one MoE block, in place. `split_mlp(up, down, tp)` cuts the shared expert as TP
    inside experts does. Raises ValueError when the routed experts cannot be divided over the ranks."""
    experts = list(m.experts)  # type: ignore[arg-type]
    if len(experts) % tp.world:
        raise ValueError(
            f"expert parallelism: {len(experts)} routed experts cannot be divided over {tp.world} ranks "
            "(use tensor parallelism inside the experts: drop --enable-expert-parallel)"
        )
    per = len(experts) // tp.world
    first = tp.rank * per
    none = copy.deepcopy(experts[0])
    for p in none.parameters():
        p.data.zero_()
    m.experts = nn.ModuleList([*experts[first : first + per], none])
    m.gate = LocalRouter(m.gate, first, per)  # type: ignore[arg-type]
    shared: Any = m.shared_experts
    split_mlp([shared.up_proj], shared.down_proj, tp)


__all__ = ["LocalRouter", "shard_moe_experts"]
