"""RoPE frequency tables of the `rope_type`s the engine serves, computed as transformers computes them.

    default   inv_freq_i = base^(-2i/dim)
    linear    default / factor                          (position interpolation)
    yarn      a per-frequency blend of default and default / factor over a ramp between the frequencies that turn
              beta_fast and beta_slow times over original_max_position_embeddings; cos/sin scaled by
              attention_factor (default 0.1 ln(factor) + 1, or from mscale / mscale_all_dim)

Any other type (dynamic NTK, longrope, llama3, ...) raises ValueError naming `rope_type`: the engine refuses the
model at load rather than serve it with the wrong positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = ("default", "linear", "yarn")


def _default(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: dict[str, Any], base: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    original = int(rope.get("original_max_position_embeddings") or max_positions)
    factor = rope.get("factor")
    factor = float(max_positions / original if factor is None else factor)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)  # CPU even under a meta device
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_frequencies(rope: dict[str, Any], base: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] fp32 on the CPU, the cos/sin scale) for the rope parameters `rope` (a config's
    rope_parameters / rope_scaling dict; `rope_type` or legacy `type`), rotary width `dim`, `max_positions` =
    max_position_embeddings."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return _default(base, dim), 1.0
    if rope_type == "linear":
        return _default(base, dim) / float(rope["factor"]), 1.0
    if rope_type == "yarn":
        return _yarn(rope, base, dim, max_positions)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED)})")


__all__ = ["SUPPORTED", "rope_frequencies"]
