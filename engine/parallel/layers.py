"""The tensor-parallel building blocks: cutting a linear's rows (column-parallel) or columns (row-parallel, its
output summed over ranks), the vocab-parallel embedding and LM head, and Mamba-2's gated norm when one norm group
spans ranks.

    column-parallel   y_r = x W[rows_r]^T               each rank computes its heads' outputs
    row-parallel      y = sum_r x_r W[:, cols_r]^T + b  partial products summed by one all-reduce (bias added once:
                                                        rank 0 keeps it, the others zero it)
    vocab-parallel    embedding rows [r*V/tp, (r+1)*V/tp) per rank, lookups outside are zero, summed;
                      LM head the same rows, logits gathered in rank order and cut to V
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from hybridpd.engine.parallel.group import TPGroup
from torch import nn


def take_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Keep only output features `rows` (int64 indices) of a linear: column-parallel."""
    linear.weight = nn.Parameter(linear.weight.data[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].contiguous(), requires_grad=False)
    linear.out_features = int(rows.numel())


def take_cols(linear: nn.Linear, cols: torch.Tensor, tp: TPGroup) -> None:
    """Keep only input features `cols` of a linear whose output is summed over ranks; the bias stays on rank 0."""
    linear.weight = nn.Parameter(linear.weight.data[:, cols].contiguous(), requires_grad=False)
    if linear.bias is not None and not tp.is_leader:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features = int(cols.numel())


def all_reduce_output(module: nn.Module, tp: TPGroup) -> None:
    """Sum the module's output over ranks after every forward (the row-parallel end of a block)."""

    def hook(_m: nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        if tp.block_reduce.active:  # the model's next residual norm sums it (engine.parallel.fused_allreduce)
            return out
        return tp.all_reduce(out)

    module.register_forward_hook(hook)


def row_parallel(linear: nn.Linear, cols: torch.Tensor, tp: TPGroup) -> None:
    take_cols(linear, cols, tp)
    all_reduce_output(linear, tp)


def index(ranges: Sequence[range]) -> torch.Tensor:
    """The int64 indices of several ranges, concatenated in order."""
    return torch.tensor([i for r in ranges for i in r], dtype=torch.int64)


def vocab_share(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """[start, end) of the rank's vocabulary rows; every rank holds ceil(V / tp) rows (the last one zero-padded)."""
    per = -(-vocab // tp.world)
    start = tp.rank * per
    return start, min(vocab, start + per)


def _padded_rows(weight: torch.Tensor, vocab: int, tp: TPGroup) -> torch.Tensor:
    start, end = vocab_share(vocab, tp)
    per = -(-vocab // tp.world)
    out = weight.new_zeros(per, weight.shape[1])
    out[: end - start] = weight[start:end]
    return out


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding; a lookup is nonzero on exactly one rank, so the sum is exact."""

    def __init__(self, full: nn.Embedding, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = full.weight.shape[0]
        self.start, self.end = vocab_share(self.vocab, tp)
        self.weight = nn.Parameter(_padded_rows(full.weight.data, self.vocab, tp), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """The rank's vocabulary rows of the LM head; logits of every rank gathered in rank order (every rank gets all
    V logits, so sampling needs no further communication)."""

    def __init__(self, full: nn.Linear, tp: TPGroup, shared: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = full.weight.shape[0]
        weight = shared.weight.data if shared is not None else _padded_rows(full.weight.data, self.vocab, tp)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(hidden, self.weight))[..., : self.vocab]


class SpanningGroupNorm(nn.Module):
    """Mamba-2's gated group RMSNorm when a norm group (intermediate / n_groups channels) is wider than a rank's
    channels (n_groups < tp): the rank's sum of squares is added to those of the other ranks holding the same group
    (ranks r with r * n_groups // tp equal), then each rank normalises its channels. fp32, as the reference."""

    def __init__(self, weight: torch.Tensor, group_size: int, n_groups: int, eps: float, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group_size, self.eps, self.tp = group_size, eps, tp
        mine = tp.rank * n_groups // tp.world
        self.peers = [r for r in range(tp.world) if r * n_groups // tp.world == mine]

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = y.float() * F.silu(gate.float())
        squares = self.tp.all_gather_first(x.pow(2).sum(-1, keepdim=True))  # [tp, ..., 1]
        total = squares[self.peers].sum(0)
        return self.weight.float() * (x * torch.rsqrt(total / self.group_size + self.eps))

    def forward_fused(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.forward(y, gate).to(dtype)


__all__ = [
    "ParallelLMHead",
    "SpanningGroupNorm",
    "VocabParallelEmbedding",
    "all_reduce_output",
    "index",
    "row_parallel",
    "take_cols",
    "take_rows",
    "vocab_share",
]
