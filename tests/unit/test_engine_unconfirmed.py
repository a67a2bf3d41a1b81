"""A decode worker's request running on transferred caches the producer has not confirmed yet (engine/transfer.py
`run_unconfirmed`), driven step by step on two EngineCores of the built-in model with a copy standing in for the
READ: preemption under memory pressure inside the window (then a yes, or a no), an end reached inside it (parked)
then aborted or past its deadline, a grammar-constrained request refused after decoding on garbage, and a yes that
finds the request not scheduled yet. Every output must equal the colocated engine's; pools must be consistent and
empty afterwards, and nothing computed on refused pages may be in the prefix cache."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
from hybridpd.decode.consumer import Consumer, PendingPull
from hybridpd.engine.config import EngineConfig
from hybridpd.engine.core import EngineCore
from hybridpd.engine.default_model import default_model_path
from hybridpd.engine.request import Request, RequestStatus
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.transfer import (
    Import,
    ImportSource,
    add_first_token,
    begin_import,
    confirm_import,
    export_prefilled,
    refuse_unconfirmed,
    release_export,
    run_unconfirmed,
)
from hybridpd.kvtransfer.pull import PullResult, PullState
from hybridpd.proto import hybridpd_pb2 as pb

from tests.oracle import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDED = SamplingParams(
    max_tokens=14,
    temperature=0.9,
    top_p=0.95,
    top_k=40,
    seed=77,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.2,
    top_logprobs=2,
    ignore_eos=True,
)


def _core(kv_bytes: int = 8 * 2**20, max_model_len: int | None = None, max_num_seqs: int = 64) -> EngineCore:
    return EngineCore(
        EngineConfig.from_settings(
            default_model_path(),
            max_model_len=max_model_len,
            block_size=16,
            checkpoint_interval=32,
            kv_cache_memory_bytes=kv_bytes,
            max_num_seqs=max_num_seqs,
        )
    )


@pytest.fixture(scope="module")
def p() -> EngineCore:
    return _core()


@pytest.fixture(scope="module")
def colo() -> EngineCore:
    return _core()


def _run(core: EngineCore, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not core.has_unfinished():
            return
        core.step()
    raise AssertionError("the engine did not finish")


def _colocated(core: EngineCore, rid: str, prompt: list[int], sp: SamplingParams) -> Any:
    req = core.add_request(rid, prompt, sp)
    _run(core)
    return core.make_output(req)


def _same(got: Any, want: Any) -> None:
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.finish_reason == want.finish_reason
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert [[t for t, _ in top] for top in got.top_logprobs] == [[t for t, _ in top] for top in want.top_logprobs]


def _handoff(
    p: EngineCore,
    d: EngineCore,
    rid: str,
    prompt: list[int],
    sp: SamplingParams,
    garbage: bool = False,
    deadline: float | None = None,
) -> tuple[Request, Import]:
    """P computes the prompt and samples token 1; D imports it (a copy for the READ; random values instead when
    `garbage`: what a lost lease lets D read) and runs it unconfirmed."""
    preq = p.add_request(rid, prompt, sp, prefill_only=True)
    _run(p)
    exp = export_prefilled(p, preq)
    dreq = d.new_request(rid, prompt, sp)
    imp = begin_import(
        d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint), deadline=deadline
    )
    assert imp is not None
    add_first_token(
        d,
        dreq,
        preq.output_token_ids[0],
        preq.output_logprobs[0],
        preq.output_top_logprobs[0] if preq.output_top_logprobs else (),
    )
    g = torch.Generator().manual_seed(5)
    for src_map, dst_map in ((imp.src_blocks, imp.dst_blocks), (imp.src_state_slots, imp.dst_state_slots)):
        for gid, src in src_map.items():
            s, t = torch.tensor(src), torch.tensor(dst_map[gid])
            for ps, ds in zip(p.runner.group_tensors[gid], d.runner.group_tensors[gid], strict=True):
                rows = ps.index_select(0, s)
                if garbage:
                    rows = torch.randn(rows.shape, generator=g, dtype=torch.float32).to(rows.dtype) * 3
                ds.index_copy_(0, t, rows)
    release_export(p, preq, exp)
    run_unconfirmed(d, dreq)
    return dreq, imp


def _empty(core: EngineCore) -> None:
    core.cache.check_integrity()
    assert not core.has_unfinished() and not core.scheduler.requests
    assert not core.scheduler.unconfirmed and not core.scheduler.parked
    assert all(s["in_use"] == 0 for s in core.cache.pool_stats()), core.cache.pool_stats()


def _steps_until(core: EngineCore, done: Any, limit: int = 200) -> None:
    for _ in range(limit):
        if done():
            return
        core.step()
    raise AssertionError("never reached")


def _answer(core: EngineCore, req: Request, yes: bool) -> None:
    if yes:
        confirm_import(core, req)
    else:
        refuse_unconfirmed(core, req, "recompute", "refused")


@pytest.mark.parametrize("phase", ["preempted", "rerun"])
@pytest.mark.parametrize("yes", [True, False])
def test_an_unconfirmed_request_preempted_under_memory_pressure_matches_colocated(p, colo, yes, phase):  # type: ignore[no-untyped-def]
    """D's pools hold 11 blocks: a colocated request growing next to the unconfirmed one preempts it (the latest to
    arrive); P answers while it waits to recompute, or once it recomputes its prompt and held tokens from 0 (still
    unconfirmed). A no comes after decoding on garbage pages."""
    sp = dataclasses.replace(SEEDED, max_tokens=20)
    a_prompt, b_prompt = random_prompts([40, 100], vocab=256, seed=31)
    want = _colocated(colo, f"a-{yes}-{phase}", a_prompt, sp)
    d = _core(kv_bytes=192 * 2**10, max_model_len=128)
    b = d.add_request("b", b_prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    d.step()  # b's prompt: 7 of the 11 blocks
    a, _ = _handoff(p, d, "a", a_prompt, sp, garbage=not yes)
    _steps_until(d, lambda: a.num_preemptions > 0)
    held = list(a.output_token_ids)
    assert len(held) > 2 and a.held_from == 1 and not a.is_finished
    assert (held == want.token_ids[: len(held)]) is yes  # garbage pages change what D decodes
    assert not d.cache.cached_hashes()[0] - set(b.block_hashes), "a block of the unconfirmed request was published"
    if phase == "rerun":  # b ends, a is scheduled again from token 0 and runs past what it held
        _steps_until(d, lambda: a.status is RequestStatus.RUNNING and a.num_computed_tokens > a.num_prompt_tokens)
        assert a.request_id in d.scheduler.unconfirmed and a.held_from == 1
    else:
        assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 0
    _answer(d, a, yes)
    _run(d)
    _same(d.make_output(a), want)
    assert b.finish_reason == "length"
    _empty(d)


def test_an_end_reached_unconfirmed_then_aborted_or_past_its_deadline(p, colo):  # type: ignore[no-untyped-def]
    """Parked (its end reached before P answered): it counts as running; an abort ends it with nothing held kept
    and every page back; a deadline that passes is a no (recomputed, as colocated)."""
    sp = dataclasses.replace(SEEDED, max_tokens=5)
    (prompt,) = random_prompts([37], vocab=256, seed=32)
    want = _colocated(colo, "parked", prompt, sp)
    d = _core()
    a, _ = _handoff(p, d, "a", prompt, sp)
    _steps_until(d, lambda: "a" in d.scheduler.parked)
    assert a.output_token_ids == want.token_ids and not a.is_finished and not d.has_unfinished()
    assert d.queue_lengths() == (1, 0), "a parked request still holds a running seat (Stats, metrics)"
    d.abort("a")
    assert a.finish_reason == "abort" and a.output_token_ids == want.token_ids[:1] and a.held_from is None
    _empty(d)
    assert not d.cache.cached_hashes()[0], "an aborted speculation published its blocks"

    a, _ = _handoff(p, d, "a2", prompt, sp, deadline=d.clock() + 3600)
    _steps_until(d, lambda: "a2" in d.scheduler.parked)
    d.clock = lambda: float("inf")
    assert d.expire_imports() == [a]  # what the decode worker's hook runs between steps
    _run(d)
    _same(d.make_output(a), want)
    _empty(d)


def test_a_grammar_constrained_request_refused_after_decoding_on_garbage(p, colo):  # type: ignore[no-untyped-def]
    """The grammar matcher advanced over speculative tokens must follow the output back to P's first token."""
    sp = SamplingParams(
        max_tokens=24, temperature=0.8, seed=3, structured_output={"regex": "[a-z]{3,12}( [0-9]{2,5}){2}"}
    )
    (prompt,) = random_prompts([33], vocab=256, seed=33)
    want = _colocated(colo, "g", prompt, sp)
    d = _core()
    a, _ = _handoff(p, d, "g", prompt, sp, garbage=True)
    _steps_until(d, lambda: len(a.output_token_ids) >= 6 or "g" in d.scheduler.parked)
    assert a.output_token_ids != want.token_ids[: len(a.output_token_ids)]
    refuse_unconfirmed(d, a, "recompute", "refused")
    _run(d)
    _same(d.make_output(a), want)
    _empty(d)


def test_a_yes_while_the_request_waits_for_a_seat_publishes_what_it_pulled(p, colo):  # type: ignore[no-untyped-def]
    """The yes comes before the request was ever scheduled (D's one seat is taken): the pulled prompt is in D's
    prefix cache at once, as after a yes to a running one, and the output is the colocated one."""
    a_prompt, b_prompt = random_prompts([50, 20], vocab=256, seed=34)
    want = _colocated(colo, "seat", a_prompt, SEEDED)
    d = _core(max_num_seqs=1)
    b = d.add_request("b", b_prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    d.step()
    a, imp = _handoff(p, d, "a", a_prompt, SEEDED)
    d.step()
    assert a.status is RequestStatus.WAITING and a.num_computed_tokens == len(a_prompt) and not b.is_finished
    confirm_import(d, a)
    prompt_blocks = set(a.block_hashes[: len(a_prompt) // 16])
    assert prompt_blocks <= d.cache.cached_hashes()[0]
    _run(d)
    _same(d.make_output(a), want)
    _empty(d)


class _Handle:
    """A pull handle whose READ is done (or still in flight: `done` False)."""

    def __init__(self, done: bool) -> None:
        self.state = PullState.DONE if done else PullState.PENDING
        self.result = PullResult("x", self.state, "recompute", 0, 0, 0.0) if done else None

    def poll(self) -> PullState:
        return self.state

    def cancel(self) -> None:
        pass


def test_a_late_answer_never_applies_to_a_later_pull_under_the_same_id(p, colo):  # type: ignore[no-untyped-def]
    """The first request "x" decodes unconfirmed, then ends (its client went away) with its Commit in flight; a new
    request comes under the same id and its READ is in flight when the old Commit's yes (or no) arrives: that
    answer must not confirm the new pages before they landed, nor free them under the READ."""
    (prompt,) = random_prompts([45], vocab=256, seed=35)
    want = _colocated(colo, "reuse", prompt, SEEDED)
    d = _core()
    sent: list[PendingPull] = []
    consumer = Consumer(commit=sent.append)
    d.transfer_canceller = consumer.cancel

    def pull(done: bool) -> PendingPull:
        preq = p.add_request("x", prompt, SEEDED, prefill_only=True)
        _run(p)
        exp = export_prefilled(p, preq)
        dreq = d.new_request("x", prompt, SEEDED)
        imp = begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
        assert imp is not None
        add_first_token(d, dreq, preq.output_token_ids[0], preq.output_logprobs[0], preq.output_top_logprobs[0])
        release_export(p, preq, exp)
        pending = consumer.pending["x"] = PendingPull(dreq, _Handle(done), pb.TransferParams(), b"", {})
        return pending

    for yes in (True, False):
        old = pull(done=True)
        consumer.poll(d)  # the READ is done: Commit sent, "x" decodes unconfirmed
        assert sent[-1] is old and "x" in d.scheduler.unconfirmed
        d.step()
        d.abort("x")
        new = pull(done=False)
        cached = d.cache.cached_hashes()[0]
        assert consumer.on_commit(d, old, yes) is None
        assert consumer.pending["x"] is new and "x" in d.scheduler.importing, "the old answer took the new pull"
        assert d.cache.cached_hashes()[0] == cached
        new.handle.state = PullState.DONE  # type: ignore[union-attr]
        new.handle.result = PullResult("x", PullState.DONE, "recompute", 0, 0, 0.0)  # type: ignore[union-attr]
        consumer.poll(d)
        assert sent[-1] is new
        assert consumer.on_commit(d, new, False) is None  # the pages were never filled: P's no recomputes them
        _run(d)
        _same(d.make_output(new.req), want)
    _empty(d)


def _importing(p: EngineCore, d: EngineCore, rid: str, prompt: list[int]) -> Request:
    """A request whose pull is in flight on D (WAITING_FOR_TRANSFER, its pages held); P's export is let go."""
    preq = p.add_request(rid, prompt, SEEDED, prefill_only=True)
    _run(p)
    exp = export_prefilled(p, preq)
    dreq = d.new_request(rid, prompt, SEEDED)
    assert begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
    release_export(p, preq, exp)
    return dreq


def test_parked_and_importing_requests_take_seats_of_max_num_seqs(p, colo):  # type: ignore[no-untyped-def]
    """They hold running states (what the cache plan sized max_num_seqs for): with 4 seats, one parked and one
    importing, at most 2 of 4 new requests are admitted; a seat given back admits one more."""
    a_prompt, b_prompt, *others = random_prompts([37, 30, 20, 21, 22, 23], vocab=256, seed=36)
    sp = dataclasses.replace(SEEDED, max_tokens=3)
    want = _colocated(colo, "seats", a_prompt, sp)
    d = _core(max_num_seqs=4)
    a, _ = _handoff(p, d, "a", a_prompt, sp)
    _steps_until(d, lambda: "a" in d.scheduler.parked)
    _importing(p, d, "b", b_prompt)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    new = [d.add_request(f"o{i}", prompt, greedy) for i, prompt in enumerate(others)]
    d.step()
    assert [r.status for r in new].count(RequestStatus.RUNNING) == 2
    assert d.scheduler.num_seated == 4
    confirm_import(d, a)  # a ends: its seat goes to the next one
    d.step()
    assert [r.status for r in new].count(RequestStatus.RUNNING) == 3
    d.abort("b")
    _run(d)
    _same(d.make_output(a), want)
    for i, r in enumerate(new):
        _same(d.make_output(r), _colocated(colo, f"seat-o{i}", others[i], greedy))
    _empty(d)


def test_a_head_that_cannot_fit_beside_a_parked_request_waits_without_stepping(p, colo):  # type: ignore[no-untyped-def]
    """D's 11 blocks: a parked request holds 7, the next request needs 7 and nothing runs. The step thread must not
    spin on empty steps until P answers (a few retries at most); the yes then lets it run, as colocated."""
    from hybridpd.engine.async_engine import AsyncEngine

    a_prompt, c_prompt = random_prompts([100, 100], vocab=256, seed=37)
    sp = dataclasses.replace(SEEDED, max_tokens=5)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want_a = _colocated(colo, "stall-a", a_prompt, sp)
    want_c = _colocated(colo, "stall-c", c_prompt, greedy)
    d = _core(kv_bytes=192 * 2**10, max_model_len=128)
    a, _ = _handoff(p, d, "a", a_prompt, sp)
    _steps_until(d, lambda: "a" in d.scheduler.parked)
    c = d.add_request("c", c_prompt, greedy)
    d.step()
    assert c.status is RequestStatus.WAITING and d.scheduler.stalled
    steps = 0
    step = d.step

    def counted() -> list[Request]:
        nonlocal steps
        steps += 1
        return step()

    d.step = counted  # type: ignore[method-assign]
    engine = AsyncEngine(d)
    try:
        time.sleep(0.5)  # P's answer is late
        assert steps < 25, f"{steps} empty steps while waiting for P's answer"
        engine.call(lambda core: confirm_import(core, a)).result(timeout=10)
        deadline = time.monotonic() + 30
        while not engine.call(lambda core: c.is_finished).result(timeout=10):
            assert time.monotonic() < deadline, "the head never ran after the parked request ended"
            time.sleep(0.01)
    finally:
        engine.shutdown()
    _same(d.make_output(a), want_a)
    _same(d.make_output(c), want_c)
    _empty(d)
