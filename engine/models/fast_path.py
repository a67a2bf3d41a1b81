"""The batched fast path of the mixers (CUDA): the same computation as the reference code in reference.py,
mamba2.py, gated_deltanet.py, nemotron_h.py and qwen3_5.py, without per-sequence Python loops. The models'
`forward_varlen` runs it (the runner picks that or `forward_reference` once, at construction); every layer reads a
`VarlenMetadata`.

    attention      write_kv + one paged varlen attention launch (engine.kernels.paged_attention)
    norms          fused residual add + RMSNorm, gated norms, silu * mul (engine.kernels.fused), fused in_proj
                   GEMMs (`fuse_linears`: one weight, the modules' weights become views of it)
    recurrent      decode rows: conv_step (+ silu) and mamba_decode / gdn_decode (dt, gates, q/k norms inside),
                   slots updated in place
                   prefill rows: conv over the extended buffer (one kernel, + silu), then fla-core's chunked kernels
                   (chunk_simple_gla for Mamba-2's SSD, chunk_gated_delta_rule for GDN), one varlen call per round;
                   off the GPU (tests) the mixers' reference `scan`, sequence by sequence, in the same rounds
    MoE            routing on the device, tokens sorted by expert, torch._grouped_mm (bf16), no host sync

fla-core is imported here only, lazily, on the first prefill step that needs it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hybridpd.engine.models.base import StateCache
from hybridpd.engine.models.layers import relu2 as relu2_reference
from hybridpd.engine.models.varlen import RecurrentPrefill, VarlenMetadata

SILU = ("silu", "swish")
"""Activations the decode kernels apply themselves (others run in torch between the two kernels)."""

# ----------------------------------------------------------------------------------------------------------------
# attention


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: VarlenMetadata,
                     scale: float) -> torch.Tensor:
    """Write the step's K/V into their slots, then one paged varlen attention launch (engine.kernels)."""
    from hybridpd.engine.kernels.paged_attention import paged_attention_varlen, write_kv

    write_kv(k, v, kv_cache, meta.slot_mapping)
    return paged_attention_varlen(q, kv_cache, meta.q_start, meta.q_len, meta.ctx_len, meta.block_table,
                                  meta.max_q_len, scale)


# ----------------------------------------------------------------------------------------------------------------
# recurrent helpers


def conv_prefill(xbc: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 pre: RecurrentPrefill, act: bool = False) -> torch.Tensor:
    """Causal depthwise conv of every prefill token (xbc's dtype, fp32 accumulation; silu'd with `act`),
    continuing each sequence's conv state; writes the conv state at every cut into its slots. Returns [P, C] in
    pre.rows order."""
    from hybridpd.engine.kernels.recurrent_step import conv_varlen

    C, K = weight.shape
    ext = xbc.new_empty(pre.ext_size, C)
    if pre.num_seqs == 1:  # its tokens follow its K-1 state rows: a slice copy, not a scatter
        ext[K - 1:] = prefill_rows(xbc, pre)
    else:
        ext[pre.ext_x] = prefill_rows(xbc, pre)
    init = xbc.new_zeros(pre.num_seqs, C, K - 1)  # state rows: zeros, or the slot's conv state
    if pre.init_index.numel() > 0:
        init[pre.init_index] = conv[pre.init_slot].to(xbc.dtype)
    ext[pre.ext_state] = init.transpose(1, 2).reshape(-1, C)
    out = conv_varlen(ext, weight, bias, pre.ext_x, act)
    conv[pre.cut_slot] = ext[pre.cut_ext].transpose(1, 2).to(conv.dtype)
    return out


def prefill_rows(t: torch.Tensor, pre: RecurrentPrefill) -> torch.Tensor:
    """The prefill tokens' rows of a per-token tensor: a slice when they are adjacent, else a gather."""
    return t[pre.rows_range[0]:pre.rows_range[1]] if pre.rows_range is not None else t[pre.rows]


def place_prefill_rows(out: torch.Tensor, pre: RecurrentPrefill, value: torch.Tensor) -> None:
    if pre.rows_range is not None:
        out[pre.rows_range[0]:pre.rows_range[1]] = value
    else:
        out[pre.rows] = value


def _initial_states(ssm: torch.Tensor, pre: RecurrentPrefill) -> torch.Tensor:
    h0 = torch.zeros(pre.num_seqs, *ssm.shape[1:], dtype=torch.float32, device=ssm.device)
    if pre.init_index.numel() > 0:
        h0[pre.init_index] = ssm[pre.init_slot].float()
    return h0


def _run_rounds(pre: RecurrentPrefill, ssm: torch.Tensor, call, empty) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Round by round: `call(round, initial_states) -> (o [n, ...], final_states)`; o goes to out[round.rows] of
    out = empty() (fp32, one row per prefill token), returned; final states go to the round's destination slots and
    seed the next round. One round over every token in order (no cut inside a chunk): its o is the output."""
    states = _initial_states(ssm, pre)
    if len(pre.rounds) == 1 and pre.rounds[0].whole:
        r = pre.rounds[0]
        o, states = call(r, states.contiguous())
        ssm[r.dest_slot] = states[r.dest_index].to(ssm.dtype)
        return o.float()
    out = empty()
    for r in pre.rounds:
        init = states if r.init_prev is None else states[r.init_prev]
        o, states = call(r, init.contiguous())
        out[r.rows] = o.to(out.dtype)
        ssm[r.dest_slot] = states[r.dest_index].to(ssm.dtype)
    return out


def _per_sequence(r, init: torch.Tensor, segment) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """CPU stand-in for one varlen chunked call: `segment(a, b, h0) -> (o, h_end)` per sequence of the round."""
    cu = r.cu_seqlens_cpu.tolist()
    outs, finals = [], []
    for i in range(len(cu) - 1):
        o, h = segment(cu[i], cu[i + 1], init[i])
        outs.append(o)
        finals.append(h)
    return torch.cat(outs), torch.stack(finals)


# ----------------------------------------------------------------------------------------------------------------
# Mamba-2


def mamba2_mixer(mixer: Any, xbc: torch.Tensor, dt: torch.Tensor, cache: StateCache, meta: VarlenMetadata
                 ) -> torch.Tensor:
    """y [T, H, P] fp32 (with the D skip) of a Mamba2Mixer for every token; updates the state slots. xbc and dt
    are the raw in_proj slices (strided rows)."""
    from hybridpd.engine.kernels.recurrent_step import conv_step, mamba_decode

    cfg = mixer.cfg
    T = xbc.shape[0]
    d, pre = meta.rec_decode, meta.rec_prefill
    # a step of prefill tokens only, in order: the prefill output is y itself (no zeros, no scatter)
    y = None if d is None and pre is not None and pre.rows_range == (0, T) else \
        torch.zeros(T, cfg.num_heads, cfg.head_dim, dtype=torch.float32, device=xbc.device)
    weight = mixer._conv_weight()
    fused_act = cfg.activation in SILU
    if d is not None:
        xc = conv_step(xbc, cache.conv, weight, mixer.conv1d.bias, d.slots, d.has_init, d.rows, act=fused_act)
        mamba_decode(xc if fused_act else mixer.act(xc), dt, mixer.dt_bias, mixer.A_log, mixer.D, cache.ssm,
                     d.slots, d.has_init, d.rows, y, cfg.n_groups, cfg.time_step_min)
    if pre is not None:
        xc = conv_prefill(xbc, cache.conv, weight, mixer.conv1d.bias, pre, act=fused_act)
        xa = xc if fused_act else mixer.act(xc)
        dtp = mixer._dt(prefill_rows(dt, pre))
        prefill = _mamba_prefill_fla if fla_prefill(xbc) else _mamba_prefill_scan
        yp = prefill(mixer, xa, dtp, cache, pre)
        if y is None:
            return yp
        place_prefill_rows(y, pre, yp)
    assert y is not None
    return y


def _mamba_prefill_fla(mixer: Any, xa: torch.Tensor, dtp: torch.Tensor, cache: StateCache, pre: RecurrentPrefill
                       ) -> torch.Tensor:
    """fla-core's chunked SSD over the prefill tokens, its inputs and the D skip from two Triton kernels."""
    from fla.ops.simple_gla import chunk_simple_gla
    from hybridpd.engine.kernels.recurrent_prefill import mamba_chunk_inputs, mamba_skip_add

    cfg = mixer.cfg
    q, k, v = mamba_chunk_inputs(xa, dtp, cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size)
    g_all = dtp * -torch.exp(mixer.A_log.float())

    def call(r, init):  # type: ignore[no-untyped-def]
        def sel(t: torch.Tensor) -> torch.Tensor:
            return t if r.whole else t[r.rows]

        o, ht = chunk_simple_gla(sel(q)[None], sel(k)[None], sel(v)[None], g=sel(g_all)[None], scale=1.0,
                                 initial_state=init, output_final_state=True, state_v_first=True,
                                 cu_seqlens=r.cu_seqlens, cu_seqlens_cpu=r.cu_seqlens_cpu)
        return o[0], ht

    yp = _run_rounds(pre, cache.ssm, call, lambda: torch.empty_like(v))
    return mamba_skip_add(yp.contiguous(), xa, mixer.D)


def fla_prefill(x: torch.Tensor) -> bool:
    """Whether a prefill's recurrent scan runs in fla-core's chunk kernels: on CUDA in bf16/fp16. Fed fp32, their
    Triton dots take TF32 (Triton's default), which put Qwen3.5-MoE's fp32 logprobs 1.0e-4 from transformers' on an
    H200; fp32 is the dtype that must be exact, so it runs the reference scans (on the GPU too)."""
    return x.is_cuda and x.dtype != torch.float32


def _mamba_prefill_scan(mixer: Any, xa: torch.Tensor, dtp: torch.Tensor, cache: StateCache, pre: RecurrentPrefill
                        ) -> torch.Tensor:
    """Off the GPU, or in fp32 (see fla_prefill): the same rounds with the reference scan (Mamba2Mixer.scan)."""
    cfg = mixer.cfg

    def call(r, init):  # type: ignore[no-untyped-def]
        x, dt = xa[r.rows], dtp[r.rows]
        return _per_sequence(r, init, lambda a, b, h: mixer.scan(x[a:b], dt[a:b], h))

    return _run_rounds(pre, cache.ssm, call, lambda: xa.new_empty(xa.shape[0], cfg.num_heads, cfg.head_dim,
                                                                  dtype=torch.float32))


# ----------------------------------------------------------------------------------------------------------------
# Gated DeltaNet


def gdn_mixer(mixer: Any, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cache: StateCache,
              meta: VarlenMetadata) -> torch.Tensor:
    """core output [T, Hv, V] fp32 of a GatedDeltaNet for every token; updates the state slots. qkv, a and b are
    the raw in_proj outputs (strided rows)."""
    from hybridpd.engine.kernels.recurrent_step import conv_step, gdn_decode

    cfg = mixer.cfg
    T = qkv.shape[0]
    core = torch.zeros(T, cfg.num_v_heads, cfg.head_v_dim, dtype=torch.float32, device=qkv.device)
    weight = mixer._conv_weight()
    fused_act = cfg.activation in SILU
    d = meta.rec_decode
    if d is not None:
        xc = conv_step(qkv, cache.conv, weight, mixer.conv1d.bias, d.slots, d.has_init, d.rows, act=fused_act)
        gdn_decode(xc if fused_act else mixer.act(xc), a, b, mixer.A_log, mixer.dt_bias, cache.ssm, d.slots,
                   d.has_init, d.rows, core, cfg.num_k_heads)
    pre = meta.rec_prefill
    if pre is not None:
        xc = conv_prefill(qkv, cache.conv, weight, mixer.conv1d.bias, pre, act=fused_act)
        q, k, v = mixer._split(xc if fused_act else mixer.act(xc))
        bp = prefill_rows(b, pre).sigmoid().float()
        gp = -torch.exp(mixer.A_log.float()) * F.softplus(prefill_rows(a, pre).float() + mixer.dt_bias.float())
        prefill = _gdn_round_fla if fla_prefill(qkv) else _gdn_round_scan

        def call(r, init):  # type: ignore[no-untyped-def]
            return prefill(mixer, r, init, q[r.rows], k[r.rows], v[r.rows], gp[r.rows], bp[r.rows])

        place_prefill_rows(core, pre, _run_rounds(pre, cache.ssm, call, lambda: torch.empty_like(v)))
    return core


def _gdn_round_fla(mixer: Any, r: Any, init: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One round in one fla-core varlen call."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, ht = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=init,
                                   output_final_state=True, cu_seqlens=r.cu_seqlens, cu_seqlens_cpu=r.cu_seqlens_cpu)
    return o[0], ht


def _gdn_round_scan(mixer: Any, r: Any, init: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Off the GPU, or in fp32 (see fla_prefill): the reference scan (GatedDeltaNet.scan), sequence by sequence."""
    return _per_sequence(r, init, lambda i, j, h: mixer.scan(q[i:j], k[i:j], v[i:j], g[i:j], beta[i:j], h))


# ----------------------------------------------------------------------------------------------------------------
# MoE


def relu2_fast(x: torch.Tensor) -> torch.Tensor:
    """layers.relu2 in one Triton pass on CUDA (same bits), the torch ops elsewhere."""
    if x.is_cuda and x.is_contiguous():
        from hybridpd.engine.kernels.fused import relu2

        return relu2(x)
    return relu2_reference(x)


def stack_experts(moe: Any) -> None:
    """Stack the routed experts' weights into [E, out, in] tensors once; each expert's weight becomes a view of
    its row (no second copy stays in memory)."""
    for name in ("up_proj", "down_proj"):
        stacked = torch.stack([getattr(e, name).weight.data for e in moe.experts])
        for i, e in enumerate(moe.experts):
            getattr(e, name).weight = torch.nn.Parameter(stacked[i], requires_grad=False)
        setattr(moe, f"stacked_{name}", stacked)


def grouped_moe_available(x: torch.Tensor, *stacked: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM can run the routed experts: bf16 on CUDA, and every operand's rows a multiple
    of 16 bytes (8 values: x's width and both dims of each stacked expert weight), which it requires. An expert
    width off 8 (a config's, or a tensor-parallel share of one) takes the masked path instead."""
    dims = [x.shape[-1], *(d for w in stacked for d in w.shape[-2:])]
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and all(d % 8 == 0 for d in dims))


def sort_by_expert(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs of idx [T, k] sorted by expert, without a host sync: (order [T*k]: flat pair index
    of each sorted row, offs [E] int32: the grouped GEMM's cumulative row ends per expert, pos [T*k]: the sorted
    row that holds each flat pair)."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would size its output on the host (a sync)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=idx.device)
    return order, offs, pos


def moe_routed(moe: Any, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Routed experts without a host sync: token copies sorted by expert, two grouped GEMMs, then each token's k
    outputs gathered back, weighted and summed in fp32 (one kernel). x [T, in] bf16; weights fp32 / idx [T, k].
    Returns [T, in] in x's dtype."""
    from hybridpd.engine.kernels.fused import moe_combine

    T, top = idx.shape
    order, offs, pos = sort_by_expert(idx, moe.stacked_up_proj.shape[0])
    up = torch._grouped_mm(x[order // top], moe.stacked_up_proj.transpose(1, 2), offs=offs)
    act_fn = moe.experts[0].act
    act = relu2_fast(up) if act_fn is relu2_reference else act_fn(up)
    down = torch._grouped_mm(act, moe.stacked_down_proj.transpose(1, 2), offs=offs)
    return moe_combine(down, pos.view(T, top), weights.float().contiguous())



def moe_routed_masked(moe: Any, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The same without grouped GEMMs (fp32, or no torch._grouped_mm): every expert on every token, weighted by
    its routing weight (0 where not chosen). E times the expert FLOPs, but no host sync, so it can be captured in a
    CUDA graph. Returns fp32 [T, in]."""
    routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, expert in enumerate(moe.experts):
        w = (weights * (idx == e)).sum(-1)
        routed += expert(x).float() * w[:, None]
    return routed


__all__ = ["conv_prefill", "gdn_mixer", "grouped_moe_available", "mamba2_mixer", "moe_routed", "moe_routed_masked",
           "relu2_fast", "sort_by_expert", "stack_experts", "varlen_attention"]
