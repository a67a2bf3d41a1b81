"""Replayed worker calls (a holder of the cluster token sending a call again) never cost another request its
answer: a second Generate under the id of one still streaming on the decode worker is refused, and the first one
streams to its end."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hybridpd.proto import hybridpd_pb2 as pb

from tests.oracle import random_prompts
from tests.support.pd_pair import Aborted, FakeContext, make_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_replayed_generate_is_refused_and_the_running_one_still_ends(checkpoint_dir, monkeypatch):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir("nemotron_attn_mid"), monkeypatch)
        try:
            prompt = random_prompts([40], vocab=256, seed=21)[0]
            sp = pb.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            req = pb.GenerateRequest(request_id="same", prompt_token_ids=prompt, sampling_params=sp)

            async def consume() -> list[int]:
                return [t async for c in pair.d.Generate(req, FakeContext()) for t in c.token_ids]  # type: ignore[arg-type]

            first = asyncio.create_task(consume())
            while not await pair.d.ctx.aengine.acall(lambda c: "same" in c.scheduler.requests):
                await asyncio.sleep(0.01)
            with pytest.raises(Aborted) as refused:
                await consume()
            assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
            assert len(await asyncio.wait_for(first, timeout=20)) == 24  # not left waiting on a closed stream
        finally:
            pair.close()

    asyncio.run(run())
