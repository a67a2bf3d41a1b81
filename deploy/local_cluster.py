"""Start a real PD cluster of plain processes (prefill workers, decode workers, proxy): used by the integration
tests and the serving benchmark. No Ray: `hybridpd serve` runs the same processes under Ray actors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
import httpx
from hybridpd.deploy.ray_launcher import WorkerProcess, free_port
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc


@dataclass
class Cluster:
    model: str
    prefill: list[WorkerProcess]
    decode: list[WorkerProcess]
    proxy: subprocess.Popen
    url: str
    model_name: str
    extra: dict = field(default_factory=dict)
    cluster_token: str | None = None
    tls_env: dict[str, str] = field(default_factory=dict)
    """HYBRIDPD_TLS_* files when the workers serve TLS."""

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel to a worker (TLS with the cluster's files when it has them)."""
        if not self.tls_env:
            return grpc.insecure_channel(address)

        def read(key: str) -> bytes | None:
            path = self.tls_env.get(key)
            return open(path, "rb").read() if path else None

        creds = grpc.ssl_channel_credentials(read("HYBRIDPD_TLS_CA_FILE"), read("HYBRIDPD_TLS_KEY_FILE"),
                                             read("HYBRIDPD_TLS_CERT_FILE"))
        return grpc.secure_channel(address, creds)

    @property
    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata a direct worker RPC needs (the cluster token, when the cluster has one)."""
        from hybridpd.worker.auth import token_metadata

        return token_metadata(self.cluster_token)

    def restart_proxy(self, timeout: float = 120.0) -> float:
        """Start the proxy again (same port and flags) after it died; the seconds until it was healthy."""
        cmd, env, log_path = self.extra["proxy_cmd"], self.extra["proxy_env"], self.extra["proxy_log"]
        t0 = time.time()
        self.proxy = subprocess.Popen(cmd, stdout=open(log_path, "a"), stderr=subprocess.STDOUT, env=env)
        _wait_healthy(self.url, self.proxy, timeout)
        return time.time() - t0

    def worker_stats(self, w: WorkerProcess) -> pb.StatsResponse:
        with self.channel(w.info["address"]) as ch:
            stub = pb_grpc.PrefillServiceStub(ch) if w.info["role"] == "prefill" else pb_grpc.DecodeServiceStub(ch)
            return stub.Stats(pb.StatsRequest(), timeout=10, metadata=self.grpc_metadata)

    def metric(self, w: WorkerProcess, name: str, **labels: str) -> float:
        """Sum of a metric's samples on a worker's /metrics matching the labels."""
        return scrape_metric(f"http://127.0.0.1:{w.info['metrics_port']}/metrics", name, **labels)

    def stop(self) -> None:
        self.proxy.terminate()
        try:
            self.proxy.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proxy.kill()
        from concurrent.futures import ThreadPoolExecutor

        workers = self.prefill + self.decode
        with ThreadPoolExecutor(max(1, len(workers))) as pool:
            list(pool.map(lambda w: w.stop(), workers))


def scrape_metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` on the Prometheus page at `url` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def start_cluster(model: str, colocated: bool = False, worker_args: list[str] | None = None,
                  num_prefill: int = 1, num_decode: int = 1, prefill_env: dict[str, str] | None = None,
                  decode_env: dict[str, str] | None = None, cluster_token: str | None = None,
                  tls_env: dict[str, str] | None = None, prefill_args: list[str] | None = None,
                  decode_args: list[str] | None = None, proxy_args: list[str] | None = None,
                  worker_envs: list[dict[str, str]] | None = None, **worker_opts: object) -> Cluster:
    """Workers and proxy as plain processes. With `cluster_token`, every worker RPC requires it (the proxy and the
    workers get it through HYBRIDPD_CLUSTER_TOKEN); with `tls_env` (HYBRIDPD_TLS_{CERT,KEY,CA}_FILE), worker gRPC
    runs over (mutual) TLS. `prefill_args` / `decode_args` are added to one role's workers only (e.g.
    `--nixl-progress-thread` on P alone); `proxy_args` to the proxy's command line (e.g. `--routing cache_aware`).
    `worker_envs`: one more environment per worker, prefill workers first (e.g. each its own CUDA_VISIBLE_DEVICES);
    `worker_opts` go to every `WorkerProcess` (e.g. `restart=False`, `ready_timeout_s=600`)."""
    args = ["--model", model, *(worker_args or [])]
    env = {"PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    if cluster_token:
        env["HYBRIDPD_CLUSTER_TOKEN"] = cluster_token
    env.update(tls_env or {})
    specs = [(["--role", "prefill", *args, *(prefill_args or [])], {**env, **(prefill_env or {})})
             for _ in range(0 if colocated else num_prefill)]
    specs += [(["--role", "colocated" if colocated else "decode", *args, *([] if colocated else (decode_args or []))],
               {**env, **(decode_env or {})}) for _ in range(num_decode)]
    for (_, spec_env), extra in zip(specs, worker_envs or [], strict=False):
        spec_env.update(extra)
    started = _start_workers(specs, **worker_opts)
    prefill = started[: 0 if colocated else num_prefill]
    decode = started[len(prefill):]
    port = free_port()
    name = os.path.basename(os.path.normpath(model))
    cmd = [sys.executable, "-m", "hybridpd.deploy.cli", "proxy", "--model", model, "--port", str(port),
           "--decode", *[w.info["address"] for w in decode]]
    if colocated:
        cmd.append("--colocated")
    else:
        cmd += ["--prefill", *[w.info["address"] for w in prefill]]
    cmd += proxy_args or []
    log_path = os.path.join(tempfile.gettempdir(), f"hybridpd-proxy-{port}.log")
    log = open(log_path, "w")
    proxy_env = {**os.environ, **env}
    proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=proxy_env)
    url = f"http://127.0.0.1:{port}"
    if not _wait_healthy(url, proxy, 180):
        proxy.kill()
        for w in prefill + decode:
            w.stop()
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"proxy did not become healthy; its log ({log_path}):\n{tail}")
    return Cluster(model, prefill, decode, proxy, url, name, cluster_token=cluster_token, tls_env=dict(tls_env or {}),
                   extra={"proxy_cmd": cmd, "proxy_env": proxy_env, "proxy_log": log_path})


def _start_workers(specs: list[tuple[list[str], dict[str, str]]], **opts: object) -> list[WorkerProcess]:
    """Start the workers concurrently (each loads its model while the others do), in `specs` order; if one fails,
    stop those that started and raise its error."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(specs))) as pool:
        futures = [pool.submit(WorkerProcess, argv, env=env, **opts) for argv, env in specs]
        errors = [f.exception() for f in futures]
    started = [f.result() for f, e in zip(futures, errors, strict=True) if e is None]
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        for w in started:
            w.stop()
        raise failed
    return started


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


def complete(c: Cluster, prompt: list[int] | str, max_tokens: int = 16, **extra) -> dict:  # type: ignore[no-untyped-def]
    body = {"model": c.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **extra}
    r = httpx.post(f"{c.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()
