"""Mamba-2 mixer (as in NemotronH): in_proj -> causal depthwise conv1d -> selective SSM -> gated RMSNorm -> out_proj.

State contract (per layer, per slot of the runner's StateCache):

    conv [conv_dim, conv_kernel - 1]   the last K-1 conv inputs, oldest first        (dtype: model dtype)
    ssm  [num_heads, head_dim, state_size]                                            (dtype: mamba_ssm_cache_dtype)

A sequence with `has_initial_state` reads its slot; otherwise it starts from zeros and never reads the slot. After
the step the final state is in the running slot and every checkpoint (num_tokens, dest) holds the state after
that many tokens. Prefill chunks use the chunked (segment) form of the SSD recurrence over stretches that end at
every checkpoint (the chunks of a stretch batched), so intermediate states come out exactly; single-token sequences
are batched into one step. `Mamba2Mixer.forward` is the reference; `forward_varlen` the batched path
(engine.models.fast_path), whose CPU stand-in for fla-core's kernel runs the same `scan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hybridpd.engine.cache.specs import RecurrentStateSpec
from hybridpd.engine.models.base import StateCache
from hybridpd.engine.models.fast_path import mamba2_mixer
from hybridpd.engine.models.layers import (
    causal_conv_chunk,
    causal_conv_step,
    get_activation,
    segment_bounds,
    segsum,
    to_chunks,
)
from hybridpd.engine.models.reference import RecurrentDecode, RecurrentSeq, StepMetadata
from hybridpd.engine.models.varlen import VarlenMetadata
from torch import nn


@dataclass(frozen=True)
class Mamba2Config:
    """Shapes and options of one Mamba-2 mixer (NemotronH config names in comments)."""

    hidden_size: int
    num_heads: int  # mamba_num_heads
    head_dim: int  # mamba_head_dim
    n_groups: int
    state_size: int  # ssm_state_size
    conv_kernel: int
    chunk_size: int
    use_bias: bool  # in_proj / out_proj bias
    use_conv_bias: bool
    activation: str  # mamba_hidden_act
    norm_eps: float  # layer_norm_epsilon (gated norm)
    time_step_min: float  # dt is clamped to [time_step_min, inf) as transformers does
    ssm_dtype: str  # mamba_ssm_cache_dtype

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def state_spec(self, conv_dtype: str) -> RecurrentStateSpec:
        return RecurrentStateSpec(
            kind="mamba2",
            conv_shape=(self.conv_dim, self.conv_kernel - 1),
            conv_dtype=conv_dtype,
            ssm_shape=(self.num_heads, self.head_dim, self.state_size),
            ssm_dtype=self.ssm_dtype,
        )


class GroupGatedRMSNorm(nn.Module):
    """y * silu(z), then RMS-normalised per group of `group_size` channels, times weight; fp32 in and out."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = y.float() * F.silu(gate.float())
        groups = x.view(*x.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * groups.view(x.shape)

    def forward_fused(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The same in one kernel, cast to `dtype` (fast path)."""
        from hybridpd.engine.kernels.fused import gated_group_norm

        return gated_group_norm(y, gate, self.weight, self.group_size, self.eps, dtype)


def ssd_segment(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact SSD over one stretch of a sequence (all fp32), starting from state h0 [H, P, N].

    x [L, H, P], dt [L, H], A [H], B/C [L, H, N]. With a_t = dt_t A and gamma_t = sum_{k<=t} a_k (per chunk):
        h_t = exp(gamma_t) h0 + sum_{s<=t} exp(gamma_t - gamma_s) dt_s x_s B_s^T,     y_t = C_t . h_t
    All chunks' intra-chunk terms are computed at once; only the chunk-to-chunk state hand-off is a loop.
    The tail is padded with dt = 0 (decay 1, no input), which leaves the state unchanged.
    Returns (y [L, H, P] without the D skip, h_end [H, P, N])."""
    length = x.shape[0]
    x, dt, B, C = (to_chunks(t, chunk_size) for t in (x, dt, B, C))  # [n, c, ...]
    a = (dt * A).transpose(1, 2)  # [n, H, c]
    seg = segsum(a)  # [n, H, t, s]
    weights = torch.einsum("nthk,nshk->nhts", C, B) * torch.exp(seg) * dt.transpose(1, 2)[:, :, None, :]
    y = torch.einsum("nhts,nshp->nthp", weights, x)
    gamma = torch.cumsum(a, dim=-1)  # [n, H, c]
    to_end = (torch.exp(seg[:, :, -1, :]) * dt.transpose(1, 2)).transpose(1, 2)  # [n, s, H]
    chunk_states = torch.einsum("nshp,nshk->nhpk", x * to_end[..., None], B)  # each chunk from a zero state
    chunk_decay = torch.exp(gamma[:, :, -1])  # [n, H]
    h = h0
    starts = []
    for i in range(x.shape[0]):
        starts.append(h)
        h = chunk_decay[i][:, None, None] * h + chunk_states[i]
    y = y + torch.exp(gamma).transpose(1, 2)[..., None] * torch.einsum("nthk,nhpk->nthp", C, torch.stack(starts))
    return y.reshape(-1, *y.shape[2:])[:length], h


class Mamba2Mixer(nn.Module):
    """Parameter names match the HF checkpoint (`...mixer.in_proj.weight`, `conv1d`, `A_log`, `D`, `dt_bias`,
    `norm.weight`, `out_proj.weight`)."""

    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.cfg = cfg
        inter, conv_dim = cfg.intermediate_size, cfg.conv_dim
        self.in_proj = nn.Linear(cfg.hidden_size, inter + conv_dim + cfg.num_heads, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, cfg.conv_kernel, groups=conv_dim, bias=cfg.use_conv_bias, padding=cfg.conv_kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_heads))
        self.D = nn.Parameter(torch.ones(cfg.num_heads))
        self.norm = GroupGatedRMSNorm(inter, inter // cfg.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.use_bias)
        self.act = get_activation(cfg.activation)

    def forward(self, hidden: torch.Tensor, cache: StateCache, meta: StepMetadata) -> torch.Tensor:
        """The reference: hidden [T, hidden_size] (already normed) -> mixer output [T, hidden_size]; updates
        `cache` in place. Prefill chunks sequence by sequence, single-token sequences batched."""
        cfg = self.cfg
        gate, xbc, dt = self.in_proj(hidden).split([cfg.intermediate_size, cfg.conv_dim, cfg.num_heads], dim=-1)
        y = torch.zeros(hidden.shape[0], cfg.num_heads, cfg.head_dim, dtype=torch.float32, device=hidden.device)
        for s in meta.rec_seqs:
            rows = slice(s.start, s.start + s.length)
            y[rows] = self._chunk(xbc[rows], dt[rows], s, cache)
        d = meta.rec_decode
        if d is not None:
            y[d.tokens] = self._decode(xbc[d.tokens], dt[d.tokens], d, cache)
        out = self.norm(y.view(hidden.shape[0], -1), gate)
        return self.out_proj(out.to(hidden.dtype))

    def forward_varlen(self, hidden: torch.Tensor, cache: StateCache, meta: VarlenMetadata) -> torch.Tensor:
        """The same on the batched path (engine.models.fast_path.mamba2_mixer)."""
        cfg = self.cfg
        gate, xbc, dt = self.in_proj(hidden).split([cfg.intermediate_size, cfg.conv_dim, cfg.num_heads], dim=-1)
        y = mamba2_mixer(self, xbc, dt, cache, meta)
        return self.out_proj(self.norm.forward_fused(y.view(hidden.shape[0], -1), gate, hidden.dtype))

    def scan(self, xa: torch.Tensor, dt: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference SSM scan over one stretch of one sequence (`ssd_segment`, then the D skip): activated conv
        output xa [L, conv_dim], dt [L, H] (from `_dt`), state h0 [H, P, N] fp32 -> (y [L, H, P] fp32, the state
        after the stretch). The batched path's CPU stand-in for fla-core's kernel runs it too."""
        x, B, C = self._split(xa)
        A = -torch.exp(self.A_log.float())
        y, h = ssd_segment(x, dt, A, self._heads(B), self._heads(C), h0, self.cfg.chunk_size)
        return y + self.D.float()[:, None] * x, h

    # -- helpers ---------------------------------------------------------------------------------------------

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]

    def _split(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated conv output [..., conv_dim] -> x [..., H, P], B and C [..., G, N] (per group), fp32."""
        cfg = self.cfg
        gn = cfg.n_groups * cfg.state_size
        x, B, C = xc.float().split([cfg.intermediate_size, gn, gn], dim=-1)
        lead = x.shape[:-1]
        groups = (cfg.n_groups, cfg.state_size)
        return x.reshape(*lead, cfg.num_heads, cfg.head_dim), B.reshape(*lead, *groups), C.reshape(*lead, *groups)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """[..., G, N] per group -> [..., H, N] per head (each group's heads share its B / C)."""
        return t.repeat_interleave(self.cfg.num_heads // self.cfg.n_groups, dim=-2)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt + dt_bias) in the model dtype, then fp32 (transformers' mamba2_chunk_scan rounds here)."""
        return F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(min=self.cfg.time_step_min).float()

    def _chunk(self, xbc: torch.Tensor, dt: torch.Tensor, s: RecurrentSeq, cache: StateCache) -> torch.Tensor:
        cfg = self.cfg
        init_conv = cache.conv[s.slot] if s.has_initial_state else None
        xc, conv_states = causal_conv_chunk(xbc, init_conv, self._conv_weight(), self.conv1d.bias, s.cuts)
        xa, dt = self.act(xc), self._dt(dt)
        if s.has_initial_state:
            h = cache.ssm[s.slot].float()
        else:
            h = torch.zeros(cfg.num_heads, cfg.head_dim, cfg.state_size, dtype=torch.float32, device=xbc.device)
        y = torch.empty(s.length, cfg.num_heads, cfg.head_dim, dtype=torch.float32, device=xbc.device)
        states: dict[int, torch.Tensor] = {}
        for a, b in segment_bounds(s.cuts):
            y[a:b], h = self.scan(xa[a:b], dt[a:b], h)
            states[b] = h
        for cut, conv_state in zip(s.cuts, conv_states, strict=True):
            for dest in s.dests[cut]:
                cache.conv[dest] = conv_state.to(cache.conv.dtype)
                cache.ssm[dest] = states[cut].to(cache.ssm.dtype)
        return y

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, d: RecurrentDecode, cache: StateCache) -> torch.Tensor:
        cfg = self.cfg
        n = xbc.shape[0]
        conv_prev = torch.zeros(n, *cache.conv.shape[1:], dtype=cache.conv.dtype, device=xbc.device)
        h0 = torch.zeros(n, cfg.num_heads, cfg.head_dim, cfg.state_size, dtype=torch.float32, device=xbc.device)
        if d.state_rows.numel() > 0:
            conv_prev[d.state_rows] = cache.conv[d.state_slots]
            h0[d.state_rows] = cache.ssm[d.state_slots].float()
        xc, conv_new = causal_conv_step(xbc, conv_prev, self._conv_weight(), self.conv1d.bias)
        x, B, C = self._split(self.act(xc))
        B, C = self._heads(B), self._heads(C)
        dt = self._dt(dt)  # [n, H]
        A = -torch.exp(self.A_log.float())
        h = h0 * torch.exp(dt * A)[:, :, None, None] + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", h, C) + self.D.float()[:, None] * x
        cache.conv[d.slots] = conv_new.to(cache.conv.dtype)
        cache.ssm[d.slots] = h.to(cache.ssm.dtype)
        return y


__all__ = ["GroupGatedRMSNorm", "Mamba2Config", "Mamba2Mixer", "ssd_segment"]
