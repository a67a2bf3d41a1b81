"""Handoffs over NIXL when P or D runs tensor-parallel: one agent per rank (one per OS process), and every D rank
reads its slice of each page from the P ranks that hold it, with the byte pieces kvtransfer.tp_slices plans once
per peer pair.

    worker start (rank 0, before its step thread):  on_ranks(start_rank_agent) -> every rank registers its caches;
                                                    the rank blobs + slicing = the worker's TPLayout (handshake)
    D handshake (gRPC thread): tp_handshake.problems(mine, P's) -> refuse the peer, or a TPPeer
    D admit (step thread):  on_ranks(load_rank_peer) once per peer: each D rank loads the P ranks it reads from
                            and plans its pieces; on_ranks(start_rank_pull): each D rank posts one READ per P rank
    D poll (step thread):   on_ranks(check_rank_pull) -> DONE when every rank is done; any ERR, or the deadline,
                            fails the whole pull (the request is recomputed: fail closed), then forget_rank_pull
                            releases every rank's READs (reusable only if all could be released)

The functions named `*_rank_*` run on each rank through `LeaderRunner.on_all` (the ranks' control channel, so
they are called from rank 0's step thread only); they never raise (an exception on a follower would end it):
errors come back as strings. P's side is unchanged but for its followers' agents: leases, Commit and the MAC'd
params live on rank 0, and block ids are the same on every rank. What progresses each rank's agent (a follower's
is touched only by rank 0's commands, and a P follower's must answer D's READs): `rank_progress`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .descriptors import check_pairs
from .errors import StaleEpochError, TransferError
from .notify import encode_release
from .pull import REASON_CANCELLED, REASON_NIXL, REASON_TIMEOUT, PullResult, PullSpec, PullState
from .tp_handshake import TPLayout
from .tp_slices import plan_peer

log = logging.getLogger(__name__)
_pull_ids = itertools.count()


@dataclass
class _PeerPlan:
    """One D rank's view of one P worker: the P ranks' handles, and per group the (local region, {P rank: (P
    region, pieces (k, 3) int64 rows (src offset, dst offset, bytes))}) of each tensor."""

    handles: dict[int, Any]
    groups: dict[int, list[tuple[Any, dict[int, tuple[Any, np.ndarray]]]]]


@dataclass
class _RankState:
    agent: Any
    tensors: dict[int, list[Any]]
    progress: Any = None
    peers: dict[tuple[str, str], _PeerPlan] = field(default_factory=dict)
    pulls: dict[str, list[Any]] = field(default_factory=dict)


_RANK: _RankState | None = None
"""This process's rank agent (one per OS process)."""


def rank_layout(group_tensors: Any, groups: Any, model_id: str, checkpoint_interval: int) -> Any:
    """The CacheLayout of one rank's caches (its slice of every page)."""
    from .layout import CacheLayout, GroupTensors

    out = []
    for g in groups:
        tensors = group_tensors[g.group_id]  # stacked: [pages, layers, ...] per cache kind
        entry = tensors[0] if g.is_attention else tensors
        out.append(GroupTensors(g.group_id, "attention" if g.is_attention else g.kind, [entry], g.layer_ids, True))
    extra = {f"spec.{g.group_id}": repr(g.spec) for g in groups}
    extra["checkpoint_interval"] = str(checkpoint_interval)
    return CacheLayout.from_tensors(out, model_id=model_id, extra=extra)


def rank_progress(
    rank: int, role: str, device_type: str, config: Any, interval: float | None
) -> tuple[Any, float | None]:
    """What progresses rank `rank`'s agent: (its AgentConfig, the interval of a light TransferProgress thread or
    None). `interval` is kvtransfer.progress.interval_from_env for the cache's device.

    Rank 0 is left as configured: its services progress it (P: the lease hook and step loop; D: the pulls' polls),
    the TP 1 path. A follower's agent is touched only by rank 0's commands, so:
      * a light thread when one is allowed (DRAM caches, or HYBRIDPD_TRANSFER_PROGRESS_S set), as before;
      * else (VRAM) on P, NIXL's own progress thread: nothing else ever progresses a P follower, whose agent must
        answer D's connection setup and READs (with none, every pull from it timed out on two H100s). NIXL's
        thread on a GPU P is the configuration seen to work (kvtransfer.progress.interval_from_env);
      * else (VRAM) on D, nothing more: its READs advance in check_rank_pull, which rank 0's poll runs on the
        follower's own command loop while a pull is in flight (NIXL's thread on a GPU D aborted inside UCX).
    """
    if rank == 0 or config.progress_thread:
        return config, None
    if interval is not None:
        return config, max(interval, 1e-3)
    if role == "prefill":
        return dataclasses.replace(config, progress_thread=True), None
    return config, None


def start_rank_agent(runner: Any, rank: int, setup: dict[str, Any]) -> bytes | str:
    """On every rank at worker start: register this rank's caches with its own NIXL agent. Returns the agent's
    handshake blob (or an error string)."""
    global _RANK
    try:
        from hybridpd.engine.parallel.handoff import sharded_tensors

        from .agent import TransferAgent
        from .metrics import TransferMetrics
        from .progress import TransferProgress, interval_from_env

        layout = rank_layout(runner.group_tensors, setup["groups"], setup["model_id"], setup["checkpoint_interval"])
        name = setup["name"] if rank == 0 else f"{setup['name']}.r{rank}"
        config, interval = rank_progress(
            rank, setup["role"], layout.device_type, setup["agent_config"], interval_from_env(layout.device_type)
        )
        agent = TransferAgent(name, layout, setup["epoch"], config=config, metrics=TransferMetrics(setup["role"]))
        progress = None
        if interval is not None:
            progress = TransferProgress(
                agent.poll_releases, lambda: True, interval_s=interval, name=f"nixl-progress-r{rank}"
            )
        _RANK = _RankState(agent, sharded_tensors(runner.model, setup["groups"], setup["world"]), progress)
        return agent.local_metadata()
    except Exception as e:  # noqa: BLE001 - reported by rank 0, never raised on a follower
        log.exception("rank %d: transfer agent failed", rank)
        return f"rank {rank}: {e!r}"


def start_agents(core: Any, name: str, epoch: str, model_id: str, agent_config: Any, role: str) -> tuple[Any, TPLayout]:
    """Rank 0, before its step thread starts: one agent per rank. Returns rank 0's agent and the worker's
    TPLayout. Raises TransferError when a rank could not register its caches."""
    from hybridpd.engine.parallel.handoff import on_ranks

    world = core.tp.world if core.tp is not None else 1
    setup = {
        "groups": list(core.groups),
        "model_id": model_id,
        "checkpoint_interval": core.plan.checkpoint_interval,
        "name": name,
        "epoch": epoch,
        "agent_config": agent_config,
        "role": role,
        "world": world,
    }
    blobs = on_ranks(core, start_rank_agent, setup)
    bad = [b for b in blobs if isinstance(b, str)]
    if bad:
        raise TransferError("tensor-parallel transfer agents: " + "; ".join(bad))
    assert _RANK is not None
    kinds = ",".join(f"{g.group_id}:{'attention' if g.is_attention else g.kind}" for g in core.groups)
    extra = {
        "model_id": model_id,
        "checkpoint_interval": str(core.plan.checkpoint_interval),
        "groups": kinds,
        "block_size": str(core.plan.block_size),
    }
    return _RANK.agent, TPLayout(world, tuple(blobs), _RANK.tensors, extra)


def _region(layout: Any, gid: int, tensor_name: str) -> Any:
    suffix = tensor_name.split(".", 1)[1]
    for r in layout.regions_of(gid):
        if r.name.endswith(f".{suffix}"):
            return r
    raise ValueError(f"no region for {tensor_name}")


def load_rank_peer(runner: Any, rank: int, key: tuple[str, str], blob: bytes) -> str | None:
    """On every D rank, once per P worker: load the P ranks this rank reads from and plan its pieces."""
    st = _RANK
    if st is None:
        return f"rank {rank}: no transfer agent"
    if key in st.peers:
        return None
    try:
        peer = TPLayout.decode(blob)
        handles: dict[int, Any] = {}
        groups: dict[int, list[tuple[Any, dict[int, tuple[Any, np.ndarray]]]]] = {}
        for gid, mine in st.tensors.items():
            plans = plan_peer(peer.tensors[gid], mine, rank)
            entries = []
            for t in mine:
                local = _region(st.agent.layout, gid, t.name)
                if local.page_bytes != math.prod(t.local_shape(rank)) * t.itemsize:
                    return f"rank {rank}: {t.name} page is {local.page_bytes} bytes, slicing says otherwise"
                by_rank = {}
                for p, pieces in plans[t.name].items():
                    if p not in handles:
                        handles[p] = st.agent.add_peer(peer.rank_blobs[p], same_layout=False)
                    remote = _region(handles[p].layout, gid, t.name)
                    by_rank[p] = (
                        remote,
                        np.asarray([(q.src_offset, q.dst_offset, q.nbytes) for q in pieces], dtype=np.int64).reshape(
                            -1, 3
                        ),
                    )
                entries.append((local, by_rank))
            groups[gid] = entries
        st.peers[key] = _PeerPlan(handles, groups)
        return None
    except Exception as e:  # noqa: BLE001
        log.exception("rank %d: loading peer %s failed", rank, key)
        return f"rank {rank}: {e!r}"


def forget_rank_peer(runner: Any, rank: int, key: tuple[str, str]) -> None:
    """On every D rank, when D forgets a P worker (gone or replaced; no pull from it in flight): drop its plan and
    have the rank's agent remove the P ranks it loaded."""
    st = _RANK
    plan = st.peers.pop(key, None) if st is not None else None
    if st is None or plan is None:
        return
    for handle in plan.handles.values():
        st.agent.remove_peer(handle)


def _rows(
    plan: _PeerPlan, layout: Any, pairs: dict[int, tuple[list[int], list[int]]]
) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], dict[str, int]]:
    """(src rows, dst rows) of (addr, len, device) per P rank for every page pair of every group, and the bytes
    per group kind. Raises ValueError for ids that would corrupt a cache (kvtransfer.descriptors.check_pairs)."""
    src_parts: dict[int, list[np.ndarray]] = {}
    dst_parts: dict[int, list[np.ndarray]] = {}
    nbytes: dict[str, int] = {}
    for gid, (src_ids, dst_ids) in pairs.items():
        if gid not in plan.groups:
            raise ValueError(f"unknown group {gid}")
        s = np.asarray(src_ids, dtype=np.int64)[:, None]
        d = np.asarray(dst_ids, dtype=np.int64)[:, None]
        for local, by_rank in plan.groups[gid]:
            for p, (remote, pieces) in by_rank.items():
                check_pairs(src_ids, dst_ids, remote.num_pages, local.num_pages, f"group {gid}")
                src_addr = remote.base_addr + s * remote.page_stride + pieces[None, :, 0]
                dst_addr = local.base_addr + d * local.page_stride + pieces[None, :, 1]
                size = np.broadcast_to(pieces[None, :, 2], src_addr.shape)
                kind = layout.kind(gid)
                nbytes[kind] = nbytes.get(kind, 0) + int(size.sum())
                for parts, addr, dev in (
                    (src_parts, src_addr, remote.device_id),
                    (dst_parts, dst_addr, local.device_id),
                ):
                    parts.setdefault(p, []).append(
                        np.stack([addr.ravel(), size.ravel(), np.full(addr.size, dev, dtype=np.int64)], axis=1)
                    )
    rows = {
        p: (np.concatenate(src_parts[p]).astype(np.uint64), np.concatenate(dst_parts[p]).astype(np.uint64))
        for p in src_parts
    }
    return rows, nbytes


def start_rank_pull(
    runner: Any, rank: int, key: tuple[str, str], pull_id: str, pairs: dict[int, tuple[list[int], list[int]]]
) -> tuple[str, dict[str, int], int]:
    """On every D rank: post one READ per P rank. Returns (status DONE | PROC | ERR..., bytes per group kind,
    descriptors)."""
    st = _RANK
    if st is None or key not in st.peers:
        return f"ERR rank {rank}: peer not loaded", {}, 0
    plan, xfers = st.peers[key], st.pulls.setdefault(pull_id, [])
    try:
        rows, nbytes = _rows(plan, st.agent.layout, pairs)
        ndesc = sum(len(src) for src, _ in rows.values())
        for p, (src, dst) in rows.items():
            xfers.append(st.agent.make_read_rows(plan.handles[p], src, dst))
        statuses = [st.agent.post(x) for x in xfers]
    except Exception as e:  # noqa: BLE001 - bad ids, NIXL errors (peer gone)
        return f"ERR rank {rank}: {e!r}", {}, 0
    return _merge(statuses), nbytes, ndesc


def check_rank_pull(runner: Any, rank: int, pull_id: str) -> str:
    st = _RANK
    xfers = st.pulls.get(pull_id) if st is not None else None
    if st is None or xfers is None:
        return f"ERR rank {rank}: unknown pull"
    try:
        return _merge([st.agent.check(x) for x in xfers])
    except Exception as e:  # noqa: BLE001
        return f"ERR rank {rank}: {e!r}"


def forget_rank_pull(runner: Any, rank: int, pull_id: str) -> bool:
    """Release the pull's READs (cancelling those in flight); False if one could not be cancelled."""
    st = _RANK
    xfers = st.pulls.pop(pull_id, []) if st is not None else []
    return all([st.agent.release_xfer(x) for x in xfers]) if st is not None else True


def _merge(statuses: list[str]) -> str:
    if any(s not in ("DONE", "PROC") for s in statuses):
        return "ERR " + ",".join(statuses)
    return "PROC" if "PROC" in statuses else "DONE"


@dataclass
class TPPeer:
    """A P worker D trades with through the TP path (either side TP > 1), checked at connect time."""

    worker: str
    epoch: str
    layout_blob: bytes
    loaded: bool = False
    whole_pages: bool = False
    """Both workers slice every tensor alike (tp_slices.same_slicing): a checkpoint P offers can travel."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.worker, self.epoch)


class TPPullHandle:
    """The pull of one request on every D rank: `poll()` from the step thread, like kvtransfer.pull.PullHandle."""

    def __init__(self, core: Any, peer: TPPeer, spec: PullSpec, timeout_s: float, policy: str, metrics: Any) -> None:
        from hybridpd.engine.parallel.handoff import on_ranks

        self._on_ranks = on_ranks
        self.core, self.peer, self.spec, self.policy, self.metrics = core, peer, spec, policy, metrics
        self.pull_id = f"{spec.request_id}#{next(_pull_ids)}"
        self._t0 = time.perf_counter()
        self._deadline = time.monotonic() + timeout_s
        self._result: PullResult | None = None
        pairs = {
            gid: (list(src), list(spec.dst_blocks[gid] if gid in spec.dst_blocks else spec.dst_state_slots[gid]))
            for gid, src in {**spec.src_blocks, **spec.src_state_slots}.items()
            if len(src)
        }
        started = on_ranks(core, start_rank_pull, peer.key, self.pull_id, pairs)
        self.bytes_by_kind: dict[str, int] = {}
        for _, by_kind, _ in started:
            for kind, n in by_kind.items():
                self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + n
        self.nbytes = sum(self.bytes_by_kind.values())
        self.descriptors = sum(n for _, _, n in started)
        self._on([s for s, _, _ in started])

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def result(self) -> PullResult | None:
        return self._result

    def _on(self, statuses: list[str]) -> None:
        bad = [s for s in statuses if s.startswith("ERR")]
        if bad:
            log.warning("pull %s failed on a rank: %s", self.spec.request_id, "; ".join(bad))
            self._finish(PullState.FAILED, REASON_NIXL)
        elif all(s == "DONE" for s in statuses):
            self._finish(PullState.DONE, None)
        elif time.monotonic() >= self._deadline:
            self._finish(PullState.FAILED, REASON_TIMEOUT)

    def poll(self) -> PullState:
        if self._result is None:
            self._on(self._on_ranks(self.core, check_rank_pull, self.pull_id))
        return PullState.PENDING if self._result is None else self._result.state

    def cancel(self) -> None:
        if self._result is None:
            self._finish(PullState.FAILED, REASON_CANCELLED)

    def _finish(self, state: PullState, reason: str | None) -> None:
        reusable = all(self._on_ranks(self.core, forget_rank_pull, self.pull_id))
        seconds = time.perf_counter() - self._t0
        done = state is PullState.DONE
        self._result = PullResult(
            self.spec.request_id,
            state,
            self.policy,  # type: ignore[arg-type]
            self.nbytes if done else 0,
            self.descriptors,
            seconds,
            reason,
            reusable,
        )
        if self.metrics is not None:
            if done:
                self.metrics.transfer_done(self.bytes_by_kind, seconds, self.descriptors)
            else:
                self.metrics.transfer_failed(reason or REASON_NIXL)
        if not done:
            release_early(self.peer.key, self.spec)


def release_early(key: tuple[str, str], spec: PullSpec) -> bool:
    """Rank 0, after a failed pull: a best-effort release notice (ok=0) to P's rank 0, whose lease table then frees
    the pinned pages before the lease expires (as the TP 1 path does). False when it could not be sent."""
    st = _RANK
    handle = st.peers[key].handles.get(0) if st is not None and key in st.peers else None
    if handle is None or st is None:
        return False
    try:
        notice = encode_release(spec.request_id, spec.src_epoch, False, spec.lease_token)
    except ValueError:  # an epoch or token no notice can carry: the lease expires on its own
        return False
    return bool(st.agent.send_notif(handle, notice))


def start_tp_pull(
    core: Any, peer: TPPeer, spec: PullSpec, *, timeout_s: float, policy: str, metrics: Any = None
) -> TPPullHandle:
    """Load the peer on every D rank (first pull from it) and post every rank's READs. Raises StaleEpochError
    for params of another epoch, TransferError when a rank cannot load the peer (nothing was posted)."""
    from hybridpd.engine.parallel.handoff import on_ranks

    if spec.src_epoch != peer.epoch:
        raise StaleEpochError(f"request {spec.request_id!r} names epoch {spec.src_epoch!r}; live is {peer.epoch!r}")
    if not peer.loaded:
        errors = [e for e in on_ranks(core, load_rank_peer, peer.key, peer.layout_blob) if e]
        if errors:
            raise TransferError("loading the prefill worker's ranks failed: " + "; ".join(errors))
        peer.loaded = True
    return TPPullHandle(core, peer, spec, timeout_s, policy, metrics)


__all__ = [
    "TPPeer",
    "TPPullHandle",
    "rank_layout",
    "rank_progress",
    "start_agents",
    "start_rank_agent",
    "start_tp_pull",
]
