"""FAKE prefill and decode gRPC workers, for testing the proxy (and `bench serve`) without an engine.

Nothing here is a model. The fakes follow the wire contract in hybridpd.proto with a trivial deterministic rule:

    FakePrefillWorker: returns the first output token of the decode rule below (its chunk; with its end when that
                       token ends the request) and, unless it ended it, TransferParams for the N prompt tokens; its
                       "prefix hit" is the longest prefix, in whole 4-token blocks, shared with any earlier prompt
                       of the same cache_salt.
                       Its mixed role (`whole`, DecodeService on the same address) generates by the decode rule.
    FakeDecodeWorker:  generates the prompt's token ids reversed (cycled when ignore_eos), one token per chunk
                       (from the second when Generate carries the first token; after the resumed ones when it
                       carries a `resume`),
                       `token_delay_s` apart; logprob of step i is -0.1 * (i % 5 + 1) (top_logprobs: the token,
                       then ids +1, +2, ... each 1.0 less likely); finishes "length" at
                       max_tokens, "stop" when the reversed prompt runs out (or at a stop token / stop string,
                       named in `stop_token_id` / `stop_string`). With prompt_logprobs k, the first output token's
                       chunk scores prompt token i (i >= 1) -0.01 * i, rank i, and lists ids +1 .. +k of it, each 1.0
                       less likely than the one before (from -0.5); a Generate continuing from P's token does not.

Both record what they received (requests, releases, aborts, cancellations) and can be told to fail, and a decode
worker to freeze mid-stream (`freeze_after_tokens`: it sends nothing more, its connection open; with
`freeze_health`, its Health goes unanswered from then on too, as a frozen process's); `ready = False` makes its
Health answer not ready (a worker whose engine is wedged while its gRPC server answers).
`tests.support.live_stack.LiveStack` runs them with a real proxy for synchronous tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc

FAKE_BLOCK = 4


@dataclasses.dataclass
class Failure:
    """Make a fake fail: `code` with `message`, after `after_tokens` tokens (decode only; 0 = before any)."""

    code: grpc.StatusCode
    message: str = "injected failure"
    after_tokens: int = 0


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _token(context: grpc.aio.ServicerContext) -> str | None:
    return next((str(v) for k, v in context.invocation_metadata() or () if k == "x-hybridpd-token"), None)


def _stats(role: str, worker_id: str, metrics_port: int, running: int, max_generate: int = 0) -> pb.StatsResponse:
    pools = [
        pb.PoolStats(group_id=0, kind="attention", total=64, free=60, cached=2, in_use=2, integrity_ok=True),
        pb.PoolStats(group_id=1, kind="mamba2", total=8, free=7, in_use=1, integrity_ok=True),
    ]
    memory = {"physical_bytes": 1 << 20, "attention_bytes_cached": 2 << 10, "checkpoint_bytes_held": 4 << 10}
    return pb.StatsResponse(
        role=role,
        worker_id=worker_id,
        epoch="fake-epoch",
        num_running=running,
        pools=pools,
        metrics_port=metrics_port,
        memory_bytes=memory,
        max_num_seqs=max(max_generate, 8) if max_generate else 0,
        max_generate=max_generate,
    )


class FakePrefillWorker(pb_grpc.PrefillServiceServicer):
    """FAKE prefill worker (see module doc)."""

    def __init__(
        self,
        worker_id: str = "fake-prefill-0",
        delay_s: float = 0.0,
        metrics_port: int = 0,
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.token_text = token_text or (lambda t: f" {t}")
        self.address = ""
        self.delay_s = delay_s
        self.metrics_port = metrics_port
        self.failure: Failure | None = None
        self.health_delay_s = 0.0
        self.ready = True
        """Health's `ready` (False: a worker whose engine is wedged though it answers)."""
        self.prefills: list[pb.PrefillRequest] = []
        self.releases: list[str] = []
        self.tokens: list[str | None] = []  # the x-hybridpd-token metadata of every Prefill call
        self._seen: list[tuple[str, tuple[int, ...]]] = []
        self.whole = FakeDecodeWorker(f"{worker_id}-whole", token_text=token_text)
        """Its mixed role: DecodeService on the same address, generating by the decode rule."""
        self.max_generate = 0
        """Whole requests it reports taking at once (Stats' max_generate; 0 reports no capacity)."""

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        self.prefills.append(request)
        self.tokens.append(_token(context))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.failure is not None:
            await context.abort(self.failure.code, self.failure.message)
        ids = tuple(request.prompt_token_ids)
        n = len(ids)
        hit = max((_common_prefix(ids, p) for s, p in self._seen if s == request.cache_salt), default=0)
        hit = min(hit // FAKE_BLOCK * FAKE_BLOCK, max(0, n - 1))
        self._seen.append((request.cache_salt, ids))
        first = next(_fake_chunks(request.prompt_token_ids, request.sampling_params, self.token_text))
        if not first.token_ids:  # a stop token: P returns it as the engine samples it (no text)
            first.token_ids.append(_fake_outputs(request.prompt_token_ids, request.sampling_params)[0])
        first.num_cached_tokens, first.num_external_cached_tokens = hit, 0
        if first.finish_reason:
            return pb.PrefillResponse(request_id=request.request_id, num_cached_tokens=hit, first=first)
        blocks = pb.GroupBlocks(group_id=0, block_ids=range(1, 1 + (n + FAKE_BLOCK - 1) // FAKE_BLOCK))
        params = pb.TransferParams(
            worker_id=self.worker_id,
            epoch="fake-epoch",
            prefill_address=self.address,
            groups=[blocks],
            states=[pb.GroupStates(group_id=1, state_slot=1)],
            num_computed_tokens=n,
            num_prompt_tokens=n,
            lease_expiry_unix=time.time() + 30.0,
        )
        return pb.PrefillResponse(request_id=request.request_id, params=params, num_cached_tokens=hit, first=first)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        self.releases.append(request.request_id)
        return pb.ReleaseResponse(released=True)

    async def GetTransferMetadata(
        self, request: pb.TransferMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.TransferMetadata:
        return pb.TransferMetadata(
            agent_metadata=b"fake", worker_id=self.worker_id, epoch="fake-epoch", compat_hash="fake"
        )

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return pb.HealthResponse(
            role="prefill", model="fake", epoch="fake-epoch", ready=self.ready, worker_id=self.worker_id
        )

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return _stats("prefill", self.worker_id, self.metrics_port, 0, self.max_generate)


class FakeDecodeWorker(pb_grpc.DecodeServiceServicer):
    """FAKE decode worker (see module doc). `token_text` renders one token id as text."""

    def __init__(
        self,
        worker_id: str = "fake-decode-0",
        token_delay_s: float = 0.0,
        metrics_port: int = 0,
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.address = ""
        self.token_delay_s = token_delay_s
        self.metrics_port = metrics_port
        self.token_text = token_text or (lambda t: f" {t}")
        self.failure: Failure | None = None
        self.freeze_after_tokens: int | None = None
        self.freeze_health = False
        self.resumes = True
        """False: a worker that predates GenerateRequest.resume (it ignores the field)."""
        self.health_delay_s = 0.0
        self.ready = True
        """Health's `ready` (False: a worker whose engine is wedged though it answers)."""
        self.generates: list[pb.GenerateRequest] = []
        self.tokens: list[str | None] = []  # the x-hybridpd-token metadata of every Generate call
        self.aborts: list[str] = []
        self.cancelled: list[str] = []
        self.running: set[str] = set()
        self._abort_requested: set[str] = set()
        self.cache_snapshot: dict[int, set[bytes]] | None = None
        self.max_generate = 0
        """Whole requests it reports taking at once (Stats' max_generate; 0 reports no capacity)."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> Any:
        rid = request.request_id
        self.generates.append(request)
        self.tokens.append(_token(context))
        self.running.add(rid)
        try:
            async for chunk in self._generate(request, context):
                yield chunk
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.running.discard(rid)

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> Any:
        external = request.params.num_computed_tokens if request.HasField("params") else 0
        start = 1 if request.HasField("first_token") else 0  # the proxy streamed P's first token
        resumed = request.HasField("resume") and self.resumes
        start += len(request.resume.token_ids) if resumed else 0  # ... and, resuming, the lost worker's output
        for i, chunk in enumerate(_fake_chunks(request.prompt_token_ids, request.sampling_params, self.token_text)):
            if i < start:
                continue
            if self.failure is not None and i >= self.failure.after_tokens:
                await context.abort(self.failure.code, self.failure.message)
            if self.freeze_after_tokens is not None and i >= self.freeze_after_tokens:
                if self.freeze_health:
                    self.health_delay_s = 3600.0
                await asyncio.Event().wait()  # frozen: nothing more, the stream open (until cancelled)
            if request.request_id in self._abort_requested:
                yield pb.GenerateChunk(finish_reason="abort")
                return
            if self.token_delay_s and chunk.token_ids:
                await asyncio.sleep(self.token_delay_s)
            chunk.num_cached_tokens = chunk.num_external_cached_tokens = external
            if resumed:
                chunk.num_resumed_tokens = start
            yield chunk

    async def CacheEvents(self, request: pb.CacheEventsRequest, context: grpc.aio.ServicerContext) -> Any:
        """With `cache_snapshot` set ({group: hashes}, block size 16, group 0 attention, 1 recurrent): that snapshot,
        then nothing (the stream stays open). Unset: UNIMPLEMENTED, as a worker without cache events."""
        if self.cache_snapshot is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no cache events")
        assert self.cache_snapshot is not None  # (abort raises)
        shape = pb.CacheShape(block_size=16, attention_groups=[0], recurrent_groups=[1], checkpoint_align=16)
        yield pb.CacheEventBatch(
            epoch="fake-epoch",
            first_seq=0,
            snapshot=True,
            shape=shape,
            groups=[pb.GroupHashes(group=g, block_hashes=sorted(h)) for g, h in self.cache_snapshot.items()],
        )
        await asyncio.Event().wait()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.aborts.append(request.request_id)
        self._abort_requested.add(request.request_id)
        return pb.AbortResponse(aborted=request.request_id in self.running)

    async def GetTransferMetadata(
        self, request: pb.TransferMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.TransferMetadata:
        return pb.TransferMetadata(
            agent_metadata=b"fake", worker_id=self.worker_id, epoch="fake-epoch", compat_hash="fake"
        )

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return pb.HealthResponse(
            role="decode", model="fake", epoch="fake-epoch", ready=self.ready, worker_id=self.worker_id
        )

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return _stats("decode", self.worker_id, self.metrics_port, len(self.running), self.max_generate)


def _fake_outputs(prompt: Any, sp: pb.SamplingParams) -> list[int]:
    rev = list(reversed(prompt))
    if sp.ignore_eos:
        return [rev[i % len(rev)] for i in range(sp.max_tokens)]
    return rev[: sp.max_tokens]


def _fake_chunks(prompt: Any, sp: pb.SamplingParams, token_text: Callable[[int], str]) -> Any:
    """The fake rule's chunks, one token each; the last carries the finish reason."""
    text_so_far = ""
    outputs = _fake_outputs(prompt, sp)

    def chunk(step: int, tokens: list[int], text: str, finish: str) -> pb.GenerateChunk:
        lp = -0.1 * (step % 5 + 1)
        # alternatives: the chosen token first, then ids +1, +2, ... each 1.0 less likely
        top = [
            pb.TopLogprobs(
                token_ids=[(t + k) % 256 for k in range(sp.top_logprobs)],
                logprobs=[lp - k for k in range(sp.top_logprobs)],
            )
            for t in tokens
        ]
        c = pb.GenerateChunk(
            token_ids=tokens,
            text=text,
            finish_reason=finish,
            logprobs=[lp] if sp.logprobs and tokens else [],
            top_logprobs=top if sp.logprobs and sp.top_logprobs else [],
            num_prompt_tokens=len(prompt),
        )
        if step == 0 and sp.HasField("prompt_logprobs"):  # the first output token's chunk scores the prompt
            k = sp.prompt_logprobs
            c.prompt_logprobs.extend(
                pb.PromptLogprob(
                    token_id=t,
                    logprob=-0.01 * i,
                    rank=i,
                    top=pb.TopLogprobs(
                        token_ids=[(t + j) % 256 for j in range(1, k + 1)], logprobs=[-0.5 - j for j in range(k)]
                    ),
                )
                for i, t in enumerate(prompt)
                if i > 0
            )
        return c

    for i, tok in enumerate(outputs):
        if tok in sp.stop_token_ids:
            end = chunk(i, [], "", "stop")
            end.stop_token_id = tok
            yield end
            return
        text = token_text(tok)
        hit = next((s for s in sp.stop if s in text_so_far + text), None)
        if hit is not None:
            cut = (text_so_far + text).index(hit)
            end = chunk(i, [tok], text[: max(0, cut - len(text_so_far))], "stop")
            end.stop_string = hit
            yield end
            return
        text_so_far += text
        last = i == len(outputs) - 1
        finish = ("length" if len(outputs) == sp.max_tokens else "stop") if last else ""
        yield chunk(i, [tok], text, finish)


async def serve_fake(worker: FakePrefillWorker | FakeDecodeWorker) -> grpc.aio.Server:
    """Start a grpc.aio server for `worker` on a free localhost port; sets `worker.address`."""
    server = grpc.aio.server()
    if isinstance(worker, FakePrefillWorker):
        pb_grpc.add_PrefillServiceServicer_to_server(worker, server)
        pb_grpc.add_DecodeServiceServicer_to_server(worker.whole, server)  # the mixed role
    else:
        pb_grpc.add_DecodeServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker.address = f"127.0.0.1:{port}"
    return server


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def write_fake_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> Path:
    """Write a FAKE byte-level `tokenizer.json` (token id == byte value; 256 = `<|endoftext|>`) and, with
    `chat_template`, a `tokenizer_config.json` holding it. Returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(root / "tokenizer.json"))
    if chat_template is not None:
        cfg = {"chat_template": chat_template, "bos_token": "", "eos_token": "<|endoftext|>"}
        (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root
