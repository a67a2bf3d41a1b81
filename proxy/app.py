"""The FastAPI app: OpenAI endpoints, auth, body limits, SSE streaming, health, cluster view, metrics.

    POST /v1/completions, POST /v1/chat/completions   (stream or not; `stream_options.include_usage`)
    GET  /v1/models, GET /v1/cluster                   (auth applies to every /v1/* route)
    GET  /health, GET /metrics                          (no auth: probes and Prometheus)

Per request: read body (413 past max_body_bytes) -> `openai_schema` -> tokenize -> `Generation` -> `responses`.
A client that disconnects (while we wait on the workers, or mid-stream) gets its request aborted on the workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from proxy import cluster_view
from proxy.config import ProxyConfig
from proxy.errors import ApiError, bad_request
from proxy.generation import Cluster, Delta, Generation, PreparedRequest
from proxy.metrics import ProxyMetrics
from proxy.openai_schema import (
    ChatRequest,
    CompletionRequest,
    parse_chat,
    parse_completion,
    parse_json_object,
    resolve_max_tokens,
)
from proxy.responses import DONE, ChatFormatter, CompletionFormatter, sse
from proxy.routing import Router
from proxy.tokenization import PromptTokenizer
from proxy.workers import WorkerClients

log = logging.getLogger(__name__)
T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; nobody reads it


class _ClientGone(Exception):
    pass


class _SSEResponse(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends (finished, failed, disconnected)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    return bytes(buf)


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising _ClientGone) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        raise _ClientGone()
    finally:
        for task in (work_task, watch_task):
            task.cancel()


class _Proxy:
    """Request handling shared by the endpoints; one per app."""

    def __init__(self, config: ProxyConfig, tokenizer: PromptTokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        prefill = None if config.colocated else Router(config.prefill_addrs, config.routing)
        decode = Router(config.decode_addrs, config.routing)
        routers = {"decode": decode} if prefill is None else {"prefill": prefill, "decode": decode}
        self.cluster = Cluster(config=config, clients=WorkerClients(config.control_timeout_s), prefill=prefill,
                               decode=decode, metrics=ProxyMetrics(routers))

    # -- input -------------------------------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def _require_tokenizer(self, what: str) -> PromptTokenizer:
        if self.tokenizer is None:
            raise bad_request(f"{what} need a tokenizer and this server has none; send token ids", param="prompt")
        return self.tokenizer

    def _check_vocab(self, ids: tuple[int, ...]) -> None:
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else None
        if vocab is not None and ids and max(ids) >= vocab:
            raise bad_request(f"'prompt' holds token id {max(ids)}, outside the vocabulary (size {vocab})",
                              param="prompt")

    def prepare(self, req: CompletionRequest | ChatRequest, prefix: str) -> PreparedRequest:
        if isinstance(req, ChatRequest):
            ids = tuple(self._require_tokenizer("chat messages").encode_chat(req.messages))
            default: int | None = None
        elif isinstance(req.prompt, str):
            ids = tuple(self._require_tokenizer("text prompts").encode(req.prompt))
            default = self.config.default_completion_max_tokens
        else:
            ids = req.prompt
            self._check_vocab(ids)
            default = self.config.default_completion_max_tokens
        max_tokens = resolve_max_tokens(req.sampling.max_tokens, default, len(ids), self.config.max_model_len)
        sampling = dataclasses.replace(req.sampling, max_tokens=max_tokens)
        return PreparedRequest(f"{prefix}-{uuid.uuid4().hex}", ids, sampling, req.cache_salt)

    async def parse(self, request: Request, chat: bool) -> CompletionRequest | ChatRequest:
        try:
            self.check_auth(request)
            body = parse_json_object(await _read_body(request, self.config.max_body_bytes))
            return parse_chat(body, self.config.model_name) if chat else parse_completion(body, self.config.model_name)
        except ApiError:
            self.cluster.metrics.count("invalid")
            raise

    # -- output ------------------------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else f"token_id:{token_id}"

    async def handle(self, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        req = await self.parse(request, chat)
        try:
            prepared = self.prepare(req, "chatcmpl" if chat else "cmpl")
        except ApiError:
            self.cluster.metrics.count("invalid")
            raise
        fmt_cls = ChatFormatter if chat else CompletionFormatter
        fmt = fmt_cls(prepared.request_id, int(time.time()), req.model, self.token_text, req.sampling.logprobs)
        gen = Generation(self.cluster, prepared, arrival)
        if req.stream.stream:
            return await self._stream(request, gen, fmt, req.stream.include_usage)
        try:
            deltas = await _until_disconnected(request, gen.collect())
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            gen.close()
        return JSONResponse(fmt.full(deltas, gen.usage))

    async def _stream(self, request: Request, gen: Generation, fmt: CompletionFormatter | ChatFormatter,
                      include_usage: bool) -> Response:
        """Wait for the first output before answering, so early failures get a real status code."""
        try:
            first = await _until_disconnected(request, gen.start())
        except _ClientGone:
            gen.close()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            gen.close()
            raise
        return _SSEResponse(self._events(gen, fmt, first, include_usage), on_close=gen.close)

    async def _events(self, gen: Generation, fmt: CompletionFormatter | ChatFormatter, first: Delta,
                      include_usage: bool) -> AsyncIterator[str]:
        try:
            if isinstance(fmt, ChatFormatter):
                yield sse(fmt.role_chunk(include_usage))
            yield sse(fmt.chunk(first, include_usage))
            async for delta in gen.rest():
                yield sse(fmt.chunk(delta, include_usage))
            if include_usage:
                yield sse(fmt.usage_chunk(gen.usage))
        except ApiError as err:  # a worker failed mid-stream: the status line is long gone
            yield sse(err.body())
        finally:
            gen.close()
        yield DONE


def create_app(config: ProxyConfig, tokenizer: PromptTokenizer | None = None) -> FastAPI:
    """Build the proxy app. `tokenizer` overrides loading one from `config.tokenizer_path`."""
    if tokenizer is None and config.tokenizer_path is not None:
        tokenizer = PromptTokenizer.from_dir(config.tokenizer_path)
    proxy = _Proxy(config, tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.cluster.clients.close()

    app = FastAPI(title="hybridpd proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.state.cluster = proxy.cluster

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:  # unknown route, wrong method
        code = "not_found" if exc.status_code == 404 else None
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return ApiError(400, f"invalid request: {exc.errors()}").response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error in the proxy")
        return ApiError(500, f"internal proxy error: {type(exc).__name__}", code="internal_error").response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        proxy.check_auth(request)
        card: dict[str, Any] = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "hybridpd",
                                "max_model_len": config.max_model_len}
        if proxy.tokenizer is not None:
            card["vocab_size"] = proxy.tokenizer.vocab_size
        return {"object": "list", "data": [card]}

    @app.get("/v1/cluster")
    async def cluster(request: Request) -> dict[str, Any]:
        proxy.check_auth(request)
        return await cluster_view.cluster_info(proxy.cluster)

    @app.get("/health")
    async def health() -> Response:
        ok, body = await cluster_view.health(proxy.cluster)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.cluster.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
