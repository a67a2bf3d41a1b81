"""The model runner: owns the model, every cache tensor and the sampler. The only place tensors are built.

Per step: restore checkpoints (pages -> running slots, one row copy over the arena), zero fresh attention blocks,
build the step's batch (one view per attention/recurrent group pairing when a kind has several
groups: engine.models.batch.GroupViews), run the model, save checkpoints (slots -> pages, one row copy), compute
logits only for rows that sample, sample.

The path is chosen once, at construction: the batched path (`CausalLM.forward_varlen` on a
engine.models.varlen.VarlenBatch, decode steps replayed as CUDA graphs) on CUDA with fla-core installed, else the
readable reference (`CausalLM.forward_reference` on a ForwardBatch).
Ownership: single thread (the engine's step loop). Caches are allocated once here and never reallocated.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate, chain, compress
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from hybridpd.engine.arena import allocate_caches
from hybridpd.engine.cache.planner import CapacityPlan
from hybridpd.engine.cache.specs import PAD_SLOT_ID, CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.models.base import AttentionCache, CausalLM, LayerCache, StateCache
from hybridpd.engine.models.batch import ForwardBatch, GroupViews, SeqInfo
from hybridpd.engine.models.varlen import VarlenBatch, build_varlen_views
from hybridpd.engine.prompt_logprobs import ScoredRows
from hybridpd.engine.prompt_scoring import score_prompt_rows
from hybridpd.engine.sampler import SampledRows, Sampler, TopLogprobs, to_device
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import SchedulerOutput


def default_fast_path(device: torch.device) -> bool:
    """The batched path on CUDA when fla-core is installed; the reference elsewhere."""
    if device.type != "cuda":
        return False
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        logging.getLogger("hybridpd.runner").warning("fla-core is not installed: the GPU runs the reference path "
                                                     "(pip install hybridpd[gpu])")
        return False
    return True


class ModelRunner:
    """Every layer reads its own cache group's block table / state slot (engine.models.batch.GroupViews)."""

    def __init__(
        self, model: CausalLM, groups: list[CacheGroup], plan: CapacityPlan, num_layers: int, device: torch.device,
        seed: int = 0, zero_fresh_blocks: bool = True, fast_path: bool | None = None,
        enforce_eager: bool | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self._fast_path = default_fast_path(device) if fast_path is None else fast_path
        self._forward = self._forward_varlen if self._fast_path else self._forward_reference
        """The step's forward and sampling on the chosen path (never switched)."""
        self.conv_width = 0
        self.block_size = plan.block_size
        self.caches: list[LayerCache] = [None] * num_layers
        self.attention_tensors: list[torch.Tensor] = []  # one per attention group: [blocks, layers, 2, bs, ...]
        self.state_tensors: list[torch.Tensor] = []  # two per recurrent group: conv, ssm [slots, layers, ...]
        self.rows, self.group_tensors = allocate_caches(groups, plan, device)
        """The arena as rows of one page (checkpoint saves and restores), and every group's tensors: strided views of
        it (engine/arena.py)."""
        self.arena = plan.arena
        for g in groups:
            self._allocate(g, plan)
            if isinstance(g.spec, RecurrentStateSpec):
                self.conv_width = g.spec.conv_shape[1] + 1
        if self.fast_path:
            model.enable_fast_path()
            if any(t.dtype == torch.float32 for t in self.attention_tensors + self.state_tensors[:1]):
                os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # fp32 engine: no TF32 in fla-core's dots
        if enforce_eager is None:
            enforce_eager = os.environ.get("HYBRIDPD_ENFORCE_EAGER", "0") not in ("", "0")
        self.views = GroupViews.of(groups, num_layers)
        """Which view (block tables and state slots of which groups) each layer reads: engine.models.batch."""
        self._group_zeroers: dict[int, Any] = {}
        """One BlockZeroer per attention group, made on first use."""
        self.graphs = None
        """CUDA graphs of decode-only steps (engine.models.cuda_graphs); off with enforce_eager or off the GPU."""
        if self.fast_path and device.type == "cuda" and not enforce_eager:
            from hybridpd.engine.models.cuda_graphs import DecodeGraphs

            max_blocks = -(-plan.max_model_len // plan.block_size) if plan.block_size else 1
            self.graphs = DecodeGraphs(model, self.caches, max(1, plan.state_slots_running), max_blocks,
                                       plan.block_size, self.conv_width, device, self.views)
        self.sampler = Sampler(device, seed)
        self._scored: dict[str, ScoredRows] = {}
        """Prompt rows the step being launched scored (`_score_prompts`)."""
        self._held_scores: dict[str, ScoredRows] = {}
        """Those of the last `execute`, until `take_prompt_scores`."""
        self.last_tokens: torch.Tensor | None = None
        """The last launched step's sampled tokens, on the device (what a fed step reads: `launch`)."""
        self.token_group: Any = None
        """Tensor-parallel ranks with asynchronous scheduling: each launch shares rank 0's samples with the other
        ranks (engine.parallel.group.TPGroup.broadcast_tokens), whose next fed step reads them; None otherwise."""
        self.zero_fresh_blocks = zero_fresh_blocks
        self.num_zeroed_blocks = 0
        self.num_graph_checkpoints = 0
        """Checkpoints saved after a decode graph's replay."""
        self.unwaited = False
        """A step launched since the last one that sampled samples nothing: nobody waited for the device to run it
        (`LaunchedStep.resolve` waits for a sampling step, and so for everything queued before it), so its copies
        and writes may still be queued. Whoever hands pages to a writer outside the stream (a NIXL READ) must
        wait for every rank first, then clear it (engine.transfer.settle_device)."""

    @property
    def fast_path(self) -> bool:
        """Batched path (engine.models.varlen + fast_path kernels); default on CUDA when fla-core is installed. The
        readable reference otherwise. Chosen at construction (read-only)."""
        return self._fast_path

    def _allocate(self, g: CacheGroup, plan: CapacityPlan) -> None:
        """Bind the group's tensors (allocated by engine/arena.py: one per cache kind for the whole group,
        block-major with the layer as dimension 1: block (slot) `i` of every layer of the group is one contiguous
        page, so a run of blocks is one transfer descriptor for all layers (kvtransfer.layout, stacked groups)).
        Each layer sees its slice `[:, layer]`."""
        if isinstance(g.spec, FullAttentionSpec):
            (kv,) = self.group_tensors[g.group_id]
            self.attention_tensors.append(kv)
            for i, layer in enumerate(g.layer_ids):
                self.caches[layer] = AttentionCache(kv[:, i])
            return
        conv, ssm = self.group_tensors[g.group_id]
        self.state_tensors += [conv, ssm]
        for i, layer in enumerate(g.layer_ids):
            self.caches[layer] = StateCache(conv[:, i], ssm[:, i])

    # -- per step ------------------------------------------------------------------------------------------------
    def _copy_checkpoints(self, copies: tuple[tuple[int, tuple[int, ...]], ...], save: bool) -> None:
        """(slot, checkpoint pages) copies: slot rows -> pages (`save`), else pages -> slot rows (a restore). One
        row copy over the arena for all of them."""
        if not copies:
            return
        arena = self.arena
        first = arena.first_page_row
        slot_rows = [r for slot, _ in copies for r in arena.slot_rows(slot)]
        page_rows = [first + p for _, pages in copies for p in pages]
        src, dst = (slot_rows, page_rows) if save else (page_rows, slot_rows)
        src_t = to_device(src, torch.int64, self.device)  # pinned: no wait for a running step
        dst_t = to_device(dst, torch.int64, self.device)
        self.rows.index_copy_(0, dst_t, self.rows.index_select(0, src_t))

    def save_states(self, copies: tuple[tuple[int, tuple[int, ...]], ...]) -> None:
        """Checkpoints saved now (stream-ordered after the step launched last): slot -> its pages."""
        with self._on_device():
            self._copy_checkpoints(copies, True)

    def synchronize(self) -> None:
        """Wait until this rank's device has run everything launched so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release_graphs(self) -> None:
        """Destroy the decode CUDA graphs: the engine stops (and, under tensor parallelism, is about to leave its
        group, which NCCL refuses while a graph that captured its all-reduces lives). Later steps run eagerly."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def zero_blocks(self, block_ids: tuple[int, ...], group_id: int) -> int:
        """Zero fresh blocks of one attention group: one launch."""
        if not block_ids or not self.zero_fresh_blocks:
            return 0
        zeroer = self._group_zeroers.get(group_id)
        if zeroer is None:
            from hybridpd.engine.kernels.zero_blocks import BlockZeroer

            zeroer = self._group_zeroers[group_id] = BlockZeroer(list(self.group_tensors[group_id]))
        n: int = zeroer.zero(list(block_ids))
        self.num_zeroed_blocks += n
        return n

    @property
    def zero_launches(self) -> int:
        """Zeroing kernel launches so far, every attention group."""
        return sum(getattr(z, "launches", 0) for z in self._group_zeroers.values())

    def zero_block_tail(self, block_id: int, start: int, group_id: int) -> None:
        """Zero token positions [start, block_size) of one attention block in every layer of its group: the
        unfilled tail of the last block a transfer wrote (its bytes came from the producer and are not trusted)."""
        for kv in self.group_tensors[group_id]:  # [blocks, layers, 2, block_size, ...]
            kv[block_id, :, :, start:].zero_()

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        """The reference path's flat batch; with several cache groups of a kind, one view per group pairing
        (engine.models.batch.GroupViews), each with its own slot mapping and SeqInfos."""
        v = self.views
        batches = [self._build_view(out, v.block_ids(out.seqs, k), v.state_slots(out.seqs, k),
                                    [v.checkpoints(s, k) for s in out.seqs]) for k in range(v.count)]
        first = batches[0]
        first.views, first.layer_views = batches[1:], v.layer_views
        return first

    def _build_view(self, out: SchedulerOutput, blocks: list[tuple[int, ...]], slots: list[int],
                    checkpoints: list[tuple[tuple[int, int], ...]]) -> ForwardBatch:
        """Column by column (C-level map/zip over the sequences, no Python statement per sequence): one host tensor
        holds every block table, each sequence's `block_table` is its slice of it (CPU: the model batches index
        tensors)."""
        bs = self.block_size
        seqs = out.seqs
        if not len(blocks) == len(slots) == len(checkpoints) == len(seqs):
            raise ValueError("one block table, state slot and checkpoint list per scheduled sequence")
        n_new = [len(s.token_ids) for s in seqs]
        starts = [s.num_computed_tokens for s in seqs]
        query_starts = list(accumulate(n_new, initial=0))
        ids = list(chain.from_iterable(s.token_ids for s in seqs))
        if len(ids) == len(seqs):  # decode: one token per sequence, at its computed count
            pos = starts
            mapping = [table[p // bs] * bs + p % bs if table else PAD_SLOT_ID
                       for p, table in zip(pos, blocks, strict=True)]
        else:
            pos = list(chain.from_iterable(range(c, c + n) for c, n in zip(starts, n_new, strict=True)))
            mapping = list(chain.from_iterable(
                [table[p // bs] * bs + p % bs for p in range(c, c + n)] if table else [PAD_SLOT_ID] * n
                for c, n, table in zip(starts, n_new, blocks, strict=True)))
        widths = list(map(len, blocks))
        tables = torch.from_numpy(np.fromiter(chain.from_iterable(blocks), np.int64, sum(widths))).split(widths)
        infos = list(map(SeqInfo, query_starts, n_new, starts, tables,
                         [slot if slot > 0 else PAD_SLOT_ID for slot in slots], [c > 0 for c in starts],
                         map(list, checkpoints)))
        t = lambda x: torch.from_numpy(np.array(x, np.int64)).to(self.device)  # noqa: E731 (numpy: 3x torch.tensor's speed)
        return ForwardBatch(input_ids=t(ids), positions=t(pos), slot_mapping=t(mapping), seqs=infos, block_size=bs)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, params: dict[str, SamplingParams]) -> dict[str, tuple[int, float]]:
        """Run one step; returns {request_id: (token, logprob)} for the sequences that sample (the top logprobs of
        rows that asked wait in `sampler.take_top_logprobs()`)."""
        step = self.launch(out, params)
        sampled, top = step.resolve()
        self.sampler.hold_top_logprobs(top)
        self._held_scores = step.prompt_scores
        return sampled

    def take_prompt_scores(self) -> dict[str, ScoredRows]:
        """The prompt rows the last `execute` scored, by request (engine.prompt_logprobs); handed over once."""
        scores, self._held_scores = self._held_scores, {}
        return scores

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, params: Mapping[str, SamplingParams | None],
               feed: tuple[int, ...] | None = None) -> LaunchedStep:
        """Start one step without waiting for its tokens (`LaunchedStep.resolve` does). `feed`: the step's input
        token of each sequence is not known on the host yet: it is the previous launch's sampled row `feed[i]`,
        copied on the device (every sequence then computes one token)."""
        with self._on_device():
            return self._launch(out, params, feed)

    def _on_device(self) -> AbstractContextManager[Any]:
        """The engine's device made current while a step is enqueued: Triton launches its kernels on the current
        device's stream and a CUDA graph is captured there, and the thread that steps the engine may have another
        device current (every thread starts on cuda:0). Nothing on the CPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def _launch(self, out: SchedulerOutput, params: Mapping[str, SamplingParams | None],
                feed: tuple[int, ...] | None) -> LaunchedStep:
        self._copy_checkpoints(out.state_restores, False)
        for gid, fresh in out.group_fresh_blocks:
            self.zero_blocks(fresh, gid)
        if out.is_empty:
            self.unwaited = True
            return LaunchedStep(None)
        fed = None
        if feed is not None:
            assert self.last_tokens is not None, "a fed step needs the previous step's samples"
            index = to_device(list(feed), torch.int64, self.device)  # pinned: no wait for the step running
            fed = self.last_tokens.index_select(0, index)
        self.last_tokens = None
        self._scored = {}
        got = self._forward(out, fed)
        self._copy_checkpoints(out.state_saves, True)  # before anything later can write the slots
        scored, self._scored = self._scored, {}
        self.unwaited = got is None  # a sampling step's resolve waits for all before it
        if got is None:
            return LaunchedStep(None, scored)
        logits, lse, rids = got
        self.sampler.unread_outputs = 0 if feed is None else 1  # each fed row's previous token is not read yet
        self.sampler.unread_tokens = fed
        rows = self.sampler.sample_rows(logits, rids, list(map(params.__getitem__, rids)), lse)  # type: ignore[misc]
        tokens = rows.tokens if rows is not None else None
        if self.token_group is not None:  # every rank holds the samples its next fed step reads
            tokens = self.token_group.broadcast_tokens(tokens, len(rids), self.device)
        self.last_tokens = tokens
        return LaunchedStep(rows, scored)

    def _score_prompts(self, hidden: torch.Tensor, out: SchedulerOutput) -> None:
        """Score the prompt rows of the step's sequences that ask for prompt logprobs (`_scored`), from the
        step's hidden states (every rank: the logits may be gathered across tensor-parallel ranks)."""
        if any(map(_PROMPT_SCORES, out.seqs)):
            self._scored = score_prompt_rows(hidden, out.seqs, self.model.compute_logits)

    def _forward_reference(self, out: SchedulerOutput, fed: torch.Tensor | None) -> Logits | None:
        batch = self.build_batch(out)
        if fed is not None:  # one token per sequence: row i is sequence i, in every view
            for b in (batch, *batch.views):
                b.input_ids[: len(fed)] = fed
        hidden = self.model.forward_reference(batch, self.caches)
        self._score_prompts(hidden, out)
        sample = [o.sample for o in out.seqs]
        if not any(sample):
            return None
        rids = list(compress([o.request_id for o in out.seqs], sample))
        rows = list(compress([s.query_start + s.num_new_tokens - 1 for s in batch.seqs], sample))
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]), None, rids

    def _forward_varlen(self, out: SchedulerOutput, fed: torch.Tensor | None) -> Logits | None:
        """The batched path: a decode step replays its CUDA graph; any other step builds its metadata vectorised,
        uploads it once, runs one forward and the logits of the sampled rows."""
        rids = [o.request_id for o in out.seqs if o.sample]
        if self.graphs is not None and not any(map(_PROMPT_SCORES, out.seqs)) and self.graphs.can_run(out.seqs):
            logits, lse = self.graphs.run(out.seqs, fed)
            self.num_graph_checkpoints += len(out.state_saves)  # (saved by `_launch` after the replay)
            if not rids:  # one-token steps that sample nothing (a prefill worker's last prompt token, say)
                return None
            if len(rids) < len(out.seqs):
                keep = torch.tensor([i for i, o in enumerate(out.seqs) if o.sample], dtype=torch.long,
                                    device=self.device)
                logits, lse = logits[keep], lse[keep]
            return logits, lse, rids
        sample = [o.sample for o in out.seqs]
        metas = build_varlen_views(out.seqs, self.block_size, self.conv_width, self.device, self.views,
                                   sample=sample)
        if fed is not None:  # one token per sequence: row i is sequence i, in every view
            for m in metas:
                m.input_ids[: len(fed)] = fed
        hidden = self.model.forward_varlen(VarlenBatch(metas, self.views.layer_views), self.caches)
        self._score_prompts(hidden, out)
        if not rids:
            return None
        return self.model.compute_logits(hidden[metas[0].sample_rows]), None, rids

_PROMPT_SCORES = attrgetter("prompt_scores")


def synchronize_rank(runner: ModelRunner, rank: int) -> None:
    """`ModelRunner.synchronize` on one tensor-parallel rank (LeaderRunner.on_all: every rank, rank 0 waits)."""
    runner.synchronize()


Logits = tuple[torch.Tensor, torch.Tensor | None, list[str]]
"""The sampled rows' logits, their logsumexp when the forward computed it, and the rows' request ids."""


class LaunchedStep:
    """A step whose samples may still be computed on the device (`ModelRunner.launch`). None: nothing sampled (or
    a follower rank, which never reads its samples)."""

    def __init__(self, rows: SampledRows | None, prompt_scores: dict[str, ScoredRows] | None = None) -> None:
        self.rows = rows
        self.prompt_scores = prompt_scores or {}
        """Prompt rows this step scored, by request (computed at launch: already on the host)."""

    def resolve(self) -> tuple[dict[str, tuple[int, float]], dict[str, TopLogprobs]]:
        """({request id: (token, logprob)}, {request id: top logprobs}) of the rows that sampled: waits for them."""
        if self.rows is None:
            return {}, {}
        tokens, logprobs, top = self.rows.resolve()
        return dict(zip(self.rows.request_ids, zip(tokens, logprobs, strict=True), strict=True)), top
