"""CUDA graphs of decode-only steps (fast path), one per batch-size bucket, captured on first use.

A graph replays forward + logits for `bucket` rows reading static input buffers; each step fills pinned host
mirrors of them (numpy, no per-step tensor construction) and copies each with one H2D copy, padded to the
bucket. Padded rows carry PAD_SLOT_ID (slot mapping and state slot) and context length 0: they write no K/V and
no state, read no block and no slot, and their logits are ignored. Steps with a prefill chunk or more sequences
than the largest bucket run eagerly (a decode row's checkpoint is saved from its running slot after the replay).
Ownership: the runner's step thread; the graphs share one memory pool. A model with several cache groups of a
kind has one set of block-table, slot-mapping and state-slot buffers per view (engine.models.batch.GroupViews),
each padded the same way.

    per step: fill the pinned mirrors -> 7 H2D copies into the static buffers (+ 3 per further view) -> graph
              replay -> logits[:n] and their logsumexp (the sampler's normaliser, computed in the graph)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hybridpd.engine.cache.specs import PAD_SLOT_ID
from hybridpd.engine.models.batch import SINGLE_VIEW, GroupViews
from hybridpd.engine.models.varlen import RecurrentDecodeRows, VarlenBatch, VarlenMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class _ViewInputs:
    """One view's static buffers (engine.models.batch.GroupViews: its attention group's block table and slot
    mapping, its recurrent group's slots) and their pinned host mirrors."""

    def __init__(self, n: int, max_blocks: int, device: torch.device, pin: bool) -> None:
        i64 = torch.int64
        self.slot_mapping = torch.full((n,), PAD_SLOT_ID, dtype=i64, device=device)
        self.table = torch.zeros(n, max(1, max_blocks), dtype=torch.int32, device=device)
        self.slots = torch.full((n,), PAD_SLOT_ID, dtype=i64, device=device)
        self.host = {k: torch.zeros(n, dtype=i64, pin_memory=pin) for k in ("slot_mapping", "slots")}
        self.host_table = torch.zeros(n * max(1, max_blocks), dtype=torch.int32, pin_memory=pin)
        self.host_np = {k: t.numpy() for k, t in self.host.items()}
        self.host_table_np = self.host_table.numpy()
        self.table_rows: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}
        """The last step's block-table rows by request id (block ids tuple, its int32 array)."""

    def fill_table(self, seqs, blocks: list[tuple[int, ...]], b: int, bs: int, pn: np.ndarray) -> int:  # type: ignore[no-untyped-def]
        """Block-table rows and slot mapping of the real rows into the host mirrors; returns the table width."""
        n = len(seqs)
        w = max(len(ids) for ids in blocks)
        table = self.host_table_np[: b * w].reshape(b, w)
        rows, seen = self.table_rows, {}
        for i, (s, ids) in enumerate(zip(seqs, blocks, strict=True)):  # a row converted once, reused while unchanged
            hit = rows.get(s.request_id)
            if hit is None or hit[0] != ids:
                hit = (ids, np.asarray(ids, dtype=np.int32))
            seen[s.request_id] = hit
            table[i, : len(ids)] = hit[1]
        self.table_rows = seen
        self.host_np["slot_mapping"][:n] = table[np.arange(n), pn // bs] * bs + pn % bs if w else PAD_SLOT_ID
        return w


class DecodeGraphs:
    def __init__(self, model, caches, max_seqs: int, max_blocks: int, block_size: int,  # type: ignore[no-untyped-def]
                 conv_width: int, device: torch.device, views: GroupViews = SINGLE_VIEW) -> None:
        self.model, self.caches = model, caches
        self.block_size, self.conv_width, self.device = block_size, conv_width, device
        self.views = views
        self.buckets = sorted({b for b in BUCKETS if b < max_seqs} | {max_seqs})
        n = self.buckets[-1]
        i64, i32 = torch.int64, torch.int32
        self.ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.q_start = torch.arange(n, dtype=i32, device=device)
        self.q_len = torch.ones(n, dtype=i32, device=device)
        self.ctx_len = torch.zeros(n, dtype=i32, device=device)
        self.rows = torch.arange(n, dtype=i64, device=device)
        self.has_init = torch.zeros(n, dtype=i32, device=device)
        pin = device.type == "cuda"
        names = ("ids", "positions", "ctx_len", "has_init")
        self.host = {k: torch.zeros(n, dtype=i32 if k in ("ctx_len", "has_init") else i64, pin_memory=pin)
                     for k in names}
        """Pinned host mirrors of the shared inputs (filled through numpy views, then one H2D copy each)."""
        self.host_np = {k: t.numpy() for k, t in self.host.items()}
        self.inputs = [_ViewInputs(n, max_blocks, device, pin) for _ in range(views.count)]
        """Per view: block table, slot mapping, state slots (one view unless a kind has several groups)."""
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool: Any = None
        self._stream: Any = None
        """The stream every graph is captured on (made at the first capture): the engine device's own
        (torch.cuda.graph's default is one per process, made on whichever device was current at its first capture:
        another engine's, say), and one for all of them (the allocator reuses a pool's freed blocks only on the
        stream they were allocated on: graphs captured on one stream share their intermediates' memory)."""
        self.num_replays = 0
        self._uploaded = torch.cuda.Event() if pin else None
        """Recorded after each step's copies: the next step refills the pinned mirrors only once they are done
        (with asynchronous scheduling the host fills step N+1's before it has waited for anything of step N)."""

    # view 0's buffers (the only ones of a model with one group of each kind)
    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.inputs[0].slot_mapping

    @property
    def table(self) -> torch.Tensor:
        return self.inputs[0].table

    @property
    def slots(self) -> torch.Tensor:
        return self.inputs[0].slots

    def _upload(self, seqs, b: int) -> None:  # type: ignore[no-untyped-def]
        """The step's inputs into the static buffers: filled on the host (pinned, through numpy views: no
        per-step tensor construction) and copied with one H2D copy per buffer; rows n..b are padding
        (PAD_SLOT_ID, context 0)."""
        n, bs, views = len(seqs), self.block_size, self.views
        if self._uploaded is not None:  # a step launched before the last one was read: its copies may be pending
            self._uploaded.synchronize()
        h = self.host_np
        h["ids"][:n] = [s.token_ids[0] for s in seqs]
        p = h["positions"]
        p[:n] = [s.num_computed_tokens for s in seqs]
        pn = p[:n]
        h["ctx_len"][:n] = pn + 1
        h["has_init"][:n] = pn > 0
        for name in ("ids", "positions", "ctx_len", "has_init"):
            h[name][n:b] = 0
            getattr(self, name)[:b].copy_(self.host[name][:b], non_blocking=True)
        for k, v in enumerate(self.inputs):
            if k == 0 or views.attention[k]:
                w = v.fill_table(seqs, views.block_ids(seqs, k), b, bs, pn)
                v.host_np["slot_mapping"][n:b] = PAD_SLOT_ID
                v.slot_mapping[:b].copy_(v.host["slot_mapping"][:b], non_blocking=True)
                if w:
                    v.table[:b, :w].copy_(v.host_table[: b * w].view(b, w), non_blocking=True)
            if k == 0 or views.recurrent[k]:
                slots = v.host_np["slots"]
                slots[:n] = views.state_slots(seqs, k)
                slots[n:b] = PAD_SLOT_ID
                v.slots[:b].copy_(v.host["slots"][:b], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record(torch.cuda.current_stream(self.device))  # the copies' stream, not the current one's

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def can_run(self, seqs) -> bool:  # type: ignore[no-untyped-def]
        if not (0 < len(seqs) <= self.buckets[-1] and all(len(s.token_ids) == 1 for s in seqs)):
            return False
        views = self.views
        for k in range(views.count):  # every group's ids must fit
            if views.attention[k] and max(map(len, views.block_ids(seqs, k))) > self.table.shape[1]:
                return False
            if views.recurrent[k] and min(views.state_slots(seqs, k)) <= 0:
                return False
        return True

    def _metas(self, b: int) -> list[VarlenMetadata]:
        out = []
        for k, v in enumerate(self.inputs):
            att = v if k == 0 or self.views.attention[k] else self.inputs[0]  # unread by the view's layers
            dec = RecurrentDecodeRows(rows=self.rows[:b], slots=v.slots[:b], has_init=self.has_init[:b])
            has_rec = self.conv_width and (k == 0 or self.views.recurrent[k])
            out.append(VarlenMetadata(
                input_ids=self.ids[:b], positions=self.positions[:b], slot_mapping=att.slot_mapping[:b],
                q_start=self.q_start[:b], q_len=self.q_len[:b], ctx_len=self.ctx_len[:b], block_table=att.table[:b],
                max_q_len=1, rec_decode=dec if has_rec else None, rec_prefill=None, sample_rows=self.rows[:b]))
        return out

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = VarlenBatch(self._metas(b), self.views.layer_views)
        logits = self.model.compute_logits(self.model.forward_varlen(batch, self.caches))
        return logits, torch.logsumexp(logits, dim=-1)  # the sampler's logprob normaliser, inside the graph

    def _capture(self, b: int) -> None:
        """Warm up (compiles the Triton kernels) on padded rows only, then capture."""
        for v in self.inputs:
            v.slot_mapping[:b].fill_(PAD_SLOT_ID)
            v.slots[:b].fill_(PAD_SLOT_ID)
        self.ctx_len[:b].zero_()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            out = self._forward(b)
        self.pool = graph.pool()
        self.graphs[b] = (graph, out)

    def release(self) -> None:
        """Destroy the captured graphs (the engine stops). Before a tensor-parallel group is left: NCCL does not
        tear down a communicator while a graph that captured its all-reduces lives (it waits for it forever)."""
        torch.cuda.synchronize(self.device)
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None

    @torch.inference_mode()
    def run(self, seqs, fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
        """Logits [len(seqs), vocab] of a decode-only step and their logsumexp [len(seqs)] (can_run must
        hold). `fed`: the rows' input tokens, already on the device (a step launched before the previous one's
        tokens were read): copied over the uploaded ids, on the device, before the replay."""
        n = len(seqs)
        b = self.bucket(n)
        assert b is not None
        if b not in self.graphs:
            self._capture(b)
        self._upload(seqs, b)
        if fed is not None:
            self.ids[:n].copy_(fed)
        graph, (logits, lse) = self.graphs[b]
        graph.replay()
        self.num_replays += 1
        return logits[:n], lse[:n]


__all__ = ["BUCKETS", "DecodeGraphs"]
