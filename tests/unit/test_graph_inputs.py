"""The CUDA-graph path's input upload (DecodeGraphs._upload: pinned host mirrors, cached block-table rows) writes
exactly what build_varlen builds for the same decode step, padding rows included, across steps whose requests
change order, grow a block, finish and arrive (run on CPU: the static buffers are CPU tensors here)."""

from __future__ import annotations

import random

import torch

from engine.cache.specs import PAD_SLOT_ID
from engine.models.cuda_graphs import DecodeGraphs
from engine.models.varlen import build_varlen
from engine.scheduler import ScheduledSeq

BS = 16


def _seq(rid: str, ctx: int, first_block: int, slot: int) -> ScheduledSeq:
    nb = -(-ctx // BS)
    return ScheduledSeq(request_id=rid, num_computed_tokens=ctx - 1, token_ids=(ctx % 97,),
                        block_ids=tuple(range(first_block, first_block + nb)), state_slot=slot, checkpoints=(),
                        sample=True)


def test_upload_equals_build_varlen_across_steps() -> None:
    rng = random.Random(0)
    graphs = DecodeGraphs(None, None, 64, 40, BS, 4, torch.device("cpu"))
    live = {f"r{i}": rng.randint(1, 600) for i in range(20)}
    for step in range(30):
        for rid in list(live):
            live[rid] += 1  # one token per step: every 16th step a request's block list grows
            if rng.random() < 0.05:
                del live[rid]
        if rng.random() < 0.3:
            live[f"n{step}"] = rng.randint(1, 600)
        order = list(live)
        rng.shuffle(order)
        seqs = [_seq(rid, live[rid], 1 + 40 * (hash(rid) % 50), 1 + i) for i, rid in enumerate(order)]
        b = graphs.bucket(len(seqs))
        graphs._upload(seqs, b)
        m = build_varlen(seqs, BS, 4, torch.device("cpu"), pad_to=b)
        assert torch.equal(graphs.ids[:b], m.input_ids) and torch.equal(graphs.positions[:b], m.positions)
        assert torch.equal(graphs.slot_mapping[:b], m.slot_mapping) and torch.equal(graphs.ctx_len[:b], m.ctx_len)
        assert torch.equal(graphs.slots[:b], m.rec_decode.slots)
        assert torch.equal(graphs.has_init[:b], m.rec_decode.has_init)
        for i, s in enumerate(seqs):  # entries past a row's own blocks are never read (context length bounds)
            n = len(s.block_ids)
            assert torch.equal(graphs.table[i, :n], m.block_table[i, :n])
        assert (graphs.slot_mapping[len(seqs):b] == PAD_SLOT_ID).all() and (graphs.ctx_len[len(seqs):b] == 0).all()
        assert set(graphs.table_rows) == set(live)  # finished requests' rows are dropped
