"""Consumer-side transfer state machine (step thread only).

    admit(params) --allocate_for_transfer--> [pulling] --poll: DONE--> zero tail, publish blocks/checkpoint,
                                                 |                   scheduler.add_transferred (continues at N-1)
                                                 +--poll: FAILED--> policy recompute: free, schedule from scratch
                                                                    policy fail: finish with "error"
No path schedules a request whose pull has not completed: `num_computed_tokens` is set only on DONE."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.cache.coordinator import TransferAllocation
from engine.core import EngineCore
from engine.request import Request
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


class Consumer:
    def __init__(self, policy: str = "recompute", timeout_s: float = 10.0) -> None:
        self.policy = policy
        self.timeout_s = timeout_s
        self.pending: dict[str, PendingPull] = {}
        self.num_recomputed = 0
        self.failed: list[Request] = []

    def admit(self, core: EngineCore, req: Request, tp: pb.TransferParams, peer) -> str:  # type: ignore[no-untyped-def]
        """Start pulling for `req`. Returns "pulling", or "local" when it was scheduled to compute locally."""
        n_ext = int(tp.num_computed_tokens)
        if peer is None or n_ext <= 0 or n_ext >= req.num_tokens:
            core.scheduler.add_request(req)
            return "local"
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
        spec = PullSpec(request_id=req.request_id, src_epoch=tp.epoch, **spec_kwargs)
        try:
            handle = start_pull(peer, spec, timeout_s=self.timeout_s, policy=self.policy)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - stale epoch, bad ids: same policy as a failed pull
            log.warning("request %s: pull refused (%s)", req.request_id, e)
            self._undo(core, req, ckpt, reusable=True)
            return self._fallback(core, req, str(e))
        self.pending[req.request_id] = PendingPull(req, handle, alloc, n_ext, ckpt)
        return "pulling"

    def poll(self, core: EngineCore) -> None:
        for rid in list(self.pending):
            p = self.pending[rid]
            state = p.handle.poll()
            if state is PullState.PENDING:
                continue
            del self.pending[rid]
            if state is PullState.DONE:
                self._complete(core, p)
            else:
                res = p.handle.result
                reusable = res.dst_reusable if res is not None else False
                log.warning("request %s: pull failed (%s)", rid, res.reason if res else "?")
                self._undo(core, p.req, p.checkpoint, reusable)
                self._fallback(core, p.req, res.reason if res else "transfer failed")

    def abort(self, core: EngineCore, request_id: str) -> bool:
        p = self.pending.pop(request_id, None)
        if p is None:
            return False
        p.handle.cancel()
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
