"""Mamba-2 prefill glue of the fast path (Triton): what feeds fla-core's chunked SSD kernel and what follows it, one
launch each instead of a chain of torch casts, splits, copies and head expansions.

    mamba_chunk_inputs   activated conv output xc [P, conv_dim] (model dtype) and dt [P, H] (fp32) ->
                         q = C, k = B expanded from their group to every head, v = x * dt   (fp32, [P, H, *])
    mamba_skip_add       y = y + D * x, in place (x read from xc)                            (fp32)

The values are the reference's (mamba2.Mamba2Mixer): x, B and C are xc's values made fp32 (exact), v is the fp32
product x * dt; only the skip term may round differently (a fused multiply-add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _expand_kernel(src_ptr, scale_ptr, out_ptr, stride_src, stride_scale, COL0, C_OUT,
                   W: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, h * W + i] = src[t, COL0 + (h // HEADS_PER_GROUP) * W + i] in fp32 (times scale[t, h]): one program
    per (token, BLOCK output columns)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C_OUT
    h = c // W
    x = tl.load(src_ptr + t * stride_src + COL0 + (h // HEADS_PER_GROUP) * W + c % W, mask=m, other=0.0)
    x = x.to(tl.float32)
    if HAS_SCALE:
        x = x * tl.load(scale_ptr + t * stride_scale + h, mask=m, other=0.0)
    tl.store(out_ptr + t * C_OUT + c, x, mask=m)


_BLOCK = 1024  # output columns per program: whole 4 KB rows of fp32, not one head's 64 values (3x faster)


def _expand(src: torch.Tensor, col0: int, width: int, heads: int, heads_per_group: int,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    P = src.shape[0]
    out = torch.empty(P, heads, width, dtype=torch.float32, device=src.device)
    if P:
        c_out = heads * width
        _expand_kernel[(P, triton.cdiv(c_out, _BLOCK))](
            src, scale if scale is not None else src, out, src.stride(0), scale.stride(0) if scale is not None else 0,
            col0, c_out, W=width, HEADS_PER_GROUP=heads_per_group, HAS_SCALE=scale is not None, BLOCK=_BLOCK)
    return out


def mamba_chunk_inputs(xc: torch.Tensor, dt: torch.Tensor, num_heads: int, head_dim: int, n_groups: int,
                       state_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xc [P, conv_dim] = [x | B | C] (rows may be strided, columns contiguous), dt [P, H] fp32 ->
    (q [P, H, N], k [P, H, N], v [P, H, head_dim]) fp32 contiguous: C and B of each head's group, x * dt."""
    inter, gn = num_heads * head_dim, n_groups * state_size
    assert xc.stride(1) == 1 and dt.stride(1) == 1 and xc.shape[1] == inter + 2 * gn
    rep = num_heads // n_groups
    q = _expand(xc, inter + gn, state_size, num_heads, rep)
    k = _expand(xc, inter, state_size, num_heads, rep)
    v = _expand(xc, 0, head_dim, num_heads, 1, scale=dt)
    return q, k, v


@triton.jit
def _skip_add_kernel(y_ptr, xc_ptr, d_ptr, stride_xc, C, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    x = tl.load(xc_ptr + t * stride_xc + c, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * C + c, mask=m, other=0.0)
    d = tl.load(d_ptr + c // HEAD_DIM, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * C + c, y + d * x, mask=m)


def mamba_skip_add(y: torch.Tensor, xc: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """y [P, H, head_dim] fp32 contiguous += D[h] * x (x: the first H * head_dim columns of xc); returns y."""
    P, H, hd = y.shape
    assert y.is_contiguous() and y.dtype == torch.float32 and xc.stride(1) == 1
    if P:
        _skip_add_kernel[(P, triton.cdiv(H * hd, _BLOCK))](y, xc, D, xc.stride(0), H * hd, HEAD_DIM=hd, BLOCK=_BLOCK)
    return y


__all__ = ["mamba_chunk_inputs", "mamba_skip_add"]
