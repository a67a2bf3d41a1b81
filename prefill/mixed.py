"""The prefill worker's mixed role: it also answers `DecodeService.Generate` / `Abort` for whole requests (no
transfer params: prompt and every decode step on its own engine, mixed with its prefill work in the same chunked
steps), so that a cluster whose decode workers are saturated does not leave the prefill GPU idle between prompts.

At most `max_decode_share` x max_num_seqs such requests run at once (the rest of the running slots stay for
prefills: the role it was started for is never starved); beyond that Generate answers RESOURCE_EXHAUSTED and the
proxy sends the request to a decode worker. A drained worker still finishes what it runs (the proxy stops
routing to it). Transfer params are refused: a prefill worker never pulls."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from hybridpd.prefill.service import PrefillServicer
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc
from hybridpd.worker.context import WorkerRpcs
from hybridpd.worker.local_generate import generate_locally


def generate_capacity(max_num_seqs: int, share: float) -> int:
    """Whole requests a prefill worker with `max_num_seqs` running slots takes at once at `share` of them."""
    return int(max_num_seqs * share)


class MixedGenerateServicer(WorkerRpcs, pb_grpc.DecodeServiceServicer):
    """Generate and Abort on a prefill worker (registered on its gRPC server next to `PrefillServicer`)."""

    def __init__(self, prefill: PrefillServicer, max_decode_share: float = 0.5) -> None:
        if not 0 <= max_decode_share <= 1:
            raise ValueError(f"max_decode_share must be in [0, 1], got {max_decode_share}")
        self.prefill = prefill
        self.ctx = prefill.ctx
        self.capacity = generate_capacity(self.ctx.core.config.scheduler.max_num_seqs, max_decode_share)
        prefill.max_generate = self.capacity
        self.running: set[str] = set()
        """Whole requests streaming from here now (event loop only)."""
        prefill.whole = self.running  # a Prefill reusing one of their ids is refused (ALREADY_EXISTS), as here

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        rid = request.request_id
        if request.HasField("params") or request.HasField("first_token"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a prefill worker runs whole requests only (no transfer params, no first token): it never pulls",
            )
        if len(self.running) >= self.capacity:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this prefill worker runs {len(self.running)} "
                f"whole requests, its cap (--max-decode-share of max_num_seqs): use a decode worker",
            )
        if rid in self.running or self.prefill.has_request(rid):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running here")
        self.running.add(rid)
        try:
            async for chunk in generate_locally(self.ctx, request, context):
                yield chunk
        finally:
            self.running.discard(rid)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id
        if rid not in self.running:  # never a prefill of the same id: those end by Release / a cancelled Prefill
            return pb.AbortResponse(aborted=False)
        aborted = await self.ctx.aengine.acall(lambda core: core.abort(rid) is not None)
        return pb.AbortResponse(aborted=bool(aborted))

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        return await self.prefill.Stats(request, context)
