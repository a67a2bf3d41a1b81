"""`LiveStack`: FAKE workers (`tests/support/fake_workers.py`) plus the real proxy (uvicorn on a free port), on a
background event loop, for synchronous tests and benchmark dry runs. Test support only; nothing here serves a model."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import httpx
import uvicorn
from hybridpd.proxy.config import ProxyConfig
from hybridpd.proxy.http_guard import uvicorn_config
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.support.fake_workers import FakeDecodeWorker, FakePrefillWorker, serve_fake

T = TypeVar("T")


class LiveStack:
    """Fake workers + the real proxy on one background event loop (a thread), for synchronous tests.

        with LiveStack(n_prefill=1, n_decode=2, api_key="k") as stack:
            stack.http.post("/v1/completions", json=...)   # a reused httpx.Client on stack.url
            stack.decode[0].aborts

    `config_overrides` go into `ProxyConfig` (addresses are filled in). `prefill_addrs_extra` adds addresses
    nobody listens on (to test unreachable workers); `decode_addrs_extra` likewise (or workers served elsewhere)."""

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, tokenizer: PromptTokenizer | None = None,
                 token_delay_s: float = 0.0, **config_overrides: Any) -> None:
        self.tokenizer = tokenizer
        text = tokenizer.visible_text if tokenizer is not None else None  # real D skips special tokens too
        self.prefill = [FakePrefillWorker(f"fake-prefill-{i}", metrics_port=9100 + i, token_text=text)
                        for i in range(n_prefill)]
        self.decode = [FakeDecodeWorker(f"fake-decode-{i}", token_delay_s, metrics_port=9200 + i, token_text=text)
                       for i in range(n_decode)]
        self._overrides = config_overrides
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="live-stack", daemon=True)
        self._servers: list[grpc.aio.Server] = []
        self._uvicorn: uvicorn.Server | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self.config: ProxyConfig | None = None
        self.app: Any = None
        self.url = ""
        self.http = httpx.Client()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the stack's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        from hybridpd.proxy.app import create_app

        workers: list[FakePrefillWorker | FakeDecodeWorker] = [*self.prefill, *self.decode]
        for w in workers:
            self._servers.append(await serve_fake(w))
        overrides = dict(self._overrides)
        extra = tuple(overrides.pop("prefill_addrs_extra", ()))
        extra_decode = tuple(overrides.pop("decode_addrs_extra", ()))
        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets: no Nagle stalls
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
        self.config = ProxyConfig(prefill_addrs=tuple(w.address for w in self.prefill) + extra,
                                  decode_addrs=tuple(w.address for w in self.decode) + extra_decode, port=port,
                                  **overrides)
        self.app = create_app(self.config, tokenizer=self.tokenizer)
        self._uvicorn = uvicorn.Server(uvicorn_config(self.app, self.config.http, self.app.state.proxy.admission
                                                      .count_rejection, host="127.0.0.1", port=port,
                                                      log_level="warning", lifespan="on"))
        self.url = f"http://127.0.0.1:{port}"
        self._serve_task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._serve_task.done():
                self._serve_task.result()
            await asyncio.sleep(0.01)

    async def _stop(self) -> None:
        if self._uvicorn is not None and self._serve_task is not None:
            self._uvicorn.should_exit = True
            await asyncio.wait_for(self._serve_task, 10)
        for s in self._servers:
            await s.stop(grace=None)

    def __enter__(self) -> LiveStack:
        self._thread.start()
        self.run(self._start())
        self.http = httpx.Client(base_url=self.url, timeout=30.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        try:
            self.run(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
