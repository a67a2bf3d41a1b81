"""Consumer-side transfer state machine (step thread only).

    admit(params) --checks--> allocate_for_transfer --> [pulling] --poll: DONE--> [committing] --P says held-->
        |  lease expired (no time left to pull)            |                         |   zero tail, publish blocks/
        |  prompt digest != params' (foreign params)       |                         |   checkpoint, scheduler.
        v                                                  |                         |   add_transferred (at N-1)
    policy: recompute locally (default) or fail            +--poll: FAILED-----------+--P says no (lease expired,
                                                                                         wrong prompt/token), or
                                                                                         Commit unreachable
                                                                                     --> discard, recompute / fail
Fail closed: pulled pages are used (scheduled, hashed into the prefix cache) only after P's Commit confirmed that
the lease was still held when the READ had completed and was granted for this very prompt. Every refusal is
counted in hybridpd_kv_transfer_failures_total{role="decode", reason}. `num_computed_tokens` is set only then."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.cache.coordinator import TransferAllocation
from engine.core import EngineCore
from engine.request import Request
from kvtransfer.binding import prompt_digest
from kvtransfer.pull import PullHandle, PullSpec, PullState, start_pull
from proto import hybridpd_pb2 as pb

log = logging.getLogger("hybridpd.decode")


@dataclass
class PendingPull:
    req: Request
    handle: PullHandle
    alloc: TransferAllocation
    num_external: int
    checkpoint: tuple[int, bytes] | None
    params: pb.TransferParams
    digest: bytes
    """D's own digest of the request's first `num_external` prompt tokens: what Commit presents to P."""
    committing: bool = False


class Consumer:
    """`commit(pending)` is called on the step thread once a pull's READ is DONE; it must arrange (asynchronously)
    for `on_commit(core, request_id, committed, reason)` to run on the step thread with P's answer."""

    def __init__(
        self,
        policy: str = "recompute",
        timeout_s: float = 10.0,
        commit: Callable[[PendingPull], None] | None = None,
        metrics=None,  # type: ignore[no-untyped-def]  # kvtransfer.metrics.TransferMetrics
        lease_margin_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.timeout_s = timeout_s
        self.commit = commit
        self.metrics = metrics
        self.lease_margin_s = lease_margin_s
        """A pull must complete this long before the lease's expiry (absorbs clock skew and the Commit trip)."""
        self.clock = clock  # wall clock: lease_expiry_unix is P's unix time
        self.pending: dict[str, PendingPull] = {}
        self.num_recomputed = 0
        self.num_refused: dict[str, int] = {}
        self.failed: list[Request] = []

    def _refuse(self, core: EngineCore, req: Request, reason: str, detail: str) -> str:
        self.num_refused[reason] = self.num_refused.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.transfer_failed(reason)
        log.warning("request %s: transfer refused (%s): %s", req.request_id, reason, detail)
        return self._fallback(core, req, f"{reason}: {detail}")

    def admit(self, core: EngineCore, req: Request, tp: pb.TransferParams, peer) -> str:  # type: ignore[no-untyped-def]
        """Start pulling for `req`. Returns "pulling", "local" when it was scheduled to compute locally, or
        "failed" (policy fail: the request is in `self.failed`)."""
        n_ext = int(tp.num_computed_tokens)
        if peer is None or n_ext <= 0 or n_ext >= req.num_tokens:
            core.scheduler.add_request(req)
            return "local"
        digest = prompt_digest(req.prompt_token_ids, n_ext, req.cache_salt)
        if digest != tp.prompt_digest:
            return self._refuse(core, req, "prompt_mismatch", "transfer params were computed for another prompt")
        time_left = float(tp.lease_expiry_unix) - self.clock() - self.lease_margin_s
        if time_left <= 0:
            return self._refuse(core, req, "lease_expired", f"lease ended {-time_left:.1f} s before a pull could")
        alloc = core.cache.allocate_for_transfer(req, n_ext)
        if alloc is None:  # no room to receive now: compute it here when room frees up
            log.info("request %s: no cache room to receive %d tokens; computing locally", req.request_id, n_ext)
            core.scheduler.add_request(req)
            return "local"
        spec_kwargs: dict = {}
        ckpt = None
        attn, rec = core.cache.attention, core.cache.recurrent
        if attn is not None:
            src = [int(b) for g in tp.groups if g.group_id == attn.group.group_id for b in g.block_ids]
            src = src[alloc.first_block_index:]
            if len(src) != len(alloc.block_ids):
                core.cache.free(req)
                raise ValueError(f"transfer params name {len(src)} blocks, expected {len(alloc.block_ids)}")
            spec_kwargs["src_blocks"] = {attn.group.group_id: src}
            spec_kwargs["dst_blocks"] = {attn.group.group_id: alloc.block_ids}
        if rec is not None:
            src_slots, dst_slots = [int(tp.state_slot)], [alloc.state_slot]
            if tp.checkpoint_slot and tp.checkpoint_num_tokens > alloc.local_hit_tokens:
                ckpt = core.cache.reserve_checkpoint(req, int(tp.checkpoint_num_tokens))
                if ckpt is not None:
                    src_slots.append(int(tp.checkpoint_slot))
                    dst_slots.append(ckpt[0])
            spec_kwargs["src_state_slots"] = {rec.group.group_id: src_slots}
            spec_kwargs["dst_state_slots"] = {rec.group.group_id: dst_slots}
        spec = PullSpec(request_id=req.request_id, src_epoch=tp.epoch, lease_token=tp.lease_token,
                        notify_done=False, **spec_kwargs)
        try:
            handle = start_pull(peer, spec, timeout_s=min(self.timeout_s, time_left),
                                policy=self.policy)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - stale epoch, bad ids: same policy as a failed pull
            log.warning("request %s: pull refused (%s)", req.request_id, e)
            self._undo(core, req, ckpt, reusable=True)
            return self._fallback(core, req, str(e))
        self.pending[req.request_id] = PendingPull(req, handle, alloc, n_ext, ckpt, tp, digest)
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
                if self.commit is None:  # no way to ask P: the data cannot be trusted
                    self.on_commit(core, rid, False, "no commit channel")
                else:
                    p.committing = True
                    self.commit(p)
                continue
            del self.pending[rid]
            res = p.handle.result
            reusable = res.dst_reusable if res is not None else False
            log.warning("request %s: pull failed (%s)", rid, res.reason if res else "?")
            self._undo(core, p.req, p.checkpoint, reusable)
            self._fallback(core, p.req, res.reason if res else "transfer failed")

    def on_commit(self, core: EngineCore, request_id: str, committed: bool, reason: str = "") -> None:
        """P's answer to the Commit of a completed pull (step thread). Ignored if the request was aborted since."""
        p = self.pending.pop(request_id, None)
        if p is None:
            return
        if committed:
            self._complete(core, p)
            return
        self._undo(core, p.req, p.checkpoint, reusable=True)  # no READ in flight: the pages are merely garbage
        self._refuse(core, p.req, "lease_lost", f"P did not confirm the lease after the READ ({reason})")

    def abort(self, core: EngineCore, request_id: str) -> bool:
        p = self.pending.pop(request_id, None)
        if p is None:
            return False
        p.handle.cancel()  # no-op once DONE (committing): the Commit in flight ends P's lease
        res = p.handle.result
        self._undo(core, p.req, p.checkpoint, res.dst_reusable if res is not None else False)
        core.scheduler.finish(p.req, "abort", free_caches=False)
        return True

    def _complete(self, core: EngineCore, p: PendingPull) -> None:
        req, n = p.req, p.num_external
        bs = core.cache.block_size
        if n % bs and p.alloc.block_ids:
            core.runner.zero_block_tail(p.alloc.block_ids[-1], n % bs)
        req.num_computed_tokens = n
        req.num_cached_tokens = n
        req.external_computed_tokens = n - p.alloc.local_hit_tokens
        core.cache.publish_transferred(req, n)
        if p.checkpoint is not None:
            core.cache.publish_checkpoint(*p.checkpoint)
        core.cache.count_external(req, req.external_computed_tokens)
        core.scheduler.add_transferred(req)

    def _undo(self, core: EngineCore, req: Request, ckpt: tuple[int, bytes] | None, reusable: bool) -> None:
        if not reusable:  # a READ may still land in these pages: never hand them out again
            log.error("request %s: transfer could not be cancelled; its pages are quarantined", req.request_id)
            return
        core.cache.free(req)
        if ckpt is not None:
            core.cache.drop_checkpoint(ckpt[0])

    def _fallback(self, core: EngineCore, req: Request, reason: str) -> str:
        if self.policy == "fail":
            req.stop_reason = f"transfer failed: {reason}"
            core.scheduler.finish(req, "error", free_caches=False)
            self.failed.append(req)
            return "failed"
        self.num_recomputed += 1
        req.num_computed_tokens = 0
        core.scheduler.add_request(req)
        return "local"
