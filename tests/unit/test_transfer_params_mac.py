"""Transfer params cannot be altered: P signs everything it issues (kvtransfer.binding.params_mac) and its Commit
checks the signature and which pages D read; D refuses what it can see is wrong before pulling.

In one process (tests/support/pd_pair.py: the real servicers over two EngineCores, a fake pull that
copies pages): the altered-pages attack (a token holder sends D request A's params carrying request B's block ids
and state slots), then every field of the params altered one at a time. Each time: the answer is the colocated
engine's, the refusal is counted, and D's cache holds nothing pulled (a later request for the prompt is right)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.proto import hybridpd_pb2 as pb

from tests.oracle import random_prompts
from tests.support.param_attacks import ALTERATIONS, with_pages_of
from tests.support.pd_pair import COLOCATED_FIRST
from tests.unit.test_pd_handoff import MODEL, NEW, Pair, generate, make_pair, prefill, settle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([75, 75], vocab=256, seed=23)


@pytest.fixture(scope="module")
def expected(checkpoint_dir, prompts):  # type: ignore[no-untyped-def]
    llm = LLM(model=checkpoint_dir(MODEL), checkpoint_interval=32, kv_cache_memory_bytes=8 * 2**20)
    outs = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    )
    COLOCATED_FIRST.update({tuple(p): o.token_ids[0] for p, o in zip(prompts, outs, strict=True)})
    return [o.token_ids for o in outs]


def _p_refusals(pair: Pair) -> list[str]:
    """Records every failure reason P counts (hybridpd_kv_transfer_failures_total{role="prefill"})."""
    seen: list[str] = []
    count = pair.p.tmetrics.transfer_failed

    def spy(reason: str, *a: Any, **kw: Any) -> Any:
        seen.append(reason)
        return count(reason, *a, **kw)

    pair.p.tmetrics.transfer_failed = spy  # type: ignore[method-assign]
    return seen


def test_another_prompts_pages_under_this_lease_are_refused(checkpoint_dir, monkeypatch, prompts, expected):  # type: ignore[no-untyped-def]
    """Prefill X (request A) and Y (request B); Generate(A, X, A's params with B's pages): D pulls Y's KV, and P's
    Commit must refuse it; D recomputes X, and later requests for X are right (nothing of Y cached under X)."""

    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        p_refused = _p_refusals(pair)
        try:
            x, y = prompts
            tp_a, tp_b = await prefill(pair, "A", x), await prefill(pair, "B", y)
            assert [g.block_ids for g in tp_a.groups] != [g.block_ids for g in tp_b.groups]
            assert await generate(pair, "A", x, with_pages_of(tp_a, tp_b)) == expected[0]
            assert len(pair.pulls) == 1  # the pull happened (D cannot check P's signature) ...
            assert pair.d.consumer.num_refused == {"lease_lost": 1}  # ... and its pages were never used
            assert p_refused == ["commit_params_forged"]
            assert pair.d.consumer.num_recomputed == 1
            for i in range(3):
                assert await generate(pair, f"X{i}", x, None) == expected[0]
            assert await generate(pair, "B", y, tp_b) == expected[1]  # B's own lease is untouched and still good
            assert pair.d.consumer.num_refused == {"lease_lost": 1}
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_every_field_altered_is_refused_and_nothing_is_cached(checkpoint_dir, monkeypatch, prompts, expected):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        p_refused = _p_refusals(pair)
        accepted, wrong, report = [], [], {}
        try:
            x = prompts[0]
            for i, (name, alter) in enumerate(ALTERATIONS.items()):
                tp = await prefill(pair, f"r{i}", x)
                assert tp.mac and tp.num_computed_tokens == len(x)
                altered = pb.TransferParams()
                altered.CopyFrom(tp)
                alter(altered)
                assert altered != tp, name
                before, handed = sum(pair.d.consumer.num_refused.values()), len(pair.d.consumer.handed_over)
                out = await generate(pair, f"r{i}", x, altered)
                if out != expected[0]:
                    wrong.append(name)
                if sum(pair.d.consumer.num_refused.values()) != before + 1:
                    accepted.append(name)
                report[name] = dict(pair.d.consumer.num_refused)
                assert len(pair.d.consumer.handed_over) == handed
                # a refusal before the pull (or a Commit presenting another token) leaves P's lease to its owner
                rid = f"r{i}"
                pair.p.ctx.aengine.call(lambda c: pair.p._release(rid)).result()  # noqa: B023 - awaited here
            assert not wrong and not accepted, (wrong, accepted, report)
            assert await generate(pair, "x-later", x, None) == expected[0]  # nothing altered was cached
            await settle(pair)
            d_reasons = pair.d.consumer.num_refused
            assert sum(d_reasons.values()) == len(ALTERATIONS), d_reasons
            assert set(d_reasons) <= {"bad_params", "prompt_mismatch", "lease_lost", "lease_expired"}, d_reasons
            assert "commit_params_forged" in p_refused, p_refused
            print(
                f"\naltered fields: {len(ALTERATIONS)} tried, 0 accepted, 0 wrong; D refusals {d_reasons}; "
                f"P refusals {sorted(set(p_refused))}"
            )
        finally:
            pair.close()

    asyncio.run(run())
