"""`hybridpd serve` end to end: a local Ray cluster whose actors supervise a prefill and a decode worker, the proxy
in the driver, the official `openai` client against it.

One test (Ray's start dominates, so the steps share one cluster): completions (plain and streamed) and a chat
completion give the colocated `LLM`'s greedy tokens; a killed decode worker is restarted by its actor (new epoch,
same output); SIGINT stops everything within 30 s and leaves no worker behind. `serve` with no `--model` (the
built-in tiny model) and a SIGKILL of `serve` are checked by tests/chaos/test_local_attacker.py on its own serve.

Each `serve` runs with its own Ray temp dir (RAY_TMPDIR) and HYBRIDPD_HOME under the test's tmp_path. Every process
it starts inherits that environment, so the test finds them (workers to kill, leftovers) through /proc by that
path, never by a broad name: other clusters may run on the same machine. Whatever is left at the end is killed by
pid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hybridpd.deploy.prometheus.targets import TARGETS_DIR, targets_from_cluster
from hybridpd.deploy.ray_launcher import free_port
from openai import OpenAI

from tests.polling import wait_for
from tests.support.secret_scan import scan

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300   # Ray + two workers loading torch on a 2-core machine: about a minute, more when busy
RESTART_TIMEOUT_S = 90
EXIT_TIMEOUT_S = 30
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
CHAT = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12


# ---------------------------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------------------------


def _processes(marker: str) -> dict[int, str]:
    """pid -> command line of the live (not zombie) processes, other than this one, whose command line or
    environment holds `marker`. Every process `serve` starts (Ray's daemons and actors, the workers) inherits
    the environment the test gives it, which names the test's own directories."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            env = (entry / "environ").read_bytes() if marker not in cmd else b""
        except OSError:  # gone, or not ours to read
            continue
        if cmd and state != "Z" and (marker in cmd or marker.encode() in env):
            found[int(entry.name)] = cmd
    return found


def _workers(marker: str, role: str | None = None) -> dict[int, str]:
    """`hybridpd worker` processes (the launcher runs `python -m hybridpd.deploy.cli worker`) of this test."""
    return {pid: cmd for pid, cmd in _processes(marker).items()
            if "hybridpd.deploy.cli worker" in cmd and (role is None or f"--role {role} " in f"{cmd} ")}


class Serve:
    """One `hybridpd serve` subprocess in its own session (so a signal reaches it alone)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, marker: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.marker = marker
        self.ray_root = env["RAY_TMPDIR"]
        exe = Path(sys.executable).with_name("hybridpd")  # the console script (a public contract)
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "hybridpd.deploy.cli"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*cmd, "serve", *args, "--port", str(self.port)], stdout=out,
                                         stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> float:
        t0 = time.time()
        while True:
            assert self.proc.poll() is None, f"hybridpd serve exited ({self.proc.returncode}):\n{self.log_tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            assert time.time() - t0 < timeout, f"not healthy after {timeout} s:\n{self.log_tail()}"
            time.sleep(0.5)

    def cluster(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/v1/cluster", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def interrupt(self) -> float:
        """SIGINT (Ctrl-C); the seconds until the process exited. Fails past EXIT_TIMEOUT_S."""
        t0 = time.time()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"hybridpd serve still running {EXIT_TIMEOUT_S} s after SIGINT:\n{self.log_tail()}")
        return time.time() - t0

    def assert_nothing_left(self) -> None:
        """After serve exited: no worker at all, and Ray's daemons gone within a few seconds."""
        assert not _workers(self.marker), f"`hybridpd serve` exited but left workers behind: {_workers(self.marker)}"
        wait_for("Ray's processes to exit", lambda: not _processes(self.marker), timeout=15, interval=0.5)

    def kill_all(self) -> None:
        """Finalizer: stop serve if it still runs, then kill (by pid) whatever of this test is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in _processes(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        (TARGETS_DIR / f"serve-{self.port}.json").unlink(missing_ok=True)  # the default targets file, if left


@pytest.fixture
def start_serve(tmp_path: Path) -> Iterator[Callable[[list[str], str], Serve]]:
    """Starts `hybridpd serve` with a private Ray temp dir (its own Ray session; never a cluster that a `ray start`
    left on this machine) and HYBRIDPD_HOME under tmp_path; kills whatever is left at the end."""
    started: list[Serve] = []
    ray_dirs: list[str] = []

    def start(args: list[str], name: str) -> Serve:
        ray_tmp = tempfile.mkdtemp(prefix="hpdray-", dir="/tmp")  # short: Ray's unix sockets live under it
        ray_dirs.append(ray_tmp)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(
            RAY_TMPDIR=ray_tmp,
            RAY_USAGE_STATS_ENABLED="0",  # no usage-stats reporting (nothing to reach from here)
            HYBRIDPD_HOME=str(tmp_path / "home"),
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        )
        serve = Serve(args, env, tmp_path / f"{name}.log", marker=f"{tmp_path}{os.sep}")
        started.append(serve)
        return serve

    yield start
    for serve in started:
        serve.kill_all()
    for d in ray_dirs:
        shutil.rmtree(d, ignore_errors=True)


def _complete(client: OpenAI, model: str) -> tuple[str, list[int], int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.usage is not None
    return choice.text, list(choice.model_extra["token_ids"]), r.usage.prompt_tokens


def _decode_epoch(serve: Serve) -> str | None:
    (worker,) = [w for w in serve.cluster()["workers"] if w["role"] == "decode"]
    return worker.get("epoch") if worker.get("reachable") and worker.get("ready") else None


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------


def test_serve_openai_client_restart_and_sigint(checkpoint_dir: Callable[[str], str],
                                                start_serve: Callable[[list[str], str], Serve], tmp_path: Path) -> None:
    from hybridpd.engine import LLM, SamplingParams

    model = tmp_path / "nemotron"  # the served model's name is the directory's
    model.symlink_to(checkpoint_dir("nemotron_attn_mid"), target_is_directory=True)
    targets = tmp_path / "targets" / "serve.json"
    started = time.time() - 2  # before the cluster token existed (secret_scan's `since`)
    serve = start_serve(["--model", str(model), "--num-prefill", "1", "--num-decode", "1",
                         "--prometheus-targets", str(targets)], "serve")
    startup_s = serve.wait_healthy()

    view = serve.cluster()
    assert sorted(w["role"] for w in view["workers"]) == ["decode", "prefill"], view
    assert all(w["reachable"] and w["ready"] and w["metrics_url"] for w in view["workers"]), view
    # the launcher wrote Prometheus' file_sd targets: what deploy/prometheus/targets.py makes of /v1/cluster
    assert json.loads(targets.read_text()) == targets_from_cluster(view, f"127.0.0.1:{serve.port}")
    client = OpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0, timeout=120)
    (card,) = client.models.list().data
    assert card.id == "nemotron"

    # the colocated engine on the same weights is the reference (the proxy's byte-level tokenizer is the model's)
    llm = LLM(model=str(model), kv_cache_memory_bytes=32 * 2**20)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    chat_ids = llm.tokenizer.encode_chat(CHAT)
    expect, expect_chat = (o.token_ids for o in llm.generate(prompt_token_ids=[prompt_ids, chat_ids],
                                                            sampling_params=greedy))

    text, ids, n_prompt = _complete(client, card.id)
    assert n_prompt == len(prompt_ids)
    assert ids == expect, "PD completion differs from the colocated engine"
    assert text, f"empty completion text for tokens {ids}"

    stream = client.completions.create(model=card.id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    streamed_ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", [])]
    assert streamed_ids == expect, "streamed completion differs from the colocated engine"
    assert "".join(ch.text for c in chunks for ch in c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    chat = client.chat.completions.create(model=card.id, messages=CHAT, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content, chat
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids)
    assert chat.usage.completion_tokens == MAX_TOKENS
    # a chat choice carries no token ids: compare the text
    assert chat.choices[0].message.content == llm.tokenizer.decode(expect_chat), "chat differs from colocated"

    # kill the decode worker: its actor restarts it on the same port with a new epoch
    (old_pid,) = _workers(serve.marker, "decode")
    (prefill_pid,) = _workers(serve.marker, "prefill")
    old_epoch = _decode_epoch(serve)
    assert old_epoch
    t_kill = time.time()
    os.kill(old_pid, signal.SIGKILL)
    new_epoch = wait_for("a new decode epoch in /v1/cluster",
                      lambda: (e := _decode_epoch(serve)) not in (None, old_epoch) and e, timeout=RESTART_TIMEOUT_S)
    restart_s = time.time() - t_kill
    (new_pid,) = _workers(serve.marker, "decode")
    assert new_pid != old_pid and new_epoch != old_epoch
    assert list(_workers(serve.marker, "prefill")) == [prefill_pid], "the prefill worker must be left alone"
    text2, ids2, _ = _complete(client, card.id)
    assert (text2, ids2) == (text, ids), "output after the decode worker's restart differs"

    # Ctrl-C: the proxy, the workers and Ray stop; Ray's temp dir goes too, and no file holds the cluster token
    (worker,) = _workers(serve.marker, "prefill")
    token_file = next(kv.split(b"=", 1)[1] for kv in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
                      if kv.startswith(b"HYBRIDPD_CLUSTER_TOKEN_FILE="))
    token = Path(token_file.decode()).read_text().strip()
    exit_s = serve.interrupt()
    assert serve.proc.returncode == 0, serve.log_tail()
    serve.assert_nothing_left()
    assert not targets.exists(), "the targets file outlived the cluster"
    assert not os.listdir(serve.ray_root), "Ray's temp dir outlived serve"
    found = scan({"cluster_token": token}, [serve.ray_root, str(serve.log), tempfile.gettempdir()], since=started)
    assert found.total_hits() == 0, found.hits
    print(f"\nserve: healthy after {startup_s:.0f} s, decode worker back after {restart_s:.0f} s, "
          f"exit {exit_s:.1f} s after SIGINT")
