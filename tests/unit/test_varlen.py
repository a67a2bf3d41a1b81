"""engine.models.varlen.build_varlen_views: the fast path's per-step metadata, exact index values on a tiny step."""

from __future__ import annotations

from dataclasses import replace

import torch
from hybridpd.engine.cache.specs import PAD_SLOT_ID
from hybridpd.engine.models.batch import SINGLE_VIEW, GroupViews
from hybridpd.engine.models.varlen import VarlenMetadata, build_varlen_views
from hybridpd.engine.scheduler import ScheduledSeq


def _seq(rid, computed, n, blocks, slot, ckpts=()):  # type: ignore[no-untyped-def]
    return ScheduledSeq(request_id=rid, num_computed_tokens=computed, token_ids=tuple(range(100, 100 + n)),
                        sample=True, group_block_ids=((0, tuple(blocks)),), group_state_slots=((1, slot),),
                        group_checkpoints=((1, tuple(ckpts)),))


def build_varlen(seqs, **kwargs) -> VarlenMetadata:  # type: ignore[no-untyped-def]
    """One group of each kind: the one view's metadata."""
    (meta,) = build_varlen_views(seqs, views=SINGLE_VIEW, **kwargs)
    return meta


def test_prefill_rounds_decode_rows_and_padding():  # type: ignore[no-untyped-def]
    # seq a: prefill of 10 tokens after 4 cached (block size 4), checkpoints after 8 and 12 tokens -> 3 segments
    # seq b: one decode token; seq c: prefill of 3 fresh tokens, no checkpoint -> 1 segment
    seqs = [_seq("a", 4, 10, [5, 6, 7, 8], 1, [(8, 11), (12, 12)]), _seq("b", 6, 1, [3, 9], 2),
            _seq("c", 0, 3, [4], 3)]
    m = build_varlen(seqs, block_size=4, conv_width=4, device=torch.device("cpu"), pad_to=16)
    assert m.input_ids.numel() == 16
    assert m.positions[:14].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 6, 0, 1, 2]
    # slot = block_table[p // 4] * 4 + p % 4; padded rows write nothing
    assert m.slot_mapping[:14].tolist() == [24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 38, 16, 17, 18]
    assert m.slot_mapping[14:].tolist() == [PAD_SLOT_ID] * 2
    assert m.q_start.tolist() == [0, 10, 11, 14, 15] and m.q_len.tolist() == [10, 1, 3, 1, 1]
    assert m.ctx_len.tolist() == [14, 7, 3, 0, 0] and m.max_q_len == 10
    d = m.rec_decode
    assert d.rows.tolist() == [10, 14, 15] and d.slots.tolist() == [2, PAD_SLOT_ID, PAD_SLOT_ID]
    assert d.has_init.tolist() == [1, 0, 0]
    p = m.rec_prefill
    assert p.rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13]
    assert p.init_index.tolist() == [0] and p.init_slot.tolist() == [1]  # only seq a reads its slot
    # extended conv buffer: | a state (3) | a x (10) | c state (3) | c x (3) |
    assert p.ext_x.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 17, 18]
    assert p.ext_state.tolist() == [0, 1, 2, 13, 14, 15]
    # conv state after c tokens of seq a = ext rows [c, c + 3); dests: 4 -> slot 11, 8 -> 12, 10 -> running slot 1
    cuts = sorted(zip(p.cut_slot.tolist(), p.cut_ext[:, 0].tolist(), strict=True))
    assert cuts == [(1, 10), (3, 16), (11, 4), (12, 8)]
    r0, r1, r2 = p.rounds
    assert r0.rows.tolist() == [0, 1, 2, 3, 10, 11, 12] and r0.cu_seqlens_cpu.tolist() == [0, 4, 7]
    assert r0.init_prev is None and r0.dest_slot.tolist() == [11, 3] and r0.dest_index.tolist() == [0, 1]
    assert r1.rows.tolist() == [4, 5, 6, 7] and r1.init_prev.tolist() == [0] and r1.dest_slot.tolist() == [12]
    assert r2.rows.tolist() == [8, 9] and r2.init_prev.tolist() == [0] and r2.dest_slot.tolist() == [1]
    assert m.sample_rows.tolist() == [9, 10, 13]
    # the prefill tokens are not adjacent (seq b's decode row sits between) and no round covers them all in order:
    # the mixers gather and scatter
    assert p.rows_range is None and not any(r.whole for r in p.rounds)


def test_adjacent_prefill_rows_are_a_range_and_one_uncut_round_is_whole():  # type: ignore[no-untyped-def]
    # seq b decodes first, then a and c prefill without a checkpoint inside their chunks: rows 1..13 in order
    seqs = [_seq("b", 6, 1, [3, 9], 2), _seq("a", 4, 10, [5, 6, 7, 8], 1), _seq("c", 0, 3, [4], 3)]
    p = build_varlen(seqs, block_size=4, conv_width=4, device=torch.device("cpu")).rec_prefill
    assert p.rows.tolist() == list(range(1, 14)) and p.rows_range == (1, 14)
    (r0,) = p.rounds
    assert r0.whole and r0.rows.tolist() == list(range(13))
    # a checkpoint inside a's chunk cuts it: two rounds, neither whole; the rows stay a range
    seqs[1] = _seq("a", 4, 10, [5, 6, 7, 8], 1, [(8, 11)])
    p = build_varlen(seqs, block_size=4, conv_width=4, device=torch.device("cpu")).rec_prefill
    assert p.rows_range == (1, 14) and len(p.rounds) == 2 and not any(r.whole for r in p.rounds)


def test_views_read_their_own_groups() -> None:
    """Several groups of a kind (engine.models.batch.GroupViews): view 1 reads group_block_ids[1] and
    group_state_slots[1] / group_checkpoints[1]; token rows are shared; a view without a recurrent group has no
    recurrent rows, one without an attention group shares view 0's attention tensors (its layers never read them)."""
    s = replace(_seq("a", 4, 3, [5, 6], 1, [(6, 11)]), group_block_ids=((0, (5, 6)), (1, (9, 2))),
                group_state_slots=((2, 1), (3, 7)), group_checkpoints=((2, ((6, 11),)), (3, ((6, 12),))))
    cpu = torch.device("cpu")
    two = GroupViews(layer_views=(0, 1), attention=(True, True), recurrent=(True, True))
    m0, m1 = build_varlen_views([s], 4, 4, cpu, two)
    assert m0.input_ids is m1.input_ids and m0.positions is m1.positions and m0.sample_rows is m1.sample_rows
    assert m0.slot_mapping.tolist() == [24, 25, 26] and m1.slot_mapping.tolist() == [8, 9, 10]  # block 1 of each
    assert m0.block_table.tolist() == [[5, 6]] and m1.block_table.tolist() == [[9, 2]]
    p0, p1 = m0.rec_prefill, m1.rec_prefill
    assert p0 is not None and p1 is not None
    assert p0.init_slot.tolist() == [1] and p1.init_slot.tolist() == [7]
    assert sorted(p0.cut_slot.tolist()) == [1, 11] and sorted(p1.cut_slot.tolist()) == [7, 12]
    att_only = GroupViews(layer_views=(0, 1), attention=(True, True), recurrent=(True, False))
    _, a1 = build_varlen_views([s], 4, 4, cpu, att_only)
    assert a1.rec_prefill is None and a1.rec_decode is None and a1.slot_mapping.tolist() == [8, 9, 10]
    rec_only = GroupViews(layer_views=(0, 1), attention=(True, False), recurrent=(True, True))
    r0, r1 = build_varlen_views([s], 4, 4, cpu, rec_only)
    assert r1.slot_mapping is r0.slot_mapping and r1.rec_prefill is not None


def test_attention_packing_of_a_model_without_attention() -> None:
    """A model with no attention layer (Mamba-2 / GDN, MLPs only): every sequence's block table is empty, at any
    position past the first block too; the packed slot mapping is all padding and the context lengths 0."""
    import numpy as np
    from hybridpd.engine.models.varlen import _pack_attention, _Packer, _Step

    n_new, computed = np.array([40, 1]), np.array([0, 70])
    seq_of_tok = np.repeat(np.arange(2), n_new)
    positions = np.concatenate((np.arange(40), [70]))
    step = _Step(seqs=[None, None], n_new=n_new, computed=computed, q_start=np.array([0, 40]), seq_of_tok=seq_of_tok,
                 positions=positions, total=41, n_pad=2, block_size=16, conv_width=4)
    packer = _Packer()
    slot_h, ctx_h, _ = _pack_attention(packer, step, [(), ()])
    dev = packer.upload(torch.device("cpu"))
    slots, ctx = dev[slot_h], dev[ctx_h]
    assert slots.tolist() == [PAD_SLOT_ID] * 43
    assert ctx.tolist() == [0] * 4
