"""Structured-output grammars compile on a helper thread of the worker, never on the engine's step thread: a schema
that takes seconds to compile (nested a few hundred levels deep) used to pause every request of the worker for
that long. Through the real prefill and decode servicers (built-in model, CPU): each compile runs on a
`grammar-compile` thread, the request is served from the cached grammar, and a malformed schema is still an
INVALID_ARGUMENT naming the problem."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hybridpd.decode.service import DecodeServicer
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.core import EngineCore
from hybridpd.engine.default_model import default_model_path
from hybridpd.engine.structured import grammar
from hybridpd.prefill.service import PrefillServicer
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc
from hybridpd.worker.context import WorkerContext

from tests.support.pd_pair import engine_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[str, str]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers: list[grpc.aio.Server] = []
    engines: list[AsyncEngine] = []

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def serve(role: str) -> str:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        engines.append(AsyncEngine(EngineCore(engine_config(default_model_path()))))
        ctx = WorkerContext(role=role, aengine=engines[-1], model_name="m", address=f"127.0.0.1:{port}")
        if role == "prefill":
            pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(ctx), server)
        else:
            pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(ctx), server)
        await server.start()
        servers.append(server)
        return ctx.address

    try:
        yield run(serve("prefill")), run(serve("decode"))
    finally:
        for s in servers:
            run(s.stop(grace=None))
        for e in engines:
            e.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.fixture
def compile_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    real = grammar.GrammarCache._compile

    def spy(self: Any, spec: Any) -> Any:
        names.append(threading.current_thread().name)
        return real(self, spec)

    monkeypatch.setattr(grammar.GrammarCache, "_compile", spy)
    return names


def _sp(schema: object) -> pb.SamplingParams:
    sp = pb.SamplingParams(max_tokens=8, temperature=0.0)
    sp.structured_output.kind, sp.structured_output.spec = "json", json.dumps(schema)
    return sp


def test_grammars_compile_off_the_step_thread(workers: tuple[str, str], compile_threads: list[str]) -> None:
    p_addr, d_addr = workers
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with grpc.insecure_channel(d_addr) as ch:
        chunks = list(
            pb_grpc.DecodeServiceStub(ch).Generate(
                pb.GenerateRequest(request_id="d1", prompt_token_ids=[1, 2, 3], sampling_params=_sp(schema)), timeout=60
            )
        )
    assert chunks[-1].finish_reason and "".join(c.text for c in chunks).startswith('{"a"')
    with grpc.insecure_channel(p_addr) as ch:
        stub = pb_grpc.PrefillServiceStub(ch)
        resp = stub.Prefill(
            pb.PrefillRequest(
                request_id="p1",
                prompt_token_ids=[1, 2, 3],
                sampling_params=_sp({"type": "array", "items": {"type": "string"}}),
            ),
            timeout=60,
        )
        assert resp.first.token_ids
        stub.Release(
            pb.ReleaseRequest(request_id="p1", epoch=resp.params.epoch, lease_token=resp.params.lease_token), timeout=10
        )
        with pytest.raises(grpc.RpcError) as bad:
            stub.Prefill(
                pb.PrefillRequest(request_id="p2", prompt_token_ids=[1, 2], sampling_params=_sp({"type": "nonsense"})),
                timeout=60,
            )
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nonsense" in (bad.value.details() or "")
    assert len(compile_threads) == 3 and all(n.startswith("grammar-compile") for n in compile_threads), compile_threads
