"""A local attacker against a real `hybridpd serve` (Ray, built-in model, CPU): one serve for every check.

- The built-in model: `serve` with no `--model` writes the tiny NemotronH under HYBRIDPD_HOME and serves it under
  its directory's name; the Prometheus targets file goes where deploy/prometheus/prometheus.yml looks.
- Network: serve runs with `--host 0.0.0.0`, and the proxy's port is the only socket of its process tree off
  loopback: the workers, UCX, Ray's GCS, raylet, core workers, agents and monitor all listen on loopback.
- Files: the secrets (the cluster token, Ray's auth token, the API key) are read the way root can (from the
  in-memory files the workers' environment points to), then every regular file under Ray's temp root, the serve's
  log, /tmp and ~/.ray is searched for them: found in none, while serving and after a SIGKILL of serve (whose
  orphan reaper stops everything and removes Ray's private temp dir). Processes never carry a secret itself in
  their environment.

Prints one JSON line per check (attacks tried, accepted, figures) and appends them to $HYBRIDPD_CHAOS_REPORT.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hybridpd.deploy.prometheus.targets import TARGETS_DIR

from tests.integration.test_serve_ray import EXIT_TIMEOUT_S, REPO, Serve, _processes, _workers
from tests.polling import wait_for
from tests.support.proc_sockets import listeners, tree
from tests.support.secret_scan import scan

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")]
SECRET_ENV = (b"HYBRIDPD_CLUSTER_TOKEN=", b"HYBRIDPD_API_KEY=", b"RAY_AUTH_TOKEN=")


def _report(what: str, figures: dict) -> None:
    line = json.dumps({"attack": what, **figures})
    print(f"\n{line}")
    if os.environ.get("HYBRIDPD_CHAOS_REPORT"):
        with open(os.environ["HYBRIDPD_CHAOS_REPORT"], "a") as f:
            f.write(line + "\n")


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def _program(command: str) -> str:
    """'python -m hybridpd.deploy.cli worker ...' -> 'hybridpd.deploy.cli worker'; '/.../raylet --x' -> 'raylet'."""
    parts = command.split()
    words = [os.path.basename(p) for p in parts[1:] if not p.startswith("-")][:2]
    first = os.path.basename(parts[0]) if parts else "?"
    return " ".join(words) if first.startswith("python") else " ".join([first, *words[:1]])[:40]


class Deployment:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started = time.time() - 2
        """Before any secret existed: files untouched since cannot hold one (secret_scan's `since`)."""
        self.ray_root = tempfile.mkdtemp(prefix="hpdray-", dir="/tmp")  # short: Ray's sockets live under it
        self.api_key = secrets.token_hex(24)
        self.key_file = tmp / "api-key"
        self.key_file.write_text(self.api_key)
        self.key_file.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HYBRIDPD_CLUSTER_TOKEN")}
        env.update(
            RAY_TMPDIR=self.ray_root,
            RAY_USAGE_STATS_ENABLED="0",
            HYBRIDPD_HOME=str(tmp / "home"),
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        )
        self.serve = Serve(
            ["--host", "0.0.0.0", "--api-key-file", str(self.key_file)],
            env,
            tmp / "serve.log",
            marker=f"{tmp}{os.sep}",
        )

    def secrets(self) -> dict[str, str]:
        """What an attacker with root would want, read the way root can."""
        found = {"api_key": self.api_key}
        for pid in tree(self.serve.proc.pid):
            env = _environ(pid)
            for name, var in (("cluster_token", b"HYBRIDPD_CLUSTER_TOKEN_FILE"), ("ray_token", b"RAY_AUTH_TOKEN_PATH")):
                if name not in found and var in env:
                    found[name] = Path(env[var].decode()).read_text().strip()
        return found

    def roots(self) -> list[str]:
        return [self.ray_root, str(self.serve.log), tempfile.gettempdir(), str(Path.home() / ".ray")]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(tmp_path_factory.mktemp("attacker"))
    try:
        d.serve.wait_healthy()
        yield d
    finally:
        d.serve.kill_all()
        import shutil

        shutil.rmtree(d.ray_root, ignore_errors=True)


def test_builtin_model_and_default_targets_file(deployment: Deployment) -> None:
    serve = deployment.serve
    (model,) = (deployment.tmp / "home" / "models").iterdir()
    assert (model / "config.json").is_file() and list(model.glob("*.safetensors"))
    cards = httpx.get(
        f"{serve.url}/v1/models", headers={"Authorization": f"Bearer {deployment.api_key}"}, timeout=30
    ).json()["data"]
    assert [c["id"] for c in cards] == [model.name]
    workers = _workers(serve.marker)
    assert len(workers) == 2 and all(str(model) in cmd for cmd in workers.values()), workers
    targets = TARGETS_DIR / f"serve-{serve.port}.json"
    assert {g["labels"]["role"] for g in json.loads(targets.read_text())} == {"proxy", "prefill", "decode"}


def test_only_the_proxy_listens_off_loopback(deployment: Deployment) -> None:
    serve = deployment.serve
    model = httpx.get(
        f"{serve.url}/v1/models", headers={"Authorization": f"Bearer {deployment.api_key}"}, timeout=30
    ).json()["data"][0]["id"]
    r = httpx.post(
        f"{serve.url}/v1/completions",
        headers={"Authorization": f"Bearer {deployment.api_key}"},
        json={
            "model": model,
            "prompt": "The quick brown fox jumps over the lazy dog",
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text  # a PD request: the KV transfer opened UCX's listeners too
    pids = tree(serve.proc.pid)
    found = listeners(pids)
    commands = {_program(x.command) for x in found}
    off = [x for x in found if not x.on_loopback()]
    _report(
        "network_listeners",
        {
            "processes": len(pids),
            "listeners": len(found),
            "off_loopback_besides_the_proxy": len(off) - 1,
            "programs": sorted(commands),
        },
    )
    assert any("gcs_server" in c for c in commands) and any("raylet" in c for c in commands), commands
    assert len(found) >= 10, found  # proxy, 2 workers x (gRPC, metrics, UCX), GCS, raylet, core workers, agents
    assert [(x.pid, x.address, x.port) for x in off] == [(serve.proc.pid, "0.0.0.0", serve.port)], off


def test_no_secret_in_any_file_or_environment_while_serving(deployment: Deployment) -> None:
    found = deployment.secrets()
    assert set(found) == {"api_key", "cluster_token", "ray_token"}, found.keys()
    assert len(set(found.values())) == 3 and all(len(v) >= 32 for v in found.values())
    result = scan(found, deployment.roots(), skip=[str(deployment.key_file)], since=deployment.started)
    carriers = [pid for pid in tree(deployment.serve.proc.pid) if any(k + b"=" in SECRET_ENV for k in _environ(pid))]
    private = [p for p in Path(deployment.ray_root).iterdir()]
    _report(
        "local_file_reader",
        {
            "files_read": result.files_read,
            "secrets": len(found),
            "files_with_a_secret": result.total_hits(),
            "readable_by_others": sum(len(v) for v in result.readable.values()),
            "processes_with_a_secret_in_env": len(carriers),
        },
    )
    assert result.files_read > 50, result.files_read  # Ray's session logs were searched
    assert result.total_hits() == 0, result.hits
    assert not carriers
    # Ray's files sit in a private dir of this serve, which no other user can enter
    assert len(private) == 1 and private[0].stat().st_mode & 0o777 == 0o700, private


def test_after_sigkill_of_serve_nothing_is_left(deployment: Deployment) -> None:
    found = deployment.secrets()
    serve = deployment.serve
    os.kill(serve.proc.pid, signal.SIGKILL)
    serve.proc.wait(timeout=EXIT_TIMEOUT_S)
    wait_for("every process of serve to exit", lambda: not _processes(serve.marker), timeout=30, interval=0.5)
    wait_for(
        "the reaper to remove Ray's temp dir",
        lambda: not list(Path(deployment.ray_root).iterdir()),
        timeout=15,
        interval=0.5,
    )
    result = scan(found, deployment.roots(), skip=[str(deployment.key_file)], since=deployment.started)
    _report(
        "local_file_reader_after_sigkill", {"files_read": result.files_read, "files_with_a_secret": result.total_hits()}
    )
    assert result.total_hits() == 0, result.hits
