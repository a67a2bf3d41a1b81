"""D side: pull a prefilled request's missing attention blocks and recurrent state slots from P.

Flow (one request):

    D engine thread                                   P (passive: NIXL READ needs no P code, only its agent)
    peer = agent.peer(params.worker_id, params.epoch)     # StaleEpochError / UnknownPeerError: re-handshake or
    h = start_pull(peer, PullSpec(...))                   #   apply the failure policy
    ... every step: h.poll() -> PENDING | DONE | FAILED   # never blocks; FAILED after `timeout_s` at the latest
    DONE:   the pages are in D's caches; NIXL tells P   -> P: agent.poll_releases() -> LeaseTable.release()
    FAILED: h.result.policy says recompute or fail; D sends P a best-effort release (ok=0); if
            h.result.dst_reusable is False the READ could not be cancelled: keep those D pages out of use.

Ownership: the caller (D's cache manager) allocated the destination blocks/slots and keeps them allocated until the
handle is DONE or FAILED; it decides which blocks to pull (only those D does not already hold). P keeps the source
pages pinned under its lease until the release arrives or the lease expires. The handle is polled by one thread.

Blocking: `start_pull` plans (pure Python/numpy, ~1 ms for a thousand runs) and posts. Between two processes on one
host without GPUs, UCX reads over CMA (process_vm_readv) and copies inside the post, so on CPU `start_pull` returns
with the bytes mostly moved; with GPU transports (cuda_ipc, RDMA) the post returns at once and `poll` sees progress.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from .agent import PeerHandle
from .descriptors import PullPlan, plan_pull, split_plan
from .errors import StaleEpochError
from .layout import CacheLayout
from .notify import encode_release

logger = logging.getLogger(__name__)

TransferPolicy = Literal["recompute", "fail"]
"""What D does when a pull fails: recompute the prompt locally (default) or fail the request."""

REASON_TIMEOUT = "timeout"
REASON_NIXL = "nixl_error"
REASON_STALE_EPOCH = "stale_epoch"
REASON_CANCELLED = "cancelled"


class PullState(str, Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class PullSpec:
    """What to pull for one request. Maps are {group id: ids}; P's ids (`src_*`, from TransferParams) pair up
    position by position with D's freshly allocated ids (`dst_*`). Attention groups go in `*_blocks`, recurrent
    groups in `*_state_slots` (the running state). A checkpoint D caches travels as extra blocks of every attention
    group (engine.transfer.Import.read_blocks)."""

    request_id: str
    src_epoch: str
    src_blocks: Mapping[int, Sequence[int]] = field(default_factory=dict)
    dst_blocks: Mapping[int, Sequence[int]] = field(default_factory=dict)
    src_state_slots: Mapping[int, Sequence[int]] = field(default_factory=dict)
    dst_state_slots: Mapping[int, Sequence[int]] = field(default_factory=dict)
    lease_token: str = ""
    """P's lease token (TransferParams.lease_token): release notices carry it, P ignores notices without it."""
    notify_done: bool = True
    """Send P a release notice (ok=1) once the data are in place. The engine's decode worker sets False: it ends
    the lease with P's Commit RPC instead, which also tells it whether the lease was still held (fail closed)."""

    def pages_by_group(self, layout: CacheLayout) -> dict[int, tuple[Sequence[int], Sequence[int]]]:
        """{group id: (src ids, dst ids)}; checks each group sits in the right map and both sides name it."""
        out: dict[int, tuple[Sequence[int], Sequence[int]]] = {}
        for src, dst, attention, what in (
            (self.src_blocks, self.dst_blocks, True, "blocks (attention groups)"),
            (self.src_state_slots, self.dst_state_slots, False, "state slots (recurrent groups)"),
        ):
            if set(src) != set(dst):
                raise ValueError(f"{what}: source groups {sorted(src)} != destination groups {sorted(dst)}")
            for gid in src:
                if gid not in layout.group_kinds:
                    raise ValueError(f"{what}: unknown group {gid}")
                if layout.is_attention(gid) != attention:
                    raise ValueError(f"{what}: group {gid} holds {layout.kind(gid)} layers")
                out[gid] = (src[gid], dst[gid])
        return out


@dataclass(frozen=True)
class PullResult:
    """Outcome of one pull. `dst_reusable` is False only when a failed READ could not be cancelled."""

    request_id: str
    state: PullState
    policy: TransferPolicy
    nbytes: int
    descriptors: int
    seconds: float
    reason: str | None = None
    dst_reusable: bool = True
    nixl_descriptors: int | None = None  # what NIXL posted after merging pages (AgentConfig.telemetry only)
    nixl_seconds: float | None = None  # NIXL's own first post -> last completion (AgentConfig.telemetry only)
    nixl_post_seconds: float | None = None  # of that, the longest post call (AgentConfig.telemetry only)


class PullHandle:
    """One in-flight pull. Made by `start_pull`; `poll()` from one thread (the engine loop) until not PENDING."""

    def __init__(
        self,
        peer: PeerHandle,
        spec: PullSpec,
        plan: PullPlan,
        policy: TransferPolicy,
        timeout_s: float,
        clock: Callable[[], float],
        t_begin: float | None = None,
    ) -> None:
        self.peer, self.spec, self.plan, self.policy = peer, spec, plan, policy
        self._clock = clock
        self._deadline = clock() + timeout_s
        now = time.perf_counter()
        self.marks: dict[str, float] = {"begin": now if t_begin is None else t_begin, "planned": now}
        """perf_counter() at each phase: begin, planned, made, posted, done (first poll that saw all READs done),
        finished (handles released, metrics and notices sent). benchmarks/transfer.py reports the gaps."""
        self._xfers: list[Any] = []  # every READ made for this pull, until _finish releases them
        self._pending: list[Any] = []  # those not yet DONE (empty before the first status)
        self._notify_on_done = False
        self._result: PullResult | None = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def result(self) -> PullResult | None:
        return self._result

    def _start(self) -> None:
        agent = self.peer.agent
        if self.plan.num_descriptors == 0:
            if self.spec.notify_done:
                agent.send_notif(self.peer, self._notice(ok=True))
            self._finish(PullState.DONE, None)
            return
        parts = split_plan(self.plan, agent.parallel_reads)
        # One READ carries the release notice itself (NIXL sends it once the data are in place), unless the agent
        # sends notices after the fact. Several READs carry none: the notice goes out from _finish once every one
        # of them is DONE.
        notify_done = self.spec.notify_done
        self._notify_on_done = notify_done and (len(parts) > 1 or agent.notice_after_done)
        notif = self._notice(ok=True) if notify_done and not self._notify_on_done else b""
        statuses = []
        try:
            for part in parts:
                self._xfers.append(agent.make_read(self.peer, part, notif))
            self.marks["made"] = time.perf_counter()
            statuses = [agent.post(x) for x in self._xfers]
            self.marks["posted"] = time.perf_counter()
        except Exception:  # noqa: BLE001 - NIXL binding errors (peer unreachable, ...)
            statuses = ["ERR"]
        self._on_status(statuses)

    def _notice(self, ok: bool) -> bytes:
        return encode_release(self.spec.request_id, self.spec.src_epoch, ok, self.spec.lease_token)

    def _on_status(self, statuses: list[str]) -> None:
        """Statuses of the READs still pending (in `self._pending` order): done ones leave the pending list."""
        if any(st not in ("DONE", "PROC") for st in statuses):
            self._finish(PullState.FAILED, REASON_NIXL)
            return
        self._pending = [x for x, st in zip(self._pending or self._xfers, statuses, strict=True) if st == "PROC"]
        if not self._pending:
            self.marks["done"] = time.perf_counter()
            self._finish(PullState.DONE, None)
        elif self._clock() >= self._deadline:
            self._finish(PullState.FAILED, REASON_TIMEOUT)

    def poll(self) -> PullState:
        """Non-blocking: advance and report. FAILED at the latest once `timeout_s` has passed."""
        if self._result is None:
            try:
                statuses = [self.peer.agent.check(x) for x in self._pending]
            except Exception:  # noqa: BLE001
                statuses = ["ERR"]
            self._on_status(statuses)
        return PullState.PENDING if self._result is None else self._result.state

    def wait(self, interval_s: float = 1e-4) -> PullResult:
        """Blocking poll loop, for tests, benchmarks and tools; the engine polls instead."""
        while self.poll() is PullState.PENDING:
            if interval_s:
                time.sleep(interval_s)
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        """Give up (request aborted): cancels the READ and releases P's lease. No-op once finished."""
        if self._result is None:
            self._finish(PullState.FAILED, REASON_CANCELLED)

    def _finish(self, state: PullState, reason: str | None) -> None:
        agent, done = self.peer.agent, state is PullState.DONE
        seconds = time.perf_counter() - self.marks["begin"]
        nixl_descs = nixl_seconds = nixl_post = None
        if done and self._xfers:
            got = [agent.xfer_telemetry(x) for x in self._xfers]
            tel = [t for t in got if t is not None]
            if len(tel) == len(got):  # telemetry on: NIXL's descriptors after merging, first start -> last completion
                nixl_descs = sum(t[0] for t in tel)
                nixl_seconds = max(t[1] + t[3] for t in tel) - min(t[1] for t in tel)
                nixl_post = max(t[2] for t in tel)
        # release every READ (cancels those still in flight); all must succeed for D's pages to be reusable
        reusable = all([agent.release_xfer(x) for x in self._xfers])
        self._xfers, self._pending = [], []
        if done and self._notify_on_done:
            agent.send_notif(self.peer, self._notice(ok=True))
        self._result = PullResult(
            self.spec.request_id,
            state,
            self.policy,
            self.plan.nbytes if done else 0,
            self.plan.num_descriptors,
            seconds,
            reason,
            reusable,
            nixl_descs,
            nixl_seconds,
            nixl_post,
        )
        if done:
            agent.metrics.transfer_done(self.plan.bytes_by_kind, seconds, self.plan.num_descriptors)
            self.marks["finished"] = time.perf_counter()
        else:
            agent.metrics.transfer_failed(reason or REASON_NIXL)
            agent.send_notif(self.peer, self._notice(ok=False))
            logger.warning(
                "pull %s from %s failed after %.3f s: %s (policy %s%s)",
                self.spec.request_id,
                self.peer.worker,
                seconds,
                reason,
                self.policy,
                "" if reusable else "; READ not cancelled, destination pages unusable",
            )


def start_pull(
    peer: PeerHandle,
    spec: PullSpec,
    *,
    timeout_s: float = 10.0,
    policy: TransferPolicy = "recompute",
    clock: Callable[[], float] = time.monotonic,
) -> PullHandle:
    """Plan and post the READ of `spec` from `peer` into the local agent's caches; returns at once.

    Raises StaleEpochError when `spec.src_epoch` is not the peer's live epoch (or the peer was replaced), and
    ValueError for inconsistent ids (counts differ, null block, out of range, duplicates, wrong group kind): those
    are refusals or caller bugs, nothing was sent. Transport failures surface as FAILED through `poll()`."""
    t_begin = time.perf_counter()
    agent = peer.agent
    if spec.src_epoch != peer.epoch or not peer.valid:
        agent.metrics.transfer_failed(REASON_STALE_EPOCH)
        raise StaleEpochError(
            f"request {spec.request_id!r} names epoch {spec.src_epoch!r} of worker {peer.worker!r}; "
            f"live epoch is {peer.epoch!r}" + ("" if peer.valid else " (peer handle replaced)")
        )
    plan = plan_pull(peer.layout, agent.layout, spec.pages_by_group(agent.layout))
    handle = PullHandle(peer, spec, plan, policy, timeout_s, clock, t_begin)
    handle._start()
    return handle
