"""What the proxy can see of its workers: `GET /health` (readiness) and `GET /v1/cluster` (addresses, metrics
ports, pool usage from each worker's `Stats`). Probes run concurrently with the control timeout; an unreachable
worker is reported, never raised.

`/health` never waits on a worker: `HealthMonitor` (one background task per app, started and stopped by the app's
lifespan) probes every worker each `health_interval_s` and `/health` answers from its last result, so a stalled
worker cannot stall the probe. Worker details (addresses, ids, epochs) are shown only to callers holding the API
key; everyone else sees the status and per-role ready counts."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
from hybridpd.proxy.generation import Cluster
from hybridpd.proxy.workers import Role

log = logging.getLogger(__name__)


def _roles(cluster: Cluster) -> list[tuple[Role, str]]:
    pairs: list[tuple[Role, str]] = []
    if cluster.prefill is not None:
        pairs += [("prefill", a) for a in cluster.prefill.members]
    pairs += [("decode", a) for a in cluster.decode.members]
    return pairs


def _host(addr: str) -> str:
    host = addr.rsplit(":", 1)[0]
    return host.strip("[]") or "127.0.0.1"


async def _probe_health(cluster: Cluster, role: Role, addr: str) -> dict[str, Any]:
    """One worker's Health; a worker that does not answer in time (frozen: its connections stay open, so no call
    fails), or answers not ready (its engine stuck in one step: its Generate streams stay silent), gets no new
    requests while another of its role answers, and the streams waiting on it are given up (Router.set_unresponsive)."""
    router = cluster.prefill if role == "prefill" else cluster.decode
    try:
        h = await cluster.clients.health(role, addr)
    except grpc.aio.AioRpcError as err:
        if router is not None:
            router.set_unresponsive(addr, True)
        return {"role": role, "address": addr, "ready": False, "error": f"{err.code().name}: {err.details()}"}
    if router is not None:  # answering but not ready (its engine wedged, worker/context.py): as unresponsive
        router.set_unresponsive(addr, not h.ready)
    if cluster.membership is not None:
        cluster.membership.worker_draining(addr, h.draining)
    return {"role": role, "address": addr, "ready": h.ready, "worker_id": h.worker_id, "epoch": h.epoch,
            "model": h.model, "draining": h.draining}


async def health(cluster: Cluster) -> tuple[bool, dict[str, Any]]:
    """Probe every worker now. Ready when at least one decode worker (and, unless colocated, one prefill worker)
    reports ready."""
    probes = await asyncio.gather(*(_probe_health(cluster, r, a) for r, a in _roles(cluster)))
    ready_roles = {p["role"] for p in probes if p["ready"]}
    needed = {"decode"} if cluster.prefill is None else {"prefill", "decode"}
    ok = needed <= ready_roles
    return ok, {"status": "ok" if ok else "unavailable", "workers": probes}


class HealthMonitor:
    """Keeps the last `health()` result, refreshed in the background. Event loop only."""

    def __init__(self, cluster: Cluster, interval_s: float) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self._ok = False
        self._body: dict[str, Any] = {"status": "starting", "workers": []}
        self._checked_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()

    async def refresh(self) -> None:
        self._ok, self._body = await health(self.cluster)
        self._checked_at = time.time()
        self._first.set()
        if self.cluster.placer is not None and self.cluster.membership is not None:
            await self._refresh_room()

    async def _refresh_room(self) -> None:
        """What cache_aware placement weighs from the workers' Stats: the decode workers' room for new pages (per
        worker, the smallest share of an attention pool that is free or holds evictable cache) and every worker's
        capacity for whole requests (max_generate: a decode worker's max_num_seqs, a prefill worker's mixed-role
        share)."""
        membership = self.cluster.membership
        assert membership is not None

        async def one(role: Role, addr: str) -> None:
            try:
                s = await self.cluster.clients.stats(role, addr)
            except grpc.aio.AioRpcError:
                return
            if s.max_num_seqs > 0:  # (an older worker reports neither)
                membership.capacity[addr] = int(s.max_generate)
            shares = [(p.free + p.cached) / p.total for p in s.pools if p.kind == "attention" and p.total > 0]
            if shares and role == "decode":
                membership.room[addr] = min(shares)

        await asyncio.gather(*(one(r, a) for r, a in _roles(self.cluster)))

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the monitor must outlive any probe failure
                log.exception("health refresh failed")
            await asyncio.sleep(self.interval_s)

    async def start(self, first_wait_s: float) -> None:
        """Start refreshing; wait up to `first_wait_s` for the first result so a fresh proxy reports truthfully."""
        self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            await asyncio.wait_for(self._first.wait(), first_wait_s)
        except asyncio.TimeoutError:
            pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def snapshot(self, detailed: bool) -> tuple[bool, dict[str, Any]]:
        """(ready, body) from the last refresh; `detailed` adds each worker's address, id and epoch."""
        workers = self._body.get("workers", [])
        body: dict[str, Any] = {"status": self._body["status"], "checked_at": self._checked_at}
        roles = ["decode"] if self.cluster.prefill is None else ["prefill", "decode"]
        body["ready"] = {r: sum(1 for w in workers if w["role"] == r and w["ready"]) for r in roles}
        body["workers_total"] = {r: sum(1 for w in workers if w["role"] == r) for r in roles}
        if detailed:
            body["workers"] = workers
        return self._ok, body


async def _probe_stats(cluster: Cluster, role: Role, addr: str) -> dict[str, Any]:
    router = cluster.prefill if role == "prefill" else cluster.decode
    entry: dict[str, Any] = {"role": role, "address": addr, "in_flight": router.in_flight(addr) if router else 0}
    try:
        h, s = await asyncio.gather(cluster.clients.health(role, addr), cluster.clients.stats(role, addr))
    except grpc.aio.AioRpcError as err:
        entry.update(reachable=False, error=f"{err.code().name}: {err.details()}")
        return entry
    port = int(s.metrics_port)
    entry.update(
        reachable=True, ready=h.ready, worker_id=s.worker_id or h.worker_id, epoch=s.epoch or h.epoch,
        model=h.model, metrics_port=port, metrics_url=f"http://{_host(addr)}:{port}/metrics" if port else None,
        num_running=s.num_running, num_waiting=s.num_waiting, leases_pinned=s.leases_pinned,
        pools=[{"group_id": p.group_id, "kind": p.kind, "total": p.total, "free": p.free, "cached": p.cached,
                "in_use": p.in_use, "pinned": p.pinned, "integrity_ok": p.integrity_ok} for p in s.pools],
        memory_bytes=dict(s.memory_bytes),
    )
    return entry


async def cluster_info(cluster: Cluster) -> dict[str, Any]:
    cfg = cluster.config
    workers = await asyncio.gather(*(_probe_stats(cluster, r, a) for r, a in _roles(cluster)))
    view = {m["address"]: m for m in cluster.membership.view()} if cluster.membership is not None else {}
    for w in workers:
        w["membership"] = view.get(w["address"])
    out: dict[str, Any] = {"model": cfg.model_name, "colocated": cfg.colocated, "routing": cfg.routing,
                           "max_model_len": cfg.max_model_len, "workers": list(workers)}
    if cluster.placer is not None:
        c = cluster.placer.costs
        out["step_costs"] = {"prefill_token_s": c.prefill_token_s, "decode_token_s": c.decode_token_s,
                             "handoff_s": c.handoff_s, "output_token_s": dict(c.token_s)}
        out["placements"] = dict(cluster.placer.decisions)
        for w in workers:  # whole requests (P-alone) a prefill worker runs now, and what it takes at most
            if w["role"] == "prefill":
                w["whole_requests"] = cluster.placer.whole_on_prefill.get(w["address"], 0)
                w["whole_capacity"] = cluster.placer.membership.capacity.get(w["address"])
    return out
