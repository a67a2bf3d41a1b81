"""The sparse MoE block of Qwen3.5-MoE (transformers' `Qwen3_5MoeSparseMoeBlock`): a softmax router, top-k routed
SwiGLU experts and a shared SwiGLU expert behind a sigmoid gate.

    p = softmax(router(x));  (w, e) = top-k of p;  w = w / sum(w)
    out(x) = sum_k w_k * expert_{e_k}(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    expert(x) = down(silu(gate(x)) * up(x))

Paths: the reference loops over the experts the batch chose (a host sync per step: eager only); the fast path
(`fuse`, bf16 on CUDA) runs the routed experts as two grouped GEMMs over the tokens sorted by expert, with no host
sync (CUDA graphs), and fp32 on the GPU runs every expert on every token weighted by its routing weight (also no
sync). Routed outputs are summed in fp32. Tensor parallelism cuts every expert's and the shared expert's
intermediate width (engine.parallel.shard); the router and the shared gate are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hybridpd.engine.models.fast_path import grouped_moe_available, moe_routed_masked, sort_by_expert
from hybridpd.engine.models.layers import GatedMLP
from torch import nn


@dataclass(frozen=True)
class SparseMoeArgs:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> SparseMoeArgs | None:
        """None when the config has no routed experts (a dense Qwen3.5)."""
        experts = int(cfg.get("num_experts") or 0)
        if experts <= 0:
            return None
        top_k = int(cfg.get("num_experts_per_tok", 8))
        if not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
        return cls(experts, top_k, int(cfg.get("moe_intermediate_size", 512)),
                   int(cfg.get("shared_expert_intermediate_size", 512)))


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, m: SparseMoeArgs, act: str) -> None:
        super().__init__()
        self.top_k = m.top_k
        self.gate = nn.Linear(hidden_size, m.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, m.intermediate_size, act) for _ in range(m.num_experts))
        self.shared_expert = GatedMLP(hidden_size, m.shared_intermediate_size, act)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.stacked_gate_up: torch.Tensor | None = None
        """[E, 2I, H]: every expert's [gate | up] (fast path); the experts' weights become views of it."""
        self.stacked_down: torch.Tensor | None = None
        """[E, H, I]."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], expert ids [T, k]): top-k of the softmax, renormalised to sum 1."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.route(x)
        if self.stacked_gate_up is None:
            routed = self._routed_reference(x, weights, idx)
        elif grouped_moe_available(x, self.stacked_gate_up, self.stacked_down):  # type: ignore[arg-type]
            routed = self.routed_grouped(x, weights, idx)
        else:
            routed = moe_routed_masked(self, x, weights, idx)  # every expert on every token: no host sync
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.forward_fused(x)
        return routed.to(x.dtype) + shared

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The batched path's call: through the module, so a tensor-parallel all-reduce hook on the block runs."""
        out: torch.Tensor = self(x)
        return out

    def _routed_reference(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            tok, pos = torch.where(idx == e)
            routed.index_add_(0, tok, (self.experts[e](x[tok]) * weights[tok, pos, None]).float())
        return routed

    def routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The token copies sorted by expert, one grouped GEMM for [gate | up] and one for down, then each token's
        k outputs weighted and summed in fp32. No host sync. (Runs on the CPU in fp32 too, for tests.)"""
        assert self.stacked_gate_up is not None and self.stacked_down is not None
        T, top = idx.shape
        order, offs, pos = sort_by_expert(idx, self.stacked_gate_up.shape[0])
        gate_up = torch._grouped_mm(x[order // top], self.stacked_gate_up.transpose(1, 2), offs=offs)
        if x.is_cuda:
            from hybridpd.engine.kernels.fused import moe_combine, silu_mul

            down = torch._grouped_mm(silu_mul(gate_up), self.stacked_down.transpose(1, 2), offs=offs)
            return moe_combine(down, pos.view(T, top), weights.float().contiguous())
        g, u = gate_up.chunk(2, dim=-1)
        down = torch._grouped_mm(F.silu(g) * u, self.stacked_down.transpose(1, 2), offs=offs)
        return (down[pos.view(T, top)].float() * weights[..., None]).sum(1)

    def fuse(self) -> None:
        """Stack the experts' weights for the grouped GEMMs (their own weights become views); fuse the shared
        expert's gate and up."""
        experts: list[GatedMLP] = list(self.experts)  # type: ignore[arg-type]
        gate_up = torch.stack([torch.cat([e.gate_proj.weight.data, e.up_proj.weight.data]) for e in experts])
        down = torch.stack([e.down_proj.weight.data for e in experts])
        inter = gate_up.shape[1] // 2
        for i, e in enumerate(experts):
            e.gate_proj.weight = nn.Parameter(gate_up[i, :inter], requires_grad=False)
            e.up_proj.weight = nn.Parameter(gate_up[i, inter:], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self.stacked_gate_up, self.stacked_down = gate_up, down
        self.shared_expert.fuse()


def split_fused_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """transformers' fused expert tensors as per-expert ones: `...experts.gate_up_proj` [E, 2I, H] ->
    `...experts.{e}.gate_proj.weight` and `.up_proj.weight`; `...experts.down_proj` [E, H, I] ->
    `...experts.{e}.down_proj.weight`. None for any other name."""
    if name.endswith(".experts.gate_up_proj") and tensor.dim() == 3:
        base, inter = name[: -len("gate_up_proj")], tensor.shape[1] // 2
        return [(f"{base}{e}.{part}_proj.weight", tensor[e, s]) for e in range(tensor.shape[0])
                for part, s in (("gate", slice(0, inter)), ("up", slice(inter, None)))]
    if name.endswith(".experts.down_proj") and tensor.dim() == 3:
        base = name[: -len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    return None


__all__ = ["SparseMoeArgs", "SparseMoeBlock", "split_fused_experts"]
