"""Continuous-batching scheduler: FCFS, a token budget per step, chunked prefill mixed with decodes, preemption
by recompute. Tensor-free; never branches on layer type (that lives in engine.cache managers).

One step:
    1. running requests in arrival order each get up to (target - computed) tokens of the remaining budget;
       when the pools cannot cover one, the latest-arrived running request is preempted (its caches freed,
       back to the front of the waiting queue, recomputed later) until it fits or it was itself the victim;
    2. if nothing was preempted, waiting requests are admitted in order while budget and max_num_seqs allow,
       starting at their prefix-cache hit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.cache.coordinator import HybridCacheManager, PrefixHit
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    num_computed_tokens: int
    """Tokens already cached before this step."""
    token_ids: tuple[int, ...]
    """The tokens computed this step (positions num_computed_tokens ...)."""
    block_ids: tuple[int, ...]
    state_slot: int
    checkpoints: tuple[tuple[int, int], ...]
    sample: bool
    """True when this chunk reaches the request's last known token: the runner samples the next one."""

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def has_initial_state(self) -> bool:
        return self.num_computed_tokens > 0


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    state_copies: tuple[tuple[int, int], ...]
    """(src slot, dst slot) recurrent-state copies to run before the forward (checkpoint restores)."""
    fresh_blocks: tuple[int, ...]
    """Attention blocks allocated this step (to zero before first use). Drained every step."""
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: HybridCacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management ----------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_transferred(self, req: Request) -> None:
        """Admit a request whose first `num_computed_tokens` tokens arrived by transfer (caches already held).
        It queues ahead of new requests; it is scheduled like any request that holds caches."""
        self.requests[req.request_id] = req
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str, free_caches: bool = True) -> None:
        """End a request. free_caches=False keeps its blocks/slot (a prefill worker pins them under a lease and
        calls `release` later)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        if free_caches:
            self.cache.free(req)

    def release(self, req: Request) -> None:
        self.cache.free(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.target_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.cache.allocate(req, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                seqs.append(self._schedule_seq(req, num_new))
                budget -= num_new
                i += 1
                continue
            break

        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed_tokens > 0:  # already holds its caches (KV received by transfer)
                hit, start = None, req.num_computed_tokens
            else:
                hit = self.cache.find_prefix_hit(req, count=False)
                start = hit.num_tokens
            num_new = min(req.target_tokens - start, budget)
            if num_new <= 0:
                break
            if not self.cache.allocate(req, start + num_new, hit):
                # a hit holds its checkpoint next to the new running state until the copy ran: with one budget
                # that can be the one page too many; with nothing running nothing else will free it, so go cold
                if hit is None or hit.num_tokens == 0 or self.running:
                    break
                hit, start = PrefixHit(), 0
                num_new = min(req.target_tokens, budget)
                if not self.cache.allocate(req, num_new, hit):
                    break
            if hit is not None:
                self.cache.count_hit(req, hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = start
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = start
            self.running.append(req)
            seqs.append(self._schedule_seq(req, num_new))
            budget -= num_new

        return SchedulerOutput(
            seqs=tuple(seqs),
            state_copies=tuple(self.cache.take_state_copies()),
            fresh_blocks=tuple(self.cache.take_fresh_blocks()),
            preempted=tuple(preempted),
        )

    def _schedule_seq(self, req: Request, num_new: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        end = start + num_new
        return ScheduledSeq(
            request_id=req.request_id,
            num_computed_tokens=start,
            token_ids=tuple(req.token_slice(start, end)),
            block_ids=tuple(self.cache.block_ids(req.request_id)),
            state_slot=self.cache.state_slot(req.request_id),
            checkpoints=tuple(self.cache.plan_checkpoints(req, start, end)),
            sample=req.compute_target is None and end == req.num_tokens,
        )

    def _preempt(self, req: Request) -> None:
        self.cache.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, tuple[int, float]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, hash filled blocks. Returns the advanced requests."""
        advanced = []
        for s in out.seqs:
            req = self.requests.get(s.request_id)
            if req is None:
                continue
            req.num_computed_tokens += s.num_new_tokens
            if s.request_id in sampled:
                tok, lp = sampled[s.request_id]
                req.output_token_ids.append(tok)
                req.output_logprobs.append(lp)
            advanced.append(req)
        self.cache.on_step_done(advanced)
        return advanced
