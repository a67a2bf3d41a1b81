"""Building blocks shared by the model families: activations, norms, rotary embedding, MLPs, the reference path's
paged attention and the per-step metadata that turns a flat `ForwardBatch` into per-sequence index tensors.

Pure torch (CPU and CUDA, fp32/bf16/fp16). Every index tensor of the reference path is built once per step
(`StepMetadata.build`, once per view of the batch when a model has several cache groups of a kind:
`StepMetadata.per_layer`) and shared by the layers that read it. Reductions that decide accuracy (softmax, norms)
run in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hybridpd.engine.cache.specs import PAD_SLOT_ID
from hybridpd.engine.models.batch import ForwardBatch, per_layer
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

    Holds no module state (so it survives meta-device construction); inv_freq is computed on CPU in fp32."""

    def __init__(self, rotary_dim: int, base: float) -> None:
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (
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
# per-step metadata


@dataclass
class AttnSeq:
    """One multi-token (prefill chunk) sequence for attention: its queries and the cache rows of its context."""

    q_start: int
    q_len: int
    num_computed: int
    ctx_blocks: torch.Tensor  # int64 [ctx_len] block id of context position p
    ctx_offsets: torch.Tensor  # int64 [ctx_len] offset of p inside its block


@dataclass
class AttnDecode:
    """All single-token sequences, batched. Context positions are padded to the longest context; padded
    entries point at the sequence's own position 0 (a valid row) and are replaced, never multiplied, away."""

    tokens: torch.Tensor  # int64 [B] flat token index
    blocks: torch.Tensor  # int64 [B, L]
    offsets: torch.Tensor  # int64 [B, L]
    valid: torch.Tensor  # bool [B, L]


@dataclass
class RecurrentSeq:
    """One multi-token sequence for a recurrent mixer.

    `cuts` are the sorted relative token counts (1..length) after which a state must be written: every
    checkpoint, and `length` itself (the running slot). `dests[c]` lists the slots that receive the state at c."""

    start: int
    length: int
    slot: int
    has_initial_state: bool
    cuts: list[int]
    dests: dict[int, list[int]]


@dataclass
class RecurrentDecode:
    """All single-token sequences with a real state slot, batched."""

    tokens: torch.Tensor  # int64 [B] flat token index
    slots: torch.Tensor  # int64 [B]
    state_rows: torch.Tensor  # int64 [R] rows of the batch that have an initial state (only these are read)
    state_slots: torch.Tensor  # int64 [R] their slots
    copy_src: torch.Tensor  # int64 [K] checkpoint copies after the step: slot -> dest
    copy_dst: torch.Tensor  # int64 [K]


@dataclass
class StepMetadata:
    """Everything the layers need about one step, built once from the ForwardBatch."""

    positions: torch.Tensor
    write_rows: torch.Tensor  # int64 [W] flat tokens whose K/V are written (slot != PAD_SLOT_ID)
    write_blocks: torch.Tensor  # int64 [W]
    write_offsets: torch.Tensor  # int64 [W]
    attn_seqs: list[AttnSeq]
    attn_decode: AttnDecode | None
    rec_seqs: list[RecurrentSeq]
    rec_decode: RecurrentDecode | None

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device) -> StepMetadata:
        bs = batch.block_size
        slots = batch.slot_mapping.cpu()
        rows = torch.nonzero(slots != PAD_SLOT_ID).flatten()
        attn_seqs: list[AttnSeq] = []
        dec_attn: list[tuple[int, torch.Tensor, int]] = []
        rec_seqs: list[RecurrentSeq] = []
        dec_rec: list[tuple[int, int, bool, list[tuple[int, int]]]] = []
        for s in batch.seqs:
            if s.num_new_tokens <= 0:
                continue
            ctx = s.num_computed_tokens + s.num_new_tokens
            table = s.block_table.cpu()
            if table.numel() > 0:
                if table.numel() * bs < ctx:
                    raise ValueError(f"block table of {table.numel()} blocks cannot hold {ctx} tokens")
                if s.num_new_tokens == 1:
                    dec_attn.append((s.query_start, table, ctx))
                else:
                    pos = torch.arange(ctx)
                    attn_seqs.append(
                        AttnSeq(
                            s.query_start,
                            s.num_new_tokens,
                            s.num_computed_tokens,
                            table[pos // bs].to(device),
                            (pos % bs).to(device),
                        )
                    )
            if s.state_slot != PAD_SLOT_ID:
                dests: dict[int, list[int]] = {s.num_new_tokens: [s.state_slot]}
                for num_tokens, dest in s.checkpoints:
                    rel = num_tokens - s.num_computed_tokens
                    if not 0 < rel <= s.num_new_tokens:
                        raise ValueError(
                            f"checkpoint at {num_tokens} tokens lies outside this chunk "
                            f"({s.num_computed_tokens}, {ctx}]"
                        )
                    dests.setdefault(rel, []).append(dest)
                if s.num_new_tokens == 1:
                    dec_rec.append((s.query_start, s.state_slot, s.has_initial_state, list(s.checkpoints)))
                else:
                    cuts = sorted(dests)
                    rec_seqs.append(
                        RecurrentSeq(s.query_start, s.num_new_tokens, s.state_slot, s.has_initial_state, cuts, dests)
                    )
        return cls(
            positions=batch.positions.to(device),
            write_rows=rows.to(device),
            write_blocks=(slots[rows] // bs).to(device),
            write_offsets=(slots[rows] % bs).to(device),
            attn_seqs=attn_seqs,
            attn_decode=_build_attn_decode(dec_attn, bs, device),
            rec_seqs=rec_seqs,
            rec_decode=_build_rec_decode(dec_rec, device),
        )

    @classmethod
    def per_layer(cls, batch: ForwardBatch, device: torch.device, num_layers: int) -> list[StepMetadata]:
        """What every layer reads: one StepMetadata per view of the batch, each built once, picked by the
        layer's view (engine.models.batch.GroupViews)."""
        return per_layer([cls.build(b, device) for b in (batch, *batch.views)], batch.layer_views, num_layers)


def _build_attn_decode(items: list[tuple[int, torch.Tensor, int]], bs: int, device: torch.device) -> AttnDecode | None:
    if not items:
        return None
    max_len = max(ctx for _, _, ctx in items)
    pos = torch.arange(max_len)
    blocks, offsets, valid = [], [], []
    for _, table, ctx in items:
        ok = pos < ctx
        p = torch.where(ok, pos, 0)
        blocks.append(table[p // bs])
        offsets.append(p % bs)
        valid.append(ok)
    return AttnDecode(
        tokens=torch.tensor([t for t, _, _ in items], dtype=torch.int64).to(device),
        blocks=torch.stack(blocks).to(device),
        offsets=torch.stack(offsets).to(device),
        valid=torch.stack(valid).to(device),
    )


def _build_rec_decode(items: list[tuple[int, int, bool, list[tuple[int, int]]]], device: torch.device):
    if not items:
        return None
    rows = [i for i, (_, _, has, _) in enumerate(items) if has]
    copies = [(slot, dest) for _, slot, _, ckpts in items for _, dest in ckpts]

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    return RecurrentDecode(
        tokens=t([tok for tok, _, _, _ in items]),
        slots=t([slot for _, slot, _, _ in items]),
        state_rows=t(rows),
        state_slots=t([items[r][1] for r in rows]),
        copy_src=t([s for s, _ in copies]),
        copy_dst=t([d for _, d in copies]),
    )


# ----------------------------------------------------------------------------------------------------------------
# paged attention

QUERY_TILE = 1024
"""Queries of one prefill chunk are processed in tiles of this many rows to bound the score matrix."""


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: StepMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention over a paged KV cache for a flat varlen batch.

    q [T, H, D]; k, v [T, KVH, D] (H a multiple of KVH: GQA); kv_cache [num_blocks, 2, block_size, KVH, D].
    First writes the new K/V rows at their slots (rows with PAD_SLOT_ID are skipped), then, per sequence, gathers
    exactly the first num_computed + num_new context rows from its block table and lets new query i see context
    positions <= num_computed + i. Output [T, H, D] in q's dtype (zeros for rows of no sequence). Only gathered
    valid rows take part, so garbage (even NaN) in unused cache rows cannot leak.

    Rounding as transformers' eager attention: q.k scores and probs @ V are matmuls in q's dtype (fp32
    accumulation), the softmax runs in fp32 and its probabilities are rounded back to q's dtype."""
    if meta.write_rows.numel() > 0:
        rows = meta.write_rows
        kv_cache[meta.write_blocks, 0, meta.write_offsets] = k[rows].to(kv_cache.dtype)
        kv_cache[meta.write_blocks, 1, meta.write_offsets] = v[rows].to(kv_cache.dtype)
    out = torch.zeros_like(q)
    for s in meta.attn_seqs:
        sl = slice(s.q_start, s.q_start + s.q_len)
        out[sl] = _attend_chunk(q[sl], kv_cache, s, scale)
    if meta.attn_decode is not None:
        out[meta.attn_decode.tokens] = _attend_decode(q[meta.attn_decode.tokens], kv_cache, meta.attn_decode, scale)
    return out


def _attend_chunk(q: torch.Tensor, kv_cache: torch.Tensor, s: AttnSeq, scale: float) -> torch.Tensor:
    n, heads, dim = q.shape
    key = kv_cache[s.ctx_blocks, 0, s.ctx_offsets].to(q.dtype)  # [C, KVH, D]
    val = kv_cache[s.ctx_blocks, 1, s.ctx_offsets].to(q.dtype)
    ctx, kvh = key.shape[0], key.shape[1]
    qg = q.view(n, kvh, heads // kvh, dim)
    kpos = torch.arange(ctx, device=q.device)
    out = torch.empty(n, kvh, heads // kvh, dim, dtype=q.dtype, device=q.device)
    for i0 in range(0, n, QUERY_TILE):
        i1 = min(n, i0 + QUERY_TILE)
        scores = torch.einsum("nkgd,ckd->kgnc", qg[i0:i1], key) * scale
        qpos = s.num_computed + torch.arange(i0, i1, device=q.device)
        scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        out[i0:i1] = torch.einsum("kgnc,ckd->nkgd", _softmax(scores), val)
    return out.view(n, heads, dim)


def _attend_decode(q: torch.Tensor, kv_cache: torch.Tensor, d: AttnDecode, scale: float) -> torch.Tensor:
    b, heads, dim = q.shape
    ok = d.valid[:, :, None, None]
    key = torch.where(ok, kv_cache[d.blocks, 0, d.offsets].to(q.dtype), 0.0)  # [B, L, KVH, D]
    val = torch.where(ok, kv_cache[d.blocks, 1, d.offsets].to(q.dtype), 0.0)
    kvh = key.shape[2]
    qg = q.view(b, kvh, heads // kvh, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, key) * scale
    scores = scores.masked_fill(~d.valid[:, None, None, :], float("-inf"))
    return torch.einsum("bkgl,blkd->bkgd", _softmax(scores), val).reshape(b, heads, dim)


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax in fp32, rounded back to the scores' dtype (transformers' eager attention)."""
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


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
    "AttnSeq",
    "GatedMLP",
    "MLP",
    "RMSNorm",
    "RecurrentSeq",
    "RotaryEmbedding",
    "StepMetadata",
    "ZeroCenteredRMSNorm",
    "apply_rotary",
    "causal_conv_chunk",
    "causal_conv_step",
    "fuse_linears",
    "get_activation",
    "paged_attention",
    "segment_bounds",
    "segsum",
    "to_chunks",
    "torch_dtype",
]
