"""Single-token (decode) steps of the recurrent mixers, batched, updating the state slots in place. Triton.

Every kernel takes `slots` (int64 [B], PAD_SLOT_ID = -1 for padded rows: the slot is neither read nor written,
the row's output is garbage-free zeros-in) and `has_init` (int32 [B]: 0 = start from zeros, the slot is not read).
States are addressed through their strides, so a layer's `[:, i]` slice of the stacked cache tensor works as is.

    conv:    window = | state (K-1) | x |;  out = sum_k w[:, k] window[:, k] (+ bias);  state <- window[:, 1:]
    mamba2:  h = h * exp(dt A) + (dt x) B^T;  y = h C + D x                  h [H, P, N] per slot
    gdn:     S = S * exp(g);  S += k (beta (v - S^T k))^T;  o = S^T q         S [Hv, K, V] per slot
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, slot_ptr, init_ptr, C, stride_xb, stride_ob,
                      stride_ss, stride_sc, stride_sk, HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    slot = tl.load(slot_ptr + b)
    valid = slot >= 0
    read = valid & (tl.load(init_ptr + b) != 0)
    slot_safe = tl.where(valid, slot, 0).to(tl.int64)
    rm = cm & ((c * 0 + read.to(tl.int32)) != 0)  # vector masks (a scalar bool in a mask breaks the interpreter)
    wm = cm & ((c * 0 + valid.to(tl.int32)) != 0)
    x = tl.load(x_ptr + b * stride_xb + c, mask=cm, other=0.0)
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
    tl.store(out_ptr + b * stride_ob + c, acc.to(out_ptr.dtype.element_ty), mask=cm)


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
    """x [B, C] conv inputs; state [slots, C, K-1]; weight [C, K] -> pre-activation output [B, C] (x's dtype)."""
    B, C = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    w = weight.contiguous()
    K = w.shape[1]
    block_c = 256
    _conv_step_kernel[(B, triton.cdiv(C, block_c))](
        x, state, w, bias if bias is not None else w, out, slots, has_init, C, x.stride(0), out.stride(0),
        state.stride(0), state.stride(1), state.stride(2), HAS_BIAS=bias is not None, K=K, BLOCK_C=block_c)
    return out


@triton.jit
def _mamba_step_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, h_ptr, y_ptr, slot_ptr, init_ptr, P,
                       stride_xb, stride_xh, stride_dtb, stride_bb, stride_bg, stride_hs, stride_hh, stride_hp,
                       HEADS_PER_GROUP: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    hd = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < P
    n = tl.arange(0, N)
    slot = tl.load(slot_ptr + b)
    valid = slot >= 0
    read = valid & (tl.load(init_ptr + b) != 0)
    slot_safe = tl.where(valid, slot, 0).to(tl.int64)
    rm = (pm & ((p * 0 + read.to(tl.int32)) != 0))[:, None]
    wm = (pm & ((p * 0 + valid.to(tl.int32)) != 0))[:, None]
    grp = hd // HEADS_PER_GROUP
    dt = tl.load(dt_ptr + b * stride_dtb + hd)
    decay = tl.exp(dt * tl.load(a_ptr + hd))
    x = tl.load(x_ptr + b * stride_xb + hd * stride_xh + p, mask=pm, other=0.0)
    bv = tl.load(b_ptr + b * stride_bb + grp * stride_bg + n)
    cv = tl.load(c_ptr + b * stride_bb + grp * stride_bg + n)
    hp = h_ptr + slot_safe * stride_hs + hd * stride_hh + p[:, None] * stride_hp + n[None, :]
    h = tl.load(hp, mask=rm, other=0.0).to(tl.float32)
    h = h * decay + (dt * x)[:, None] * bv[None, :]
    y = tl.sum(h * cv[None, :], 1) + tl.load(d_ptr + hd) * x
    tl.store(hp, h.to(h_ptr.dtype.element_ty), mask=wm)
    tl.store(y_ptr + b * stride_xb + hd * stride_xh + p, y, mask=pm)


def mamba_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
    """x [Bt, H, P] fp32, dt [Bt, H] fp32 (softplus'd), A [H] fp32, B/C [Bt, G, N] fp32, D [H] fp32, ssm state
    [slots, H, P, N] -> y [Bt, H, P] fp32 (with the D skip); the slots are updated in place."""
    bt, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if bt == 0:
        return y
    assert x.stride() == y.stride() and B.stride(2) == 1 and C.stride() == B.stride() and ssm.stride(3) == 1
    block_p = min(triton.next_power_of_2(P), 32)
    _mamba_step_kernel[(bt, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D, ssm, y, slots, has_init, P, x.stride(0), x.stride(1), dt.stride(0), B.stride(0),
        B.stride(1), ssm.stride(0), ssm.stride(1), ssm.stride(2), HEADS_PER_GROUP=H // G, N=N, BLOCK_P=block_p)
    return y


@triton.jit
def _gdn_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, slot_ptr, init_ptr, V,
                     stride_qb, stride_qh, stride_vb, stride_vh, stride_gb, stride_ss, stride_sh, stride_sk,
                     V_PER_K: tl.constexpr, KD: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    v_idx = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = v_idx < V
    kk = tl.arange(0, KD)
    slot = tl.load(slot_ptr + b)
    valid = slot >= 0
    read = valid & (tl.load(init_ptr + b) != 0)
    slot_safe = tl.where(valid, slot, 0).to(tl.int64)
    rm = (vm & ((v_idx * 0 + read.to(tl.int32)) != 0))[None, :]
    wm = (vm & ((v_idx * 0 + valid.to(tl.int32)) != 0))[None, :]
    hk = hv // V_PER_K
    q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + kk)
    k = tl.load(k_ptr + b * stride_qb + hk * stride_qh + kk)
    v = tl.load(v_ptr + b * stride_vb + hv * stride_vh + v_idx, mask=vm, other=0.0)
    g = tl.load(g_ptr + b * stride_gb + hv)
    beta = tl.load(beta_ptr + b * stride_gb + hv)
    sp = s_ptr + slot_safe * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + v_idx[None, :]
    S = tl.load(sp, mask=rm, other=0.0).to(tl.float32)
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], 0)) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], 0)
    tl.store(sp, S.to(s_ptr.dtype.element_ty), mask=wm)
    tl.store(o_ptr + b * stride_vb + hv * stride_vh + v_idx, o, mask=vm)


def gdn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
    """q, k [B, Hk, K] fp32 (normalised, q scaled); v [B, Hv, V] fp32; g, beta [B, Hv] fp32; state
    [slots, Hv, K, V] -> o [B, Hv, V] fp32; the slots are updated in place."""
    bt, hk, KD = q.shape
    hv, V = v.shape[1], v.shape[2]
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if bt == 0:
        return o
    assert q.stride() == k.stride() and q.stride(2) == 1 and v.stride() == o.stride() and state.stride(3) == 1
    assert g.stride() == beta.stride()
    block_v = min(triton.next_power_of_2(V), 32)
    _gdn_step_kernel[(bt, hv, triton.cdiv(V, block_v))](
        q, k, v, g, beta, state, o, slots, has_init, V, q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        g.stride(0), state.stride(0), state.stride(1), state.stride(2), V_PER_K=hv // hk, KD=KD, BLOCK_V=block_v)
    return o


__all__ = ["conv_step", "gdn_step", "mamba_step"]
