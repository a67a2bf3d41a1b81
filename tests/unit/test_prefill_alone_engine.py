"""A whole request on the prefill worker (P-alone, its mixed role) through the real proxy and real workers in one
process (built-in model, CPU, no NIXL): its output equals the colocated engine's, greedy and seeded, and the same
engine still serves a PD prefill sent meanwhile (its first token as colocated, its lease held, then released;
nothing left running or pinned); the worker refuses transfer params and, at its cap, further whole requests."""

from __future__ import annotations

import asyncio
import contextlib
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
from hybridpd.worker.auth import TokenInterceptor
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


def test_the_prefill_worker_dying_mid_stream_resumes_on_the_decode_worker(model, llm) -> None:  # type: ignore[no-untyped-def]
    """The prefill worker running a whole request stops after two chunks: the decode worker resumes the stream
    after them; the client gets the colocated greedy output, every token once."""
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
                "max_tokens": 40,
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
            resumed = 'hybridpd_proxy_decode_failovers_total{cause="lost",outcome="resumed"} 1.0'
            assert resumed in s.http.get("/metrics").text
    finally:
        workers.close()
    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
    streamed = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    want = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)
    assert (
        streamed == want[0].token_ids
        and "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want[0].text
    )


def _openai_view(body: dict[str, Any]) -> dict[str, Any]:
    """A completion body as an OpenAI client compares it: no id / created, logprobs rounded (PD's decode worker
    recomputes in other batch shapes: the last float bits differ, as between any two engines), no text_offset (it
    follows how tokens were grouped into chunks, which timing decides on every path), usage without the
    hybridpd-only breakdown of where the prompt was cached."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    out["choices"] = []
    for c in body["choices"]:
        c = dict(c)
        if c.get("logprobs"):
            lp = dict(c["logprobs"])
            lp.pop("text_offset")
            lp["token_logprobs"] = [round(x, 4) for x in lp["token_logprobs"]]
            lp["top_logprobs"] = [{k: round(v, 4) for k, v in top.items()} for top in lp["top_logprobs"]]
            c["logprobs"] = lp
        out["choices"].append(c)
    if out.get("usage"):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "hybridpd"}
    return out


def _stream_view(events: list[str]) -> tuple[list[Any], str, list[int], list[Any], dict[str, Any]]:
    """A stream as a client reads it (chunk boundaries are timing's): its keys per event, the whole text, tokens,
    finish reasons, and the usage event."""
    bodies = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    chunks = [b for b in bodies if b["choices"]]
    keys = sorted({(k, *sorted(b["choices"][0])) for b in chunks for k in b})
    text = "".join(b["choices"][0]["text"] for b in chunks)
    tokens = [t for b in chunks for t in b["choices"][0]["token_ids"]]
    finishes = [b["choices"][0]["finish_reason"] for b in chunks if b["choices"][0]["finish_reason"]]
    usage = _openai_view({"choices": [], "usage": bodies[-1]["usage"]})["usage"]
    return keys, text, tokens, finishes, usage


def test_a_client_cannot_tell_p_alone_from_pd_or_colocated(stack, model, llm) -> None:  # type: ignore[no-untyped-def]
    """Greedy, the same request through three proxies over the same two workers: P-alone (the module's stack), PD
    and colocated (the decode worker alone). The bodies match but for ids and timestamps: text, token ids, stop
    string and finish reason, logprobs and alternatives, usage (each proxy's first request caches the prompt where
    it runs, so the cached-token counts compare too); streamed with usage, the same."""
    s_alone, workers = stack
    p, d = workers.addrs
    prompt = llm.tokenizer.encode("A tale of two cities")
    greedy = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=10, temperature=0))
    tokens = greedy[0].token_ids
    stop = llm.tokenizer.decode(tokens[4:6])  # a stop string the greedy output reaches
    body = {"model": "m", "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    requests = [{**body, "stop": [stop]}, {**body, "ignore_eos": True}]
    stream = {**body, "stop": [stop], "stream": True, "stream_options": {"include_usage": True}}
    pd = LiveStack(n_prefill=0, n_decode=0, model_name="m", prefill_addrs_extra=(p,), decode_addrs_extra=(d,))
    colocated = LiveStack(n_prefill=0, n_decode=0, model_name="m", colocated=True, decode_addrs_extra=(d,))
    views = []
    for s in (s_alone, pd, colocated):
        with s if s is not s_alone else contextlib.nullcontext():
            assert s.http.post("/v1/completions", json=body).status_code == 200  # the prompt cached where it runs
            got: list[Any] = []
            for req in requests:
                r = s.http.post("/v1/completions", json=req)
                assert r.status_code == 200, r.text
                got.append(_openai_view(r.json()))
            with s.http.stream("POST", "/v1/completions", json=stream) as r:
                got.append(_stream_view([line[6:] for line in r.iter_lines() if line.startswith("data: ")]))
            views.append(got)
    assert 'path="prefill_alone"' in s_alone.http.get("/metrics").text
    alone, via_pd, colo = views
    assert alone[1]["choices"][0]["token_ids"] == tokens
    assert alone[0]["choices"][0]["finish_reason"] == "stop" and stop not in alone[0]["choices"][0]["text"]
    assert alone == via_pd == colo


async def _generate_status(addr: str, req: pb.GenerateRequest, metadata: tuple = ()) -> tuple[grpc.StatusCode, int]:
    """A whole request's final status and the tokens it streamed."""
    n = 0
    async with grpc.aio.insecure_channel(addr) as ch:
        try:
            async for chunk in pb_grpc.DecodeServiceStub(ch).Generate(req, timeout=30, metadata=metadata):
                n += len(chunk.token_ids)
        except grpc.aio.AioRpcError as e:
            return e.code(), n
    return grpc.StatusCode.OK, n


def test_the_mixed_role_rpcs_need_the_cluster_token(stack) -> None:  # type: ignore[no-untyped-def]
    """The prefill worker's server, token interceptor on (as worker/bootstrap.py builds it): Generate, Abort and
    Stats of its DecodeService refuse a missing or wrong token, and the refused Generate reaches no engine."""
    _, workers = stack

    async def serve() -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server(interceptors=[TokenInterceptor("s3cret")])
        port = server.add_insecure_port("127.0.0.1:0")
        pb_grpc.add_PrefillServiceServicer_to_server(workers.prefill, server)
        pb_grpc.add_DecodeServiceServicer_to_server(workers.mixed, server)
        await server.start()
        return server, f"127.0.0.1:{port}"

    async def unary(addr: str, md: tuple) -> list[grpc.StatusCode]:
        codes = []
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = pb_grpc.DecodeServiceStub(ch)
            for call in (
                stub.Abort(pb.AbortRequest(request_id="t"), timeout=10, metadata=md),
                stub.Stats(pb.StatsRequest(), timeout=10, metadata=md),
            ):
                try:
                    await call
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
        return codes

    ended: list[str] = []
    workers.prefill.ctx.aengine.on_finished.append(lambda r: ended.append(r.request_id))
    server, addr = workers.run(serve())
    try:
        req = pb.GenerateRequest(
            request_id="t", prompt_token_ids=[1, 2, 3], sampling_params=pb.SamplingParams(max_tokens=2, temperature=0.0)
        )
        for md in ((), (("x-hybridpd-token", "wrong"),), (("x-hybridpd-token", "s3cret "),)):
            assert workers.run(_generate_status(addr, req, md)) == (grpc.StatusCode.UNAUTHENTICATED, 0)
            assert workers.run(unary(addr, md)) == [grpc.StatusCode.UNAUTHENTICATED] * 2
        good = (("x-hybridpd-token", "s3cret"),)
        assert workers.run(_generate_status(addr, req, good)) == (grpc.StatusCode.OK, 2)
        assert ended.count("t") == 1  # only the call with the token reached the engine
        assert workers.run(unary(addr, good)) == [grpc.StatusCode.OK] * 2
    finally:
        workers.run(server.stop(grace=None))


def test_bad_whole_requests_get_a_clean_status_and_the_step_thread_lives(stack) -> None:  # type: ignore[no-untyped-def]
    """Bad input on P's Generate is a gRPC status (never a crash of P's step thread); an id in use, by a PD prefill
    holding its lease or by a whole request running, is ALREADY_EXISTS whichever RPC comes second, and the request
    holding it is unharmed."""
    _, workers = stack
    p = workers.addrs[0]
    sp = pb.SamplingParams(max_tokens=2, temperature=0.0)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        pb.GenerateRequest(request_id="b1", prompt_token_ids=[], sampling_params=sp),
        pb.GenerateRequest(request_id="b2", prompt_token_ids=[1, 2, 3]),  # no sampling params: max_tokens 0
        pb.GenerateRequest(request_id="b3", prompt_token_ids=[10**9], sampling_params=sp),
        pb.GenerateRequest(request_id="b4", prompt_token_ids=[1] * 5000, sampling_params=sp),
        pb.GenerateRequest(
            request_id="b5", prompt_token_ids=[1, 2], sampling_params=pb.SamplingParams(max_tokens=2, temperature=-1.0)
        ),
        pb.GenerateRequest(
            request_id="b6",
            prompt_token_ids=[1, 2],
            sampling_params=pb.SamplingParams(
                max_tokens=2, structured_output=pb.StructuredOutput(kind="nope", spec="{")
            ),
        ),
    ]
    for req in cases:
        assert workers.run(_generate_status(p, req)) == (invalid, 0), req.request_id

    async def collisions() -> tuple[grpc.StatusCode, grpc.StatusCode, bool, str]:
        async with grpc.aio.insecure_channel(p) as ch:
            prefill, whole_rpcs = pb_grpc.PrefillServiceStub(ch), pb_grpc.DecodeServiceStub(ch)
            held = await prefill.Prefill(
                pb.PrefillRequest(request_id="lease", prompt_token_ids=[4, 5, 6], sampling_params=sp), timeout=30
            )
            on_lease, _ = await _generate_status(
                p, pb.GenerateRequest(request_id="lease", prompt_token_ids=[1, 2], sampling_params=sp)
            )
            await prefill.Release(
                pb.ReleaseRequest(request_id="lease", epoch=held.params.epoch, lease_token=held.params.lease_token),
                timeout=10,
            )
            # a whole request as long as the engine allows (huge max_tokens), running while a Prefill reuses its id
            huge = pb.SamplingParams(max_tokens=2**31 - 1, temperature=0.0, ignore_eos=True)
            whole = whole_rpcs.Generate(
                pb.GenerateRequest(request_id="whole", prompt_token_ids=[7, 8, 9], sampling_params=huge), timeout=60
            )
            await whole.read()
            try:
                await prefill.Prefill(
                    pb.PrefillRequest(request_id="whole", prompt_token_ids=[1, 2], sampling_params=sp), timeout=30
                )
                on_whole = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                on_whole = e.code()
            aborted = (await whole_rpcs.Abort(pb.AbortRequest(request_id="whole"), timeout=10)).aborted
            finish = ""
            while (chunk := await whole.read()) is not grpc.aio.EOF:
                finish = chunk.finish_reason or finish
            return on_lease, on_whole, aborted, finish

    exists = grpc.StatusCode.ALREADY_EXISTS
    assert workers.run(collisions()) == (exists, exists, True, "abort")  # and the whole request ran on until
    ok = pb.GenerateRequest(request_id="b8", prompt_token_ids=[1, 2, 3], sampling_params=sp)
    assert workers.run(_generate_status(p, ok)) == (grpc.StatusCode.OK, 2)
    assert workers.run(workers.prefill.ctx.aengine.acall(lambda c: c.queue_lengths())) == (0, 0)
    assert not workers.prefill.held and not workers.mixed.running


def test_pd_lease_given_back_when_the_decode_worker_computed_the_prompt_itself(stack) -> None:  # type: ignore[no-untyped-def]
    """PD through the proxy to a decode worker that cannot pull (here: no transfer agent; on a cluster: P unknown
    or unreachable, no cache room to receive, params refused) and computes the prompt itself: P's lease is given
    back as soon as D's first chunk shows it pulled nothing, not held pinned until it expires (30 s; meanwhile
    P's pinned pages count against its prefills' and whole requests' room)."""
    _, workers = stack
    p, d = workers.addrs
    with LiveStack(n_prefill=0, n_decode=0, model_name="m", prefill_addrs_extra=(p,), decode_addrs_extra=(d,)) as s:
        body = {"model": "m", "prompt": [11, 12, 13, 14, 15], "max_tokens": 4, "ignore_eos": True}
        r = s.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["hybridpd"]["transferred_tokens"] == 0  # D computed it
        wait_for("P's lease released", lambda: not workers.prefill.held, timeout=3, interval=0.02)
