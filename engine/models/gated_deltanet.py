"""Gated-DeltaNet linear-attention mixer (Qwen3.5 `linear_attn`).

    in_proj_qkv -> causal depthwise conv1d + silu -> q, k (L2-normalised, q scaled by 1/sqrt(dk)), v
    in_proj_b -> beta = sigmoid(b);  in_proj_a -> g = -exp(A_log) * softplus(a + dt_bias)   (log decay <= 0)
    per value head:  S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t
    o -> RMSNorm(o) * silu(z) (per head) -> out_proj

State contract (per layer, per slot of the runner's StateCache):

    conv [conv_dim, conv_kernel - 1]         the last K-1 conv inputs, oldest first   (dtype: model dtype)
    ssm  [num_v_heads, head_k_dim, head_v_dim]                                        (dtype: float32)

Same rules as the Mamba-2 mixer: `has_initial_state` or zeros (the slot is then never read), final state in the
running slot, checkpoint states in their dest slots. Prefill chunks use the chunked (UT-transform) form in stretches
that end at every checkpoint; single-token sequences are batched through the recurrent form. `forward` is the
reference; `forward_varlen` the batched path (engine.models.fast_path), whose CPU stand-in for fla-core's kernel runs
the same `scan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hybridpd.engine.cache.specs import RecurrentStateSpec
from hybridpd.engine.models.base import StateCache
from hybridpd.engine.models.fast_path import gdn_mixer
from hybridpd.engine.models.layers import (
    causal_conv_chunk,
    causal_conv_step,
    fuse_linears,
    get_activation,
    rms_normalize,
    segment_bounds,
    segsum,
    to_chunks,
)
from hybridpd.engine.models.reference import RecurrentDecode, RecurrentSeq, StepMetadata
from hybridpd.engine.models.varlen import VarlenMetadata
from torch import nn


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Shapes and options of one Gated-DeltaNet mixer (Qwen3.5 config names in comments)."""

    hidden_size: int
    num_k_heads: int  # linear_num_key_heads
    num_v_heads: int  # linear_num_value_heads
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    activation: str  # hidden_act
    norm_eps: float  # rms_norm_eps
    chunk_size: int = 64

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_spec(self, conv_dtype: str) -> RecurrentStateSpec:
        return RecurrentStateSpec(
            kind="gated_deltanet",
            conv_shape=(self.conv_dim, self.conv_kernel - 1),
            conv_dtype=conv_dtype,
            ssm_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
            ssm_dtype="float32",
        )


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x), then times silu(gate) (norm before gate), in x's dtype (Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = self.weight * rms_normalize(x, self.eps).to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact gated delta rule over one stretch of a sequence (fp32), starting from state [H, K, V].

    q, k [L, H, K]; v [L, H, V]; g, beta [L, H]. Per chunk, with gamma_t = sum_{k<=t} g_k and the per-token
    update u_t = beta_t (v_t - S_{t-1}'^T k_t) (S' = decayed state), the u solve a unit lower-triangular system
        (I + tril_{-1}(beta_t e^{gamma_t - gamma_s} k_t.k_s)) u = beta v - beta e^{gamma} (k S_0)
    and o_t = e^{gamma_t} S_0^T q_t + sum_{s<=t} e^{gamma_t - gamma_s} (q_t.k_s) u_s.
    The triangular solves of all chunks run at once; the chunk-to-chunk state hand-off is a loop. The tail is
    padded with g = 0, beta = 0 (no decay, no update). Returns (o [L, H, V], final state [H, K, V])."""
    length = q.shape[0]
    q, k, v, g, beta = (to_chunks(t, chunk_size).transpose(1, 2) for t in (q, k, v, g, beta))  # [n, H, c, *]
    seg = segsum(g)
    decay = torch.exp(seg)  # [n, H, t, s], zero above the diagonal
    gamma = torch.cumsum(g, dim=-1)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat((v * beta[..., None], k_beta * torch.exp(gamma)[..., None]), dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_v, w = sol.split([v.shape[-1], k.shape[-1]], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * torch.exp(gamma)[..., None]
    k_to_end = (k * torch.exp(seg[:, :, -1, :])[..., None]).transpose(-1, -2)  # [n, H, K, c]
    chunk_decay = torch.exp(gamma[:, :, -1])[..., None, None]  # [n, H, 1, 1]
    out = torch.empty_like(v)
    for i in range(q.shape[0]):
        u = u_v[i] - w[i] @ state
        out[i] = q_decayed[i] @ state + attn[i] @ u
        state = chunk_decay[i] * state + k_to_end[i] @ u
    return out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[-1])[:length], state


class GatedDeltaNet(nn.Module):
    """Parameter names match the HF checkpoint (`...linear_attn.in_proj_qkv.weight`, `in_proj_z`, `in_proj_b`,
    `in_proj_a`, `conv1d.weight`, `dt_bias`, `A_log`, `norm.weight`, `out_proj.weight`)."""

    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, cfg.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, cfg.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, cfg.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False, padding=cfg.conv_kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_v_heads))
        self.norm = GatedRMSNorm(cfg.head_v_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)
        self.act = get_activation(cfg.activation)
        self.in_proj_all: torch.Tensor | None = None
        """[qkv | z | b | a] weights in one tensor (fast path: one GEMM); the four weights are views of it."""

    def forward(self, hidden: torch.Tensor, cache: StateCache, meta: StepMetadata) -> torch.Tensor:
        """The reference: hidden [T, hidden_size] (already normed) -> mixer output [T, hidden_size]; updates
        `cache` in place. Prefill chunks sequence by sequence, single-token sequences batched."""
        cfg = self.cfg
        n = hidden.shape[0]
        qkv = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden).view(n, cfg.num_v_heads, cfg.head_v_dim)
        beta = self.in_proj_b(hidden).sigmoid().float()
        g = -torch.exp(self.A_log.float()) * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias.float())
        core = torch.zeros(n, cfg.num_v_heads, cfg.head_v_dim, dtype=torch.float32, device=hidden.device)
        for s in meta.rec_seqs:
            rows = slice(s.start, s.start + s.length)
            core[rows] = self._chunk(qkv[rows], g[rows], beta[rows], s, cache)
        d = meta.rec_decode
        if d is not None:
            core[d.tokens] = self._decode(qkv[d.tokens], g[d.tokens], beta[d.tokens], d, cache)
        out = self.norm(core.to(hidden.dtype), z)
        return self.out_proj(out.reshape(n, cfg.value_dim))

    def forward_varlen(self, hidden: torch.Tensor, cache: StateCache, meta: VarlenMetadata) -> torch.Tensor:
        """The same on the batched path (engine.models.fast_path.gdn_mixer): the four input projections as one
        GEMM (`fuse`, done by the model's enable_fast_path), the output norm and gate in one kernel."""
        from hybridpd.engine.kernels.fused import gated_head_norm

        cfg = self.cfg
        assert self.in_proj_all is not None, "forward_varlen needs fuse() (the model's enable_fast_path)"
        qkv, z, b, a = F.linear(hidden, self.in_proj_all).split(
            [cfg.conv_dim, cfg.value_dim, cfg.num_v_heads, cfg.num_v_heads], dim=-1)
        core = gdn_mixer(self, qkv, a, b, cache, meta)
        z = z.view(hidden.shape[0], cfg.num_v_heads, cfg.head_v_dim)
        return self.out_proj(gated_head_norm(core, z, self.norm.weight, self.norm.eps, hidden.dtype))

    def scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference delta-rule scan over one stretch of one sequence (`gdn_segment`): q, k [L, Hk, K] and
        v [L, Hv, V] from `_split`, g and beta [L, Hv], state [Hv, K, V] fp32 -> (o [L, Hv, V], the state after
        the stretch). The batched path's CPU stand-in for fla-core's kernel runs it too."""
        return gdn_segment(self._heads(q), self._heads(k), v, g, beta, state, self.cfg.chunk_size)

    def fuse(self) -> None:
        """Fast path: the four input projections as one GEMM."""
        self.in_proj_all = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]

    def _split(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated conv output [n, conv_dim] -> q, k [n, Hk, K] (L2-normalised, q scaled by 1/sqrt(K); per key
        head), v [n, Hv, V]; fp32, contiguous."""
        cfg = self.cfg
        n = xc.shape[0]
        q, k, v = xc.float().split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q = l2norm(q.reshape(n, cfg.num_k_heads, cfg.head_k_dim)) * cfg.head_k_dim**-0.5
        k = l2norm(k.reshape(n, cfg.num_k_heads, cfg.head_k_dim))
        return q.contiguous(), k.contiguous(), v.reshape(n, cfg.num_v_heads, cfg.head_v_dim).contiguous()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """[n, Hk, K] per key head -> [n, Hv, K] per value head (GQA-style sharing)."""
        return t.repeat_interleave(self.cfg.num_v_heads // self.cfg.num_k_heads, dim=1)

    def _chunk(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: RecurrentSeq, cache: StateCache
    ) -> torch.Tensor:
        cfg = self.cfg
        init_conv = cache.conv[s.slot] if s.has_initial_state else None
        xc, conv_states = causal_conv_chunk(qkv, init_conv, self._conv_weight(), self.conv1d.bias, s.cuts)
        q, k, v = self._split(self.act(xc))
        if s.has_initial_state:
            state = cache.ssm[s.slot].float()
        else:
            state = torch.zeros(cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, dtype=torch.float32, device=q.device)
        out = torch.empty_like(v)
        states: dict[int, torch.Tensor] = {}
        for a, b in segment_bounds(s.cuts):
            out[a:b], state = self.scan(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
            states[b] = state
        for cut, conv_state in zip(s.cuts, conv_states, strict=True):
            for dest in s.dests[cut]:
                cache.conv[dest] = conv_state.to(cache.conv.dtype)
                cache.ssm[dest] = states[cut].to(cache.ssm.dtype)
        return out

    def _decode(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, d: RecurrentDecode, cache: StateCache
    ) -> torch.Tensor:
        cfg = self.cfg
        n = qkv.shape[0]
        conv_prev = torch.zeros(n, *cache.conv.shape[1:], dtype=cache.conv.dtype, device=qkv.device)
        state = torch.zeros(n, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, dtype=torch.float32, device=qkv.device)
        if d.state_rows.numel() > 0:
            conv_prev[d.state_rows] = cache.conv[d.state_slots]
            state[d.state_rows] = cache.ssm[d.state_slots].float()
        xc, conv_new = causal_conv_step(qkv, conv_prev, self._conv_weight(), self.conv1d.bias)
        q, k, v = self._split(self.act(xc))
        q, k = self._heads(q), self._heads(k)
        state = state * torch.exp(g)[:, :, None, None]
        delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[:, :, None]
        state = state + k[..., None] * delta[:, :, None, :]
        out = torch.einsum("bhkv,bhk->bhv", state, q)
        cache.conv[d.slots] = conv_new.to(cache.conv.dtype)
        cache.ssm[d.slots] = state.to(cache.ssm.dtype)
        return out


__all__ = ["GatedDeltaNet", "GatedDeltaNetConfig", "GatedRMSNorm", "gdn_segment", "l2norm"]
