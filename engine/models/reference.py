"""The reference path's step: `StepMetadata` turns a flat `ForwardBatch` into per-sequence index tensors, and
`paged_attention` attends over the paged KV cache sequence by sequence. The batched path's counterparts are
engine.models.varlen (VarlenMetadata) and engine.models.fast_path (varlen_attention).

Pure torch (CPU and CUDA, fp32/bf16/fp16). Every index tensor is built once per step (`StepMetadata.build`, once per
view of the batch when a model has several cache groups of a kind: `StepMetadata.per_layer`) and shared by the
layers that read it. The softmax runs in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hybridpd.engine.cache.specs import PAD_SLOT_ID
from hybridpd.engine.models.batch import ForwardBatch, per_layer

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
                    if s.checkpoints:  # its only boundary is its end: the step's `state_saves` copy it
                        raise ValueError("a one-token row names a checkpoint inside its chunk")
                    dec_rec.append((s.query_start, s.state_slot, s.has_initial_state))
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


def _build_rec_decode(items: list[tuple[int, int, bool]], device: torch.device):
    if not items:
        return None
    rows = [i for i, (_, _, has) in enumerate(items) if has]

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    return RecurrentDecode(
        tokens=t([tok for tok, _, _ in items]),
        slots=t([slot for _, slot, _ in items]),
        state_rows=t(rows),
        state_slots=t([items[r][1] for r in rows]),
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


__all__ = ["AttnDecode", "AttnSeq", "RecurrentDecode", "RecurrentSeq", "StepMetadata", "paged_attention"]
