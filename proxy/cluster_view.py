"""What the proxy can see of its workers: `GET /health` (readiness) and `GET /v1/cluster` (addresses, metrics
ports, pool usage from each worker's `Stats`). Probes run concurrently with the control timeout; an unreachable
worker is reported, never raised."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from proxy.generation import Cluster
from proxy.workers import Role


def _roles(cluster: Cluster) -> list[tuple[Role, str]]:
    pairs: list[tuple[Role, str]] = []
    if cluster.prefill is not None:
        pairs += [("prefill", a) for a in cluster.prefill.addrs]
    pairs += [("decode", a) for a in cluster.decode.addrs]
    return pairs


def _host(addr: str) -> str:
    host = addr.rsplit(":", 1)[0]
    return host.strip("[]") or "127.0.0.1"


async def _probe_health(cluster: Cluster, role: Role, addr: str) -> dict[str, Any]:
    try:
        h = await cluster.clients.health(role, addr)
    except grpc.aio.AioRpcError as err:
        return {"role": role, "address": addr, "ready": False, "error": f"{err.code().name}: {err.details()}"}
    return {"role": role, "address": addr, "ready": h.ready, "worker_id": h.worker_id, "epoch": h.epoch,
            "model": h.model}


async def health(cluster: Cluster) -> tuple[bool, dict[str, Any]]:
    """Ready when at least one decode worker (and, unless colocated, one prefill worker) reports ready."""
    probes = await asyncio.gather(*(_probe_health(cluster, r, a) for r, a in _roles(cluster)))
    ready_roles = {p["role"] for p in probes if p["ready"]}
    needed = {"decode"} if cluster.prefill is None else {"prefill", "decode"}
    ok = needed <= ready_roles
    return ok, {"status": "ok" if ok else "unavailable", "workers": probes}


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
    )
    return entry


async def cluster_info(cluster: Cluster) -> dict[str, Any]:
    cfg = cluster.config
    workers = await asyncio.gather(*(_probe_stats(cluster, r, a) for r, a in _roles(cluster)))
    return {"model": cfg.model_name, "colocated": cfg.colocated, "routing": cfg.routing,
            "max_model_len": cfg.max_model_len, "workers": list(workers)}
