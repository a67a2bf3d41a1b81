"""The runner reads every cache group: a tiny model's attention layers split into two attention groups
and its recurrent layers into two recurrent groups (tests/support/split_groups.py). Every group of a kind gets the
same ids (one block table, one slot per request: checked on every step), each its own view of the arena's pages and
slots, so each layer must read its own group's view (engine.models.batch.GroupViews).

On the reference path and on the fast path (Triton under TRITON_INTERPRET=1; the chunked scans run the reference
per sequence on CPU): greedy tokens and logprobs equal to the unsplit engine's and to transformers' fp32 run, with
chunked prefill, checkpoints written while prefilling, and a second request that hits the first one's prefix (a
checkpoint restored into every recurrent group's running slot). Then a graph-style decode step (DecodeGraphs'
static buffers, padded to a bucket) with every group's caches filled: padded rows (PAD_SLOT_ID in every view)
write nothing, real rows write only their own groups' pages, and the logits and written caches equal the eager
fast path's and the reference path's for the same step."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import pytest

if "hybridpd.engine.kernels.paged_attention" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
    pytest.skip("Triton kernels already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from hybridpd.engine import LLM, SamplingParams  # noqa: E402
from hybridpd.engine.cache.specs import PAD_SLOT_ID  # noqa: E402
from hybridpd.engine.scheduler import ScheduledSeq, SchedulerOutput  # noqa: E402

from tests.oracle import hf_greedy, random_prompts  # noqa: E402
from tests.support.forward_path import forward_path  # noqa: E402
from tests.support.split_groups import split_llm  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES: dict[str, tuple[str, dict[str, Any]]] = {  # two attention and at least two recurrent layers each
    "qwen": ("qwen3_5", {"layer_types": ["full_attention", "linear_attention", "linear_attention",
                                         "linear_attention", "full_attention"]}),
    "nemotron": ("nemotron_h", {"hybrid_override_pattern": "M*M-*ME"}),
}
NEW_TOKENS = 6
ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", max_num_batched_tokens=32,
                              kv_cache_memory_bytes=16 * 2**20, max_model_len=256, checkpoint_interval=16)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
BASE, TAIL_A, TAIL_B, OTHER = random_prompts([40, 7, 9, 21], vocab=256, seed=5)
FIRST, SECOND = [BASE + TAIL_A], [BASE + TAIL_B, OTHER]
"""The second batch's first prompt shares 40 tokens with the first: it hits 32 (the last checkpoint in the shared
full blocks of 16)."""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):  # type: ignore[no-untyped-def]
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    @functools.cache
    def get(name: str) -> str:
        family, overrides = CASES[name]
        return write_random_checkpoint(str(tmp_path_factory.mktemp(name)), family, seed=0, **overrides)

    return get


def _run(path: str, split: bool, fast: bool) -> list:  # type: ignore[type-arg]
    with forward_path(fast):
        llm = split_llm(model=path, **ENGINE) if split else LLM(model=path, **ENGINE)
    outs = llm.generate(prompt_token_ids=FIRST, sampling_params=GREEDY)
    outs += llm.generate(prompt_token_ids=SECOND, sampling_params=GREEDY)
    assert outs[1].num_cached_tokens == 32, "the second request was meant to restore the first one's checkpoint"
    if split:
        assert llm.split_steps_checked[0] > 0  # every step's ids were the same in every group of a kind
    llm.engine.cache.check_integrity()
    return outs


@functools.cache
def _unsplit_reference(path: str) -> list:  # type: ignore[type-arg]
    return _run(path, split=False, fast=False)


def _assert_oracle(path: str, outs: list) -> None:  # type: ignore[type-arg]
    for prompt, out in zip(FIRST + SECOND, outs, strict=True):
        tokens, logprobs = hf_greedy(path, prompt, NEW_TOKENS)
        assert out.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs, strict=True)) < 1e-4


def test_split_engine_has_two_groups_of_each_kind(model_path) -> None:  # type: ignore[no-untyped-def]
    llm = split_llm(model=model_path("qwen"), **ENGINE)
    groups = [(g.kind, g.layer_ids) for g in llm.engine.groups]
    assert groups == [("attention", (0,)), ("attention", (4,)), ("gated_deltanet", (1, 2)),
                      ("gated_deltanet", (3,))]
    views = llm.engine.runner.views
    assert views.layer_views == (0, 0, 0, 1, 1) and views.count == 2
    assert views.attention == (True, True) and views.recurrent == (True, True)
    llm.engine.add_request("r", FIRST[0], GREEDY)  # one step of a prompt: every group's ids reach the runner
    step = llm.engine.scheduler.schedule()
    s = step.seqs[0]
    assert [g for g, _ in s.group_block_ids] == [0, 1] and [g for g, _ in s.group_state_slots] == [2, 3]
    assert [g for g, _ in step.group_fresh_blocks] == [0, 1]
    assert s.group_block_ids[0][1] == s.group_block_ids[1][1] and s.group_state_slots[0][1] == s.group_state_slots[1][1]
    kv = [p for p in llm.engine.plan.arena.parts if p.name == "kv"]  # block j of both groups: one page, two parts
    assert len(kv) == 2 and kv[0].page_stride == kv[1].page_stride and kv[0].offset != kv[1].offset


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_reference_path_matches_unsplit_and_transformers(name, model_path) -> None:  # type: ignore[no-untyped-def]
    path = model_path(name)
    split, whole = _run(path, split=True, fast=False), _unsplit_reference(path)
    for a, b in zip(split, whole, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    _assert_oracle(path, split)


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_fast_path_matches_unsplit_and_transformers(name, model_path) -> None:  # type: ignore[no-untyped-def]
    path = model_path(name)
    split, whole = _run(path, split=True, fast=True), _unsplit_reference(path)
    for a, b in zip(split, whole, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    _assert_oracle(path, split)


# -- a graph-style decode step ----------------------------------------------------------------------------------

BS = 16


def _decode_seq(rid: str, computed: int, blocks: tuple[tuple[int, ...], ...], slots: tuple[int, ...]) -> ScheduledSeq:
    """One decode token; `blocks` per attention group (ids 0, 1), `slots` per recurrent group (ids 2, 3)."""
    return ScheduledSeq(request_id=rid, num_computed_tokens=computed, token_ids=(computed % 200 + 3,),
                        sample=True,
                        group_block_ids=((0, blocks[0]), (1, blocks[1])),
                        group_state_slots=((2, slots[0]), (3, slots[1])), group_checkpoints=((2, ()), (3, ())))


def test_graph_padded_rows_leave_every_groups_states_untouched(model_path) -> None:  # type: ignore[no-untyped-def]
    from hybridpd.engine.models.cuda_graphs import DecodeGraphs
    from hybridpd.engine.models.varlen import VarlenBatch, build_varlen_views

    with forward_path(True):
        llm = split_llm(model=model_path("qwen"), **ENGINE)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.caches, 8, 4, BS, runner.conv_width, torch.device("cpu"),
                          runner.views)
    running = llm.engine.plan.state_slots_running
    assert running >= 6
    seqs = [_decode_seq("a", 20, ((1, 2), (7, 5)), (3, 6)), _decode_seq("b", 5, ((3,), (4,)), (4, 2))]
    assert graphs.can_run(seqs)
    written_kv = {0: {(2, 4), (3, 5)}, 1: {(5, 4), (4, 5)}}  # group -> (block, offset) of each real row's token
    read_slots = {2: {3, 4}, 3: {6, 2}}
    g = torch.Generator().manual_seed(0)
    tensors = runner.group_tensors
    for ts in tensors.values():
        for t in ts:
            t.copy_(torch.randn(t.shape, generator=g))
    before = {gid: [t.clone() for t in ts] for gid, ts in tensors.items()}

    def restore() -> None:
        for gid, ts in tensors.items():
            for t, b in zip(ts, before[gid], strict=True):
                t.copy_(b)

    b = graphs.bucket(3)
    assert b == 4  # 2 real rows + 2 padded rows
    stale = [_decode_seq("c", 9, ((5,), (6,)), (5, 5)), _decode_seq("d", 9, ((6,), (2,)), (6, 4))]
    graphs._upload(seqs + stale, b)  # an earlier step left real ids in rows 2 and 3 of every view's buffers
    graphs._upload(seqs, b)
    logits, _ = graphs._forward(b)
    after = {gid: [t.clone() for t in ts] for gid, ts in tensors.items()}
    for gid, ts in after.items():
        for t, old in zip(ts, before[gid], strict=True):
            if gid in written_kv:  # [blocks, layers, 2, block_size, ...]: the (block, offset) rows that changed
                changed = (t != old).movedim(3, 1).flatten(2).any(-1)
                assert {tuple(i) for i in torch.nonzero(changed).tolist()} == written_kv[gid], gid
            else:  # [slots, layers, ...]: the running slots that changed (never 0, never another group's); the
                # slots past them are staging slots
                changed = (t != old).flatten(1).any(-1)[: 1 + running]
                assert set(torch.nonzero(changed).flatten().tolist()) == read_slots[gid], gid
    # the same step eagerly (no padding) and on the reference path: same logits, same caches written
    restore()
    metas = build_varlen_views(seqs, BS, runner.conv_width, torch.device("cpu"), runner.views)
    eager = runner.model.compute_logits(runner.model.forward_varlen(VarlenBatch(metas, runner.views.layer_views),
                                                                    runner.caches))
    torch.testing.assert_close(logits[:2], eager, atol=1e-5, rtol=0)
    for gid, ts in tensors.items():
        for t, a in zip(ts, after[gid], strict=True):
            torch.testing.assert_close(t, a, atol=1e-5, rtol=0)
    restore()
    ref = runner.model.compute_logits(runner.model.forward_reference(runner.build_batch(_output(seqs)),
                                                                     runner.caches))
    torch.testing.assert_close(logits[:2], ref, atol=1e-4, rtol=0)
    for gid, ts in tensors.items():
        for t, a in zip(ts, after[gid], strict=True):
            torch.testing.assert_close(t, a, atol=1e-4, rtol=0)
    assert (graphs.inputs[1].slots[2:b] == PAD_SLOT_ID).all() and (graphs.inputs[1].slot_mapping[2:b] == -1).all()


def _output(seqs: list[ScheduledSeq]) -> SchedulerOutput:
    return SchedulerOutput(seqs=tuple(seqs), preempted=())
