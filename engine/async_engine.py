"""Runs an EngineCore on a background step thread and hands results to asyncio callers (the gRPC servers).

Ownership: only the step thread touches the EngineCore. Other threads submit work with `call(fn)` (runs fn(core)
on the step thread between steps) and receive per-request outputs through asyncio queues fed with
`loop.call_soon_threadsafe`. `hooks` run on the step thread before every step (transfer polling, lease reaping).

Idle (nothing scheduled), the step thread sleeps on an event that `call()` sets, so an idle worker costs no CPU:
  - `idle_wait()` below 1 ms (a hook owner with a KV pull in flight): hooks run that often (hot polling);
  - a hook added with `add_hook(fn, needs_poll)`: polled every `idle_wait()` only while `needs_poll()` is true;
  - a hook appended to `hooks` directly (it never said when it needs polling): polled with back-off, from
    `idle_wait()` doubling up to `MAX_IDLE_POLL_S` while nothing happens, reset by any call or step;
  - otherwise (no hook, or every declared hook has nothing in flight): no timeout at all.
A stalled scheduler (the head of the queue cannot get its caches while only parked or importing requests hold
them; `EngineCore.is_stalled`) counts as idle: no empty steps until something changes (a call, a hook's work, a
deadline), or `STALLED_RETRY_S` at the latest.

`busy_for()` tells how long the step thread has been in its current pass (calls, hooks, one step) without getting
back to its wait: a step thread wedged in a step or a hook (a hung kernel, a deadlock) shows here while the gRPC
server, on another thread, still answers; the worker's Health reports it (worker/context.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from hybridpd.engine.core import EngineCore
from hybridpd.engine.prompt_logprobs import PromptLogprobs
from hybridpd.engine.request import Request

log = logging.getLogger("hybridpd.async_engine")

HOT_POLL_S = 1e-3
"""An `idle_wait()` below this is a request for hot polling (no back-off)."""
MAX_IDLE_POLL_S = 0.5
"""Longest sleep between runs of hooks that never declared when they need polling."""
STALLED_RETRY_S = 0.05
"""A stalled scheduler (`Scheduler.stalled`) is stepped again after this long even if nothing it knows changed."""


@dataclass(frozen=True)
class OutputDelta:
    """What one publish hands a request's stream: new tokens since the last delta, the full text so far, and the
    end. Plain values copied on the step thread (the live Request never leaves it)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    """Per new token, the requested most likely (token id, logprob) pairs; () when not requested."""
    finish_reason: str | None
    stop_reason: str | None
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_external_tokens: int
    stop_match: str | int | None = None
    """What ended the request with "stop" (`EngineCore.stop_match`: vLLM's stop_reason), on the last delta."""
    prompt_logprobs: PromptLogprobs | None = None
    """On the request's first delta, when it asked for prompt logprobs (complete once a token is sampled)."""

    def then(self, later: OutputDelta) -> OutputDelta:
        """This delta and the next one as one (a stream that fell behind sends one message for both)."""
        return dataclasses.replace(
            later, token_ids=self.token_ids + later.token_ids, logprobs=self.logprobs + later.logprobs,
            top_logprobs=self.top_logprobs + later.top_logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs)


def _put_all(items: list[tuple[asyncio.Queue, OutputDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


def take_pending(q: asyncio.Queue, first: OutputDelta) -> OutputDelta:
    """`first` merged with every delta already waiting in `q` (up to and including an end): one stream message
    instead of one per token when the reader is slower than the steps."""
    delta = first
    while delta.finish_reason is None and not q.empty():
        delta = delta.then(q.get_nowait())
    return delta


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._calls: queue.Queue[tuple[Callable[[EngineCore], Any], Future]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._emitted: dict[str, int] = {}
        self.hooks: list[Callable[[EngineCore], None]] = []
        self.on_finished: list[Callable[[Request], None]] = []
        self._finished: list[Request] = []  # ended by EngineCore.finish, not yet delivered (step thread only)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, OutputDelta]]] = {}
        """Deltas published on the step thread, not yet handed to their loops (`_flush`)."""
        core.finish_listeners.append(self._on_finish)
        # seconds the idle loop waits between hook runs; a hook owner with work in flight (a KV pull) shortens it
        self.idle_wait: Callable[[], float | None] = lambda: 0.005
        self._needs_poll: dict[int, Callable[[], bool]] = {}  # id(hook) -> "has work that needs polling"
        self._stalled_since: float | None = None  # monotonic time the scheduler was first seen stalled
        self._idle_wakes = 0  # consecutive idle wake-ups with nothing to do (back-off of undeclared hooks)
        self._pass_started: float | None = None  # monotonic start of the step thread's current pass (None: waiting)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    # -- cross-thread API ------------------------------------------------------------------------------------------
    def add_hook(self, hook: Callable[[EngineCore], None], needs_poll: Callable[[], bool] | None = None) -> None:
        """Run `hook` before every step; while idle, only when `needs_poll()` is true (None: never while idle).
        Call before work starts, or from the step thread."""
        self.hooks.append(hook)
        self._needs_poll[id(hook)] = needs_poll or (lambda: False)

    def idle_timeout(self) -> float | None:
        """How long the idle step thread sleeps before running the hooks again (None: until woken)."""
        wait = self.idle_wait()
        if wait is not None and wait < HOT_POLL_S:
            return wait
        base = wait if wait is not None else 0.005
        if any(pred() for pred in self._needs_poll.values()):
            return base
        if any(id(h) not in self._needs_poll for h in self.hooks):
            return min(MAX_IDLE_POLL_S, base * 2 ** min(self._idle_wakes, 16))
        return None

    def busy_for(self) -> float:
        """Seconds the step thread has spent in its current pass of calls, hooks and one step (0 while it waits
        for work). Any thread."""
        started = self._pass_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def call(self, fn: Callable[[EngineCore], Any]) -> Future:
        fut: Future = Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    async def acall(self, fn: Callable[[EngineCore], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def open_stream(self, request_id: str, emitted: int = 0) -> asyncio.Queue:
        """Register an output queue for a request (call from the event loop before the request is added).
        `emitted`: output tokens the caller already has (a first token sampled elsewhere): not streamed again."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        if emitted:
            self._emitted[request_id] = emitted
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._emitted.pop(request_id, None)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive() and hasattr(self.core, "shutdown"):  # (test doubles of the core have none)
            self.core.shutdown()  # graphs destroyed, tensor-parallel ranks stopped, their group left
        pipe = getattr(self.core, "pipeline", None)  # a core without the asynchronous mode (test doubles) has none
        if pipe is not None:  # how much ran ahead: the asynchronous mode really ran (tests over real processes)
            log.info(
                "asynchronous scheduling: %d steps launched ahead, %d overrun rows, %d late checkpoints, %d "
                "synchronous fallbacks",
                pipe.num_ahead,
                pipe.num_overrun,
                pipe.num_late_checkpoints,
                pipe.num_sync_fallbacks,
            )

    # -- step thread -----------------------------------------------------------------------------------------------
    def publish(self, req: Request) -> None:
        """Push the request's new tokens (and its end) to its stream, if any. Step thread only. Output held back
        (`Request.held_from`: computed on a transfer not confirmed yet) waits until it is released."""
        entry = self._streams.get(req.request_id)
        if entry is None or req.held_from is not None:
            return
        start = self._emitted.get(req.request_id, 0)
        n = len(req.output_token_ids)
        if n == start and not req.is_finished:
            return
        self._emitted[req.request_id] = n
        delta = OutputDelta(
            token_ids=tuple(req.output_token_ids[start:n]),
            logprobs=tuple(req.output_logprobs[start:n]),
            top_logprobs=tuple(tuple(t) for t in req.output_top_logprobs[start:n]),
            finish_reason=req.finish_reason if req.is_finished else None,
            stop_reason=None if req.stop_reason is None else str(req.stop_reason),
            text=self.core.output_text(req),
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_external_tokens=req.external_computed_tokens,
            stop_match=self.core.stop_match(req) if req.is_finished else None,
            prompt_logprobs=req.prompt_logprobs if start == 0 else None,
        )
        loop, q = entry
        self._outbox.setdefault(loop, []).append((q, delta))  # sent by `_flush`, one wake-up of the loop per step
        if req.is_finished:
            self._emitted.pop(req.request_id, None)

    def _on_finish(self, req: Request) -> None:
        self._finished.append(req)

    def _deliver_finished(self) -> None:
        """Every request `EngineCore.finish` ended since the last call (step, engine call or hook alike): its last
        tokens and its end go to its stream, then to the finish callbacks (P's waiting Prefill RPCs). Then every
        delta published since the last flush goes out."""
        while self._finished:
            batch, self._finished = self._finished, []
            for req in batch:
                self._deliver(req)
        self._flush()

    def _flush(self) -> None:
        """Hand the published deltas to their streams: one `call_soon_threadsafe` per event loop (a wake-up of that
        thread, a write to its self-pipe) for the whole step, not one per request."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (shutdown): nobody is reading these streams any more
                log.debug("event loop closed: %d deltas dropped", len(items))

    def _deliver(self, req: Request) -> None:
        """One ended request: its stream, then the finish callbacks."""
        self.publish(req)
        for cb in self.on_finished:
            try:
                cb(req)
            except Exception:  # noqa: BLE001 - a callback must not kill the step loop
                log.exception("on_finished callback failed for %s", req.request_id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._pass_started = time.monotonic()
            if self._drain_calls():
                self._idle_wakes = 0
            for hook in self.hooks:
                try:
                    hook(self.core)
                except Exception:  # noqa: BLE001 - a hook must not kill the step loop
                    log.exception("step hook failed")
            self._deliver_finished()
            retry_in = self._stalled_retry_in()
            if retry_in is not None or not self.core.has_unfinished():
                timeout = self.idle_timeout()
                if retry_in is not None:
                    timeout = retry_in if timeout is None else min(timeout, retry_in)
                self._pass_started = None
                self._wake.wait(timeout=timeout)
                self._wake.clear()
                self._idle_wakes += 1
                continue
            self._idle_wakes = 0
            try:
                advanced = self.core.step()
            except Exception as e:
                log.exception("engine step failed; ending its requests with an error")
                advanced = []
                self.core.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            for req in advanced:
                if not req.is_finished:  # finished ones go out with their end, below
                    self.publish(req)
            self._deliver_finished()

    def _stalled_retry_in(self) -> float | None:
        """Seconds until a stalled scheduler (its last step found nothing to run, nothing changed since) is stepped
        again anyway; None when it is not stalled, or that time has come."""
        if not self.core.is_stalled():
            self._stalled_since = None
            return None
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
        left = self._stalled_since + STALLED_RETRY_S - now
        if left <= 0:
            self._stalled_since = None
            return None
        return left

    def _drain_calls(self) -> bool:
        """Run every pending call; True when there was any."""
        ran = False
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.core))
                except BaseException as e:  # noqa: BLE001 - delivered to the caller
                    fut.set_exception(e)
