"""Single-token (decode) steps of the recurrent mixers, batched, updating the state slots in place. Triton.

Every kernel takes `slots` (int64 [B], PAD_SLOT_ID = -1 for padded rows: the slot is neither read nor written,
the row's output is garbage-free zeros-in) and `has_init` (int32 [B]: 0 = start from zeros, the slot is not read).
States are addressed through their strides, so a layer's `[:, i]` slice of the stacked cache tensor works as is.

    conv:    window = | state (K-1) | x |;  out = sum_k w[:, k] window[:, k] (+ bias);  state <- window[:, 1:]
    mamba2:  h = h * exp(dt A) + (dt x) B^T;  y = h C + D x                  h [H, P, N] per slot
             (dt = softplus(dt_raw + dt_bias) clamped, A = -exp(A_log): computed in the kernel)
    gdn:     S = S * exp(g);  S += k (beta (v - S^T k))^T;  o = S^T q         S [Hv, K, V] per slot
             (q, k l2-normalised, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias): in the kernel)

Inputs are the raw projections (strided rows of the fused in_proj output) and the conv output of the rows that
step (`rows`: their token index; outputs are written at those rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hybridpd.engine.kernels.fused import sigmoid, silu, softplus

TILES = {"mamba": (32, 8), "gdn": (64, 4)}
"""(block of P / V columns, num_warps) per decode kernel: the fastest of benchmarks/decode_kernels.py's choices on an
H200 at batch 64 (Nemotron-H-8B / Qwen3.5-9B shapes; docs/BENCHMARKS.md)."""


@triton.jit
def _conv_step_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, slot_ptr, init_ptr, row_ptr, C, stride_xb,
                      stride_ob, stride_ss, stride_sc, stride_sk, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                      K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    row = tl.load(row_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b)
    valid = slot >= 0
    read = valid & (tl.load(init_ptr + b) != 0)
    slot_safe = tl.where(valid, slot, 0).to(tl.int64)
    rm = cm & ((c * 0 + read.to(tl.int32)) != 0)  # vector masks (a scalar bool in a mask breaks the interpreter)
    wm = cm & ((c * 0 + valid.to(tl.int32)) != 0)
    x = tl.load(x_ptr + row * stride_xb + c, mask=cm, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + c * K + (K - 1), mask=cm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    base = state_ptr + slot_safe * stride_ss + c * stride_sc
    for k in tl.static_range(K - 1):
        s_k = tl.load(base + k * stride_sk, mask=rm, other=0.0).to(x.dtype)
        acc += s_k.to(tl.float32) * tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)
        if k > 0:
            tl.store(base + (k - 1) * stride_sk, s_k.to(state_ptr.dtype.element_ty), mask=wm)
    tl.store(base + (K - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=wm)
    if ACT:  # silu of the conv output as the reference applies it: on the value rounded to the dtype
        acc = silu(acc.to(x.dtype).to(tl.float32))
    tl.store(out_ptr + b * stride_ob + c, acc.to(out_ptr.dtype.element_ty), mask=cm)


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              slots: torch.Tensor, has_init: torch.Tensor, rows: torch.Tensor, act: bool = False) -> torch.Tensor:
    """x [T, C] conv inputs (rows may be strided); rows [B] int64: the rows of x that take a step; state
    [slots, C, K-1]; weight [C, K] -> output [B, C] (x's dtype), pre-activation, or silu'd with `act`."""
    B, C = rows.shape[0], x.shape[1]
    out = torch.empty(B, C, dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    assert x.stride(1) == 1
    w = weight.contiguous()
    K = w.shape[1]
    block_c = 256
    _conv_step_kernel[(B, triton.cdiv(C, block_c))](
        x, state, w, bias if bias is not None else w, out, slots, has_init, rows, C, x.stride(0), out.stride(0),
        state.stride(0), state.stride(1), state.stride(2), HAS_BIAS=bias is not None, ACT=act, K=K, BLOCK_C=block_c)
    return out


@triton.jit
def _conv_varlen_kernel(ext_ptr, w_ptr, bias_ptr, out_ptr, pos_ptr, C, stride_e, stride_o, HAS_BIAS: tl.constexpr,
                        ACT: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr):
    j = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    e = tl.load(pos_ptr + j).to(tl.int64)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(K):
        xk = tl.load(ext_ptr + (e - (K - 1 - k)) * stride_e + c, mask=cm, other=0.0)
        acc += xk.to(tl.float32) * tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if ACT:
        acc = silu(acc.to(dt).to(tl.float32))
    tl.store(out_ptr + j.to(tl.int64) * stride_o + c, acc.to(dt), mask=cm)


def conv_varlen(ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ext_x: torch.Tensor,
                act: bool = False) -> torch.Tensor:
    """Causal depthwise conv of prefill tokens laid out in an extended buffer (each sequence's K-1 state rows,
    then its tokens): ext [E, C]; ext_x [P] the row of each token -> [P, C] in ext's dtype, fp32 accumulation
    (k = 0..K-1, then the bias, as the reference), silu'd with `act`."""
    P, C = ext_x.shape[0], ext.shape[1]
    out = torch.empty(P, C, dtype=ext.dtype, device=ext.device)
    if P == 0:
        return out
    assert ext.stride(1) == 1
    w = weight.contiguous()
    block_c = 256
    _conv_varlen_kernel[(P, triton.cdiv(C, block_c))](ext, w, bias if bias is not None else w, out, ext_x, C,
                                                      ext.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                                      ACT=act, K=w.shape[1], BLOCK_C=block_c)
    return out


@triton.jit
def _mamba_decode_kernel(xc_ptr, dt_ptr, dtb_ptr, alog_ptr, d_ptr, h_ptr, y_ptr, slot_ptr, init_ptr, row_ptr, P,
                         INTER, GN, stride_xc, stride_dt, stride_yb, stride_yh, stride_hs, stride_hh, stride_hp,
                         time_step_min, HEADS_PER_GROUP: tl.constexpr, N: tl.constexpr, N_P2: tl.constexpr,
                         BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    hd = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < P
    n = tl.arange(0, N_P2)  # a state size that is not a power of two: padded, the extra lanes masked
    nm = n < N
    row = tl.load(row_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b)
    valid = slot >= 0
    read = valid & (tl.load(init_ptr + b) != 0)
    slot_safe = tl.where(valid, slot, 0).to(tl.int64)
    rm = (pm & ((p * 0 + read.to(tl.int32)) != 0))[:, None] & nm[None, :]
    wm = (pm & ((p * 0 + valid.to(tl.int32)) != 0))[:, None] & nm[None, :]
    grp = hd // HEADS_PER_GROUP
    # dt = softplus(dt + dt_bias).clamp(min), each step rounded to the model dtype (Mamba2Mixer._dt)
    ddt = dt_ptr.dtype.element_ty
    dt = (tl.load(dt_ptr + row * stride_dt + hd).to(tl.float32) + tl.load(dtb_ptr + hd).to(tl.float32)).to(ddt)
    dt = softplus(dt.to(tl.float32)).to(ddt)
    dt = tl.maximum(dt.to(tl.float32), time_step_min).to(ddt).to(tl.float32)
    decay = tl.exp(dt * -tl.exp(tl.load(alog_ptr + hd).to(tl.float32)))
    xrow = xc_ptr + b.to(tl.int64) * stride_xc
    x = tl.load(xrow + hd * P + p, mask=pm, other=0.0).to(tl.float32)
    bv = tl.load(xrow + INTER + grp * N + n, mask=nm, other=0.0).to(tl.float32)
    cv = tl.load(xrow + INTER + GN + grp * N + n, mask=nm, other=0.0).to(tl.float32)
    hp = h_ptr + slot_safe * stride_hs + hd * stride_hh + p[:, None] * stride_hp + n[None, :]
    h = tl.load(hp, mask=rm, other=0.0).to(tl.float32)
    h = h * decay + (dt * x)[:, None] * bv[None, :]
    y = tl.sum(h * cv[None, :], 1) + tl.load(d_ptr + hd).to(tl.float32) * x
    tl.store(hp, h.to(h_ptr.dtype.element_ty), mask=wm)
    tl.store(y_ptr + row * stride_yb + hd * stride_yh + p, y, mask=pm)


def mamba_decode(xc: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                 ssm: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor, rows: torch.Tensor, y: torch.Tensor,
                 n_groups: int, time_step_min: float) -> None:
    """One Mamba-2 step for B rows: xc [B, conv_dim] the activated conv output (x | B | C, model dtype or fp32),
    dt [T, H] raw (in_proj slice), ssm [slots, H, P, N]; writes y[rows] ([T, H, P] fp32, with the D skip) and the
    slots in place."""
    bt = rows.shape[0]
    if bt == 0:
        return
    _, H, P = y.shape
    N = ssm.shape[-1]
    assert xc.stride(1) == 1 and dt.stride(1) == 1 and y.stride(2) == 1 and ssm.stride(3) == 1
    block, warps = TILES["mamba"]
    block_p = min(triton.next_power_of_2(P), block)
    _mamba_decode_kernel[(bt, H, triton.cdiv(P, block_p))](
        xc, dt, dt_bias, A_log, D, ssm, y, slots, has_init, rows, P, H * P, n_groups * N, xc.stride(0),
        dt.stride(0), y.stride(0), y.stride(1), ssm.stride(0), ssm.stride(1), ssm.stride(2), time_step_min,
        HEADS_PER_GROUP=H // n_groups, N=N, N_P2=triton.next_power_of_2(N), BLOCK_P=block_p, num_warps=warps)


@triton.jit
def _gdn_decode_kernel(xc_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, slot_ptr, init_ptr, row_ptr, V,
                       KEY_DIM, stride_xc, stride_a, stride_ob, stride_oh, stride_ss, stride_sh, stride_sk, scale,
                       V_PER_K: tl.constexpr, KD: tl.constexpr, KD_P2: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    v_idx = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = v_idx < V
    kk = tl.arange(0, KD_P2)  # a key head dim that is not a power of two: padded, the extra lanes masked
    km = kk < KD
    row = tl.load(row_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b)
    valid = slot >= 0
    read = valid & (tl.load(init_ptr + b) != 0)
    slot_safe = tl.where(valid, slot, 0).to(tl.int64)
    rm = (vm & ((v_idx * 0 + read.to(tl.int32)) != 0))[None, :] & km[:, None]
    wm = (vm & ((v_idx * 0 + valid.to(tl.int32)) != 0))[None, :] & km[:, None]
    hk = hv // V_PER_K
    xrow = xc_ptr + b.to(tl.int64) * stride_xc
    q = tl.load(xrow + hk * KD + kk, mask=km, other=0.0).to(tl.float32)
    k = tl.load(xrow + KEY_DIM + hk * KD + kk, mask=km, other=0.0).to(tl.float32)
    v = tl.load(xrow + 2 * KEY_DIM + hv * V + v_idx, mask=vm, other=0.0).to(tl.float32)
    q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale  # l2norm(q) * K^-0.5, l2norm(k) (GatedDeltaNet._split)
    k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6)
    # beta = sigmoid(b) in the model dtype; g = -exp(A_log) * softplus(a + dt_bias) in fp32 (GatedDeltaNet.forward)
    bdt = b_ptr.dtype.element_ty
    beta = sigmoid(tl.load(b_ptr + row * stride_a + hv).to(tl.float32)).to(bdt).to(tl.float32)
    a = tl.load(a_ptr + row * stride_a + hv).to(tl.float32) + tl.load(dtb_ptr + hv).to(tl.float32)
    g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * softplus(a)
    sp = s_ptr + slot_safe * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + v_idx[None, :]
    S = tl.load(sp, mask=rm, other=0.0).to(tl.float32)
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], 0)) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], 0)
    tl.store(sp, S.to(s_ptr.dtype.element_ty), mask=wm)
    tl.store(o_ptr + row * stride_ob + hv * stride_oh + v_idx, o, mask=vm)


def gdn_decode(xc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
               num_k_heads: int) -> None:
    """One Gated DeltaNet step for B rows: xc [B, conv_dim] the activated conv output (q | k | v), a and b [T, Hv]
    raw (in_proj_a / in_proj_b outputs, rows may be strided), state [slots, Hv, K, V]; writes out[rows]
    ([T, Hv, V] fp32) and the slots in place."""
    bt = rows.shape[0]
    if bt == 0:
        return
    _, hv, V = out.shape
    KD = state.shape[2]
    assert xc.stride(1) == 1 and a.stride(1) == 1 and a.stride(0) == b.stride(0) and out.stride(2) == 1
    assert state.stride(3) == 1
    block, warps = TILES["gdn"]
    block_v = min(triton.next_power_of_2(V), block)
    _gdn_decode_kernel[(bt, hv, triton.cdiv(V, block_v))](
        xc, a, b, A_log, dt_bias, state, out, slots, has_init, rows, V, num_k_heads * KD, xc.stride(0), a.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2), KD**-0.5,
        V_PER_K=hv // num_k_heads, KD=KD, KD_P2=triton.next_power_of_2(KD), BLOCK_V=block_v, num_warps=warps)


__all__ = ["conv_step", "conv_varlen", "gdn_decode", "mamba_decode"]
