"""Fused elementwise and normalisation kernels of the fast path (Triton): what the reference does in several torch
ops, one launch each, with the reference's rounding points kept (a value the reference holds in the model dtype is
rounded to it here too, so bf16 results match the reference's bf16 results).

    rms_norm          [h = h + x (model dtype)];  out = w * x / rms(x)  or  (1 + w) * x / rms(x)   (NemotronH, Qwen3.5)
    gated_group_norm  Mamba-2:  x = y * silu(gate);  out = w * x / rms(x) per group                 (fp32 -> dtype)
    gated_head_norm   Qwen3.5 GDN:  out = (w * rmsnorm(core)) * silu(z) per head                    (norm before gate)
    silu_mul          [gate | up] -> silu(gate) * up                                                (gated MLP)
    relu2             relu(x)^2 in one pass                                                         (NemotronH experts)
    moe_combine       out[t] = sum_k w[t, k] * rows[pos[t, k]]: the routed experts' outputs gathered back to their
                      tokens, weighted and summed in fp32, rounded once to the dtype                (MoE)

`softplus` and `silu` below are torch's formulas (threshold 20; x / (1 + exp(-x))), `log1p` the accurate form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def log1p(x):
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def softplus(x):
    return tl.where(x > 20.0, x, log1p(tl.exp(x)))


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, h_ptr, w_ptr, out_ptr, D, H, stride_x0, stride_x1, stride_o0, stride_o1, eps,
                     HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    i = (r // H).to(tl.int64)
    j = r % H
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + d, mask=m, other=0.0)
    if HAS_RES:  # h = x + residual, rounded to the model dtype as the reference's `h + x`
        res = tl.load(res_ptr + i * D + d, mask=m, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + i * D + d, x, mask=m)
    y = rms_norm_row(x, w_ptr, d, m, D, eps, ZERO_CENTERED)
    tl.store(out_ptr + i * stride_o0 + j * stride_o1 + d, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def rms_norm_row(x, w_ptr, d, m, D, eps, ZERO_CENTERED: tl.constexpr):
    """One row's RMSNorm in fp32 (lanes d, valid where m): w * x / rms(x), or (1 + w) * x / rms(x)."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        return (xf * rstd) * (1.0 + w)
    else:
        return w * (xf * rstd)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, D] or [n, H, D] (last dim contiguous, any leading strides) -> (normalised, same shape and dtype,
    contiguous; h). With `residual` ([n, D] contiguous, 2-D x only): h = x + residual (the block's residual
    stream, rounded to the dtype) is normalised and returned; otherwise h is x."""
    assert x.stride(-1) == 1
    D = x.shape[-1]
    H = x.shape[1] if x.dim() == 3 else 1
    s0, s1 = x.stride(0), (x.stride(1) if x.dim() == 3 else 0)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = x
    if residual is not None:
        assert x.dim() == 2 and residual.is_contiguous() and residual.shape == x.shape
        h = torch.empty_like(residual)
    rows = x.shape[0] * H
    if rows:
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, h, weight, out, D, H, s0, s1,
                                  out.stride(0), out.stride(1) if x.dim() == 3 else 0, eps,
                                  HAS_RES=residual is not None, ZERO_CENTERED=zero_centered,
                                  BLOCK=triton.next_power_of_2(D), num_warps=8 if D >= 2048 else 4)
    return out, h


@triton.jit
def _gated_group_norm_kernel(y_ptr, g_ptr, w_ptr, out_ptr, GS, stride_y, stride_g, stride_o, eps,
                             BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * GS + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < GS
    y = tl.load(y_ptr + i * stride_y + c, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + i * stride_g + c, mask=m, other=0.0).to(tl.float32)
    x = y * silu(g)
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / GS + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i * stride_o + c, (w * (x * rstd)).to(out_ptr.dtype.element_ty), mask=m)


def gated_group_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """Mamba-2's gated norm (mamba2.GroupGatedRMSNorm) then the cast to the model dtype: y [n, C] fp32, gate
    [n, C] (rows may be strided) -> [n, C] out_dtype."""
    n, C = y.shape
    assert y.stride(1) == 1 and gate.stride(1) == 1 and C % group_size == 0
    out = torch.empty(n, C, dtype=out_dtype, device=y.device)
    if n:
        _gated_group_norm_kernel[(n, C // group_size)](y, gate, weight, out, group_size, y.stride(0), gate.stride(0),
                                                       out.stride(0), eps, BLOCK=triton.next_power_of_2(group_size))
    return out


@triton.jit
def _gated_head_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, V, H, stride_x0, stride_x1, stride_z0, stride_z1, eps,
                            BLOCK: tl.constexpr):
    r = tl.program_id(0)
    i = (r // H).to(tl.int64)
    j = r % H
    d = tl.arange(0, BLOCK)
    m = d < V
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + d, mask=m, other=0.0).to(dt).to(tl.float32)
    nrm = (x * tl.math.rsqrt(tl.sum(x * x, 0) / V + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    o = (w * nrm).to(dt).to(tl.float32)
    z = tl.load(z_ptr + i * stride_z0 + j * stride_z1 + d, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i * H + j) * V + d, (o * silu(z)).to(dt), mask=m)


def gated_head_norm(core: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Qwen3.5's GDN output norm (gated_deltanet.GatedRMSNorm applied to core.to(dtype)): core [n, H, V] fp32,
    z [n, H, V] (strided rows) -> [n, H * V] out_dtype."""
    n, H, V = core.shape
    assert core.stride(2) == 1 and z.stride(2) == 1
    out = torch.empty(n, H * V, dtype=out_dtype, device=core.device)
    if n:
        _gated_head_norm_kernel[(n * H,)](core, z, weight, out, V, H, core.stride(0), core.stride(1), z.stride(0),
                                          z.stride(1), eps, BLOCK=triton.next_power_of_2(V))
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, stride_x, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    dt = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + i * stride_x + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + i * stride_x + N + c, mask=m, other=0.0).to(tl.float32)
    a = silu(g).to(dt).to(tl.float32)
    tl.store(out_ptr + i * N + c, (a * u).to(dt), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2N] = [gate | up] -> silu(gate) * up [n, N], each rounded to the dtype as the reference's
    `act(gate(x)) * up(x)`."""
    n, N2 = gate_up.shape
    N = N2 // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(n, N, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(N, block))](gate_up, out, N, gate_up.stride(0), BLOCK=block)
    return out


@triton.jit
def round_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32, in integer arithmetic: on the H200 the compiler
    folded `v.to(bf16).to(fp32)` away when the result fed an add (rope's x * cos + rotate_half(x) * sin came out
    unrounded in 3.7 % of the elements); NaN passes through."""
    bits = v.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(v != v, v, r.to(tl.float32, bitcast=True))


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_c, D: tl.constexpr,
                 ROT: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    r = tl.program_id(0)
    t = (r // H).to(tl.int64)
    h = r % H
    d = tl.arange(0, BLOCK_D)
    m = d < D
    row = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(row + d, mask=m, other=0.0)
    half: tl.constexpr = ROT // 2
    rm = m & (d < ROT)
    partner = tl.load(row + tl.where(d < half, d + half, d - half), mask=rm, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_c + d, mask=rm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + d, mask=rm, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    a = x.to(tl.float32) * c  # x * cos
    b = tl.where(d < half, -partner, partner) * s  # rotate_half(x) * sin
    if BF16:  # each product rounded as the reference's own
        a, b = round_bf16(a), round_bf16(b)
    tl.store(out_ptr + (t * H + h) * D + d, tl.where(d < ROT, (a + b).to(dt), x), mask=m)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers.apply_rotary in one launch (fp32, bf16): x [T, heads, head_dim] (rows may be strided, the last dim
    contiguous), cos/sin [T, rotary_dim] -> a new [T, heads, head_dim] with the same rounding points."""
    T, H, D = x.shape
    rot = cos.shape[-1]
    assert x.stride(2) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride() and rot % 2 == 0 and rot <= D
    if x.dtype not in (torch.float32, torch.bfloat16):  # fp16: the reference's torch ops (no rounding helper here)
        from hybridpd.engine.models.layers import apply_rotary

        return apply_rotary(x, cos, sin)
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T:
        _rope_kernel[(T * H,)](x, cos, sin, out, H, x.stride(0), x.stride(1), cos.stride(0), D=D, ROT=rot,
                               BLOCK_D=triton.next_power_of_2(D), BF16=x.dtype == torch.bfloat16)
    return out


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, C, stride_g0, stride_g1, W: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + i * stride_g0 + (c // W) * stride_g1 + c % W, mask=m, other=0.0)
    gate = sigmoid(g.to(tl.float32)).to(dt).to(tl.float32)
    x = tl.load(x_ptr + i * C + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i * C + c, (x * gate).to(dt), mask=m)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) (the sigmoid rounded to the dtype first, as the reference's torch.sigmoid): x [n, C]
    contiguous; gate [n, heads, W] with heads * W == C (a strided view, e.g. Qwen3.5's output gate chunked off
    its q projection) -> [n, C]."""
    n, C = x.shape
    assert x.is_contiguous() and gate.stride(2) == 1 and gate.shape[1] * gate.shape[2] == C
    out = torch.empty_like(x)
    if n:
        _sigmoid_gate_kernel[(n, triton.cdiv(C, 1024))](x, gate, out, C, gate.stride(0), gate.stride(1),
                                                        W=gate.shape[2], BLOCK=1024)
    return out


@triton.jit
def _relu2_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    x = tl.maximum(tl.load(x_ptr + c, mask=m, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + c, (x * x).to(out_ptr.dtype.element_ty), mask=m)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (layers.relu2) in one pass; x contiguous. relu is exact in any dtype, so rounding the square
    once gives the reference's bits."""
    assert x.is_contiguous()
    out = torch.empty_like(x)
    if x.numel():
        block = 2048
        _relu2_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
    return out


@triton.jit
def _moe_combine_kernel(rows_ptr, pos_ptr, w_ptr, out_ptr, H, TOP: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP):
        r = tl.load(pos_ptr + t * TOP + k).to(tl.int64)
        w = tl.load(w_ptr + t * TOP + k).to(tl.float32)
        acc += tl.load(rows_ptr + r * H + c, mask=m, other=0.0).to(tl.float32) * w
    tl.store(out_ptr + t * H + c, acc.to(out_ptr.dtype.element_ty), mask=m)


def moe_combine(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' outputs back on their tokens: rows [T * k, H] (the experts' outputs, in expert order),
    pos [T, k] (row of each token's k-th choice), weights [T, k] fp32 -> [T, H] in rows' dtype, with
    out[t] = sum_k weights[t, k] * rows[pos[t, k]] accumulated in fp32 (the reference's index_add_ of the fp32
    products, summed in choice order instead of expert order). One read of rows, one write: no [T, H] fp32
    buffer, no atomics."""
    T, top = pos.shape
    H = rows.shape[1]
    assert rows.is_contiguous() and pos.is_contiguous() and weights.is_contiguous() and weights.shape == pos.shape
    out = torch.empty(T, H, dtype=rows.dtype, device=rows.device)
    if T:
        block = min(1024, triton.next_power_of_2(H))
        _moe_combine_kernel[(T, triton.cdiv(H, block))](rows, pos, weights, out, H, TOP=top, BLOCK=block)
    return out


__all__ = ["gated_group_norm", "gated_head_norm", "log1p", "moe_combine", "relu2", "rms_norm", "rope", "round_bf16",
           "sigmoid", "sigmoid_gate", "silu", "silu_mul", "softplus"]
