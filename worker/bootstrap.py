"""Start one worker process: engine + step thread, NIXL agent over its caches, metrics server, gRPC server.

Prints one JSON line `{"event": "ready", ...}` on stdout once serving (launchers wait for it)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass

import grpc
from hybridpd.engine.config import EngineConfig

log = logging.getLogger("hybridpd.worker")


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # prefill | decode | colocated (= decode without transfers)
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    advertise_host: str | None = None
    lease_seconds: float = 30.0
    transfer_policy: str = "recompute"
    pull_timeout_s: float = 10.0
    model_name: str | None = None
    enable_transfer: bool = True
    cluster_token: str | None = None  # worker.auth.load_cluster_token(); None = open development cluster
    tls: object = None  # worker.auth.TlsFiles: serve (and call peers) over TLS
    prefill_peers: tuple[str, ...] = ()  # decode: pull only from these P addresses (empty: any that proves the token)
    max_pinned_fraction: float = 0.5  # prefill: pages pinned for transfers, at most this share of each pool
    max_decode_share: float = 0.25  # prefill (mixed role): whole requests at once, this share of max_num_seqs (0: off)
    nixl_progress_thread: bool = False  # NIXL's own progress thread (busy-polls a core); off: the step loop polls
    register_with: tuple[str, ...] = ()  # proxy URLs to register with (worker/announce.py); empty: static only
    heartbeat_s: float = 1.0  # registration renewal period (a registration expires after 5 of them)
    stall_timeout_s: float = 300.0  # Health says not ready while the engine is stuck in one pass this long (0: never)


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _start_agents(core, opts: WorkerOptions, name: str, epoch: str, model_name: str, role: str):  # type: ignore[no-untyped-def]
    """One NIXL agent per rank over its caches; returns rank 0's agent and the worker's TP layout (handshake)."""
    from hybridpd.kvtransfer.agent import AgentConfig
    from hybridpd.kvtransfer.tp_pull import start_agents

    if _is_loopback(opts.host) and "UCX_NET_DEVICES" not in os.environ:
        # UCX's TCP transport listens on every interface by default: keep it where the worker was told to be
        os.environ["UCX_NET_DEVICES"] = "lo"
    # No NIXL progress thread by default: it busy-polls a core per worker even when idle (28-35 % of a core per
    # worker on the loaded dev box). The step loops progress the agents instead, only while work is in flight:
    # D polls its pulls every 100 us, P polls (serving READs over TCP, taking notices) every 0.5 ms while it
    # holds leases (followers' agents: kvtransfer/tp_pull.py). On GPUs the thread also slowed D's pulls 2-3x on an
    # H200 (docs/BENCHMARKS.md). Trade-off: over UCX/TCP (CPU, no RDMA) a busy P serves READs only between its
    # steps; --nixl-progress-thread restores the thread for that case.
    if opts.nixl_progress_thread and role == "decode" and core.device.type == "cuda":
        log.warning("--nixl-progress-thread on a decode worker with GPU caches: on an H200 such a worker "
                    "aborted inside UCX on its first handoff when UCX staged the READs through host memory "
                    "(kvtransfer/README.md, Progress thread)")
    return start_agents(core, name, epoch, model_name, AgentConfig(progress_thread=opts.nixl_progress_thread), role)


async def serve_worker(config: EngineConfig, opts: WorkerOptions) -> None:
    from hybridpd.engine.async_engine import AsyncEngine
    from hybridpd.engine.core import EngineCore
    from hybridpd.engine.metrics import WorkerMetrics
    from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc
    from hybridpd.worker.context import WorkerContext
    from prometheus_client import start_http_server

    t_load = time.monotonic()
    log.info("%s worker: loading weights from %s (dtype %s, device %s)", opts.role, config.model.path,
             config.model.dtype, config.model.device)
    core = EngineCore(config)
    log.info("%s worker: model loaded and KV cache allocated in %.1f s", opts.role, time.monotonic() - t_load)
    model_name = opts.model_name or os.path.basename(os.path.normpath(config.model.path))
    role = "decode" if opts.role == "colocated" else opts.role
    worker_id, epoch = uuid.uuid4().hex[:12], uuid.uuid4().hex
    agent, tp_layout = None, None
    if opts.enable_transfer and opts.role != "colocated":  # before the step thread: the ranks' channel is free
        agent, tp_layout = _start_agents(core, opts, f"{role}-{worker_id}", epoch, model_name, role)
    aengine = AsyncEngine(core)
    from hybridpd.worker.auth import TokenInterceptor

    interceptors = [TokenInterceptor(opts.cluster_token)] if opts.cluster_token else []
    if not opts.cluster_token:
        log.warning("no cluster token (HYBRIDPD_CLUSTER_TOKEN / --cluster-token-file): this worker's RPCs are open "
                    "to anyone who can reach %s:%s", opts.host, opts.port)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20)], interceptors=interceptors)
    if opts.tls is not None:
        from hybridpd.worker.auth import server_credentials

        port = server.add_secure_port(f"{opts.host}:{opts.port}", server_credentials(opts.tls))  # type: ignore[arg-type]
    else:
        port = server.add_insecure_port(f"{opts.host}:{opts.port}")
    metrics_port = opts.metrics_port
    if metrics_port >= 0:
        srv, _ = start_http_server(metrics_port, addr=opts.host)
        metrics_port = srv.server_port
    ctx = WorkerContext(role=role, aengine=aengine, model_name=model_name,
                        address=f"{opts.advertise_host or opts.host}:{port}", metrics_port=max(metrics_port, 0),
                        metrics=WorkerMetrics(role, min_interval_s=0.002, slow_interval_s=0.25),
                        cluster_token=opts.cluster_token, tls=opts.tls, worker_id=worker_id, epoch=epoch,
                        agent=agent, tp_layout=tp_layout, stall_timeout_s=opts.stall_timeout_s)
    if role == "prefill":
        from hybridpd.prefill.mixed import MixedGenerateServicer
        from hybridpd.prefill.service import PrefillServicer

        prefill = PrefillServicer(ctx, opts.lease_seconds, opts.max_pinned_fraction)
        pb_grpc.add_PrefillServiceServicer_to_server(prefill, server)
        # the mixed role: whole requests too (DecodeService.Generate) while the decode workers are saturated
        pb_grpc.add_DecodeServiceServicer_to_server(MixedGenerateServicer(prefill, opts.max_decode_share), server)
    else:
        from hybridpd.decode.service import DecodeServicer

        pb_grpc.add_DecodeServiceServicer_to_server(
            DecodeServicer(ctx, opts.transfer_policy, opts.pull_timeout_s, opts.prefill_peers), server)
    await server.start()
    print(json.dumps({"event": "ready", "role": role, "address": ctx.address, "grpc_port": port,
                      "metrics_port": ctx.metrics_port, "worker_id": ctx.worker_id, "epoch": ctx.epoch,
                      "pid": os.getpid(), "kv_cache": core.kv_cache_info(), "device": str(core.device),
                      "dtype": core.config.model.dtype, "fast_path": core.runner.fast_path,
                      "cuda_graphs": core.runner.graphs is not None}), flush=True)
    announcer = None
    if opts.register_with:
        from hybridpd.worker.announce import Announcer

        announcer = Announcer(opts.register_with, ctx, role, ctx.address, ctx.worker_id, ctx.epoch, opts.cluster_token,
                              opts.heartbeat_s, ttl_s=5 * opts.heartbeat_s)
        announcer.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down %s worker", role)
    if announcer is not None:
        await announcer.stop()
    await server.stop(grace=2.0)
    aengine.shutdown()
    if ctx.agent is not None:
        ctx.agent.close()


def run_worker(config: EngineConfig, opts: WorkerOptions) -> int:
    try:
        asyncio.run(serve_worker(config, opts))
    except KeyboardInterrupt:
        pass
    sys.stdout.flush()
    return 0
