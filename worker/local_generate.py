"""A whole request on this worker's engine, streamed as `DecodeService.Generate` chunks: the colocated contract
(no transfer params, no first token: the worker computes the prompt and samples every token itself).

The prefill worker's mixed role serves Generate with it (prefill/mixed.py); the chunks are built by the decode
worker's rule (text held back for stop strings and incomplete characters, `streamable_end`), so a client cannot
tell which worker ran its request. Event loop; engine work on the step thread (`run_engine_call`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from hybridpd.engine.async_engine import OutputDelta, take_pending
from hybridpd.engine.core import EngineCore
from hybridpd.engine.transfer import schedule_local
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.worker.context import WorkerContext, precompile_structured, run_engine_call
from hybridpd.worker.convert import chunk_of, sampling_params_from_proto
from hybridpd.worker.stream_text import streamable_end


async def generate_locally(
    ctx: WorkerContext, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.GenerateChunk]:
    """Stream a request computed entirely here. The caller has checked it carries no params / first token. A
    cancelled stream (the client went away) aborts the request on the engine."""
    rid = request.request_id
    prompt = [int(t) for t in request.prompt_token_ids]
    try:
        params = sampling_params_from_proto(request.sampling_params)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    await precompile_structured(ctx, context, params)
    want_logprobs = request.sampling_params.logprobs
    salt = request.cache_salt or None
    aengine = ctx.aengine
    q = aengine.open_stream(rid)
    max_stop = max((len(s) for s in params.stop), default=0)

    admitted = False

    def admit(core: EngineCore) -> None:
        nonlocal admitted
        schedule_local(core, core.new_request(rid, prompt, params, salt))
        admitted = True

    try:
        await run_engine_call(ctx, context, admit)
        sent = 0
        while True:
            delta: OutputDelta = take_pending(q, await q.get())
            finished = delta.finish_reason is not None
            end = streamable_end(delta.text, sent, finished, max_stop)
            chunk = chunk_of(delta, delta.text[sent:end], want_logprobs)
            sent = end
            if delta.finish_reason == "error":
                await context.abort(grpc.StatusCode.UNAVAILABLE, delta.stop_reason or "request failed")
            yield chunk
            if finished:
                return
    except BaseException:
        if admitted:  # (a refused request's id may be another request's: never abort that one)
            aengine.call(lambda core: core.abort(rid))  # a finished request is not aborted again
        raise
    finally:
        aengine.close_stream(rid)
