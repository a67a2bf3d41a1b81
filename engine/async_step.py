"""Asynchronous scheduling: the engine launches decode step N+1 before it has read step N's tokens, so the host's
work between two steps (waiting for the tokens, stop checks, finishes, outputs, the next schedule and its inputs,
the tensor-parallel followers' command) overlaps the device's step instead of leaving it idle.

    EngineCore.step() k:  plan N+1 | launch N+1 (its input tokens: N's samples, copied on the device) | wait for N's
                          tokens | process N (tokens, stops, finishes)                          -> N's requests
    device:               ...... N ......|.................... N+1 ...........................................

Exactness: a step runs ahead only when it is exactly the step `Scheduler.schedule` would give once step N is
processed, plus rows of requests that turn out to end at step N. The invariants that make that safe:

 1. Ahead only if every running request was in step N and sampled there, nothing waits to be admitted, no row could
    save a recurrent checkpoint other than its rolling one (4), the pools cover every row without preempting, and
    every row's sampling needs nothing of N's token on the host: no structured output (the grammar's next mask), no
    prefill-only or compute-target request, no output held back on an unconfirmed transfer. Otherwise the step is
    synchronous. (min_tokens and the penalties take the unread token from the device: `Sampler.unread_tokens`.)
 2. Requests whose end at step N is known (max_tokens, max_model_len) are not in step N+1 at all.
 3. A request that ends at step N for a reason known only then (a stop token or string, EOS) or is aborted still
    runs in step N+1 (an "overrun" row): that row's results are dropped (nothing appended, counted or hashed), and
    the request's pages and running state are freed only once step N+1 is done (`defer_free`), so no other request
    can be given them while N+1 writes them. What N+1 wrote there is never published: blocks are hashed up to the
    computed count, which a dropped row does not advance, and step N+1 saves no checkpoint (1).
 4. A row of step N+1 that reaches a block boundary would save its rolling (request-end) checkpoint there, but the
    boundary is named by a hash of N's token, unknown when N+1 is planned. It is planned one step late, exactly as
    `schedule()` would have planned it (same call, same hash, same dedupe), once N is read and before anything is
    launched after N+1: its running state, which holds the boundary's state until the next step runs, is copied
    into the checkpoint's pages (`ModelRunner.save_states`), stream-ordered after N+1. The checkpoint is published
    only once that copy is done: with the step after N+1 when one was launched ahead (`held`), else right after
    waiting for the copy. An ended
    request's frees come after the publication, as in the synchronous engine.
So every kept row computes what the synchronous step would, from the same token, state and pages, and the
prefix cache publishes the same blocks and checkpoints. Rows never read each other, but an overrun row is one more
row in the batch: unseeded random sampling (from the engine's shared generator) draws differently than the
synchronous engine would (seeded rows draw from their own generator, unchanged), and a kernel whose result depends
on the batch size could round differently.

Ownership: the step thread (EngineCore's). `EngineCore.finish` asks `defer_free` for every request it ends.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridpd.engine.cache.coordinator import PendingCheckpoint
    from hybridpd.engine.core import EngineCore
    from hybridpd.engine.request import Request
    from hybridpd.engine.runner import LaunchedStep
    from hybridpd.engine.scheduler import SchedulerOutput


@dataclass
class _Launched:
    out: SchedulerOutput
    step: LaunchedStep
    requests: dict[str, Request]
    """The request each row computes, as it was at launch: a row whose request has ended since (or whose id now
    names another request) is an overrun row."""
    sample_index: dict[str, int]
    """Request id -> its row in the step's samples (what a step fed from this one reads)."""
    deferred: list[Request] = field(default_factory=list)
    """Requests that ended while this step was in flight: their pages are freed once it is done."""
    late: list[tuple[Request, int]] = field(default_factory=list)
    """(request, block boundary) of rows whose rolling checkpoint is planned after this step (invariant 4)."""
    held: list[PendingCheckpoint] | None = None
    """Checkpoints of the step before this one, copied after it: published with the step after this one."""
    publishes: frozenset[str] = frozenset()
    """Requests whose late checkpoints (the previous step's `held`) are published once this step is done: one that
    ends before then is freed after that publication too (as in the synchronous engine: publish, then free)."""

    def live(self, requests: dict[str, Request]) -> tuple[str, ...]:
        return tuple(rid for rid, req in self.requests.items() if requests.get(rid) is req)

    def any_live(self, requests: dict[str, Request]) -> bool:
        """`bool(self.live(requests))`, stopping at the first live row."""
        return any(requests.get(rid) is req for rid, req in self.requests.items())

    def live_late(self, requests: dict[str, Request]) -> list[tuple[Request, int]]:
        """`late` without rows of requests that have ended (the synchronous engine never ran those rows)."""
        return [(req, b) for req, b in self.late if requests.get(req.request_id) is req]


class StepPipeline:
    """At most one step in flight beyond the one being read. See the module docstring for the invariants."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.in_flight: _Launched | None = None
        self.num_ahead = 0
        """Steps launched before the previous step's tokens were read."""
        self.num_overrun = 0
        """Rows computed for requests that had already ended (their results dropped)."""
        self.num_late_checkpoints = 0
        """Rolling checkpoints planned one step late (invariant 4)."""
        self.num_sync_fallbacks = 0
        """Steps after which the next one could not be launched ahead (invariant 1): it was scheduled synchronously."""

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """`EngineCore.step` with asynchronous scheduling (after its expired imports)."""
        core = self.core
        t0 = time.perf_counter()
        cur, self.in_flight = self.in_flight, None
        try:
            if cur is None:
                cur = self._launch(core.scheduler.schedule(), None)
            marks = core.cache.pending_marks()
            late = core.scheduler.plan_late_checkpoints(cur.live_late(core.scheduler.requests))
            live = cur.live(core.scheduler.requests)  # no request ends before `_process`: one look for both
            ahead = self._plan_ahead(cur, live)
            if late:
                self._save_late(cur, late, marks, ahead is not None)
            if ahead is not None:
                out, rows_late = ahead
                self.in_flight = self._launch(out, tuple(cur.sample_index[s.request_id] for s in out.seqs))
                self.in_flight.late = rows_late
                if cur.held is not None:
                    self.in_flight.publishes = frozenset(p.req_id for p in cur.held)
                self.num_ahead += 1
            sampled, top = cur.step.resolve()
        except Exception:
            self._abandon(cur)
            raise
        advanced = self._process(cur, live, sampled, top, t0)
        if self.in_flight is not None and not self.in_flight.any_live(core.scheduler.requests):
            self.drain()  # only ended requests in it: nothing to wait for later, and their pages come back now
        return advanced

    def defer_free(self, req: Request) -> bool:
        """`req` ends now: True if a launched step still computes it (its pages are freed once that step is done,
        invariant 3) or its late checkpoint is published with that step (freed after it, invariant 4); False: free
        them now."""
        f = self.in_flight
        if f is not None and (f.requests.get(req.request_id) is req or req.request_id in f.publishes):
            f.deferred.append(req)
            return True
        return False

    def drain(self) -> None:
        """Wait for the step in flight and drop it (every request in it has ended): its deferred pages are freed."""
        f, self.in_flight = self.in_flight, None
        if f is None:
            return
        f.step.resolve()
        self.num_overrun += len(f.requests) - len(f.live(self.core.scheduler.requests))
        self.core.cache.on_step_done([])  # late checkpoints copied before it are written now: publish them
        self._release(f)

    # -- parts ---------------------------------------------------------------------------------------------------
    def _launch(self, out: SchedulerOutput, feed: tuple[int, ...] | None) -> _Launched:
        core = self.core
        requests = core.scheduler.requests
        try:
            step = core.runner.launch(out, core.step_params(out), feed)
        except Exception:
            core.cache.on_step_failed()
            raise
        rids = [s.request_id for s in out.seqs]
        sample_index = {rid: i for i, rid in enumerate(s.request_id for s in out.seqs if s.sample)}
        return _Launched(out, step, {rid: requests[rid] for rid in rids}, sample_index)

    def _save_late(self, cur: _Launched, saves: tuple[tuple[int, tuple[int, ...]], ...], marks: int,
                   ahead: bool) -> None:
        """Copy the running states of `cur`'s rows that reached a block boundary into their rolling checkpoints,
        after `cur` and before anything after it. With a step launched ahead the copy may still be queued when
        `cur` is read, so the checkpoints are published with the step after `cur` (`held`); else the copy is waited
        for and they are published with `cur`, as the synchronous engine does."""
        core = self.core
        core.runner.save_states(saves)
        self.num_late_checkpoints += len(saves)
        if ahead:
            cur.held = core.cache.hold_pending(marks)
        else:
            core.runner.synchronize()

    def _plan_ahead(
        self, cur: _Launched, live: tuple[str, ...]
    ) -> tuple[SchedulerOutput, list[tuple[Request, int]]] | None:
        """The step after `cur` if it can be launched before `cur`'s tokens are read (invariants 1 and 2); `live`:
        its rows whose requests have not ended (`_Launched.live`)."""
        core, sched = self.core, self.core.scheduler
        if not live:
            return None
        rows: list[tuple[Request, int]] = []
        by_id = {s.request_id: s for s in cur.out.seqs}
        ok = not sched.waiting and not sched.unconfirmed and len(live) == len(sched.running)
        for rid in live if ok else ():
            req, s = cur.requests[rid], by_id[rid]
            if (
                not s.sample
                or req.sampling_params.structured is not None
                or req.prefill_only
                or req.compute_target is not None
                or req.held_from is not None
            ):
                ok = False
                break
            if core.length_reached(req, ahead=1):
                continue  # ends with cur's token, known now: not in the next step (invariant 2)
            rows.append((req, s.num_computed_tokens + s.num_new_tokens))
        ahead = sched.schedule_ahead(rows) if ok and rows else None
        if ahead is None and (not ok or rows):
            self.num_sync_fallbacks += 1
        return ahead

    def _process(
        self,
        cur: _Launched,
        live_rows: tuple[str, ...],
        sampled: dict[str, tuple[int, float]],
        top: dict[str, list[tuple[int, float]]],
        t0: float,
    ) -> list[Request]:
        """`cur`'s results into its requests that have not ended (`live_rows`; the others' rows are overrun rows),
        then its deferred frees."""
        core = self.core
        out = cur.out
        if len(live_rows) < len(out.seqs):
            live = set(live_rows)
            self.num_overrun += len(out.seqs) - len(live)
            out = dataclasses.replace(out, seqs=tuple(s for s in out.seqs if s.request_id in live))
            sampled = {r: v for r, v in sampled.items() if r in live}
            top = {r: v for r, v in top.items() if r in live}
        advanced = core.process_step(out, sampled, top, t0, cur.step.prompt_scores)
        if cur.held is not None:  # published with the step launched after `cur` (`_save_late`)
            core.cache.release_held(cur.held)
        self._release(cur)
        return advanced

    def _release(self, done: _Launched) -> None:
        for req in done.deferred:
            self.core.scheduler.release(req)

    def _abandon(self, cur: _Launched | None) -> None:
        """A launch or a wait failed: nothing in flight is published; the pages deferred to either step are freed
        (the caller ends every request with an error)."""
        for f in (cur, self.in_flight):
            if f is not None and f.held is not None:
                self.core.cache.release_held(f.held)  # unpublished: dropped with the others
        self.core.cache.on_step_failed()
        for f in (cur, self.in_flight):
            if f is not None:
                self._release(f)
        self.in_flight = None
