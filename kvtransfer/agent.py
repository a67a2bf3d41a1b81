"""One NIXL agent per worker process: registers the worker's cache memory once, publishes handshake metadata, loads
peers' metadata, and runs the READs that `pull.py` plans.

Ownership and threads:
  * The engine owns the cache tensors; it must keep them alive (same addresses) until `close()`. The agent
    registers every region once in `__init__` (DRAM for CPU tensors, VRAM for CUDA) and deregisters in `close()`.
  * Every NIXL call goes through one lock, so any thread may call any method: typically the gRPC threads call
    `local_metadata()` (precomputed bytes) and `add_peer()`, and the engine thread starts and polls pulls
    (`pull.PullHandle.poll`) and, on P, drains `poll_releases()` once per step.
  * NIXL's progress thread (`AgentConfig.progress_thread`, on by default here, for tests and benchmarks) serves D's
    READs on P while its engine is busy or idle (UCX over TCP needs the target to progress). It busy-polls one
    core, so workers run without it unless `--nixl-progress-thread`: their step loops poll the agent while
    leases or pulls are in flight (worker/bootstrap.py).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from . import metadata as md_codec
from .descriptors import PullPlan, byte_descs, page_dlist, page_indices, region_offsets
from .errors import CompatibilityError, MetadataError, StaleEpochError, TransferError, UnknownPeerError
from .layout import CacheLayout, Region
from .metrics import TransferMetrics
from .notify import ReleaseNotice, decode_release

logger = logging.getLogger(__name__)
_DROP_NOTICE_RATE = float(os.environ.get("HYBRIDPD_FAULT_DROP_NOTICE_RATE", "0") or 0)
"""Fault injection (tests only): the share of notifications `send_notif` drops. 0 in production."""

DescriptorMode = Literal["prepped", "per_transfer"]
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
_live_agents = 0  # agents of this process; more than one is legal but slow (0.3-0.5 GB/s seen on an H200)


@dataclass(frozen=True)
class AgentConfig:
    """NIXL agent settings.

    descriptor_mode: "per_transfer" (default) builds the coalesced descriptors of each pull (one per region and
      run) and lets NIXL prepare them; "prepped" prepares every page of every region once per peer and starts
      each pull from page-index lists (NIXL merges adjacent pages back into the same runs). benchmarks/transfer.py
      measured per_transfer 25-30% cheaper to prepare (0.23 vs 0.32 ms for 12 descriptors, 1.2 vs 1.7 ms for
      12k) with the same bytes on the wire, and it needs no per-peer page list (prepped: about 26 MiB and 0.8 s
      per million pages, at handshake). See kvtransfer/README.md.
    progress_thread: NIXL progress thread. Required on P unless its engine thread polls the agent often: with
      UCX over TCP (what NIXL picks between processes on one host when peer-failure detection is on) a READ only
      advances while the target progresses. Costs one busy-polling core per process. Decode workers on GPUs turn
      it off: it contends with their own post/check calls (pulls 2-3x slower on H200, docs/BENCHMARKS.md).
    The backend is UCX with NIXL's default ucx_error_handling_mode ("peer": a dead peer fails the transfer instead
      of hanging, which also rules out UCX's shared-memory transports). UCX settings such as UCX_TLS come from the
      environment.
    parallel_reads: a pull is cut into up to this many READs of about equal bytes, posted together (NIXL's release
      notice then goes out once all are done). 1 = one READ per pull. See docs/BENCHMARKS.md for measurements.
    num_workers: UCX workers of NIXL's UCX backend (0 = NIXL's default, one).
    release_notice: "with_read" (default) hands P's release notice to NIXL with the READ (sent once the data are
      in place); "after_done" sends it from D once poll() has seen the READ done, keeping it off the post.
    """

    descriptor_mode: DescriptorMode = "per_transfer"
    progress_thread: bool = True
    telemetry: bool = False
    parallel_reads: int = 1
    num_workers: int = 0
    release_notice: Literal["with_read", "after_done"] = "with_read"

    def __post_init__(self) -> None:
        if self.parallel_reads < 1:
            raise ValueError(f"parallel_reads must be >= 1 (got {self.parallel_reads})")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (got {self.num_workers})")


def _mem_type(layout: CacheLayout) -> str:
    return "DRAM" if layout.device_type == "cpu" else "VRAM"


UCX_GPU_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
"""UCX settings a GPU cache needs, set in this process's environment unless the operator set them. UCX turns off
cuda_ipc's GET (the READ that D posts) when NVML reports no NVLink ("cuda-ipc get zcopy disabled as no nvlinks
detected", UCX_LOG_LEVEL=debug): on a host with one GPU, or PCIe GPUs, the READs then went through host memory over
TCP at 0.4-0.7 GB/s (docs/BENCHMARKS.md, 2026-11-24) instead of a device copy."""


def apply_ucx_defaults(device_type: str) -> dict[str, str]:
    """Put UCX_GPU_DEFAULTS into os.environ for a GPU cache (before NIXL creates its UCX context); returns what it
    set. A value already in the environment wins."""
    if device_type == "cpu":
        return {}
    applied = {k: v for k, v in UCX_GPU_DEFAULTS.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


def registration_spans(regions: tuple[Region, ...]) -> list[tuple[int, int, int, str]]:
    """The regions' byte spans per device as NIXL registration tuples (addr, len, dev, ""); overlapping spans (views
    of one tensor, e.g. per-layer slices of a stacked cache) are merged, merely adjacent ones are not: adjacent
    spans may be two allocations, and a GPU registration must stay inside one (UCX's cuda_ipc exports memory per
    allocation). Seen on H200: a registration covering a stacked KV tensor and the conv-state tensor that began
    where it ended failed every READ (cuMemcpyDtoDAsync "invalid argument"); one registration each works."""
    out: list[tuple[int, int, int, str]] = []
    for dev in sorted({r.device_id for r in regions}):
        spans = sorted((r.base_addr, r.base_addr + r.span_bytes) for r in regions if r.device_id == dev)
        lo, hi = spans[0]
        for a, b in spans[1:]:
            if a < hi:
                hi = max(hi, b)
            else:
                out.append((lo, hi - lo, dev, ""))
                lo, hi = a, b
        out.append((lo, hi - lo, dev, ""))
    return out


class PeerHandle:
    """A worker this agent has handshaken with: its id, epoch, layout and prepared page list. Made and owned by
    `TransferAgent.add_peer`; invalid once the peer is removed or replaced (new epoch) or the agent is closed."""

    def __init__(self, agent: TransferAgent, meta: md_codec.WorkerMetadata, remote_dlist: Any) -> None:
        self.agent = agent
        self.worker = meta.worker
        self.epoch = meta.epoch
        self.agent_name = meta.agent_name
        self.layout = meta.layout
        self.offsets = region_offsets(meta.layout)
        self._remote_dlist = remote_dlist
        self.valid = True

    def __repr__(self) -> str:
        return f"PeerHandle(worker={self.worker!r}, epoch={self.epoch!r}, valid={self.valid})"


class TransferAgent:
    """The worker's NIXL agent. `name` is the worker id (TransferParams.worker_id); `epoch` defaults to a fresh
    uuid4 per process start, so a restarted worker is a different peer (and a different NIXL agent name)."""

    def __init__(
        self,
        name: str,
        layout: CacheLayout,
        epoch: str | None = None,
        *,
        config: AgentConfig | None = None,
        metrics: TransferMetrics | None = None,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        global _live_agents
        if not layout.regions:
            raise ValueError("a transfer agent needs at least one cache region")
        if epoch is not None and (not epoch or "|" in epoch):
            raise ValueError(f"epoch {epoch!r} must be non-empty and free of '|'")
        if _live_agents:
            logger.warning("%d NIXL agent(s) already live in this process: keep one per process", _live_agents)
        self.name = name
        self.layout = layout
        self.epoch = epoch or uuid.uuid4().hex
        self.config = config or AgentConfig()
        self.metrics = metrics or TransferMetrics("decode")
        self.nixl_name = f"{name}@{self.epoch}"
        self._lock = threading.RLock()
        self._peers: dict[str, PeerHandle] = {}
        cfg = self.config
        applied = apply_ucx_defaults(layout.device_type)
        if applied:
            logger.info("UCX settings for GPU transfers (not set by the environment): %s", applied)
        self._nixl: Any = nixl_agent(
            self.nixl_name,
            nixl_agent_config(enable_prog_thread=cfg.progress_thread, backends=[], capture_telemetry=cfg.telemetry),
        )
        self._nixl.create_backend("UCX", {"num_workers": str(cfg.num_workers)} if cfg.num_workers else {})
        self._reg = self._nixl.register_memory(registration_spans(layout.regions), _mem_type(layout))
        self._offsets = region_offsets(layout)
        self._local_dlist = None
        if cfg.descriptor_mode == "prepped":
            self._local_dlist = self._nixl.prep_xfer_dlist(NIXL_INIT_AGENT, page_dlist(layout), _mem_type(layout))
        self._metadata = md_codec.encode(
            md_codec.WorkerMetadata(name, self.nixl_name, self.epoch, layout, self._nixl.get_agent_metadata())
        )
        _live_agents += 1

    # -- handshake -------------------------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        """Versioned, checksummed handshake blob (see metadata.py). Precomputed: safe from any thread."""
        return self._metadata

    def add_peer(self, metadata: bytes, *, same_layout: bool = True) -> PeerHandle:
        """Load a peer's handshake blob. Idempotent for the same worker and epoch; a new epoch of a known worker
        replaces the old peer. Raises MetadataError / ProtocolMismatchError / CompatibilityError. With
        `same_layout` False the layouts may differ (a rank of a worker of another TP size: the caller checked the
        two workers' kvtransfer.tp_handshake layouts instead)."""
        meta = md_codec.decode(metadata)
        if same_layout and meta.layout.compat_hash != self.layout.compat_hash:
            diffs = self.layout.diff(meta.layout) or ["fingerprints equal but hashes differ"]
            raise CompatibilityError(f"worker {meta.worker!r} has an incompatible cache layout: " + "; ".join(diffs))
        with self._lock:
            self._check_open()
            old = self._peers.get(meta.worker)
            if old is not None and old.epoch == meta.epoch:
                return old
            if old is not None:
                self._drop(old)
            try:
                loaded = self._nixl.add_remote_agent(meta.nixl_metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            except Exception as e:  # nixl raises its own binding exceptions
                raise MetadataError(f"NIXL refused metadata of worker {meta.worker!r}: {e}") from e
            if loaded != meta.agent_name:
                raise MetadataError(f"NIXL metadata names agent {loaded!r}, header says {meta.agent_name!r}")
            remote = None
            if self.config.descriptor_mode == "prepped":
                remote = self._nixl.prep_xfer_dlist(loaded, page_dlist(meta.layout), _mem_type(meta.layout))
            peer = PeerHandle(self, meta, remote)
            self._peers[meta.worker] = peer
            try:
                self._nixl.make_connection(loaded)  # wire up now rather than on the first pull
            except Exception:  # noqa: BLE001 - the first pull will report an unreachable peer
                pass
            return peer

    def peer(self, worker: str, epoch: str) -> PeerHandle:
        """The handshaken peer for transfer params (worker id, epoch). Raises UnknownPeerError when no handshake
        was made, StaleEpochError when the params' epoch is not the peer's live one (re-handshake, then retry)."""
        with self._lock:
            p = self._peers.get(worker)
        if p is None:
            raise UnknownPeerError(f"no handshake with worker {worker!r}")
        if p.epoch != epoch:
            raise StaleEpochError(f"params name epoch {epoch!r} of worker {worker!r}; its live epoch is {p.epoch!r}")
        return p

    def remove_peer(self, peer: PeerHandle) -> bool:
        """Forget a peer (its worker is gone or was replaced): its prepared list released and NIXL's remote agent
        removed. The caller has no READ of it in flight. False when `peer` is no longer its worker's live peer
        (already replaced or removed)."""
        with self._lock:
            if self._peers.get(peer.worker) is not peer:
                return False
            self._drop(peer)
            return True

    def _drop(self, p: PeerHandle) -> None:
        p.valid = False
        if p._remote_dlist is not None:
            p._remote_dlist.release()
        try:
            self._nixl.remove_remote_agent(p.agent_name)
        except Exception:  # noqa: BLE001 - already gone on the NIXL side
            pass
        self._peers.pop(p.worker, None)

    # -- transfers (called by pull.py on the thread that polls) ----------------------------------------------
    @property
    def parallel_reads(self) -> int:
        return self.config.parallel_reads

    @property
    def notice_after_done(self) -> bool:
        return self.config.release_notice == "after_done"

    def make_read(self, peer: PeerHandle, plan: PullPlan, notif: bytes) -> Any:
        """Create (not post) one READ of everything in `plan` from `peer` into our regions; NIXL delivers `notif`
        to the peer once the data is in place. May raise NIXL errors (peer unreachable)."""
        with self._lock:
            self._check_open()
            if not peer.valid:
                raise UnknownPeerError(f"peer {peer.worker!r} epoch {peer.epoch!r} was removed or replaced")
            if self.config.descriptor_mode == "prepped":
                return self._nixl.make_prepped_xfer(
                    "READ",
                    self._local_dlist,
                    page_indices(plan, self._offsets, "dst"),
                    peer._remote_dlist,
                    page_indices(plan, peer.offsets, "src"),
                    notif,
                )
            local = self._nixl.get_xfer_descs(byte_descs(plan, "dst"), _mem_type(self.layout))
            remote = self._nixl.get_xfer_descs(byte_descs(plan, "src"), _mem_type(peer.layout))
            return self._nixl.initialize_xfer("READ", local, remote, peer.agent_name, notif)

    def make_read_rows(self, peer: PeerHandle, src_rows: Any, dst_rows: Any) -> Any:
        """Create (not post) one READ of raw (addr, len, device id) rows, the peer's `src_rows` into our
        `dst_rows` (kvtransfer.tp_pull: byte pieces of pages), with no notification."""
        with self._lock:
            self._check_open()
            if not peer.valid:
                raise UnknownPeerError(f"peer {peer.worker!r} epoch {peer.epoch!r} was removed or replaced")
            local = self._nixl.get_xfer_descs(dst_rows, _mem_type(self.layout))
            remote = self._nixl.get_xfer_descs(src_rows, _mem_type(peer.layout))
            return self._nixl.initialize_xfer("READ", local, remote, peer.agent_name, b"")

    def post(self, handle: Any) -> str:
        """Post a READ made by `make_read`: "DONE" | "PROC" | "ERR". With UCX's CMA transport (CPU, same host)
        the copy itself runs inside this call; with GPU transports it returns at once."""
        with self._lock:
            self._check_open()
            return str(self._nixl.transfer(handle))

    def check(self, handle: Any) -> str:
        """ "DONE" | "PROC" | "ERR" of a posted READ. May raise NIXL errors (treated as ERR by the caller)."""
        with self._lock:
            return str(self._nixl.check_xfer_state(handle))

    def xfer_telemetry(self, handle: Any) -> tuple[int, float, float, float] | None:
        """(descriptors after NIXL's merging, start s, post s, transfer s) of a finished READ from NIXL's telemetry:
        the transfer time runs from the start and includes the post; starts are on NIXL's own clock, so compare
        them with each other only. None without telemetry."""
        if not self.config.telemetry:
            return None
        with self._lock:
            try:
                t = self._nixl.get_xfer_telemetry(handle)
                return int(t.descCount), t.startTime / 1e6, t.postDuration / 1e6, t.xferDuration / 1e6
            except Exception:  # noqa: BLE001
                return None

    def release_xfer(self, handle: Any) -> bool:
        """Free a READ handle, cancelling it if still in flight. False if NIXL could not cancel it: the
        destination pages may still be written and must not be reused for anything else."""
        with self._lock:
            try:
                handle.release()
                return True
            except Exception:  # noqa: BLE001
                return False

    def send_notif(self, peer: PeerHandle, msg: bytes) -> bool:
        """Best-effort standalone notification; False if NIXL refused (peer gone). Fault injection for tests:
        env HYBRIDPD_FAULT_DROP_NOTICE_RATE=p drops each notification with probability p (as a lossy network
        would); correctness must not depend on any notification arriving."""
        if _DROP_NOTICE_RATE and random.random() < _DROP_NOTICE_RATE:
            logger.warning("fault injection: dropped a notification to %s", peer.worker)
            return True
        with self._lock:
            try:
                self._nixl.send_notif(peer.agent_name, msg)
                return True
            except Exception:  # noqa: BLE001
                return False

    def poll_releases(self) -> list[ReleaseNotice]:
        """P side: drain NIXL notifications and return the release notices among them (non-blocking). Call from
        the engine thread once per step and feed each notice to `LeaseTable.release`."""
        with self._lock:
            self._check_open()
            notifs: dict[str, list[bytes]] = self._nixl.get_new_notifs()
        return [n for msgs in notifs.values() for m in msgs if (n := decode_release(m)) is not None]

    # -- lifetime ---------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._nixl is None:
            raise TransferError(f"transfer agent {self.nixl_name} is closed")

    def close(self) -> None:
        """Drop peers, release prepared lists, deregister memory and destroy the NIXL agent. Idempotent. In-flight
        pulls must be finished or cancelled first."""
        with self._lock:
            if self._nixl is None:
                return
            for p in list(self._peers.values()):
                self._drop(p)
            if self._local_dlist is not None:
                self._local_dlist.release()
            self._nixl.deregister_memory(self._reg)
            self._nixl = None
            global _live_agents
            _live_agents -= 1

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
