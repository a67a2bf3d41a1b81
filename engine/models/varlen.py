"""Step metadata of the batched fast path: every index tensor of one step, built vectorised from the scheduler's
output in numpy and uploaded to the device in one copy (one pinned int64 buffer, sliced into views).

Flat layout (same as ForwardBatch):

    flat tokens:  | seq0 chunk (prefill)   | seq1 (decode) | seq2 chunk | pad (graph buckets) |
    attention:    one row per sequence: q_start, q_len, ctx_len (= computed + new), block table row
    recurrent:    decode rows (q_len == 1): slot (PAD_SLOT_ID = -1: skip), has_initial_state
                  prefill rows (q_len > 1): cut into segments at every checkpoint; round r runs segment r of every
                  sequence in one varlen call, starting from round r-1's final states (round 0: the slot or zeros)

    extended conv buffer (prefill): | state0 (K-1) | x of seq0 | state2 (K-1) | x of seq2 |
        conv output of token j = sum_k w[:, k] * ext[pos_j - (K-1) + k];  state after c tokens = ext[base + c : + K-1]

No per-sequence Python loop touches a tensor: the loops below run over the scheduler's integers once per step
(once per view when a model has several cache groups of a kind: engine.models.batch.GroupViews).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hybridpd.engine.cache.specs import PAD_SLOT_ID
from hybridpd.engine.models.batch import GroupViews, per_layer


@dataclass
class Round:
    """One varlen call of the chunked recurrent kernels (segment r of every prefill sequence that has one)."""

    rows: torch.Tensor  # int64 [n] positions in the prefill-token order (index into the gathered prefill tokens)
    cu_seqlens: torch.Tensor  # int64 [m+1] (device)
    cu_seqlens_cpu: torch.Tensor  # int64 [m+1] (host copy: the kernels plan their grid without a device sync)
    init_prev: torch.Tensor | None  # int64 [m] index into the previous round's final states (None for round 0)
    dest_index: torch.Tensor  # int64 [k] index into this round's final states ...
    dest_slot: torch.Tensor  # int64 [k] ... written into these state slots (checkpoints, running slot at the end)
    whole: bool = False  # rows is every prefill token in order (one round, no cut inside a chunk): no gather needed


@dataclass
class RecurrentPrefill:
    rows: torch.Tensor  # int64 [P] flat token index of every prefill token, sequence by sequence
    num_seqs: int
    init_index: torch.Tensor  # int64 [I] sequences (of the prefill list) that start from their slot ...
    init_slot: torch.Tensor  # int64 [I] ... this one
    ext_size: int
    ext_x: torch.Tensor  # int64 [P] position of each prefill token in the extended conv buffer
    ext_state: torch.Tensor  # int64 [num_seqs * (K-1)] positions of the initial conv state rows
    cut_ext: torch.Tensor  # int64 [M, K-1] extended rows of the conv state after a cut
    cut_slot: torch.Tensor  # int64 [M] slot that receives it
    rounds: list[Round]
    rows_range: tuple[int, int] | None = None  # rows == range(a, b) (prefill tokens adjacent): slices, no gathers


@dataclass
class RecurrentDecodeRows:
    rows: torch.Tensor  # int64 [D] flat token index
    slots: torch.Tensor  # int64 [D] state slot, PAD_SLOT_ID for padded rows
    has_init: torch.Tensor  # int32 [D] 1: read the slot first; 0: start from zeros


@dataclass
class VarlenMetadata:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T], PAD_SLOT_ID: not written
    # attention: one row per sequence that has a block table
    q_start: torch.Tensor  # int32 [S]
    q_len: torch.Tensor  # int32 [S]
    ctx_len: torch.Tensor  # int32 [S] (0 for padded rows: nothing is read)
    block_table: torch.Tensor  # int32 [S, W]
    max_q_len: int
    rec_decode: RecurrentDecodeRows | None
    rec_prefill: RecurrentPrefill | None
    sample_rows: torch.Tensor  # int64 [R] flat row of the last token of every sequence that samples


@dataclass
class VarlenBatch:
    """The batched path's step (`CausalLM.forward_varlen`): one VarlenMetadata per view of the cache groups
    (engine.models.batch.GroupViews; the views share the token rows)."""

    views: list[VarlenMetadata]
    layer_views: tuple[int, ...] = ()
    """The view each layer reads; empty: every layer reads views[0]."""

    @property
    def input_ids(self) -> torch.Tensor:
        return self.views[0].input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self.views[0].positions

    def per_layer(self, num_layers: int) -> list[VarlenMetadata]:
        return per_layer(self.views, self.layer_views, num_layers)


class _Packer:
    """Collects int64 numpy arrays, uploads them as one buffer and hands back device views."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.shapes: list[tuple[int, ...]] = []

    def add(self, a: np.ndarray) -> int:
        self.parts.append(np.ascontiguousarray(a, dtype=np.int64).ravel())
        self.shapes.append(tuple(a.shape))
        return len(self.parts) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        flat = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)
        host = torch.from_numpy(flat)
        if device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        out, o = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape)) if shape else 1
            out.append(dev[o : o + n].view(shape))
            o += n
        return out


def build_varlen_views(seqs, block_size: int, conv_width: int, device: torch.device,  # type: ignore[no-untyped-def]
                       views: GroupViews, pad_to: int = 0, sample: list[bool] | None = None) -> list[VarlenMetadata]:
    """`seqs`: the scheduler's ScheduledSeq list (token_ids, num_computed_tokens, group_block_ids,
    group_state_slots, group_checkpoints). `pad_to` > number of tokens adds padded decode rows (token 0,
    PAD_SLOT_ID everywhere, ctx 0); `sample` marks the sequences whose last row is sampled (default: all).

    One VarlenMetadata per view (engine.models.batch.GroupViews), all uploaded in one copy. The token rows
    (ids, positions, q_start, q_len, sample rows) are shared; each view has its own block table, slot mapping,
    context lengths and recurrent rows. A view without an attention group shares view 0's attention tensors
    (no layer of it reads them); one without a recurrent group has no recurrent rows."""
    n_new = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
    computed = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
    q_start = np.concatenate(([0], np.cumsum(n_new)[:-1])) if len(seqs) else np.zeros(0, np.int64)
    total = int(n_new.sum())
    T = max(total, pad_to)
    ids = np.zeros(T, np.int64)
    if total:
        ids[:total] = np.fromiter((t for s in seqs for t in s.token_ids), np.int64, total)
    seq_of_tok = np.repeat(np.arange(len(seqs)), n_new)
    positions = np.zeros(T, np.int64)
    positions[:total] = computed[seq_of_tok] + (np.arange(total) - q_start[seq_of_tok])
    n_pad = T - total
    att_q_start = np.concatenate((q_start, total + np.arange(n_pad)))
    att_q_len = np.concatenate((n_new, np.ones(n_pad, np.int64)))

    p = _Packer()
    last = q_start + n_new - 1
    sample_rows = last[np.asarray(sample, dtype=bool)] if sample is not None else last
    shared = [p.add(ids), p.add(positions), p.add(att_q_start), p.add(att_q_len), p.add(sample_rows)]
    steps = _Step(seqs, n_new, computed, q_start, seq_of_tok, positions, total, n_pad, block_size, conv_width)
    att = [_pack_attention(p, steps, views.block_ids(seqs, k)) if k == 0 or views.attention[k] else None
           for k in range(views.count)]
    rec = [_pack_recurrent(p, steps, views.state_slots(seqs, k), lambda s, k=k: views.checkpoints(s, k))
           if k == 0 or views.recurrent[k] else (None, None) for k in range(views.count)]
    dev = p.upload(device)
    ids_t, pos_t, q_start_t, q_len_t, sample_t = (dev[h] for h in shared)
    q_start_t, q_len_t = q_start_t.to(torch.int32), q_len_t.to(torch.int32)
    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    max_q_len = int(att_q_len.max()) if len(att_q_len) else 1
    out = []
    for k in range(views.count):
        slot_h, ctx_h, table_h = att[k] if att[k] is not None else att[0]  # type: ignore[misc]
        dec_h, pre_h = rec[k]
        out.append(VarlenMetadata(
            input_ids=ids_t, positions=pos_t, slot_mapping=dev[slot_h], q_start=q_start_t, q_len=q_len_t,
            ctx_len=i32(dev[ctx_h]), block_table=i32(dev[table_h]), max_q_len=max_q_len,
            rec_decode=dec_h(dev) if dec_h else None, rec_prefill=pre_h(dev) if pre_h else None, sample_rows=sample_t,
        ))
    return out


@dataclass
class _Step:
    """The token layout of one step, shared by every view's packing."""

    seqs: Any
    n_new: np.ndarray
    computed: np.ndarray
    q_start: np.ndarray
    seq_of_tok: np.ndarray
    positions: np.ndarray
    total: int
    n_pad: int
    block_size: int
    conv_width: int


def _pack_attention(p: _Packer, st: _Step, blocks: list[tuple[int, ...]]) -> tuple[int, int, int]:
    """One attention group's slot mapping, context lengths and block table (padded rows: PAD_SLOT_ID, ctx 0)."""
    n = len(blocks)
    width = max([len(b) for b in blocks] + [1])
    table = np.zeros((n, width), np.int64)
    for i, b in enumerate(blocks):
        table[i, : len(b)] = b
    has_table = np.array([len(b) > 0 for b in blocks], dtype=bool)
    T = st.total + st.n_pad
    slot_mapping = np.full(T, PAD_SLOT_ID, np.int64)
    if st.total:
        bs, pos, sot = st.block_size, st.positions[: st.total], st.seq_of_tok
        blk = table[sot, np.where(has_table[sot], pos // bs, 0)]  # rows without a table (no attention): no block
        slot_mapping[: st.total] = np.where(has_table[sot], blk * bs + pos % bs, PAD_SLOT_ID)
    ctx = np.where(has_table, st.computed + st.n_new, 0)
    att_ctx = np.concatenate((ctx, np.zeros(st.n_pad, np.int64)))
    att_table = np.concatenate((table, np.zeros((st.n_pad, width), np.int64)))
    return p.add(slot_mapping), p.add(att_ctx), p.add(att_table)


def _pack_recurrent(p: _Packer, st: _Step, state_slots: list[int], checkpoints):  # type: ignore[no-untyped-def]
    """One recurrent group's decode rows and prefill rounds; `checkpoints(seq)` gives a sequence's (num_tokens,
    slot) in this group."""
    seqs, n_new, computed, q_start, total, n_pad = st.seqs, st.n_new, st.computed, st.q_start, st.total, st.n_pad
    slots = np.array(state_slots, dtype=np.int64)
    slots[slots <= 0] = PAD_SLOT_ID
    real = slots != PAD_SLOT_ID
    dec = np.nonzero(real & (n_new == 1))[0]
    pre = np.nonzero(real & (n_new > 1))[0]
    dec_h = pre_h = None
    if any(checkpoints(seqs[i]) for i in dec):  # a one-token row's only boundary is its end: `state_saves`
        raise ValueError("a one-token row names a checkpoint inside its chunk")
    if len(dec) or n_pad:
        hs = [p.add(np.concatenate((q_start[dec], total + np.arange(n_pad)))),
              p.add(np.concatenate((slots[dec], np.full(n_pad, PAD_SLOT_ID)))),
              p.add(np.concatenate((computed[dec] > 0, np.zeros(n_pad, bool))).astype(np.int64))]

        def dec_h(views):  # type: ignore[no-untyped-def]
            r = [views[h] for h in hs]
            return RecurrentDecodeRows(rows=r[0], slots=r[1], has_init=r[2].to(torch.int32))
    if len(pre):
        pre_h = _pack_prefill(p, [checkpoints(seqs[i]) for i in pre], pre, n_new, computed, q_start, slots,
                              st.conv_width)
    return dec_h, pre_h


def _pack_prefill(p: _Packer, pre_ckpts, pre, n_new, computed, q_start, slots, conv_width):  # type: ignore[no-untyped-def]
    k1 = conv_width - 1
    lens = n_new[pre]
    rows = np.concatenate([np.arange(q_start[i], q_start[i] + n_new[i]) for i in pre])
    local_start = np.concatenate(([0], np.cumsum(lens)[:-1]))
    ext_base = local_start + np.arange(len(pre)) * k1  # extended-buffer row of each sequence's first state row
    ext_x = np.repeat(ext_base + k1, lens) + (np.arange(lens.sum()) - np.repeat(local_start, lens))
    ext_state = (ext_base[:, None] + np.arange(k1)[None, :]).ravel()
    has_init = computed[pre] > 0
    init_index = np.nonzero(has_init)[0]
    # cuts (relative token counts) per sequence, each with its destination slots
    cuts: list[dict[int, list[int]]] = []
    for j, i in enumerate(pre):
        d: dict[int, list[int]] = {int(lens[j]): [int(slots[i])]}
        for num_tokens, dest in pre_ckpts[j]:
            rel = num_tokens - int(computed[i])
            if not 0 < rel <= lens[j]:
                raise ValueError(f"checkpoint at {num_tokens} tokens lies outside this chunk")
            d.setdefault(rel, []).append(int(dest))
        cuts.append(d)
    cut_ext, cut_slot = [], []
    for j, d in enumerate(cuts):
        for c, dests in d.items():
            for dest in dests:
                cut_ext.append(ext_base[j] + c + np.arange(k1))
                cut_slot.append(dest)
    handles = [p.add(rows), p.add(init_index), p.add(slots[pre][init_index]), p.add(ext_x), p.add(ext_state),
               p.add(np.array(cut_ext, np.int64).reshape(-1, k1)),
               p.add(np.array(cut_slot, np.int64))]
    round_handles = _pack_rounds(p, cuts, local_start)
    ext_size = int(lens.sum() + len(pre) * k1)
    adjacent = bool(np.all(np.diff(rows) == 1))
    rows_range = (int(rows[0]), int(rows[-1]) + 1) if adjacent else None

    def pre_h(views):  # type: ignore[no-untyped-def]
        r = [views[h] for h in handles]
        rounds = [Round(rows=views[a], cu_seqlens=views[b], cu_seqlens_cpu=cpu, init_prev=None if c is None else
                        views[c], dest_index=views[e], dest_slot=views[f], whole=w)
                  for a, b, cpu, c, e, f, w in round_handles]
        return RecurrentPrefill(rows=r[0], num_seqs=len(pre), init_index=r[1], init_slot=r[2], ext_size=ext_size,
                                ext_x=r[3], ext_state=r[4], cut_ext=r[5], cut_slot=r[6],
                                rounds=rounds, rows_range=rows_range)
    return pre_h


def _pack_rounds(p: _Packer, cuts: list[dict[int, list[int]]], local_start: np.ndarray):  # type: ignore[no-untyped-def]
    """Round r: segment r (between the (r-1)-th and r-th cut) of every sequence with more than r cuts."""
    sorted_cuts = [sorted(d) for d in cuts]
    total = int(sum(c[-1] for c in sorted_cuts))  # every prefill token (the last cut of a sequence is its length)
    handles = []
    prev_members: list[int] = []
    for r in range(max(len(c) for c in sorted_cuts)):
        members = [j for j, c in enumerate(sorted_cuts) if len(c) > r]
        seg = [(sorted_cuts[j][r - 1] if r else 0, sorted_cuts[j][r]) for j in members]
        rows = np.concatenate([local_start[j] + np.arange(a, b) for j, (a, b) in zip(members, seg, strict=True)])
        cu = np.concatenate(([0], np.cumsum([b - a for a, b in seg])))
        init_prev = None if r == 0 else p.add(np.array([prev_members.index(j) for j in members], np.int64))
        dest_index = [m for m, j in enumerate(members) for _ in cuts[j][sorted_cuts[j][r]]]
        dest_slot = [s for j in members for s in cuts[j][sorted_cuts[j][r]]]
        whole = len(rows) == total and bool(np.array_equal(rows, np.arange(total)))
        handles.append((p.add(rows), p.add(cu), torch.from_numpy(cu.astype(np.int64)), init_prev,
                        p.add(np.array(dest_index, np.int64)), p.add(np.array(dest_slot, np.int64)), whole))
        prev_members = members
    return handles


__all__ = ["PAD_SLOT_ID", "RecurrentDecodeRows", "RecurrentPrefill", "Round", "VarlenBatch", "VarlenMetadata",
           "build_varlen_views"]
