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
def _chunk_inputs_kernel(xc_ptr, dt_ptr, q_ptr, k_ptr, v_ptr, stride_xc, stride_dt, H, INTER, GN,
                         HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, N: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HEADS_PER_GROUP
    p = tl.arange(0, BLOCK_P)
    pm = p < HEAD_DIM
    x = tl.load(xc_ptr + t * stride_xc + h * HEAD_DIM + p, mask=pm, other=0.0).to(tl.float32)
    d = tl.load(dt_ptr + t * stride_dt + h)
    tl.store(v_ptr + (t * H + h) * HEAD_DIM + p, x * d, mask=pm)
    n = tl.arange(0, BLOCK_N)
    nm = n < N
    b = tl.load(xc_ptr + t * stride_xc + INTER + g * N + n, mask=nm, other=0.0).to(tl.float32)
    c = tl.load(xc_ptr + t * stride_xc + INTER + GN + g * N + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(k_ptr + (t * H + h) * N + n, b, mask=nm)
    tl.store(q_ptr + (t * H + h) * N + n, c, mask=nm)


def mamba_chunk_inputs(xc: torch.Tensor, dt: torch.Tensor, num_heads: int, head_dim: int, n_groups: int,
                       state_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xc [P, conv_dim] = [x | B | C] (rows may be strided, columns contiguous), dt [P, H] fp32 ->
    (q [P, H, N], k [P, H, N], v [P, H, head_dim]) fp32 contiguous: C and B of each head's group, x * dt."""
    P = xc.shape[0]
    inter, gn = num_heads * head_dim, n_groups * state_size
    assert xc.stride(1) == 1 and dt.stride(1) == 1 and xc.shape[1] == inter + 2 * gn
    q = torch.empty(P, num_heads, state_size, dtype=torch.float32, device=xc.device)
    k = torch.empty_like(q)
    v = torch.empty(P, num_heads, head_dim, dtype=torch.float32, device=xc.device)
    if P:
        _chunk_inputs_kernel[(P, num_heads)](xc, dt, q, k, v, xc.stride(0), dt.stride(0), num_heads, inter, gn,
                                             HEADS_PER_GROUP=num_heads // n_groups, HEAD_DIM=head_dim, N=state_size,
                                             BLOCK_P=triton.next_power_of_2(head_dim),
                                             BLOCK_N=triton.next_power_of_2(state_size))
    return q, k, v


@triton.jit
def _skip_add_kernel(y_ptr, xc_ptr, d_ptr, stride_xc, H, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    pm = p < HEAD_DIM
    x = tl.load(xc_ptr + t * stride_xc + h * HEAD_DIM + p, mask=pm, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + (t * H + h) * HEAD_DIM + p, mask=pm, other=0.0)
    d = tl.load(d_ptr + h).to(tl.float32)
    tl.store(y_ptr + (t * H + h) * HEAD_DIM + p, y + d * x, mask=pm)


def mamba_skip_add(y: torch.Tensor, xc: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """y [P, H, head_dim] fp32 contiguous += D[h] * x (x: the first H * head_dim columns of xc); returns y."""
    P, H, hd = y.shape
    assert y.is_contiguous() and y.dtype == torch.float32 and xc.stride(1) == 1
    if P:
        _skip_add_kernel[(P, H)](y, xc, D, xc.stride(0), H, HEAD_DIM=hd, BLOCK_P=triton.next_power_of_2(hd))
    return y


__all__ = ["mamba_chunk_inputs", "mamba_skip_add"]
