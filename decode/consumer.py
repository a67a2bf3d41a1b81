"""Consumer-side transfer state machine (step thread only).

    admit(params) --checks--> allocate_for_transfer --> [pulling] --poll: DONE--> [committing] --P says held-->
        |  lease expired (no time left to pull)            |        send Commit;     |   publish blocks/checkpoint,
        |  prompt digest != params' (foreign params)       |        run_unconfirmed: |   release the held output
        |  malformed (unsigned, wrong groups or pages)     |        zero tail, runs  |   (confirm_import)
        v                                                  |        at N, output held|
    policy: recompute locally (default) or fail            +--poll: FAILED-----------+--P says no (lease expired,
                                                                                         wrong prompt/token, params
                                                                                         altered, other pages
                                                                                         read), or
                                                                                         Commit unreachable
                                                                                     --> drop the held output,
                                                                                         free, recompute / fail
Fail closed: pulled pages are published (hashed into the prefix cache) and what the request computes on them is
streamed only after P's Commit confirmed that the lease was still held when the READ had completed and was granted
for this very prompt. With the overlap on (the default; HYBRIDPD_COMMIT_OVERLAP=0 turns it off for A/B runs) the
request starts decoding on them at once, while the Commit is in flight (`run_unconfirmed`): its tokens are held
back until P's yes (`confirm_import` releases them, in order) and dropped on a no (`refuse_unconfirmed`: the
prompt and P's first token are recomputed, the seeded generator restarted, exactly as a failed pull). Without it,
the request waits (WAITING_FOR_TRANSFER) for the answer. Every refusal is counted in
hybridpd_kv_transfer_failures_total{role="decode", reason}.

Ownership: the request and its destination pages are the engine's: `begin_import` puts the request in the
scheduler (WAITING_FOR_TRANSFER) with its `Import`; this class keeps only the transport side (the pull handle and
the Commit in flight), keyed by request id. When the engine ends an import itself (`core.abort`, a failed step,
the import's deadline) it calls `cancel` (installed as `EngineCore.transfer_canceller`) to stop the pull and learn
whether the pages may be reused."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridpd.decode.params_check import params_problem
from hybridpd.engine.core import EngineCore
from hybridpd.engine.request import Request
from hybridpd.engine.transfer import (
    Checkpoint,
    ImportSource,
    abort_import,
    begin_import,
    complete_import,
    confirm_import,
    end_unscheduled,
    refuse_unconfirmed,
    run_unconfirmed,
    schedule_local,
)
from hybridpd.kvtransfer.binding import prompt_digest
from hybridpd.kvtransfer.pull import PullHandle, PullSpec, PullState, start_pull
from hybridpd.kvtransfer.tp_pull import TPPeer, TPPullHandle, start_tp_pull
from hybridpd.proto import hybridpd_pb2 as pb

log = logging.getLogger("hybridpd.decode")


@dataclass
class PendingPull:
    """The transport side of one import (the Import itself is in `core.scheduler.importing`)."""

    req: Request
    handle: PullHandle | TPPullHandle
    params: pb.TransferParams
    digest: bytes
    """D's own digest of the request's first `num_external` prompt tokens: what Commit presents to P."""
    pages_read: dict[int, tuple[int, ...]]
    """P's page ids this pull reads, by group (attention blocks past D's hit; recurrent slots): Commit names them."""
    committing: bool = False
    unconfirmed: bool = False
    """The request runs on the pulled pages while the Commit is in flight (its output held back)."""
    posted_at: float = 0.0
    """perf_counter() when the READ was posted, and when a poll saw it done (hybridpd_kv_handoff_seconds)."""
    done_at: float = 0.0


class Consumer:
    """`commit(pending)` is called on the step thread once a pull's READ is DONE; it must arrange (asynchronously)
    for `on_commit(core, pending, committed, reason)` to run on the step thread with P's answer. `overlap`: the
    request decodes on the pulled pages meanwhile (its output held back until the answer)."""

    def __init__(
        self,
        policy: str = "recompute",
        timeout_s: float = 10.0,
        commit: Callable[[PendingPull], None] | None = None,
        metrics=None,  # type: ignore[no-untyped-def]  # kvtransfer.metrics.TransferMetrics
        lease_margin_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        commit_grace_s: float = 10.0,
        overlap: bool = True,
    ) -> None:
        self.policy = policy
        self.overlap = overlap
        self.timeout_s = timeout_s
        self.commit = commit
        self.metrics = metrics
        self.lease_margin_s = lease_margin_s
        """A pull must complete this long before the lease's expiry (absorbs clock skew and the Commit trip)."""
        self.clock = clock  # wall clock: lease_expiry_unix is P's unix time
        self.commit_grace_s = commit_grace_s
        """The engine gives up on an import this long after its pull's timeout (a Commit that never answers)."""
        self.pending: dict[str, PendingPull] = {}
        self.num_recomputed = 0
        self.num_refused: dict[str, int] = {}
        self.handed_over: dict[str, tuple[float, float, float]] = {}
        """request id -> perf_counter() at (READ posted, READ seen done, Commit confirmed) of a completed handoff;
        the Generate call pops it at its first token (or its end) to time the phases."""

    def num_pulling(self) -> int:
        """Pulls whose READ is still in flight (they need polling; committing ones wait for P's answer, which
        wakes the step loop by itself)."""
        return sum(not p.committing for p in self.pending.values())

    def _refuse(self, core: EngineCore, req: Request, reason: str, detail: str) -> str:
        self._count_refusal(req, reason, detail)
        return self._fallback(core, req, f"{reason}: {detail}")

    def _count_refusal(self, req: Request, reason: str, detail: str) -> None:
        self.num_refused[reason] = self.num_refused.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.transfer_failed(reason)
        log.warning("request %s: transfer refused (%s): %s", req.request_id, reason, detail)

    def admit(self, core: EngineCore, req: Request, tp: pb.TransferParams, peer) -> str:  # type: ignore[no-untyped-def]
        """Start pulling for `req`. Returns "pulling", "local" when it was scheduled to compute locally, or
        "failed" (policy fail: the request ended with an error)."""
        n_ext = int(tp.num_computed_tokens)
        if peer is None or n_ext <= 0 or n_ext > req.num_prompt_tokens:
            schedule_local(core, req)
            return "local"
        digest = prompt_digest(req.prompt_token_ids, n_ext, req.cache_salt)
        if digest != tp.prompt_digest:
            return self._refuse(core, req, "prompt_mismatch", "transfer params were computed for another prompt")
        problem = params_problem(core, req, tp)
        if problem is not None:
            return self._refuse(core, req, "bad_params", problem)
        time_left = float(tp.lease_expiry_unix) - self.clock() - self.lease_margin_s
        if time_left <= 0:
            return self._refuse(core, req, "lease_expired", f"lease ended {-time_left:.1f} s before a pull could")
        pull_timeout = min(self.timeout_s, time_left)
        whole_pages = not isinstance(peer, TPPeer) or peer.whole_pages
        try:
            imp = begin_import(core, req, source_of(tp, checkpoint=whole_pages),
                               deadline=core.clock() + pull_timeout + self.commit_grace_s, fallback=self.policy)
        except ValueError as e:  # the params do not name the pages this request needs: nothing was kept
            return self._refuse(core, req, "bad_params", str(e))
        if imp is None:  # no room to receive now: compute it here when room frees up
            log.info("request %s: no cache room to receive %d tokens; computing locally", req.request_id, n_ext)
            schedule_local(core, req)
            return "local"
        src_blocks, dst_blocks = imp.read_blocks()
        spec = PullSpec(request_id=req.request_id, src_epoch=tp.epoch, src_blocks=src_blocks,
                        dst_blocks=dst_blocks, src_state_slots=imp.src_state_slots,
                        dst_state_slots=imp.dst_state_slots, lease_token=tp.lease_token, notify_done=False)
        handle: PullHandle | TPPullHandle
        try:
            if isinstance(peer, TPPeer):  # either side runs tensor-parallel: every D rank pulls its slice
                handle = start_tp_pull(core, peer, spec, timeout_s=pull_timeout, policy=self.policy,
                                       metrics=self.metrics)
            else:
                handle = start_pull(peer, spec, timeout_s=pull_timeout, policy=self.policy)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - stale epoch, bad ids: same policy as a failed pull
            log.warning("request %s: pull refused (%s)", req.request_id, e)
            self._undo(core, req, reusable=True)
            return self._fallback(core, req, str(e))
        read = {**src_blocks, **imp.src_state_slots}
        self.pending[req.request_id] = PendingPull(req, handle, tp, digest, read, posted_at=time.perf_counter())
        return "pulling"

    def poll(self, core: EngineCore) -> None:
        for rid in list(self.pending):
            p = self.pending[rid]
            if p.committing:
                continue
            state = p.handle.poll()
            if state is PullState.PENDING:
                continue
            if state is PullState.DONE:
                p.done_at = time.perf_counter()
                if self.commit is None:  # no way to ask P: the data cannot be trusted
                    self.on_commit(core, p, False, "no commit channel")
                else:
                    p.committing = True
                    self.commit(p)
                    if self.overlap:  # decode at this very step, while P answers
                        run_unconfirmed(core, p.req)
                        p.unconfirmed = True
                continue
            del self.pending[rid]
            res = p.handle.result
            reusable = res.dst_reusable if res is not None else False
            log.warning("request %s: pull failed (%s)", rid, res.reason if res else "?")
            self._undo(core, p.req, reusable)
            self._fallback(core, p.req, (res.reason if res else None) or "transfer failed")

    def on_commit(self, core: EngineCore, p: PendingPull, committed: bool, reason: str = "") -> Request | None:
        """P's answer to the Commit of the pull `p` (step thread). Ignored if that pull is no longer pending: its
        request ended since, and another request may have come under the same id (an answer meant for the old
        pull must never confirm or free the new one's pages). Returns the request when it was confirmed (the
        caller streams the output it held back)."""
        request_id = p.req.request_id
        if self.pending.get(request_id) is not p:
            return None
        del self.pending[request_id]
        if committed:
            (confirm_import if p.unconfirmed else complete_import)(core, p.req)
            self.handed_over[request_id] = (p.posted_at, p.done_at, time.perf_counter())
            return p.req
        detail = f"P did not confirm the lease after the READ ({reason})"
        if not p.unconfirmed:
            self._undo(core, p.req, reusable=True)  # no READ in flight: the pages are merely garbage
            self._refuse(core, p.req, "lease_lost", detail)
            return None
        self._count_refusal(p.req, "lease_lost", detail)
        if self.policy != "fail":
            self.num_recomputed += 1
        refuse_unconfirmed(core, p.req, self.policy, f"transfer failed: lease_lost: {detail}")
        return None

    def abort(self, core: EngineCore, request_id: str) -> bool:
        """End a request whose pull is in flight or committing ("abort"): the engine's one finish path, which calls
        `cancel` back. False if no pull of it is pending."""
        if request_id not in self.pending:
            return False
        core.abort(request_id)
        return True

    def cancel(self, request_id: str) -> bool:
        """`EngineCore.transfer_canceller`: stop the pull into an import the engine is ending; returns whether its
        pages may be reused (False: a READ may still land)."""
        p = self.pending.pop(request_id, None)
        if p is None:
            return True  # nothing in flight (refused before the pull started)
        p.handle.cancel()  # no-op once DONE (committing): the Commit in flight ends P's lease
        res = p.handle.result
        return res.dst_reusable if res is not None else False

    def _undo(self, core: EngineCore, req: Request, reusable: bool) -> None:
        abort_import(core, req, None, reusable)  # not reusable: a READ may still land there; quarantined

    def _fallback(self, core: EngineCore, req: Request, reason: str) -> str:
        if self.policy == "fail":
            end_unscheduled(core, req, "error", f"transfer failed: {reason}")  # its stream ends with the error
            return "failed"
        self.num_recomputed += 1
        schedule_local(core, req)
        return "local"


def overlap_from_env() -> bool:
    """HYBRIDPD_COMMIT_OVERLAP: "0" makes a request wait for P's Commit answer before it decodes (the handoff before
    the overlap, for A/B measurements); anything else, or unset, overlaps them."""
    return os.environ.get("HYBRIDPD_COMMIT_OVERLAP", "1").strip() != "0"


def source_of(tp: pb.TransferParams, checkpoint: bool = True) -> ImportSource:
    """The engine's view of transfer params (group ids are the model's: identical on both sides). `checkpoint`:
    whether P's checkpoint offer is kept: its pages land whole in ours only when both workers are single-rank or
    slice every tensor alike (TPPeer.whole_pages); otherwise it is dropped and D pulls blocks and states alone."""
    offer = None
    if checkpoint and tp.checkpoint_num_tokens and tp.checkpoint_pages:
        offer = Checkpoint(int(tp.checkpoint_num_tokens), tuple(int(p) for p in tp.checkpoint_pages))
    return ImportSource(int(tp.num_computed_tokens), {g.group_id: list(g.block_ids) for g in tp.groups},
                        {int(g.group_id): int(g.state_slot) for g in tp.states}, offer)
