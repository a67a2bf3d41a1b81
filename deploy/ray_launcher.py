"""`hybridpd serve`: start (or join) Ray, run each worker as a Ray actor that supervises a `hybridpd worker`
process (restarting it on the same port if it dies: new epoch, so stale transfer params are refused), then serve
the proxy in this process. Ctrl-C stops the proxy, the workers and Ray.

    driver (hybridpd serve) --ray--> WorkerActor(prefill) --spawns--> hybridpd worker --role prefill
                            --ray--> WorkerActor(decode)  --spawns--> hybridpd worker --role decode
                            uvicorn proxy --gRPC--> workers
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from hybridpd.engine.errors import HybridPDError

log = logging.getLogger("hybridpd.serve")


class WorkerStartError(HybridPDError):
    """A worker exited (or hung) before it was ready. `reason` is the worker's own: its last error line (a model
    that does not fit, a missing package, a bad flag), so `serve` can print it instead of a traceback."""

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"{role} worker did not start: {reason}")
        self.role, self.reason = role, reason


def worker_error(role: str, code: int | None, stderr_tail: list[str]) -> WorkerStartError:
    """The error of a worker that exited with `code` before its ready line: its own `error:` line when it printed
    one (the CLI's one-line message), else the last lines it wrote."""
    lines = [line.strip() for line in stderr_tail if line.strip()]
    own = next((line for line in reversed(lines) if ": error: " in line), None)
    detail = own.split(": error: ", 1)[1] if own else " | ".join(lines[-3:]) or "no output on stderr"
    return WorkerStartError(role, f"{detail} (exit code {code})")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_gpus_per_worker(asked: float | None, device: str, cluster_gpus: float, gpus_needed: int) -> float:
    """`--gpus-per-worker`, or when not given: one GPU per rank where the engine may use CUDA (`--device auto` or
    cuda) and the Ray cluster has one for each (`gpus_needed`: every worker's tensor-parallel ranks), none on a
    cluster without GPUs. A cluster with some GPUs but fewer than that is a ConfigError: Ray would hide the GPUs
    from actors that reserve none, and `auto` would quietly run every worker on the CPU."""
    if asked is not None:
        return asked
    wants_gpu = device == "auto" or device.startswith("cuda")
    if not wants_gpu or cluster_gpus <= 0:
        return 0.0
    if cluster_gpus >= gpus_needed:
        return 1.0
    from hybridpd.deploy.commands import ConfigError

    raise ConfigError(
        f"the workers need {gpus_needed} GPUs (one per worker and tensor-parallel rank) but the Ray cluster has "
        f"{cluster_gpus:g}: share them (e.g. two workers on one GPU: --gpus-per-worker 0.5 --gpu-memory-utilization "
        f"0.45), serve fewer workers (--colocated --num-decode 1), or run on the CPU (--device cpu)"
    )


def check_started(infos: list[tuple[str, dict[str, Any]]]) -> None:
    """WorkerStartError naming each reason once, with the roles it stopped (N workers of one model usually fail
    alike), when any actor's worker did not start."""
    roles: dict[str, list[str]] = {}
    for role, info in infos:
        if info.get("error"):
            roles.setdefault(info["error"], []).append(role)
    if roles:
        raise WorkerStartError("; ".join(" and ".join(dict.fromkeys(r)) for r in roles.values()), "; ".join(roles))


START_TIMEOUT_S = 600.0
"""How long `serve` waits for its workers to load their model and report ready (as vLLM's engine start-up wait;
a model past it: a WorkerStartError saying so)."""


def gather_infos(ray: Any, actors: list[tuple[str, Any]], timeout_s: float = START_TIMEOUT_S
                 ) -> list[tuple[str, dict[str, Any]]]:
    """Each actor's worker info, waiting at most `timeout_s` in all; WorkerStartError naming the role of an actor
    that died (its process killed: host memory, a node lost) or is still not ready by then."""
    deadline = time.monotonic() + timeout_s
    infos = []
    for role, actor in actors:
        try:
            infos.append((role, ray.get(actor.info.remote(), timeout=max(deadline - time.monotonic(), 0.0))))
        except ray.exceptions.GetTimeoutError:
            raise WorkerStartError(role, f"not ready in {timeout_s:g} s (still loading its model?)") from None
        except ray.exceptions.RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise WorkerStartError(role, f"its Ray actor died ({first})") from None
    return infos


def served_max_model_len(asked: int, infos: list[tuple[str, dict[str, Any]]]) -> int:
    """The proxy's max_model_len: `asked` (the checkpoint's, or --max-model-len), or less where a worker's cache
    plan holds less (--max-model-len auto fitted it to its memory): the shortest, so every worker serves what the
    proxy admits."""
    lens = [int(i["kv_cache"]["max_model_len"]) for _, i in infos if (i.get("kv_cache") or {}).get("max_model_len")]
    if lens and min(lens) < asked:
        log.info("max_model_len %d: the workers' caches hold %d (auto-fit)", asked, min(lens))
        return min(lens)
    return asked


class WorkerProcess:
    """One `hybridpd worker` subprocess, restarted on death with the same ports. Used inside the Ray actor and by
    tests/launchers without Ray.

    Ports: the first start lets the worker bind free ports itself (port 0; its ready line reports them), so no other
    process can take a port between choosing and binding it (a port picked here and bound seconds later, after the
    model loads, can meanwhile become some connection's ephemeral port). Restarts ask for the same ports; if those
    were taken meanwhile, the worker comes back on new ones rather than not at all."""

    def __init__(self, argv: list[str], host: str = "127.0.0.1", env: dict[str, str] | None = None,
                 restart: bool = True, ready_timeout_s: float = 600.0) -> None:
        self.host = host
        self.base_argv = list(argv)
        self.grpc_port = 0
        self.metrics_port = 0
        self.env = {**os.environ, **(env or {})}
        self.restart = restart
        self.ready_timeout_s = ready_timeout_s
        self.info: dict[str, Any] = {}
        self.restarts = 0
        self._stopping = False
        self.proc: subprocess.Popen | None = None
        self._start()
        self._watch = threading.Thread(target=self._supervise, daemon=True)
        self._watch.start()

    @property
    def argv(self) -> list[str]:
        """The worker's command line: the caller's arguments and this process's host and ports."""
        ports = ["--port", str(self.grpc_port), "--metrics-port", str(self.metrics_port)]
        return [*self.base_argv, "--host", self.host, *ports]

    @property
    def role(self) -> str:
        argv = self.base_argv
        return argv[argv.index("--role") + 1] if "--role" in argv[:-1] else "worker"

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridpd.deploy.cli", "worker", *self.argv],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        tail: deque[str] = deque(maxlen=20)  # the worker's last stderr lines: the error of one that fails to start
        tee = threading.Thread(target=self._tee_stderr, args=(self.proc, tail), daemon=True)
        tee.start()
        lines: queue.Queue[str | None] = queue.Queue()
        waiting = threading.Event()  # set while the ready line is awaited; after it, stdout is only drained
        waiting.set()
        threading.Thread(target=self._read_stdout, args=(self.proc, lines, waiting), daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)  # never a blocking read past the deadline (a silent, stuck worker)
            except queue.Empty:
                break
            if line is None:
                code = self.proc.wait()
                tee.join(timeout=5)  # its last lines
                raise worker_error(self.role, code, list(tail))
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict) and msg.get("event") == "ready":
                waiting.clear()
                self.info = msg
                self.grpc_port = int(msg.get("grpc_port") or self.grpc_port)
                self.metrics_port = int(msg.get("metrics_port") or self.metrics_port)
                return
        waiting.clear()
        self.proc.kill()
        self.proc.wait()
        raise WorkerStartError(self.role, f"not ready in {self.ready_timeout_s:g} s")

    @staticmethod
    def _read_stdout(proc: subprocess.Popen, lines: queue.Queue[str | None], waiting: threading.Event) -> None:
        """The worker's stdout lines into `lines` while its ready line is awaited, then drained (a full pipe would
        block the worker); None at its end."""
        assert proc.stdout is not None
        for line in proc.stdout:
            if waiting.is_set():
                lines.put(line)
        lines.put(None)

    @staticmethod
    def _tee_stderr(proc: subprocess.Popen, tail: deque[str]) -> None:
        """Copy the worker's stderr to ours as it comes (its log), keeping the last lines."""
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line)
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):  # our stderr closed: keep draining the pipe
                pass

    def _supervise(self) -> None:
        while not self._stopping:
            time.sleep(0.5)
            if self.proc is not None and self.proc.poll() is not None and not self._stopping and self.restart:
                log.warning("worker %s died (exit %s): restarting", self.info.get("role"), self.proc.returncode)
                self.restarts += 1
                for retry in (False, True):  # on its ports, then (they may have been taken meanwhile) on new ones
                    try:
                        self._start()
                        break
                    except Exception:  # noqa: BLE001
                        if retry or self._stopping or not (self.grpc_port or self.metrics_port):
                            log.exception("worker restart failed")
                            break
                        log.warning("worker %s did not come back on ports %d / %d: restarting it on new ones",
                                    self.info.get("role"), self.grpc_port, self.metrics_port)
                        self.grpc_port = self.metrics_port = 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _make_actor_class(ray: Any) -> Any:
    @ray.remote(max_restarts=-1, max_concurrency=4)
    class WorkerActor:
        def __init__(self, argv: list[str], host: str) -> None:
            if host == "node":  # joined a multi-node cluster: bind on the node this actor landed on
                host = ray.util.get_node_ip_address()
            self.role = argv[argv.index("--role") + 1] if "--role" in argv else "worker"
            self.error: str | None = None
            """Why the worker never started (its own message): the driver reports it. Not raised here, where Ray
            would restart the actor (max_restarts) and the driver see only that it went away."""
            self.worker: WorkerProcess | None = None
            try:
                self.worker = WorkerProcess(argv, host=host)
            except WorkerStartError as e:
                self.error = e.reason
            except Exception as e:  # noqa: BLE001 - any start failure goes to the driver as text
                self.error = f"{type(e).__name__}: {e}"

        def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this: "(prefill worker pid=...)"
            return f"{self.role} worker"

        def info(self) -> dict[str, Any]:
            if self.worker is None:
                return {"error": self.error}
            return {**self.worker.info, "restarts": self.worker.restarts, "alive": self.worker.alive(),
                    "node_id": ray.get_runtime_context().get_node_id()}

        def pid(self) -> int:
            return self.worker.proc.pid if self.worker is not None and self.worker.proc else -1

        def stop(self) -> None:
            if self.worker is not None:
                self.worker.stop()

    return WorkerActor


def _targets_path(args: Any) -> Path | None:
    """Where to write the Prometheus file_sd targets: `--prometheus-targets`, else `serve-<port>.json` beside
    deploy/prometheus/prometheus.yml (which reads targets/*.json); None for `--prometheus-targets none`."""
    from hybridpd.deploy.prometheus.targets import TARGETS_DIR

    chosen = getattr(args, "prometheus_targets", None)
    if chosen is None:
        return TARGETS_DIR / f"serve-{args.port}.json"
    return None if chosen.lower() in ("", "none") else Path(chosen)


def _write_prometheus_targets(args: Any, infos: list[tuple[str, dict[str, Any]]]) -> Path | None:
    """The proxy and every worker's metrics endpoint as file_sd targets (deploy/prometheus/targets/README.md), in the
    shape `GET /v1/cluster` would give. Best effort: a failure to write is logged, never fatal."""
    from hybridpd.deploy.prometheus.targets import targets_from_cluster, write_targets

    path = _targets_path(args)
    if path is None:
        return None
    workers = []
    for role, info in infos:
        worker_host, port = info["address"].rsplit(":", 1)[0], info.get("metrics_port")
        workers.append({"role": role, "metrics_url": f"http://{worker_host}:{port}/metrics" if port else None})
    proxy_host = args.host if args.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    proxy = f"[{proxy_host}]:{args.port}" if ":" in proxy_host else f"{proxy_host}:{args.port}"
    try:
        write_targets(targets_from_cluster({"workers": workers}, proxy), path)
    except OSError as e:
        log.warning("could not write the Prometheus targets file %s: %s", path, e)
        return None
    print(f"prometheus targets: {path}", flush=True)
    return path


def role_tensor_parallel(args: Any) -> dict[str, int]:
    """Ranks per worker of each role: --prefill-tp / --decode-tp, each defaulting to --tensor-parallel-size."""
    from hybridpd.deploy.commands import ConfigError

    both = getattr(args, "tensor_parallel_size", 1)
    out = {"prefill": getattr(args, "prefill_tp", None) or both, "decode": getattr(args, "decode_tp", None) or both}
    if min(out.values()) < 1:
        raise ConfigError(f"tensor-parallel sizes must be >= 1, got {out}")
    return out


def with_tensor_parallel(worker_argv: list[str], tp: int) -> list[str]:
    """`worker_argv` with its --tensor-parallel-size replaced by `tp`."""
    out, skip = [], False
    for a in worker_argv:
        if skip:
            skip = False
        elif a == "--tensor-parallel-size":
            skip = True
        elif not a.startswith("--tensor-parallel-size="):
            out.append(a)
    return [*out, "--tensor-parallel-size", str(tp)] if tp > 1 else out


def role_argv(args: Any, role: str, worker_argv: list[str], tp: int, register: list[str]) -> list[str]:
    """The `hybridpd worker` command line of one worker of `role` (prefill, decode or colocated): the engine flags at
    the role's TP size, prefill's own flags (--max-decode-share), --enforce-eager (not a config field: on the
    command line, which reaches a worker on any node) and the proxy to register with."""
    own = ["--max-decode-share", repr(float(args.max_decode_share))] if role == "prefill" else []
    eager = ["--enforce-eager"] if getattr(args, "enforce_eager", False) else []
    return ["--role", role, *with_tensor_parallel(worker_argv, tp), *eager, *own, *register]


def _placement(args: Any, role: str) -> dict[str, Any]:
    """Ray actor options that pin a role to chosen nodes: `--prefill-resources` / `--decode-resources` (JSON custom
    resources each worker of the role needs, e.g. {"prefill_node": 1}, given to nodes by `ray start --resources`)."""
    import json

    raw = getattr(args, f"{role}_resources", None)
    return {"resources": json.loads(raw)} if raw else {}


def _registration_argv(args: Any, host: str, ray: Any) -> list[str]:
    """Workers register with the proxy (live membership): a worker an actor restarts elsewhere, on another node or
    port, is routed to without a proxy restart. The proxy's address as the workers reach it."""
    proxy_host = args.host
    if proxy_host in ("0.0.0.0", "::", ""):
        proxy_host = "127.0.0.1" if host == "127.0.0.1" else ray.util.get_node_ip_address()
    elif host != "127.0.0.1" and proxy_host in ("127.0.0.1", "localhost"):
        return []  # a loopback proxy is out of reach of other nodes: static membership only
    netloc = f"[{proxy_host}]" if ":" in proxy_host else proxy_host
    return ["--register-with", f"http://{netloc}:{args.port}"]


def serve(args: Any, worker_argv: list[str], model_path: str, max_model_len: int) -> int:
    role_tp = role_tensor_parallel(args)
    from hybridpd.deploy.commands import routing_weights
    from hybridpd.deploy.ray_local import LocalRay, prepare_local_ray
    from hybridpd.deploy.secret_files import SecretFiles, scrub_secret_env
    from hybridpd.proxy.config import ProxyConfig
    from hybridpd.proxy.server import run as run_proxy
    from hybridpd.worker.auth import TOKEN_FILE_ENV

    host = "127.0.0.1" if args.address is None and not os.environ.get("RAY_ADDRESS") else "node"
    env_vars = {"PYTHONPATH": os.pathsep.join(sys.path)}
    token: str | None = getattr(args, "cluster_token", None)
    scrub_secret_env()  # the proxy gets its secrets as arguments; no process started from here inherits them
    secret_files = SecretFiles()
    local_ray: LocalRay | None = None
    if host == "127.0.0.1":
        # a cluster of our own: its workers accept only calls that carry the token (the proxy here sends it); they
        # read it from an in-memory file of this process, never from an environment variable (Ray logs those)
        token = token or secrets.token_hex(32)
        env_vars[TOKEN_FILE_ENV] = secret_files.add("cluster-token", token)
        local_ray = prepare_local_ray(secret_files)  # loopback, private temp dir, Ray's own token in memory
    elif token is None:
        log.warning("joining a Ray cluster without a cluster token: give every node's workers one "
                    "(HYBRIDPD_CLUSTER_TOKEN_FILE) and this serve the same (--cluster-token-file)")
    local = args.address is None
    if local:  # a SIGKILLed driver must not leave Ray's daemons, the workers or Ray's temp dir behind
        from hybridpd.deploy.reaper import start_orphan_reaper

        stale = _targets_path(args)  # a SIGKILLed serve leaves its Prometheus targets: the reaper removes them
        start_orphan_reaper(remove=([local_ray.temp_dir] if local_ray else []) + ([str(stale)] if stale else []))
    import ray

    ray.init(address=args.address, logging_level=logging.WARNING,
             runtime_env={"env_vars": env_vars} if local else None,
             **(local_ray.init_kwargs if local_ray else {"include_dashboard": False}))
    actor_cls = _make_actor_class(ray)
    roles = ["decode"] * args.num_decode if args.colocated else \
        ["prefill"] * args.num_prefill + ["decode"] * args.num_decode
    actors = []
    targets: Path | None = None
    try:
        # one CPU per worker where there is one; on a smaller machine a share of it (a whole CPU each would leave the
        # third worker of a 2-core box waiting forever for a CPU that does not exist)
        total_cpus = float(ray.cluster_resources().get("CPU", 1.0))
        num_cpus = min(1.0, round(total_cpus / max(1, len(roles)), 2))
        gpus = default_gpus_per_worker(args.gpus_per_worker, getattr(args, "device", "auto"),
                                       float(ray.cluster_resources().get("GPU", 0.0)),
                                       sum(role_tp[role] for role in roles))
        register = _registration_argv(args, host, ray)
        for role in roles:
            tp = role_tp[role]  # a worker's ranks: one actor, so one node
            argv = role_argv(args, "colocated" if args.colocated else role, worker_argv, tp, register)
            opts = {"num_cpus": num_cpus, "num_gpus": max(gpus, tp) if gpus else 0.0, **_placement(args, role)}
            actors.append((role, actor_cls.options(**opts).remote(argv, host)))
        infos = gather_infos(ray, actors)
        check_started(infos)
        max_model_len = served_max_model_len(max_model_len, infos)
        prefill = tuple(i["address"] for r, i in infos if r == "prefill")
        decode = tuple(i["address"] for r, i in infos if r == "decode")
        for role, info in infos:
            node = info["address"].rsplit(":", 1)[0]
            print(f"worker {role:8s} grpc={info['address']} metrics=http://{node}:{info['metrics_port']}/metrics "
                  f"epoch={info['epoch'][:8]} node={info.get('node_id', '')[:12]}", flush=True)
        targets = _write_prometheus_targets(args, infos)
        cfg = ProxyConfig(prefill_addrs=prefill, decode_addrs=decode,
                          model_name=getattr(args, "served_model_name", None)
                          or os.path.basename(os.path.normpath(model_path)),
                          tokenizer_path=getattr(args, "tokenizer", None) or model_path, model_path=model_path,
                          generation_config=getattr(args, "generation_config", "auto"),
                          chat_template=getattr(args, "chat_template", None),
                          routing=args.routing, api_key=args.api_key, max_model_len=max_model_len,
                          colocated=args.colocated, host=args.host, port=args.port,
                          request_timeout_s=getattr(args, "request_timeout", 600.0), cluster_token=token,
                          **getattr(args, "proxy_limits", {}), routing_weights=routing_weights(args))
        print(f"proxy: http://{args.host}:{args.port}/v1 (model {cfg.model_name}); cluster view: "
              f"http://{args.host}:{args.port}/v1/cluster", flush=True)
        run_proxy(cfg)
    except KeyboardInterrupt:
        pass
    finally:
        if targets is not None:
            targets.unlink(missing_ok=True)
        for _, a in actors:
            try:
                ray.get(a.stop.remote(), timeout=15)
            except Exception:  # noqa: BLE001
                pass
        ray.shutdown()
        secret_files.close()
        if local_ray is not None:
            local_ray.close()
    return 0
