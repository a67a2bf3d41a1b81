"""The FastAPI app: OpenAI endpoints, auth, body limits, SSE streaming, health, cluster view, metrics.

    POST /v1/completions, POST /v1/chat/completions   (stream or not; `stream_options.include_usage`)
    GET  /v1/models, GET /v1/cluster                   (auth applies to every /v1/* route)
    POST /tokenize, POST /detokenize                   (vLLM's shapes; auth applies)
    GET  /health, GET /metrics, GET /version            (no auth: probes, Prometheus, the package version)

Per request: read body (413 past max_body_bytes) -> `openai_schema` -> `request_limits` -> tokenize (worker
thread) -> `admission` (a Ticket, or 400/429/503) -> one `Generation` per choice (`choices.Choices`) ->
`responses`; the Ticket is released when the request ends, however it ends. A client that disconnects (while
it waits for admission or the workers, or mid-stream) gets its request aborted on the workers. `/health`
answers from the `HealthMonitor`'s cache (worker details only with the API key). Every 5xx is counted in
`hybridpd_requests_total{status="error"}` and sent with `Connection: close`; a stream that fails after its 200
ends with an error event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from hybridpd.proxy import cluster_view, workers
from hybridpd.proxy.admission import Admission, Demand, Tenant, Ticket
from hybridpd.proxy.api_keys import ApiKey, find_key
from hybridpd.proxy.body_parser import BodyParser
from hybridpd.proxy.choices import Choices, gather_or_cancel
from hybridpd.proxy.cluster_routes import add_cluster_routes
from hybridpd.proxy.config import ProxyConfig
from hybridpd.proxy.deltas import Delta, PreparedRequest
from hybridpd.proxy.errors import ApiError, bad_request
from hybridpd.proxy.generation import Cluster, Generation
from hybridpd.proxy.membership import Membership
from hybridpd.proxy.metrics import ProxyMetrics
from hybridpd.proxy.openai_schema import (
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    parse_chat,
    parse_json_object,
    resolve_max_tokens,
)
from hybridpd.proxy.placement import Placer
from hybridpd.proxy.request_limits import check_request_limits
from hybridpd.proxy.responses import DONE, ChatFormatter, CompletionFormatter, sse, usage_dict
from hybridpd.proxy.routing import Router
from hybridpd.proxy.sampling_defaults import apply_sampling_defaults, load_sampling_defaults
from hybridpd.proxy.tokenization import PromptTokenizer
from hybridpd.proxy.workers import Role, WorkerClients
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)


def package_version() -> str:
    """The installed hybridpd distribution's version (`GET /version`)."""
    from importlib import metadata

    try:
        return metadata.version("hybridpd")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def _check_model_name(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served}'.", param="model",
                       code="model_not_found")
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


def _check_prompt_scores_fit(num_tokens: int, k: int | None) -> None:
    """Prompt logprobs (asked for directly, or by echo with logprobs) travel in one worker message: a prompt whose
    scores could exceed the channel's limit is a 400 before any worker computes it (else every prefill worker would
    score it in vain and the client get a 503)."""
    if k is None:
        return
    need, limit = workers.prompt_scores_bytes(num_tokens, k), workers.max_message_bytes()
    if need > limit:
        raise bad_request(f"prompt_logprobs={k} over a {num_tokens}-token prompt can take up to {need / 2**20:.0f} MiB "
                          f"in one worker message, above its {limit / 2**20:.0f} MiB limit: ask for fewer "
                          f"alternatives or send a shorter prompt", param="prompt_logprobs")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    buf = bytearray()
    try:
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    except ClientDisconnect:  # gone, or dropped by the body deadline (proxy.http_guard): nobody reads the answer
        raise ApiError(408, "the client closed the connection before sending the whole body",
                       code="request_timeout") from None
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


class _Held:
    """A request's choices and its admission ticket: prompts stop counting as queued once every choice has output;
    `close()` (idempotent) ends the choices and gives the budget back, crediting unused max_tokens to the key."""

    def __init__(self, choices: Choices, ticket: Ticket) -> None:
        self.choices = choices
        self.ticket = ticket

    async def start(self) -> list[Delta]:
        first = await self.choices.start()
        self.ticket.prompts_done()
        return first

    async def collect(self) -> list[list[Delta]]:
        """Every choice whole (non-streamed: a decode worker lost mid-generation is replaced, collect_after)."""
        firsts = await self.start()
        return await gather_or_cancel([g.collect_after(f) for g, f in zip(self.choices.gens, firsts, strict=True)])

    def close(self) -> None:
        self.choices.close()
        gens = self.choices.gens
        self.ticket.release(sum((g.req.sampling.max_tokens or 0) - g.usage.completion_tokens for g in gens))


LARGE_RESPONSE_ENTRIES = 20_000
"""Logprob entries (tokens and their alternatives, prompt logprobs included) past which a non-streamed answer, or a
streamed choice's first event, is rendered on a helper thread (`_render_json`, `_render_sse`), not on the event
loop."""
_INCREMENTAL_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""JSONResponse's format, encoded piece by piece (`iterencode`: Python code that lets the event loop's thread run
between pieces; the one-shot C encoder would hold the GIL for the whole body)."""
_SSE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""`responses.sse`'s format, encoded piece by piece."""


def _logprob_entries(choices: list[list[Delta]]) -> int:
    """A cheap measure of how big a non-streamed answer's body will be."""
    n = 0
    for deltas in choices:
        for d in deltas:
            n += len(d.token_ids) + sum(len(top) for top in d.top_logprobs)
            n += sum(1 + len(e.top) for e in d.prompt_logprobs or ())
    return n


def _render_json(full: Callable[..., dict[str, Any]], *args: Any) -> bytes:
    """`full(*args)` as JSONResponse renders it, built and encoded on a helper thread: a body of many megabytes
    (prompt logprobs or echo with logprobs over a long prompt, times n) took the event loop seconds, during which
    every other client and /health waited."""
    return "".join(_INCREMENTAL_JSON.iterencode(full(*args))).encode("utf-8")


def _render_sse(chunk: Callable[..., dict[str, Any]], *args: Any) -> str:
    """`sse(chunk(*args))`, built and encoded on a helper thread: the first event of a streamed echo with logprobs
    carries the whole prompt's tokens and alternatives, as large as a non-streamed answer."""
    return f"data: {''.join(_SSE_JSON.iterencode(chunk(*args)))}\n\n"


def _token_id_text(token_id: int) -> str:
    """A logprob token as vLLM writes it with `return_tokens_as_token_ids` (and without a tokenizer)."""
    return f"token_id:{token_id}"


class _Proxy:
    """Request handling shared by the endpoints; one per app."""

    def __init__(self, config: ProxyConfig, tokenizer: PromptTokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.sampling_defaults = load_sampling_defaults(config.generation_config,
                                                        config.model_path or config.tokenizer_path)
        dynamic = config.dynamic_membership
        prefill = None if config.colocated else Router(config.prefill_addrs, config.routing, dynamic)
        decode = Router(config.decode_addrs, config.routing, dynamic)
        routers: dict[Role, Router] = {"decode": decode} if prefill is None else {"prefill": prefill,
                                                                                  "decode": decode}
        clients = WorkerClients(config.control_timeout_s, config.cluster_token)
        self.membership = membership = Membership(clients, routers, config.cache_event_drop_fraction)
        cost_aware = config.routing in ("cache_aware", "adaptive")
        placer = Placer(membership, prefill, decode, config.routing_weights) if cost_aware else None
        metrics = ProxyMetrics({str(role): router for role, router in routers.items()})
        self.cluster = Cluster(config=config, clients=clients, prefill=prefill, decode=decode, metrics=metrics,
                               membership=membership, placer=placer)
        self.monitor = cluster_view.HealthMonitor(self.cluster, config.health_interval_s)
        # tokenization and chat templating run here, never on the event loop
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hybridpd-tokenize")
        self.render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridpd-render")  # huge answers
        self.bodies = BodyParser(config.model_name, config.request_limits)  # big bodies in a helper process
        self.admission = Admission(config, self.cluster.metrics.registry)
        self.keys = config.api_keys + ((ApiKey("api-key", config.api_key),) if config.api_key is not None else ())

    # -- input -------------------------------------------------------------------------------------------------

    def presented_key(self, request: Request) -> ApiKey | None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return find_key(self.keys, token.strip()) if scheme.lower() == "bearer" else None

    def authorized(self, request: Request) -> bool:
        return not self.keys or self.presented_key(request) is not None

    def check_auth(self, request: Request) -> None:
        if not self.authorized(request):
            raise ApiError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def tenant(self, request: Request) -> Tenant:
        """Who shares the budget: the API key's name, or the client's address when no keys are configured."""
        key = self.presented_key(request) if self.keys else None
        if key is not None:
            return self.admission.tenant(f"key:{key.name}", key)
        return self.admission.tenant(f"client:{request.client.host if request.client else '?'}", None)

    def _require_tokenizer(self, what: str) -> PromptTokenizer:
        if self.tokenizer is None:
            raise bad_request(f"{what} need a tokenizer and this server has none; send token ids", param="prompt")
        return self.tokenizer

    def _check_vocab(self, ids: tuple[int, ...], param: str) -> None:
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else None
        if vocab is not None and ids and max(ids) >= vocab:
            raise bad_request(f"'{param}' holds token id {max(ids)}, outside the vocabulary (size {vocab})",
                              param=param)

    def _encode_text(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        tok = self._require_tokenizer("text prompts")
        if len(text) > tok.max_chars(self.config.max_model_len):
            raise bad_request(f"the prompt has {len(text)} characters: more tokens than this model's maximum context "
                              f"length of {self.config.max_model_len}", param="prompt",
                              code="context_length_exceeded")
        return tuple(tok.encode(text) if add_special_tokens else tok.encode_plain(text))

    def _prompt_ids(self, req: CompletionRequest | ChatRequest) -> list[tuple[tuple[int, ...], str]]:
        """(token ids, echo text) per prompt. Worker thread."""
        if isinstance(req, ChatRequest):
            tok = self._require_tokenizer("chat messages")
            text = tok.render_chat(req.messages, list(req.tools.tools) if req.tools is not None else None, req.render)
            if len(text) > tok.max_chars(self.config.max_model_len):
                raise bad_request("the messages hold more tokens than this model's maximum context length of "
                                  f"{self.config.max_model_len}", param="messages", code="context_length_exceeded")
            # chat: the rendered prompt in the echo slot
            return [(tuple(tok.encode_rendered(text, req.add_special_tokens)), text)]
        out = []
        for p in req.prompts:
            if isinstance(p, str):
                out.append((self._encode_text(p, req.add_special_tokens), p if req.echo else ""))
            else:
                self._check_vocab(p, "prompt")
                echo = self.tokenizer.decode(p) if req.echo and self.tokenizer is not None else ""
                out.append((p, echo))
        return out

    def prepare(self, req: CompletionRequest | ChatRequest, base_id: str) -> tuple[list[PreparedRequest], list[str]]:
        """Tokenize and check every prompt; one PreparedRequest (and echo text) per choice. Worker thread."""
        self._check_vocab(tuple(t for t, _ in req.sampling.logit_bias), "logit_bias")
        self._check_vocab(req.sampling.allowed_token_ids or (), "allowed_token_ids")
        chat_or_null = isinstance(req, ChatRequest) or req.max_tokens_null  # no limit but the context (vLLM)
        default: int | None = self.config.default_completion_max_tokens
        if chat_or_null:  # the generation config's max_new_tokens, if any
            default = int(self.sampling_defaults["max_tokens"]) if "max_tokens" in self.sampling_defaults else None
        single = len(getattr(req, "prompts", (None,))) * req.n == 1
        prepared: list[PreparedRequest] = []
        echoes: list[str] = []
        base = apply_sampling_defaults(req.sampling, self.sampling_defaults)
        for ids, echo in self._prompt_ids(req):
            if isinstance(req, ChatRequest):
                if req.tools is not None and req.tools.constrained:  # required / named: the calls' grammar
                    base = dataclasses.replace(base, structured=req.tools.structured_request(echo))
                echo = ""
            max_tokens = resolve_max_tokens(req.sampling.max_tokens, default, len(ids), self.config.max_model_len,
                                            req.sampling.min_tokens)
            _check_prompt_scores_fit(len(ids), req.sampling.prompt_logprobs)
            for j in range(req.n):
                seed = req.sampling.seed
                if seed is not None:  # sample j gets seed + j (seed - j at the top of the int64 range)
                    seed = seed + j if seed + j < 2**63 else seed - j
                sampling = dataclasses.replace(base, max_tokens=max_tokens, seed=seed)
                rid = base_id if single else f"{base_id}-{len(prepared)}"
                prepared.append(PreparedRequest(rid, ids, sampling, req.cache_salt, counts_prompt=j == 0))
                echoes.append(echo)
        return prepared, echoes

    async def parse(self, request: Request, chat: bool) -> CompletionRequest | ChatRequest:
        try:
            self.check_auth(request)
            req = await self.bodies.parse(await _read_body(request, self.config.max_body_bytes), chat)
            check_request_limits(req, self.config.request_limits)
        except ApiError as err:
            if err.code == "limit_exceeded":
                self.admission.count_rejection("request_limits")
            self._count(err)
            raise
        try:  # n x prompts that can never fit: refused before tokenization
            key = self.presented_key(request) if self.keys else None
            self.admission.check_seqs(key, len(getattr(req, "prompts", (None,))) * req.n)
        except ApiError as err:
            self._count(err)
            raise
        return req

    async def admit(self, request: Request, prepared: list[PreparedRequest]) -> Ticket:
        """Hold the budget for `prepared` (waiting briefly if need be); 400 / 429 / 503 ApiError otherwise."""
        demand = Demand(seqs=len(prepared),
                        prompt_tokens=sum(len(p.prompt_token_ids) for p in prepared if p.counts_prompt),
                        reserved_tokens=sum(len(p.prompt_token_ids) + (p.sampling.max_tokens or 0) for p in prepared))
        try:
            return await _until_disconnected(request, self.admission.admit(self.tenant(request), demand))
        except ApiError as err:
            self._count(err)
            raise

    def _count(self, err: ApiError) -> None:
        if not err.counted:
            err.counted = True
            self.cluster.metrics.count("invalid" if err.status < 500 else "error")

    # -- /tokenize, /detokenize (vLLM's shapes; worker thread) -------------------------------------------------
    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """{"prompt": text, "add_special_tokens"} or {"messages", "tools", "add_generation_prompt"} ->
        {"count", "max_model_len", "tokens", "token_strs"}."""
        _check_model_name(body, self.config.model_name)
        tok = self._require_tokenizer("/tokenize")
        strs = body.get("return_token_strs")
        if "messages" in body:
            fields = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
            req = parse_chat({k: body[k] for k in fields if k in body}, self.config.model_name)
            tools = list(req.tools.tools) if req.tools else None
            text = tok.render_chat(req.messages, tools, req.render)
            if len(text) > tok.max_chars(self.config.max_model_len) * 4:
                raise bad_request("'messages' are too long to tokenize", param="messages")
            ids = tok.encode_rendered(text)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("'prompt' (a string) or 'messages' is required", param="prompt")
            if len(prompt) > tok.max_chars(self.config.max_model_len) * 4:
                raise bad_request("'prompt' is too long to tokenize", param="prompt")
            special = body.get("add_special_tokens", True)
            ids = tok.encode(prompt) if special is not False else tok.encode_plain(prompt)
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": list(ids),
                "token_strs": [tok.token_text(t) for t in ids] if strs is True else None}

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """{"tokens": [ids]} -> {"prompt": text}."""
        _check_model_name(body, self.config.model_name)
        tok = self._require_tokenizer("/detokenize")
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_request("'tokens' must be a list of token ids", param="tokens")
        if ids and (min(ids) < 0 or max(ids) >= tok.vocab_size):
            raise bad_request(f"'tokens' holds an id outside the vocabulary (size {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(ids)}

    # -- output ------------------------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else _token_id_text(token_id)

    def visible_text(self, token_id: int) -> str:
        return self.tokenizer.visible_text(token_id) if self.tokenizer is not None else ""

    async def handle(self, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        req = await self.parse(request, chat)
        base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            prepared, echoes = await asyncio.get_running_loop().run_in_executor(self.pool, self.prepare, req,
                                                                                base_id)
        except ApiError as err:
            self._count(err)
            raise
        logprobs = req.sampling.logprobs
        token_text = _token_id_text if req.output.tokens_as_ids else self.token_text
        prompt_ids = [p.prompt_token_ids for p in prepared] if req.output.return_token_ids else None
        skip = req.sampling.skip_special_tokens  # what a token adds to the text: special tokens too, unless skipped
        visible = self.visible_text if skip else self.token_text
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=skip) if self.tokenizer else None
        fmt: CompletionFormatter | ChatFormatter
        want_prompt = req.sampling.prompt_logprobs is not None
        if isinstance(req, ChatRequest):
            fmt = ChatFormatter(base_id, int(time.time()), req.model, token_text, logprobs, visible, prompt_ids,
                                tools=req.tools, echo=req.echo_text, prompt_logprobs=want_prompt,
                                decoded_token=self.token_text)
        else:
            fmt = CompletionFormatter(base_id, int(time.time()), req.model, token_text, logprobs, visible, prompt_ids,
                                      echo=echoes if any(echoes) else (), decode=decode, prompt_logprobs=want_prompt,
                                      echo_ids=[p.prompt_token_ids for p in prepared] if req.echo else (),
                                      top_k=req.sampling.top_logprobs, echo_only=req.echo_only,
                                      decoded_token=self.token_text)
        try:
            ticket = await self.admit(request, prepared)
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = Choices([Generation(self.cluster, p, arrival) for p in prepared])
        held = _Held(choices, ticket)
        if req.stream.stream:
            return await self._stream(request, held, fmt, req.stream)
        try:
            deltas = await _until_disconnected(request, held.collect())
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            held.close()
        if _logprob_entries(deltas) <= LARGE_RESPONSE_ENTRIES:
            return JSONResponse(fmt.full(deltas, choices.usages))
        body = await asyncio.get_running_loop().run_in_executor(self.render_pool, _render_json, fmt.full,
                                                                deltas, choices.usages)
        return Response(body, media_type="application/json")

    async def _stream(self, request: Request, held: _Held, fmt: CompletionFormatter | ChatFormatter,
                      opts: StreamOptions) -> Response:
        """Wait for every choice's first output before answering, so early failures get a real status code."""
        try:
            first = await _until_disconnected(request, held.start())
        except _ClientGone:
            held.close()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            held.close()
            raise
        return _SSEResponse(self._events(held.choices, fmt, first, opts), on_close=held.close)

    async def _first_event(self, fmt: CompletionFormatter | ChatFormatter, index: int, d: Delta,
                           usage: dict[str, Any] | None, include: bool) -> str:
        """A choice's first event: on the render thread when it carries many logprob entries (echo with logprobs
        over a long prompt), as a non-streamed answer past LARGE_RESPONSE_ENTRIES is."""
        if _logprob_entries([[d]]) <= LARGE_RESPONSE_ENTRIES:
            return sse(fmt.chunk(index, d, usage, include))
        return await asyncio.get_running_loop().run_in_executor(self.render_pool, _render_sse, fmt.chunk, index, d,
                                                                usage, include)

    async def _events(self, choices: Choices, fmt: CompletionFormatter | ChatFormatter, first: list[Delta],
                      opts: StreamOptions) -> AsyncIterator[str]:
        """SSE events; any failure after the 200 ends the stream with an OpenAI-style error event, then [DONE]."""
        include = opts.include_usage or opts.continuous_usage_stats

        def usage() -> dict[str, Any] | None:
            return usage_dict(choices.usages) if opts.continuous_usage_stats else None

        try:
            if isinstance(fmt, ChatFormatter):
                for i in range(len(first)):
                    yield sse(fmt.role_chunk(i, include))
                for i in range(len(first)):
                    echoed = fmt.echo_chunk(i, include)
                    if echoed is not None:
                        yield sse(echoed)
            for i, d in enumerate(first):
                yield await self._first_event(fmt, i, d, usage(), include)
            async for i, d in choices.rest():
                yield sse(fmt.chunk(i, d, usage(), include))
            if opts.include_usage:
                yield sse(fmt.usage_chunk(choices.usages))
        except ApiError as err:  # a worker failed or the deadline passed mid-stream: the status line is long gone
            self._count(err)
            yield sse(err.body())
        except Exception as exc:  # noqa: BLE001 - never a torn stream without an error event
            log.exception("stream failed")
            choices.record_error()
            yield sse(ApiError(500, f"internal proxy error: {type(exc).__name__}", code="internal_error").body())
        finally:
            choices.close()
        yield DONE


def create_app(config: ProxyConfig, tokenizer: PromptTokenizer | None = None) -> FastAPI:
    """Build the proxy app. `tokenizer` overrides loading one from `config.tokenizer_path`."""
    if tokenizer is None and config.tokenizer_path is not None:
        tokenizer = PromptTokenizer.from_dir(config.tokenizer_path, chat_template=config.chat_template)
    proxy = _Proxy(config, tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        membership = proxy.membership
        await membership.start()
        await proxy.monitor.start(first_wait_s=min(2.0, config.control_timeout_s))
        try:
            yield
        finally:
            await proxy.monitor.stop()
            await membership.stop()
            await proxy.cluster.clients.close()
            proxy.pool.shutdown(wait=False, cancel_futures=True)
            proxy.render_pool.shutdown(wait=False, cancel_futures=True)
            proxy.bodies.close()

    app = FastAPI(title="hybridpd proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.state.cluster = proxy.cluster

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        if exc.status >= 500:
            proxy._count(exc)  # every 5xx is counted once in hybridpd_requests_total{status="error"}
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
        err = ApiError(500, f"internal proxy error: {type(exc).__name__}", code="internal_error")
        proxy._count(err)
        return err.response()

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

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        proxy.check_auth(request)
        body = parse_json_object(await _read_body(request, config.max_body_bytes))
        result = await asyncio.get_running_loop().run_in_executor(proxy.pool, proxy.tokenize, body)
        return JSONResponse(result)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        proxy.check_auth(request)
        body = parse_json_object(await _read_body(request, config.max_body_bytes))
        return JSONResponse(await asyncio.get_running_loop().run_in_executor(proxy.pool, proxy.detokenize, body))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/v1/cluster")
    async def cluster(request: Request) -> dict[str, Any]:
        proxy.check_auth(request)
        return await cluster_view.cluster_info(proxy.cluster)

    add_cluster_routes(app, proxy.membership, config.cluster_token, proxy.check_auth, bool(proxy.keys))

    @app.get("/health")
    async def health(request: Request) -> Response:
        ok, body = proxy.monitor.snapshot(detailed=proxy.authorized(request))
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.cluster.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
