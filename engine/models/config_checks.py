"""Load-time checks of a config's shape relations that the model code relies on: a config that breaks one is
refused with the fields named (ValueError, a ModelLoadError at load) instead of failing at the first step or
computing something else."""

from __future__ import annotations


def require_multiple(count: int, count_name: str, unit: int, unit_name: str) -> None:
    """`count` heads share `unit` groups evenly (e.g. num_attention_heads over num_key_value_heads)."""
    if unit <= 0 or count <= 0 or count % unit:
        raise ValueError(f"{count_name}={count} must be a positive multiple of {unit_name}={unit}")


def require_routing(experts: int, top_k: int, n_group: int = 1, topk_group: int = 1) -> None:
    """Top-k routing over `experts` in `n_group` groups of which `topk_group` are kept (DeepSeek-V3 style)."""
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={experts}]")
    require_multiple(experts, "n_routed_experts", n_group, "n_group")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    per_group = experts // n_group
    if topk_group < n_group and per_group < 2:
        raise ValueError(
            f"group-limited routing scores each group by its top 2 experts: n_routed_experts={experts} "
            f"over n_group={n_group} leaves {per_group}"
        )
    if top_k > topk_group * per_group:
        raise ValueError(
            f"num_experts_per_tok={top_k} exceeds the {topk_group * per_group} experts of the "
            f"topk_group={topk_group} kept groups"
        )


__all__ = ["require_multiple", "require_routing"]
