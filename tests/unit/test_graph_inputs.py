"""The CUDA-graph path's input upload (DecodeGraphs._upload: pinned host mirrors, cached block-table rows) writes
exactly what build_varlen_views builds for the same decode step, padding rows included, across steps whose requests
change order, grow a block, finish and arrive, and with several cache groups of a kind (one set of buffers per view)
(run on CPU: the static buffers are CPU tensors here)."""

from __future__ import annotations

import random
from dataclasses import replace

import torch
from hybridpd.engine.cache.specs import PAD_SLOT_ID
from hybridpd.engine.models.batch import SINGLE_VIEW, GroupViews
from hybridpd.engine.models.cuda_graphs import DecodeGraphs
from hybridpd.engine.models.varlen import build_varlen_views
from hybridpd.engine.scheduler import ScheduledSeq

BS = 16


def _seq(rid: str, ctx: int, first_block: int, slot: int) -> ScheduledSeq:
    nb = -(-ctx // BS)
    return ScheduledSeq(request_id=rid, num_computed_tokens=ctx - 1, token_ids=(ctx % 97,),
                        sample=True, group_block_ids=((0, tuple(range(first_block, first_block + nb))),),
                        group_state_slots=((1, slot),), group_checkpoints=((1, ()),))


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
        assert b is not None
        graphs._upload(seqs, b)
        (m,) = build_varlen_views(seqs, BS, 4, torch.device("cpu"), SINGLE_VIEW, pad_to=b)
        assert m.rec_decode is not None
        assert torch.equal(graphs.ids[:b], m.input_ids) and torch.equal(graphs.positions[:b], m.positions)
        assert torch.equal(graphs.slot_mapping[:b], m.slot_mapping) and torch.equal(graphs.ctx_len[:b], m.ctx_len)
        assert torch.equal(graphs.slots[:b], m.rec_decode.slots)
        assert torch.equal(graphs.has_init[:b], m.rec_decode.has_init)
        for i, s in enumerate(seqs):  # entries past a row's own blocks are never read (context length bounds)
            n = len(s.group_block_ids[0][1])
            assert torch.equal(graphs.table[i, :n], m.block_table[i, :n])
        assert (graphs.slot_mapping[len(seqs):b] == PAD_SLOT_ID).all() and (graphs.ctx_len[len(seqs):b] == 0).all()
        assert set(graphs.inputs[0].table_rows) == set(live)  # finished requests' rows are dropped


def _split_seq(rid: str, ctx: int, first_block: int, slot: int) -> ScheduledSeq:
    """Two attention groups (ids 0, 1) and two recurrent groups (2, 3), each group with its own ids."""
    s = _seq(rid, ctx, first_block, slot)
    first = s.group_block_ids[0][1]
    other = tuple(b + 7 for b in first)
    return replace(s, group_block_ids=((0, first), (1, other)), group_state_slots=((2, slot), (3, slot + 90)),
                   group_checkpoints=((2, ()), (3, ())))


def test_upload_of_every_view_equals_build_varlen_views() -> None:
    """Several groups of a kind: each view's block table, slot mapping and slots are its own groups' (view 1 reads
    group 1 and group 3), padded rows carry PAD_SLOT_ID in every view, across steps that shrink the batch."""
    views = GroupViews(layer_views=(0, 0, 1, 1), attention=(True, True), recurrent=(True, True))
    graphs = DecodeGraphs(None, None, 16, 40, BS, 4, torch.device("cpu"), views)
    for step, ctxs in enumerate([[40, 17, 300, 5, 64], [41, 18, 301], [42]]):
        seqs = [_split_seq(f"r{i}", c, 1 + 40 * i, 1 + i) for i, c in enumerate(ctxs)]
        assert graphs.can_run(seqs)
        b = graphs.bucket(len(seqs))
        assert b is not None
        graphs._upload(seqs, b)
        metas = build_varlen_views(seqs, BS, 4, torch.device("cpu"), views, pad_to=b)
        for v, m in zip(graphs.inputs, metas, strict=True):
            assert m.rec_decode is not None
            assert torch.equal(v.slot_mapping[:b], m.slot_mapping) and torch.equal(v.slots[:b], m.rec_decode.slots)
            for i, s in enumerate(seqs):
                n = len(s.group_block_ids[0][1])
                assert torch.equal(v.table[i, :n], m.block_table[i, :n])
        assert torch.equal(graphs.ctx_len[:b], metas[1].ctx_len)
        assert torch.equal(graphs.positions[:b], metas[1].positions)
        assert graphs.inputs[1].slots[: len(seqs)].tolist() == [1 + i + 90 for i in range(len(seqs))]
        assert graphs.inputs[1].slot_mapping[0] != graphs.inputs[0].slot_mapping[0], step
        for v in graphs.inputs:
            assert (v.slots[len(seqs):b] == PAD_SLOT_ID).all() and (v.slot_mapping[len(seqs):b] == PAD_SLOT_ID).all()


class _SpyEvent:
    """The graphs' `_uploaded` CUDA event, on CPU: what the pinned mirrors held each time `_upload` waited on it,
    and whether the static buffers already held the mirrors' values (the copies issued) when it was recorded."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs = graphs
        self.b = 0
        """The bucket of the step being uploaded."""
        self.calls: list[tuple[str, list[torch.Tensor], bool]] = []

    def _mirrors(self) -> list[torch.Tensor]:
        g = self.graphs
        views = [t for v in g.inputs for t in (*v.host.values(), v.host_table)]
        return [t.clone() for t in (*g.host.values(), *views)]

    def _copied(self) -> bool:
        g = self.graphs
        pairs = [(getattr(g, k), g.host[k]) for k in g.host]
        pairs += [(getattr(v, k), v.host[k]) for v in g.inputs for k in v.host]
        return all(torch.equal(dev[: self.b], host[: self.b]) for dev, host in pairs)

    def synchronize(self) -> None:
        self.calls.append(("wait", self._mirrors(), False))

    def record(self, _stream: object = None) -> None:
        self.calls.append(("record", self._mirrors(), self._copied()))


def test_upload_refills_the_pinned_mirrors_only_after_the_previous_copies(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On CUDA the mirrors' copies are non-blocking, and with asynchronous scheduling (or a step that samples
    nothing) the host fills the next step's before anything waited for them: `_upload` waits on the event first,
    writes nothing before, and records it after issuing every copy (on CPU a copy is done at once, so the event
    is a spy here; tests/gpu/test_pinned_copies_cuda.py holds the real copies back behind a long kernel)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    views = GroupViews(layer_views=(0, 0, 1, 1), attention=(True, True), recurrent=(True, True))
    graphs = DecodeGraphs(None, None, 16, 40, BS, 4, torch.device("cpu"), views)
    spy = _SpyEvent(graphs)
    graphs._uploaded = spy  # type: ignore[assignment]
    for ctxs in ([40, 17, 300, 5, 64], [41, 18, 301, 6, 65], [42, 19]):
        seqs = [_split_seq(f"r{i}", c, 1 + 40 * i, 1 + i) for i, c in enumerate(ctxs)]
        spy.b = graphs.bucket(len(seqs)) or 0
        graphs._upload(seqs, spy.b)
    assert [c[0] for c in spy.calls] == ["wait", "record"] * 3
    assert all(copied for kind, _, copied in spy.calls if kind == "record")
    for i in (2, 4):  # each wait saw the mirrors as the previous step's copies read them; then the step changed them
        waited, before, after = spy.calls[i][1], spy.calls[i - 1][1], spy.calls[i + 1][1]
        assert all(torch.equal(a, b) for a, b in zip(waited, before, strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(after, waited, strict=True))
