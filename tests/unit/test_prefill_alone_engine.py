"""A whole request on the prefill worker (P-alone, its mixed role) through the real proxy and real workers in one
process (built-in model, CPU, no NIXL): its output equals the colocated engine's, greedy and seeded, and the same
engine still serves a PD prefill sent meanwhile (its first token as colocated, its lease held, then released;
nothing left running or pinned); the worker refuses transfer params and, at its cap, further whole requests."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hybridpd.decode.service import DecodeServicer
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.core import EngineCore
from hybridpd.engine.default_model import default_model_path
from hybridpd.prefill.mixed import MixedGenerateServicer
from hybridpd.prefill.service import PrefillServicer
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc
from hybridpd.proxy.config import RoutingWeights
from hybridpd.worker.context import WorkerContext

from tests.polling import wait_for
from tests.support.live_stack import LiveStack
from tests.support.pd_pair import engine_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "presence_penalty": 0.5}


class Workers:
    """A real prefill worker (with its mixed role) and a real decode worker, served on a loop of their own."""

    def __init__(self, model: str, max_decode_share: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="workers", daemon=True)
        self.thread.start()
        self.cores = [EngineCore(engine_config(model)) for _ in range(2)]
        self.servers: list[grpc.aio.Server] = []
        self.contexts: list[WorkerContext] = []
        self.addrs = self.run(self._start(max_decode_share))

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, share: float) -> tuple[str, str]:
        addrs = []
        for role, core in zip(("prefill", "decode"), self.cores, strict=True):
            server = grpc.aio.server()
            port = server.add_insecure_port("127.0.0.1:0")
            ctx = WorkerContext(role=role, aengine=AsyncEngine(core), model_name="m", address=f"127.0.0.1:{port}")
            self.contexts.append(ctx)
            if role == "prefill":
                self.prefill = PrefillServicer(ctx)
                self.mixed = MixedGenerateServicer(self.prefill, share)
                pb_grpc.add_PrefillServiceServicer_to_server(self.prefill, server)
                pb_grpc.add_DecodeServiceServicer_to_server(self.mixed, server)
            else:
                pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(ctx), server)
            await server.start()
            self.servers.append(server)
            addrs.append(ctx.address)
        return addrs[0], addrs[1]

    def close(self) -> None:
        for s in self.servers:
            self.run(s.stop(grace=None))
        for ctx in self.contexts:
            ctx.aengine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def model() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def llm(model: str) -> LLM:
    return LLM(config=engine_config(model))


@pytest.fixture(scope="module")
def stack(model: str) -> Iterator[tuple[LiveStack, Workers]]:
    workers = Workers(model, max_decode_share=1 / 32)  # 64 seqs: 2 whole requests at once
    p, d = workers.addrs
    s = LiveStack(
        n_prefill=0,
        n_decode=0,
        model_name="m",
        routing="adaptive",
        prefill_addrs_extra=(p,),
        decode_addrs_extra=(d,),
        routing_weights=RoutingWeights(prefill_decode="always"),
    )
    with s:
        yield s, workers
    workers.close()


def test_whole_request_on_the_prefill_worker_matches_colocated(stack, llm) -> None:  # type: ignore[no-untyped-def]
    s, workers = stack
    prompts = [llm.tokenizer.encode(t) for t in ("The quick brown fox jumps over", "Once upon a time there")]
    # a PD prefill on the same engine, sent while the whole requests run: P's first token, its lease
    sp = pb.SamplingParams(max_tokens=8, temperature=0.0)

    async def prefill_on_p() -> pb.PrefillResponse:
        async with grpc.aio.insecure_channel(workers.addrs[0]) as ch:
            resp = await pb_grpc.PrefillServiceStub(ch).Prefill(
                pb.PrefillRequest(request_id="pd-1", prompt_token_ids=prompts[1], sampling_params=sp), timeout=60
            )
            await pb_grpc.PrefillServiceStub(ch).Release(
                pb.ReleaseRequest(request_id="pd-1", epoch=resp.params.epoch, lease_token=resp.params.lease_token),
                timeout=10,
            )
            return resp

    pd_first = asyncio.run_coroutine_threadsafe(prefill_on_p(), workers.loop)
    got = []
    for prompt, extra in [(prompts[0], {"temperature": 0.0}), (prompts[1], SEEDED)]:
        r = s.http.post(
            "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 12, "ignore_eos": True, **extra}
        )
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    want = [
        llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=12, ignore_eos=True, **e))[
            0
        ].token_ids
        for p, e in ((prompts[0], {"temperature": 0.0}), (prompts[1], SEEDED))
    ]
    assert got == want
    first = pd_first.result(60)
    greedy = llm.generate(prompt_token_ids=[prompts[1]], sampling_params=SamplingParams(max_tokens=8, temperature=0))
    assert list(first.first.token_ids) == greedy[0].token_ids[:1] and first.HasField("params")
    metrics = s.http.get("/metrics").text
    assert 'hybridpd_proxy_route_decisions_total{path="prefill_alone"} 2.0' in metrics
    assert workers.run(workers.prefill.ctx.aengine.acall(lambda c: c.queue_lengths())) == (0, 0)
    assert not workers.prefill.held  # the PD lease released, nothing pinned by the whole requests


def test_the_prefill_worker_refuses_params_and_whole_requests_past_its_cap(stack) -> None:  # type: ignore[no-untyped-def]
    _, workers = stack

    async def generate(req: pb.GenerateRequest) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(workers.addrs[0]) as ch:
            try:
                async for _ in pb_grpc.DecodeServiceStub(ch).Generate(req, timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    sp = pb.SamplingParams(max_tokens=2, temperature=0.0)
    with_params = pb.GenerateRequest(
        request_id="x", prompt_token_ids=[1, 2, 3], sampling_params=sp, params=pb.TransferParams(num_computed_tokens=3)
    )
    assert workers.run(generate(with_params)) == grpc.StatusCode.INVALID_ARGUMENT
    workers.mixed.running.update({"a", "b"})  # its 2 slots taken
    try:
        plain = pb.GenerateRequest(request_id="y", prompt_token_ids=[1, 2, 3], sampling_params=sp)
        assert workers.run(generate(plain)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        workers.mixed.running.clear()
    assert workers.run(generate(plain)) == grpc.StatusCode.OK


def test_a_client_gone_mid_stream_aborts_the_whole_request_on_the_prefill_worker(stack) -> None:  # type: ignore[no-untyped-def]
    s, workers = stack
    ended: list[tuple[str, str | None]] = []
    workers.prefill.ctx.aengine.on_finished.append(lambda req: ended.append((req.request_id, req.finish_reason)))
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with s.http.stream("POST", "/v1/completions", json=body) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # the first token: then go away
    wait_for("the whole request ended on P", lambda: bool(ended), timeout=10, interval=0.02)
    assert ended[0][1] == "abort"
    queues = workers.run(workers.prefill.ctx.aengine.acall(lambda c: c.queue_lengths()))
    assert queues == (0, 0) and not workers.mixed.running


def test_the_prefill_worker_dying_mid_stream_ends_it_with_an_error_after_a_right_prefix(model, llm) -> None:  # type: ignore[no-untyped-def]
    workers = Workers(model, max_decode_share=1 / 32)
    p, d = workers.addrs
    s = LiveStack(
        n_prefill=0,
        n_decode=0,
        model_name="m",
        routing="adaptive",
        prefill_addrs_extra=(p,),
        decode_addrs_extra=(d,),
        routing_weights=RoutingWeights(prefill_decode="always"),
    )
    prompt = [5, 6, 7, 8, 9]
    try:
        with s:
            body = {
                "model": "m",
                "prompt": prompt,
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            }
            events = []
            with s.http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:  # P dies (its server stops) after 2 chunks
                            workers.run(workers.servers[0].stop(grace=None))
    finally:
        workers.close()
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    streamed = [t for e in events[:-2] for t in json.loads(e)["choices"][0]["token_ids"]]
    greedy = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
    want = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].token_ids
    assert 0 < len(streamed) < 400 and streamed == want[: len(streamed)]  # cut short, never wrong
