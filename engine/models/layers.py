"""Building blocks shared by the model families: activations, norms, rotary embedding, MLPs and the recurrent
mixers' reference helpers (causal conv, segment sums).

Pure torch (CPU and CUDA, fp32/bf16/fp16). Reductions that decide accuracy (norms) run in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------------------------
# dtypes and activations

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype string ("float32", "bfloat16", "float16") to the torch dtype."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(TORCH_DTYPES)}") from None


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": relu2,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; expected one of {sorted(ACTIVATIONS)}") from None


# ----------------------------------------------------------------------------------------------------------------
# norms


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 (returns fp32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """weight * x / rms(x); the weight multiply stays in fp32, the result is cast back (NemotronH)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * rms_normalize(x, self.eps)).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """(1 + weight) * x / rms(x), in fp32, cast back (Qwen3.5; the weight is stored zero-centred)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# rotary embedding


class RotaryEmbedding:
    """Neox-style RoPE (rotate_half) applied to the first `rotary_dim` dims of every head; the rest pass through.

    Holds no module state (so it survives meta-device construction); inv_freq is computed on CPU in fp32. A scaled
    rope passes its own `inv_freq` and the factor cos/sin are multiplied by (engine.models.rope_scaling)."""

    def __init__(self, rotary_dim: int, base: float, inv_freq: torch.Tensor | None = None,
                 attention_scaling: float = 1.0) -> None:
        self.rotary_dim = rotary_dim
        self.attention_scaling = attention_scaling
        self.inv_freq = inv_freq if inv_freq is not None else 1.0 / (
            base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim)
        )
        self._device_inv_freq: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, rotary_dim] for int64 positions [T], cast to `dtype` (as transformers does)."""
        inv_freq = self._device_inv_freq.get(positions.device)
        if inv_freq is None:  # copied once per device (a copy inside a CUDA graph capture is not allowed)
            inv_freq = self._device_inv_freq[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling != 1.0:
            return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim] with rotary_dim <= head_dim (partial rotary)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# MLPs


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate bias-free linears' weights along the output dim into one tensor (one GEMM instead of several)
    and make each module's weight a view of its rows, so no second copy stays in memory. Returns the weight."""
    assert all(lin.bias is None for lin in linears), "fuse_linears takes bias-free linears"
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start:start + n], requires_grad=False)
        start += n
    return fused


class MLP(nn.Module):
    """down(act(up(x))) (NemotronH, non-gated)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) (Qwen3.5)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = get_activation(act)
        self.fused_silu = act in ("silu", "swish")
        self.gate_up: torch.Tensor | None = None
        """[gate | up] weights in one tensor (fast path); gate_proj / up_proj weights are views of it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The same with one GEMM for gate and up and one kernel for silu(gate) * up (fast path)."""
        if self.gate_up is None or not self.fused_silu:
            return self.forward(x)
        from hybridpd.engine.kernels.fused import silu_mul

        return self.down_proj(silu_mul(F.linear(x, self.gate_up)))

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)


# ----------------------------------------------------------------------------------------------------------------
# recurrent helpers shared by Mamba-2 and Gated-DeltaNet


def causal_conv_chunk(
    x: torch.Tensor,
    init_state: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cuts: list[int],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Depthwise causal conv1d over one sequence's chunk, continuing from a conv state.

    x [n, C] (conv inputs); init_state [C, K-1] (the previous K-1 inputs, oldest first) or None for zeros;
    weight [C, K]. Accumulates in fp32. Returns the pre-activation outputs [n, C] in x's dtype and, for every c
    in `cuts`, the conv state after c tokens (the last K-1 inputs up to token c), each [C, K-1]:

        full = | state (K-1) | x_0 ... x_{n-1} |     state after c tokens = full[:, c : c + K-1]
    """
    width = weight.shape[1]
    if init_state is None:
        init_state = torch.zeros(x.shape[1], width - 1, dtype=x.dtype, device=x.device)
    full = torch.cat((init_state.to(x.dtype), x.t()), dim=1)
    bias32 = None if bias is None else bias.float()
    out = F.conv1d(full.float()[None], weight.float()[:, None, :], bias32, groups=x.shape[1])[0]
    return out.t().to(x.dtype), [full[:, c : c + width - 1] for c in cuts]


def causal_conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [B, C], state [B, C, K-1] -> (pre-activation output [B, C], new state)."""
    window = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)
    out = (window.float() * weight.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype), window[:, :, 1:]


def segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., l] (log decays) -> [..., l, l] with out[t, s] = sum_{s < k <= t} a_k for s <= t, -inf above.

    Computed as masked cumulative sums (no difference of two large cumsums), so it stays exact for long chunks."""
    n = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, n)  # x[..., k, s] = a_k
    strict = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    x = torch.cumsum(x.masked_fill(~strict, 0.0), dim=-2)
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device))
    return x.masked_fill(~keep, float("-inf"))


def segment_bounds(cuts: list[int]) -> list[tuple[int, int]]:
    """[0, c1), [c1, c2), ... for sorted cuts: the stretches between two states that must be written."""
    return list(zip([0, *cuts[:-1]], cuts, strict=True))


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[L, *rest] -> [num, size, *rest] with num = ceil(L / chunk_size) balanced chunks of size ceil(L / num)
    <= chunk_size, zero-padded at the end (less than num rows of padding)."""
    n = x.shape[0]
    num = -(-n // chunk_size)
    size = -(-n // num)
    pad = num * size - n
    if pad:
        x = torch.cat((x, x.new_zeros(pad, *x.shape[1:])), dim=0)
    return x.view(num, size, *x.shape[1:])


__all__ = [
    "ACTIVATIONS",
    "GatedMLP",
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "ZeroCenteredRMSNorm",
    "apply_rotary",
    "causal_conv_chunk",
    "causal_conv_step",
    "fuse_linears",
    "get_activation",
    "segment_bounds",
    "segsum",
    "to_chunks",
    "torch_dtype",
]
