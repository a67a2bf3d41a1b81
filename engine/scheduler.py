"""Continuous-batching scheduler: FCFS, a token budget per step, chunked prefill mixed with decodes, preemption
by recompute. Tensor-free; never branches on layer type (that lives in engine.cache).

One step:
    1. running requests in arrival order each get up to (target - computed) tokens of the remaining budget;
       when the pools cannot cover one, the latest-arrived running request is preempted (its caches freed,
       back to the front of the waiting queue, recomputed later) until it fits or it was itself the victim;
    2. if nothing was preempted, waiting requests are admitted in order while budget and max_num_seqs allow
       (parked and importing requests hold running states too: they count), starting at their prefix-cache hit.

Requests waiting for a transfer (a decode worker's imports, `engine/transfer.py`) sit in `importing`, state
WAITING_FOR_TRANSFER, holding their destination pages; `schedule()` never looks at them. `transfer_done` moves one
to the front of the waiting queue (it continues at `num_computed_tokens`); `drop_import` lets one go (the caller
frees or quarantines its pages and schedules it locally or ends it); `finish` ends one like any request.

    new_request --begin_import--> [importing] --transfer_done--> [waiting] --schedule--> [running] --> finish
                                      |  --drop_import--> (recompute: add_request at 0 | end)
                                      +-- finish (abort, deadline, error) ---------------------------------^

A request may also run before its transfer is confirmed (`hold_unconfirmed` instead of `transfer_done`): it is
scheduled like any other, but sits in `unconfirmed` too, and nothing it computes is published to the prefix cache
(no block hashed, no checkpoint planned) until `confirm`. If it reaches its end meanwhile it is `park`ed (out of
`running`, caches kept, not scheduled) until the answer; a refusal `restart`s it from token 0 wherever it is.

The runner reads, per sequence, one block table per attention group and one state slot and checkpoint list per
recurrent group (`group_block_ids`, `group_state_slots`, `group_checkpoints`; per step `group_fresh_blocks`, and the
arena's `state_restores` and `state_saves`): tuples of (group id, value) in group order, the same shape for every group.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from hybridpd.engine.cache.coordinator import HybridCacheManager, PrefixHit
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from hybridpd.engine.transfer import Import


PLACEHOLDER_TOKEN = -1
"""The input token of a step scheduled before it is known on the host (`Scheduler.schedule_ahead`): the runner feeds
the real one from the previous step's samples, on the device. Out of every vocabulary, so it never passes unfed."""


def _remove(queue: list[Request] | deque[Request], req: Request) -> bool:
    """Remove `req` from `queue` by identity (`in` / `remove` would compare Requests field by field, as a dataclass
    does). False when it is not there."""
    for i, r in enumerate(queue):
        if r is req:
            del queue[i]
            return True
    return False


@dataclass(slots=True)
class ScheduledSeq:
    """One request's part of a step. Read-only by convention: not frozen, because a frozen dataclass's __init__
    costs about 2.5x as much, once per request per step."""

    request_id: str
    num_computed_tokens: int
    """Tokens already cached before this step."""
    token_ids: tuple[int, ...]
    """The tokens computed this step (positions num_computed_tokens ...)."""
    sample: bool
    """True when this chunk reaches the request's last known token: the runner samples the next one."""
    group_block_ids: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """(attention group id, block table) for every attention group."""
    group_state_slots: tuple[tuple[int, int], ...] = ()
    """(recurrent group id, running slot) for every recurrent group."""
    group_checkpoints: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()
    """(recurrent group id, ((num_tokens, staging slot), ...)) for every recurrent group: checkpoints inside the chunk,
    written by the kernels into a staging slot (the same in every group) and saved to their pages after the step."""
    prompt_scores: tuple[int, tuple[int, ...]] | None = None
    """(k, targets) when the request asks for prompt logprobs and this chunk computes prompt positions before the
    last: the runner scores rows num_computed_tokens .. + len(targets) - 1, row j against prompt token targets[j]
    (engine.prompt_logprobs), with the top k."""

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def has_initial_state(self) -> bool:
        return self.num_computed_tokens > 0


_TOKEN_IDS = attrgetter("token_ids")


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[str, ...]
    state_restores: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """((running slot, checkpoint pages), ...): checkpoints restored before the forward (every recurrent group's
    state: one row copy per page, engine/cache/arena.py)."""
    state_saves: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """((slot, checkpoint pages), ...): checkpoints saved after the forward (the running slot at a chunk's end, or
    the staging slot a `group_checkpoints` entry had the kernels write)."""
    group_fresh_blocks: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """(attention group id, blocks allocated this step) for every attention group: to zero before first use."""

    @property
    def num_tokens(self) -> int:
        return sum(map(len, map(_TOKEN_IDS, self.seqs)))  # no Python frame per sequence

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
        """Every unfinished request: waiting, running and importing."""
        self.importing: dict[str, Import] = {}
        """request id -> the import it waits for (WAITING_FOR_TRANSFER, destination pages held). Never scheduled."""
        self.unconfirmed: dict[str, Import] = {}
        """request id -> the import it runs on before the producer confirmed it: scheduled, never published."""
        self.parked: dict[str, Request] = {}
        """Unconfirmed requests that reached their end (Request.held_finish): out of `running`, caches kept."""
        self._no_checkpoints = tuple((gid, ()) for gid in cache.recurrent_groups)
        self.num_preemptions = 0
        self.version = 0
        """Bumped by every change of the queues or of what requests hold (`stalled`)."""
        self._stalled_at = -1

    # -- queue management ----------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.version += 1
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_importing(self, req: Request, imp: Import) -> None:
        """Hold a request whose first tokens are being transferred in: it keeps `imp`'s destination pages and waits
        (WAITING_FOR_TRANSFER) until `transfer_done` or `drop_import`; `schedule()` never looks at it."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.version += 1
        self.requests[req.request_id] = req
        self.importing[req.request_id] = imp
        req.status = RequestStatus.WAITING_FOR_TRANSFER

    def transfer_done(self, req: Request) -> None:
        """The transfer completed (`num_computed_tokens` set): the request queues ahead of new requests and is
        scheduled like any request that holds caches."""
        self.version += 1
        self.importing.pop(req.request_id)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def hold_unconfirmed(self, req: Request) -> None:
        """`transfer_done` for a transfer not confirmed yet: the request runs, in `unconfirmed` until `confirm`."""
        self.unconfirmed[req.request_id] = self.importing[req.request_id]
        self.transfer_done(req)

    def confirm(self, req: Request) -> Import:
        """The producer confirmed the transfer: what `req` computes is publishable from now on. Returns the import
        (the caller publishes what it holds; a parked request is the caller's to finish)."""
        self.version += 1
        return self.unconfirmed.pop(req.request_id)

    def park(self, req: Request, reason: str) -> None:
        """An unconfirmed request reached its end (`reason`): stop scheduling it, keep its caches, until `confirm`
        (then the caller finishes it) or `restart`."""
        self.version += 1
        _remove(self.running, req)
        req.held_finish = reason
        self.parked[req.request_id] = req

    def restart(self, req: Request) -> Import | None:
        """The transfer an unconfirmed request ran on was refused: free its caches (nothing of them was published)
        and queue it first to compute from token 0. Returns its import."""
        self.version += 1
        if not _remove(self.running, req):
            _remove(self.waiting, req)
        self.parked.pop(req.request_id, None)
        self.cache.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        return self.unconfirmed.pop(req.request_id, None)

    def drop_import(self, req: Request) -> Import:
        """Let an importing request go unscheduled (its pages are the caller's to free or quarantine)."""
        self.version += 1
        imp = self.importing.pop(req.request_id)
        self.requests.pop(req.request_id, None)
        req.status = RequestStatus.WAITING
        return imp

    def expired_imports(self, now: float) -> list[Request]:
        """Importing requests whose deadline (Import.deadline, monotonic seconds) has passed."""
        return [self.requests[rid] for rid, imp in self.importing.items()
                if imp.deadline is not None and imp.deadline <= now]

    def expired_unconfirmed(self, now: float) -> list[Request]:
        """Requests running on an unconfirmed transfer past its deadline (no answer from the producer)."""
        return [self.requests[rid] for rid, imp in self.unconfirmed.items()
                if imp.deadline is not None and imp.deadline <= now]

    def finish(self, req: Request, reason: str, free_caches: bool = True) -> None:
        """End a request. free_caches=False keeps its blocks/slot (a prefill worker pins them under a lease and
        calls `release` later)."""
        self.version += 1
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if not _remove(self.running, req) and not _remove(self.waiting, req):
            self.parked.pop(req.request_id, None)
        self.importing.pop(req.request_id, None)
        self.unconfirmed.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        if free_caches:
            self.cache.free(req)

    def release(self, req: Request) -> None:
        self.version += 1
        self.cache.free(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    @property
    def num_unfinished(self) -> int:
        """Requests a step can advance (importing ones wait for their transfer, not for steps)."""
        return len(self.waiting) + len(self.running)

    @property
    def num_seated(self) -> int:
        """Requests that hold a running state: running, parked (their end reached on an unconfirmed transfer) and
        importing (a transfer into their pages). `max_num_seqs` bounds them: the cache plan was sized for that."""
        return len(self.running) + len(self.parked) + len(self.importing)

    @property
    def stalled(self) -> bool:
        """The last `schedule()` found nothing to run (the head of the queue cannot get its caches: only parked or
        importing requests hold them) and nothing changed since: another step would be as empty. Waiting for a
        change (an answer, a deadline, a call) instead of stepping keeps an idle worker from spinning."""
        return self._stalled_at == self.version

    # -- one step ------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []

        running, cache = self.running, self.cache
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            target = req.compute_target  # req.target_tokens, inlined: once per request per step
            if target is None:
                target = len(req.prompt_token_ids) + len(req.output_token_ids)
            num_new = min(target - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not cache.allocate(req, req.num_computed_tokens + num_new):
                victim = running.pop()
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

        while self.waiting and budget > 0 and not preempted and self.num_seated < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed_tokens > 0:  # already holds its caches (KV received by transfer)
                hit, start = None, req.num_computed_tokens
            else:
                hit = self._prefix_hit(req)
                start = hit.num_tokens
            num_new = min(req.target_tokens - start, budget)
            if num_new <= 0:
                break
            fits = self.cache.allocate(req, start + num_new, hit)
            while not fits and not self.running and self._recompute_a_holder(req, preempted):
                fits = self.cache.allocate(req, start + num_new, hit)
            if not fits:
                # a hit holds its checkpoint next to the new running state until the copy ran: with one budget
                # that can be the one page too many; with nothing running nothing else will free it, so go cold
                if hit is None or hit.num_tokens == 0 or self.running:
                    break
                hit, start = PrefixHit(), 0
                num_new = min(req.target_tokens, budget)
                if not self.cache.allocate(req, num_new, hit):
                    break
            if hit is not None and not _scores_prompt(req):
                self.cache.count_hit(req, hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = start
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = start
            self.running.append(req)
            seqs.append(self._schedule_seq(req, num_new))
            budget -= num_new

        self._stalled_at = self.version if not seqs and not preempted else -1
        self._plan_checkpoints(seqs)
        return self._output(tuple(seqs), tuple(preempted))

    def _output(self, seqs: tuple[ScheduledSeq, ...], preempted: tuple[str, ...]) -> SchedulerOutput:
        cache = self.cache
        fresh = cache.take_fresh_blocks()
        return SchedulerOutput(seqs, preempted, cache.take_restores(), cache.take_saves(),
                               tuple((gid, fresh) for gid in cache.attention_groups))

    def schedule_ahead(
        self, rows: list[tuple[Request, int]]
    ) -> tuple[SchedulerOutput, list[tuple[Request, int]]] | None:
        """The decode step after the one in flight (asynchronous scheduling), before its tokens are known: each
        `(request, tokens it will have computed once the step in flight is done)` computes one token, the
        placeholder for the one the step in flight samples. The caller keeps it what `schedule()` would give then
        (the running requests that stay, in order, nothing waiting). Returns the step and its rows that reach a
        block boundary, (request, boundary): their rolling checkpoints are planned one step late, once the token
        that names the boundary is known (the caller copies the state before the step after). None when a row
        could save any other checkpoint, or the pools cannot cover every row without preempting: the caller
        waits for the step in flight and schedules as usual (pages already added stay with their requests)."""
        if len(rows) > self.config.max_num_batched_tokens:
            return None
        cache = self.cache
        late = []
        for req, computed in rows:
            kind = cache.checkpoint_kind(req, computed + 1, computed)
            if kind == "planned":
                return None
            if kind == "rolling":
                late.append((req, computed + 1))
        seqs = []
        for req, computed in rows:
            if not cache.allocate(req, computed + 1):
                return None
            blocks, slots = cache.seq_tables(req.request_id)
            seqs.append(
                ScheduledSeq(req.request_id, computed, (PLACEHOLDER_TOKEN,), True, blocks, slots, self._no_checkpoints)
            )
        return self._output(tuple(seqs), ()), late

    def plan_late_checkpoints(self, late: list[tuple[Request, int]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The rolling checkpoints of rows that reached a block boundary in a step scheduled ahead (`late` from
        `schedule_ahead`), planned now that the boundary's token is known, exactly as `schedule()` would have
        planned them with that step: ((running slot, checkpoint pages), ...), the copies that save them (the running
        state holds the boundary's state until the next step runs)."""
        for req, boundary in late:
            self.cache.checkpoint_plan(req, boundary - 1, boundary)
        return self.cache.take_saves()

    def _prefix_hit(self, req: Request) -> PrefixHit:
        """The request's prefix-cache hit, not counted. One still scoring its prompt (prompt logprobs) reads no
        more of the cache than the positions it has scored: a cached prefix has no logits (vLLM skips reading the
        cache for such requests; its queries are not counted either)."""
        if not _scores_prompt(req):
            return self.cache.find_prefix_hit(req, count=False)
        assert req.prompt_logprobs is not None
        scored = len(req.prompt_logprobs)
        return self.cache.find_prefix_hit(req, max_tokens=scored, count=False) if scored else PrefixHit()

    def _schedule_seq(self, req: Request, num_new: int) -> ScheduledSeq:
        """The request's chunk, its checkpoints not planned yet (`_plan_checkpoints`, once every request of the step
        holds its blocks: a checkpoint's pages never take what a block of this step needs)."""
        start = req.num_computed_tokens
        end = start + num_new
        blocks, slots = self.cache.seq_tables(req.request_id)
        outputs = req.output_token_ids
        past_prompt = start - len(req.prompt_token_ids)
        # a decode row's one token read directly (`token_slice` builds a list first): once per request per step
        tokens = (outputs[past_prompt],) if num_new == 1 and past_prompt >= 0 else tuple(req.token_slice(start, end))
        # Positional (fields in declaration order): keywords cost about 2.5x as much, once per request per step.
        return ScheduledSeq(
            req.request_id,  # request_id
            start,  # num_computed_tokens
            tokens,  # token_ids
            req.compute_target is None and past_prompt + num_new == len(outputs),  # sample: end == num_tokens
            blocks,  # group_block_ids
            slots,  # group_state_slots
            self._no_checkpoints,  # group_checkpoints
            None if req.prompt_logprobs is None else _prompt_scores(req, start, end),
        )

    def _plan_checkpoints(self, seqs: list[ScheduledSeq]) -> None:
        """Each sequence's checkpoints (none for state computed on an unconfirmed transfer: it would be published
        when written); a chunk may end early, at a checkpoint that found no staging slot."""
        cache, unconfirmed, requests = self.cache, self.unconfirmed, self.requests
        for s in seqs:
            if unconfirmed and s.request_id in unconfirmed:
                continue
            req = requests[s.request_id]
            start = s.num_computed_tokens
            end = start + len(s.token_ids)
            s.group_checkpoints, cut = cache.checkpoint_plan(req, start, end)
            if cut < end:
                s.token_ids, s.sample = s.token_ids[: cut - start], False
                if s.prompt_scores is not None:
                    s.prompt_scores = _prompt_scores(req, start, cut)

    def _recompute_a_holder(self, head: Request, preempted: list[str]) -> bool:
        """The head of the queue cannot get its caches and nothing runs: only requests waiting behind it that hold
        transferred caches hold memory. Free the latest one's (it recomputes from token 0), so the queue cannot
        deadlock. False when there is none."""
        for victim in reversed(self.waiting):
            if victim is not head and victim.num_computed_tokens > 0:
                self.cache.free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                self.num_preemptions += 1
                preempted.append(victim.request_id)
                return True
        return False

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
        requests = self.requests
        for s in out.seqs:
            req = requests.get(s.request_id)
            if req is None:
                continue
            req.num_computed_tokens += len(s.token_ids)
            got = sampled.get(s.request_id)
            if got is not None:
                tok, lp = got
                req.output_token_ids.append(tok)
                req.output_logprobs.append(lp)
            advanced.append(req)
        unconfirmed = self.unconfirmed
        # blocks filled on an unconfirmed transfer's caches are not hashed into the prefix cache (`confirm` does it)
        self.cache.on_step_done([r for r in advanced if r.request_id not in unconfirmed] if unconfirmed else advanced)
        return advanced


def _scores_prompt(req: Request) -> bool:
    """The request asks for prompt logprobs and has not scored every prompt position yet."""
    return req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens - 1


def _prompt_scores(req: Request, start: int, end: int) -> tuple[int, tuple[int, ...]] | None:
    """`ScheduledSeq.prompt_scores` of a chunk computing positions [start, end): rows up to position N-2 (the
    last prompt position samples instead); none when the chunk holds no position not scored yet (a chunk
    recomputed after a preemption)."""
    assert req.prompt_logprobs is not None
    last = min(end, req.num_prompt_tokens - 1)
    if last <= max(start, len(req.prompt_logprobs)):  # nothing it has not scored yet
        return None
    return req.prompt_logprobs.k, tuple(req.prompt_token_ids[start + 1 : last + 1])
