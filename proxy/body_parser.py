"""Request bodies into typed requests: small bodies on the event loop, big ones in a helper process.

json.loads and the schema's per-element checks hold the GIL: a 0.6 MB body (60,000 stop strings) takes tens of
milliseconds, and on a thread that time is taken from the event loop all the same. Bodies over `INLINE_BYTES` are
therefore parsed in one helper process, spawned by `start()` (which `proxy.server` calls before serving) or else on
the first big body, from a thread (starting a process forks this one: up to a second on a loaded host, which the
event loop must not wait out); one worker, so big bodies queue behind one another, never in front of small ones.
Errors come back as `ApiError`s; a helper that died is replaced on the next big body (that request gets a 503). A
helper whose proxy died without closing it (killed) exits within a second: it watches its parent.

    parser = BodyParser(model_name, limits); parser.start()    # optional: else spawned on the first big body
    req = await parser.parse(raw, chat)                          # CompletionRequest | ChatRequest, or ApiError
    parser.close()
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from hybridpd.proxy.config import RequestLimits
from hybridpd.proxy.errors import ApiError
from hybridpd.proxy.openai_schema import ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_json_object
from hybridpd.proxy.request_limits import check_body_limits

INLINE_BYTES = 64 * 1024  # parsed on the event loop: well under a millisecond


def parse_body(raw: bytes, chat: bool, model_name: str, limits: RequestLimits) -> CompletionRequest | ChatRequest:
    """JSON -> list-size limits (before the schema walks the elements) -> the schema. Raises ApiError (4xx)."""
    body = parse_json_object(raw)
    check_body_limits(body, limits)
    return parse_chat(body, model_name) if chat else parse_completion(body, model_name)


def _parse_in_helper(raw: bytes, chat: bool, model_name: str, limits: RequestLimits) -> tuple[bool, Any]:
    """(True, request) or (False, the ApiError's fields): ApiError itself does not survive pickling."""
    try:
        return True, parse_body(raw, chat, model_name, limits)
    except ApiError as err:
        return False, (err.status, err.message, err.param, err.code)


def _ready() -> bool:
    return True


def _exit_with_parent(parent: int) -> None:
    """The helper's initializer: leave when the proxy that started it is gone (its queue never closes for it)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="body-parser-parent-watch", daemon=True).start()


class BodyParser:
    """Owned by the app (`close()` in its lifespan's shutdown). Event loop only."""

    def __init__(self, model_name: str, limits: RequestLimits) -> None:
        self.model_name = model_name
        self.limits = limits
        self._helper: ProcessPoolExecutor | None = None
        self._starting = asyncio.Lock()

    def start(self) -> None:
        if self._helper is None:
            self._helper = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_exit_with_parent,
                initargs=(os.getpid(),),
            )
            self._helper.submit(_ready)  # spawn it now, not on the first big body

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=False, cancel_futures=True)
            self._helper = None

    async def parse(self, raw: bytes, chat: bool) -> CompletionRequest | ChatRequest:
        if len(raw) <= INLINE_BYTES:
            return parse_body(raw, chat, self.model_name, self.limits)
        loop = asyncio.get_running_loop()
        if self._helper is None:
            async with self._starting:  # one spawn however many big bodies arrive meanwhile
                if self._helper is None:
                    await loop.run_in_executor(None, self.start)
        assert self._helper is not None
        try:
            ok, value = await loop.run_in_executor(
                self._helper, _parse_in_helper, raw, chat, self.model_name, self.limits
            )
        except BrokenProcessPool:
            self._helper = None  # replaced on the next big body
            raise ApiError(
                503, "the request parser restarted; retry", code="overloaded", headers={"Retry-After": "1"}
            ) from None
        if ok:
            return value  # type: ignore[no-any-return]
        status, message, param, code = value
        raise ApiError(status, message, param=param, code=code)
