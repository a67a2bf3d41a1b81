"""D's Commit overlaps the request's first decode steps: once the READ is done, the request decodes on the pulled
caches while P's answer is on its way; what it produces is held back (not streamed, its blocks not in the prefix
cache) until P says yes, and dropped on a no (the prompt and the first token recomputed, exactly as colocated).

P's answer is held at a gate until D has decoded a few tokens speculatively. Scenarios: a late yes (greedy and
seeded: the held tokens are released in order, the blocks published), a no after D decoded on garbage pages
(seeded: the generator restarts, output equals colocated, nothing speculative streamed or cached), the request's end
reached inside the window (max_tokens, a stop string: it ends only after the yes; on a no it is recomputed), an abort
inside the window, and the overlap switched off (D waits for the answer). Driven in one process with the pair of
tests/support on the built-in model (it has a tokenizer)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hybridpd.engine import LLM
from hybridpd.engine.core import EngineCore
from hybridpd.engine.default_model import default_model_path
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.worker.convert import sampling_params_from_proto

from tests.support.pd_pair import Aborted, FakeContext, Pair, engine_config, make_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDED = dict(
    max_tokens=12,
    temperature=0.9,
    top_p=0.95,
    top_k=40,
    seed=77,
    presence_penalty=0.5,
    repetition_penalty=1.2,
    logprobs=True,
    top_logprobs=2,
    ignore_eos=True,
)
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(config=engine_config(default_model_path()))


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    return llm.tokenizer.encode("The old lighthouse keeper climbed the stairs every night")  # type: ignore[no-any-return]


def colocated(llm: LLM, prompt: list[int], sp: pb.SamplingParams) -> Any:
    return llm.generate(prompt_token_ids=[prompt], sampling_params=sampling_params_from_proto(sp))[0]


class Gate:
    """D's view of P's Commit, held until `open(yes)`: yes lets P's servicer answer; no first releases the lease on
    P, so P's own Commit refuses it (unknown_lease), as when the lease expired during the READ."""

    def __init__(self, pair: Pair) -> None:
        self.pair, self.asked, self.answer = pair, asyncio.Event(), asyncio.Event()
        self.yes = True

    def open(self, yes: bool) -> None:
        self.yes = yes
        self.answer.set()

    async def Commit(self, req: pb.CommitRequest, timeout: float, metadata: Any) -> pb.CommitResponse:
        self.asked.set()
        await self.answer.wait()
        if not self.yes:
            p = self.pair.p
            await p.ctx.aengine.acall(lambda c: p._release(req.request_id))
        return await self.pair.p.Commit(req, FakeContext())  # type: ignore[arg-type]


async def gated_pair(monkeypatch: pytest.MonkeyPatch) -> tuple[Pair, Gate]:
    pair = await make_pair(default_model_path(), monkeypatch)
    gate = Gate(pair)
    monkeypatch.setattr(pair.d, "_prefill_stub", lambda address: gate)
    return pair, gate


async def start(
    pair: Pair, rid: str, prompt: list[int], sp: pb.SamplingParams
) -> tuple[pb.GenerateChunk, list[pb.GenerateChunk], asyncio.Task]:
    """P's Prefill, then D's Generate in a task whose chunks land in the returned list as they stream."""
    resp = await pair.p.Prefill(
        pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp), FakeContext()
    )  # type: ignore[arg-type]
    assert not resp.first.finish_reason
    first = pb.FirstToken(token_id=resp.first.token_ids[0], logprob=resp.first.logprobs[0])
    if resp.first.top_logprobs:
        first.top_logprobs.CopyFrom(resp.first.top_logprobs[0])
    req = pb.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=sp, params=resp.params, first_token=first
    )
    chunks: list[pb.GenerateChunk] = []

    async def consume() -> None:
        async for c in pair.d.Generate(req, FakeContext()):  # type: ignore[arg-type]
            chunks.append(c)

    return resp.first, chunks, asyncio.create_task(consume())


def d_view(pair: Pair, rid: str) -> Any:
    """On D's step thread: (output tokens so far, parked, the hashes D's prefix cache finds now)."""

    def look(core: EngineCore) -> tuple[list[int], bool, set[bytes]]:
        req = core.scheduler.requests.get(rid)
        cached = set().union(*core.cache.cached_hashes().values())
        return (list(req.output_token_ids) if req is not None else [], rid in core.scheduler.parked, cached)

    return pair.d.ctx.aengine.acall(look)


async def until(pred: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await pred():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.005)


async def decoded_at_least(pair: Pair, rid: str, n: int) -> list[int]:
    """Wait until D's request has `n` output tokens (P's first included); returns them."""
    out: list[int] = []

    async def enough() -> bool:
        nonlocal out
        out = (await d_view(pair, rid))[0]
        return len(out) >= n

    await until(enough)
    return out


def output(first: pb.GenerateChunk, chunks: list[pb.GenerateChunk]) -> dict[str, Any]:
    allc = [first, *chunks]
    return {
        "tokens": [t for c in allc for t in c.token_ids],
        "text": "".join(c.text for c in allc),
        "logprobs": [x for c in allc for x in c.logprobs],
        "finish": allc[-1].finish_reason,
    }


def assert_colocated(got: dict[str, Any], want: Any, sp: pb.SamplingParams) -> None:
    assert got["tokens"] == want.token_ids and got["text"] == want.text and got["finish"] == want.finish_reason
    if sp.logprobs:  # (P always sends the first token's; D only when asked)
        assert got["logprobs"] == pytest.approx(want.logprobs, abs=1e-4)


async def settle(pair: Pair) -> None:
    def check(core: EngineCore) -> list[int]:
        assert not core.has_unfinished() and not core.scheduler.parked and not core.scheduler.unconfirmed
        core.cache.check_integrity()
        return [int(s["in_use"]) for s in core.cache.pool_stats()]

    assert not any(await pair.d.ctx.aengine.acall(check)), "D holds pages after every request ended"
    assert not any(await pair.p.ctx.aengine.acall(check)), "P holds pages after every request ended"
    assert len(pair.p.leases) == 0 and not pair.d.consumer.pending


def test_a_late_yes_releases_the_held_tokens_in_order_and_publishes_the_blocks(llm, prompt, monkeypatch):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair, gate = await gated_pair(monkeypatch)
        try:
            for i, kw in enumerate((GREEDY, SEEDED)):
                sp = pb.SamplingParams(**kw)  # type: ignore[arg-type]
                gate.__init__(pair)  # type: ignore[misc]
                first, chunks, task = await start(pair, f"r{i}", prompt, sp)
                await gate.asked.wait()
                held = await decoded_at_least(pair, f"r{i}", 5)  # P's token + 4 decoded before P answered
                await asyncio.sleep(0.02)
                assert chunks == [], "a token computed on unconfirmed pages was streamed"
                if i == 0:  # nothing pulled is in D's prefix cache yet (it started empty)
                    assert not (await d_view(pair, "r0"))[2]
                gate.open(yes=True)
                await asyncio.wait_for(task, 20)
                got = output(first, chunks)
                assert got["tokens"][: len(held)] == held and len(chunks[0].token_ids) >= len(held) - 1
                assert_colocated(got, colocated(llm, prompt, sp), sp)
                if i == 0:  # confirmed: the prompt's full blocks are D's prefix cache now
                    assert len((await d_view(pair, "r0"))[2]) >= len(prompt) // 16
            assert pair.d.consumer.num_recomputed == 0
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_a_no_after_speculative_tokens_recomputes_exactly_and_leaks_nothing(llm, prompt, monkeypatch):  # type: ignore[no-untyped-def]
    """P's pages are overwritten while D reads them (what a lost lease allows), D decodes on that garbage, and P
    then refuses: none of it reaches the client, the seeded generator restarts, D's cache holds none of it."""

    async def run() -> None:
        pair, gate = await gated_pair(monkeypatch)
        try:
            sp = pb.SamplingParams(**SEEDED)  # type: ignore[arg-type]

            def scribble() -> None:
                def on_p(core: EngineCore) -> None:
                    g = torch.Generator().manual_seed(3)
                    for t in (t for ts in core.runner.group_tensors.values() for t in ts):
                        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))

                pair.p.ctx.aengine.call(on_p).result(timeout=30)

            pair.during_read = scribble
            first, chunks, task = await start(pair, "g", prompt, sp)
            await gate.asked.wait()
            spec = await decoded_at_least(pair, "g", 5)
            want = colocated(llm, prompt, sp)
            assert spec[1:5] != want.token_ids[1:5], "garbage pages should change what D decodes"
            assert chunks == [] and not (await d_view(pair, "g"))[2]
            gate.open(yes=False)
            await asyncio.wait_for(task, 20)
            assert_colocated(output(first, chunks), want, sp)
            assert pair.d.consumer.num_refused == {"lease_lost": 1} and pair.d.consumer.num_recomputed == 1
            pair.during_read = None
            # D's cache holds the recomputed prompt, not the garbage: a colocated repeat on D hits it, same output
            repeat = pb.GenerateRequest(request_id="again", prompt_token_ids=prompt, sampling_params=sp)
            again = [c async for c in pair.d.Generate(repeat, FakeContext())]  # type: ignore[arg-type]
            assert [t for c in again for t in c.token_ids] == want.token_ids
            assert again[-1].num_cached_tokens >= 16
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_the_end_reached_inside_the_window_waits_for_the_answer(llm, prompt, monkeypatch):  # type: ignore[no-untyped-def]
    """max_tokens and a stop string reached before P answers: the request is parked (ended neither early nor
    streamed); a yes ends it as colocated would, a no recomputes it and ends it the same way."""
    a = llm.tokenizer.encode("a")[-1]
    cases = [
        (pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), True),
        (pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), False),
        (pb.SamplingParams(max_tokens=9, temperature=0.0, logit_bias={a: 100.0}, stop=["aaa"]), True),
        (pb.SamplingParams(max_tokens=9, temperature=0.0, logit_bias={a: 100.0}, stop=["aaa"]), False),
    ]

    async def run() -> None:
        pair, gate = await gated_pair(monkeypatch)
        try:
            for i, (sp, yes) in enumerate(cases):
                gate.__init__(pair)  # type: ignore[misc]
                first, chunks, task = await start(pair, f"e{i}", prompt, sp)

                async def parked(rid: str = f"e{i}") -> bool:
                    return bool((await d_view(pair, rid))[1])

                await until(parked)
                await asyncio.sleep(0.02)
                assert chunks == [] and not task.done()
                gate.open(yes)
                await asyncio.wait_for(task, 20)
                assert_colocated(output(first, chunks), colocated(llm, prompt, sp), sp)
            assert pair.d.consumer.num_recomputed == 2
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_abort_inside_the_window_streams_nothing_speculative(prompt, monkeypatch):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair, gate = await gated_pair(monkeypatch)
        try:
            first, chunks, task = await start(pair, "x", prompt, pb.SamplingParams(**GREEDY))  # type: ignore[arg-type]
            await gate.asked.wait()
            await decoded_at_least(pair, "x", 4)
            resp = await pair.d.Abort(pb.AbortRequest(request_id="x"), FakeContext())  # type: ignore[arg-type]
            await asyncio.wait_for(task, 10)
            assert resp.aborted and chunks[-1].finish_reason == "abort"
            assert not [t for c in chunks for t in c.token_ids] and not "".join(c.text for c in chunks)
            gate.open(yes=True)  # P's late yes ends its lease; D has nothing left to confirm
            await until(lambda: asyncio.sleep(0, len(pair.p.leases) == 0))
            await asyncio.sleep(0.05)
            assert not (await d_view(pair, "x"))[2], "an aborted speculation published its blocks"
            await settle(pair)

            # policy "fail": a no ends the stream with an error, nothing speculative streamed before it
            pair.d.consumer.policy = "fail"
            gate.__init__(pair)  # type: ignore[misc]
            first, chunks, task = await start(pair, "f", prompt, pb.SamplingParams(**GREEDY))  # type: ignore[arg-type]
            await gate.asked.wait()
            await decoded_at_least(pair, "f", 3)
            gate.open(yes=False)
            with pytest.raises(Aborted, match="lease_lost"):
                await asyncio.wait_for(task, 10)
            assert not [t for c in chunks for t in c.token_ids]
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_with_the_overlap_off_d_waits_for_the_answer(llm, prompt, monkeypatch):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair, gate = await gated_pair(monkeypatch)
        pair.d.consumer.overlap = False
        try:
            sp = pb.SamplingParams(**GREEDY)  # type: ignore[arg-type]
            first, chunks, task = await start(pair, "w", prompt, sp)
            await gate.asked.wait()
            await asyncio.sleep(0.1)
            assert len((await d_view(pair, "w"))[0]) == 1  # P's first token only: nothing decoded before the yes
            gate.open(yes=True)
            await asyncio.wait_for(task, 20)
            assert_colocated(output(first, chunks), colocated(llm, prompt, sp), sp)
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_an_answer_that_never_comes_is_a_no_at_the_import_deadline(llm, prompt, monkeypatch):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair, gate = await gated_pair(monkeypatch)
        try:
            sp = pb.SamplingParams(**GREEDY)  # type: ignore[arg-type]
            first, chunks, task = await start(pair, "late", prompt, sp)
            await gate.asked.wait()
            await decoded_at_least(pair, "late", 3)
            later = pair.d_core.clock() + 3600
            pair.d.ctx.aengine.call(lambda c: setattr(c, "clock", lambda: later))  # past the import's deadline
            await asyncio.wait_for(task, 20)
            assert_colocated(output(first, chunks), colocated(llm, prompt, sp), sp)
            gate.open(yes=True)  # the late yes ends P's lease and finds nothing to confirm on D
            await until(lambda: asyncio.sleep(0, len(pair.p.leases) == 0))
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_an_idle_d_enforces_the_import_deadline_on_time(llm, prompt, monkeypatch):  # type: ignore[no-untyped-def]
    """The answer never comes and the Commit RPC would time out much later than the import's deadline: D, idle with
    only the parked request, wakes at that deadline by itself and recomputes the request there (as colocated)."""

    async def run() -> None:
        pair, gate = await gated_pair(monkeypatch)
        try:
            pair.d.commit_timeout_s = 60.0
            pair.d.consumer.commit_grace_s = 0.6 - pair.d.consumer.timeout_s  # deadline: 0.6 s after the admit
            sp = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            t0 = asyncio.get_running_loop().time()
            first, chunks, task = await start(pair, "idle", prompt, sp)
            await gate.asked.wait()
            await asyncio.wait_for(task, 20)
            took = asyncio.get_running_loop().time() - t0
            assert took < 3.0, f"the deadline (0.6 s) fired after {took:.1f} s"
            assert_colocated(output(first, chunks), colocated(llm, prompt, sp), sp)
            assert pair.d.consumer.num_recomputed == 0 and not pair.d.consumer.pending
            gate.open(yes=True)  # the late yes ends P's lease and finds nothing to confirm on D
            await until(lambda: asyncio.sleep(0, len(pair.p.leases) == 0))
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())
