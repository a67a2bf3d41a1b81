"""Review of the checkpoint a handoff carries as k pages (engine/transfer.py `read_blocks`, `begin_import`): what D
publishes is what P offered, byte for byte, and a prompt D later computes itself restores from it exactly as a
colocated engine restores from its own."""

from __future__ import annotations

import random

import pytest
import torch
from hybridpd.engine import SamplingParams
from hybridpd.engine.core import EngineCore
from hybridpd.engine.parallel.handoff import copy_import
from hybridpd.engine.transfer import (
    ImportSource,
    begin_import,
    complete_import,
    export_prefilled,
    release_export,
    schedule_local,
)

from tests.unit.test_pd_prefix_reuse import _core, _run  # (the same P/D engines)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _handoff(p: EngineCore, d: EngineCore, rid: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    preq = p.add_request(rid, prompt, GREEDY, compute_target=len(prompt) - 1)
    _run(p)
    assert preq.finish_reason == "prefilled"
    exp = export_prefilled(p, preq)
    dreq = d.new_request(rid, prompt, GREEDY)
    imp = begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
    assert imp is not None
    return preq, exp, dreq, imp


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_first"])
def test_pulled_checkpoint_is_p_s_and_restores_like_colocated(checkpoint_dir, name):  # type: ignore[no-untyped-def]
    model = checkpoint_dir(name)
    p, d, colo = _core(model), _core(model), _core(model)
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(88)]  # P's prompt-end checkpoint at 80 (the first of its prefix)
    preq, exp, dreq, imp = _handoff(p, d, "a", prompt)
    assert exp.checkpoint is not None and imp.checkpoint is not None
    k = d.cache.k
    assert len(exp.checkpoint.pages) == len(imp.checkpoint.pages) == k
    src, dst = imp.read_blocks()
    for gid in imp.dst_blocks:
        assert src[gid][-k:] == exp.checkpoint.pages and dst[gid][-k:] == imp.checkpoint.pages
    copy_import(p, d, imp)  # the in-process reference of the pull: every page read_blocks names
    complete_import(d, dreq, imp)  # zeroes the last block's tail: the request's block, never a checkpoint page
    rows_p, rows_d = p.runner.rows, d.runner.rows
    first_p, first_d = p.runner.arena.first_page_row, d.runner.arena.first_page_row
    for sp, dp in zip(exp.checkpoint.pages, imp.checkpoint.pages, strict=True):
        assert torch.equal(rows_p[first_p + sp], rows_d[first_d + dp])  # all of every page, not some groups' part
    release_export(p, preq, exp)
    _run(d)

    # a prompt branching at 80: D restores the pulled checkpoint, the colocated engine its own
    other = prompt[:80] + [rng.randrange(256) for _ in range(20)]
    colo.add_request("c0", prompt, GREEDY)
    _run(colo)
    want = colo.add_request("c1", other, GREEDY)
    _run(colo)
    got = d.new_request("b", other, GREEDY)
    schedule_local(d, got)
    _run(d)
    assert want.num_cached_tokens == got.num_cached_tokens == 80
    assert got.output_token_ids == want.output_token_ids
    for core in (p, d):
        core.cache.check_integrity()
        assert all(s["in_use"] == 0 for s in core.cache.pool_stats()), core.cache.pool_stats()


PATHS = ["abort_reusable", "abort_quarantined", "core_abort_quarantined", "core_abort", "expired",
         "expired_quarantined", "unconfirmed_refused", "unconfirmed_aborted", "unconfirmed_expired",
         "unconfirmed_confirmed", "completed"]


@pytest.mark.parametrize("path", PATHS)
def test_reserved_checkpoint_pages_on_every_ending(checkpoint_dir, path):  # type: ignore[no-untyped-def]
    """The k pages reserved for a pulled checkpoint go back to the free list when the import ends unpublished and
    the READ can no longer land, stay out of it (and out of the tree) when it may still land, and are cached only
    after a confirmed pull."""
    from hybridpd.engine.transfer import abort_import, confirm_import, refuse_unconfirmed, run_unconfirmed

    model = checkpoint_dir("nemotron_attn_mid")
    p, d = _core(model), _core(model)
    rng = random.Random(4)
    prompt = [rng.randrange(256) for _ in range(88)]
    free_before = sorted(d.cache.pages.free)
    preq, exp, dreq, imp = _handoff(p, d, "a", prompt)
    ckpt = imp.checkpoint
    assert ckpt is not None
    copy_import(p, d, imp)
    if path.endswith("quarantined"):
        d.transfer_canceller = lambda rid: False
    quarantined = False
    if path == "abort_reusable":
        assert abort_import(d, dreq, imp, reusable=True)
    elif path == "abort_quarantined":
        assert not abort_import(d, dreq, imp, reusable=False)
        quarantined = True
    elif path in ("core_abort", "core_abort_quarantined"):
        d.abort("a")
        quarantined = path == "core_abort_quarantined"
    elif path in ("expired", "expired_quarantined"):
        d.scheduler.importing["a"] = __import__("dataclasses").replace(imp, deadline=0.0, fallback="fail")
        assert d.expire_imports() == [dreq]
        quarantined = path == "expired_quarantined"
    elif path.startswith("unconfirmed"):
        run_unconfirmed(d, dreq)
        d.step()
        if path == "unconfirmed_refused":
            refuse_unconfirmed(d, dreq, "fail", "refused")
        elif path == "unconfirmed_aborted":
            d.abort("a")
        elif path == "unconfirmed_expired":
            d.scheduler.unconfirmed["a"] = __import__("dataclasses").replace(imp, deadline=0.0, fallback="fail")
            assert d.expire_imports() == [dreq]
        else:
            confirm_import(d, dreq)
    else:
        complete_import(d, dreq, imp)
    _run(d)
    release_export(p, preq, exp)
    d.cache.check_integrity()
    free = set(d.cache.pages.free)
    cached = {q for node in d.cache.tree.nodes.values() for q in node.ckpt or ()}
    if quarantined:
        assert not set(ckpt.pages) & free and not set(ckpt.pages) & cached
    elif path in ("unconfirmed_confirmed", "completed"):
        assert set(ckpt.pages) <= cached
    else:
        assert not set(ckpt.pages) & cached
        assert d.cache.tree.num_reserved == 0
        # nothing pinned any more: every page is free or a cached item (evictable)
        d.cache.tree.make_room(len(free_before), checkpoint=False)
        assert sorted(d.cache.pages.free) == free_before


class _LaggingDevice:
    """A device that runs a step's checkpoint copies (restores and saves) only when the host waits for it: when a
    step that sampled resolves its tokens, or on `runner.synchronize()`; as CUDA does, where a step that samples
    nothing (a prompt chunk, a compute-target step) is never waited for and its copies may still be queued."""

    def __init__(self, core: EngineCore) -> None:
        runner = core.runner
        self.queue: list = []  # type: ignore[type-arg]
        copy, launch, sync = runner._copy_checkpoints, runner.launch, runner.synchronize

        def queued(copies, save):  # type: ignore[no-untyped-def]
            if copies:
                self.queue.append((copies, save))

        def flush() -> None:
            while self.queue:
                copy(*self.queue.pop(0))
            sync()

        def launched(*args, **kwargs):  # type: ignore[no-untyped-def]
            step = launch(*args, **kwargs)
            if step.rows is not None:
                resolve = step.resolve
                step.resolve = lambda: (flush(), resolve())[1]
            return step

        runner._copy_checkpoints, runner.launch, runner.synchronize = queued, launched, flush


def test_pages_go_to_a_pull_only_once_the_device_ran_what_was_queued(checkpoint_dir):  # type: ignore[no-untyped-def]
    """A NIXL READ writes D's pages off the device's stream, as soon as `begin_import` returns them. A step that
    sampled nothing was never waited for: its checkpoint saves (pages named in the cache at once) and restores
    (their checkpoint unpinned at once) may still be queued, so pages `begin_import` takes by eviction, checkpoint
    pages included, could be written by the READ before, or after, the queued copy reads or writes them (a restore
    of pulled bytes; a pulled checkpoint overwritten by a local save). begin_import must leave nothing of that
    queued."""
    model = checkpoint_dir("nemotron_attn_mid")
    p, d = _core(model), _core(model)
    dev = _LaggingDevice(d)
    rng = random.Random(5)
    local = [rng.randrange(256) for _ in range(88)]
    req = d.add_request("local", local, GREEDY, compute_target=len(local) - 1)  # samples nothing
    _run(d)
    assert req.finish_reason == "prefilled" and dev.queue  # its checkpoint saves are still queued
    d.scheduler.release(req)
    prompt = [rng.randrange(256) for _ in range(88)]
    preq, exp, dreq, imp = _handoff(p, d, "a", prompt)
    assert not dev.queue
    release_export(p, preq, exp)


def test_unwaited_marks_steps_nobody_waits_for_and_every_rank_settles(checkpoint_dir):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from hybridpd.engine.runner import synchronize_rank
    from hybridpd.engine.transfer import settle_device

    d = _core(checkpoint_dir("nemotron_attn_mid"))
    rng = random.Random(6)
    d.add_request("x", [rng.randrange(256) for _ in range(40)], GREEDY, compute_target=39)
    d.step()
    assert d.runner.unwaited  # a compute-target step samples nothing
    d.add_request("y", [rng.randrange(256) for _ in range(40)], GREEDY)
    _run(d)
    assert not d.runner.unwaited  # the last step sampled: its resolve waited for everything before it
    calls: list = []  # type: ignore[type-arg]
    leader = SimpleNamespace(unwaited=True, on_all=lambda fn, *a: calls.append(fn), synchronize=lambda: calls.append(0))
    settle_device(SimpleNamespace(runner=leader))  # type: ignore[arg-type]
    assert calls == [synchronize_rank] and not leader.unwaited  # every rank waits, not rank 0 alone
    settle_device(SimpleNamespace(runner=leader))  # type: ignore[arg-type]
    assert calls == [synchronize_rank]


@pytest.mark.parametrize("pattern", ["MMMM", "*-*-"])
def test_no_checkpoint_travels_for_a_model_without_attention_or_recurrent_layers(tmp_path, pattern):  # type: ignore[no-untyped-def]
    """States only: no page is a block, so no checkpoint can be read as blocks; attention only: nothing to restore.
    A checkpoint named in the source anyway is neither reserved nor read, and the handoff still matches colocated."""
    from hybridpd.engine.models.checkpoint import write_random_checkpoint
    from hybridpd.engine.transfer import Checkpoint, add_first_token, checkpoints_travel

    model = str(write_random_checkpoint(str(tmp_path), "nemotron_h", seed=0, hybrid_override_pattern=pattern))
    p, d, colo = _core(model), _core(model), _core(model)
    assert not checkpoints_travel(p) if pattern == "MMMM" else checkpoints_travel(p)
    rng = random.Random(7)
    prompt = [rng.randrange(256) for _ in range(88)]
    preq = p.add_request("a", prompt, GREEDY, prefill_only=True)
    _run(p)
    exp = export_prefilled(p, preq)
    assert exp.checkpoint is None
    forged = Checkpoint(64, tuple(range(1, 1 + max(1, d.cache.k))))
    dreq = d.new_request("a", prompt, GREEDY)
    imp = begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, forged))
    assert imp is not None and imp.checkpoint is None and imp.src_checkpoint_pages == ()
    assert imp.read_blocks() == (dict(imp.src_blocks), dict(imp.dst_blocks))
    add_first_token(d, dreq, preq.output_token_ids[0], preq.output_logprobs[0])
    copy_import(p, d, imp)
    complete_import(d, dreq, imp)
    release_export(p, preq, exp)
    _run(d)
    want = colo.add_request("a", prompt, GREEDY)
    _run(colo)
    assert dreq.output_token_ids == want.output_token_ids
    for core in (p, d):
        core.cache.check_integrity()
        assert all(s["in_use"] == 0 for s in core.cache.pool_stats()), core.cache.pool_stats()
