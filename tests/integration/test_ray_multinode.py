"""`hybridpd serve --address` on a two-node Ray cluster on one machine: `ray start --head` with the custom resource
`node_a`, a second `ray start --address` with `node_b`, both able to hold both workers (2 CPUs each). `serve`
attaches (it starts no Ray of its own), places the prefill worker through `--prefill-resources '{"node_a": 1}'` and
the decode worker through `--decode-resources '{"node_b": 1}'`: they land on different nodes, bind on their
node's address, register with the proxy, and a completion through the proxy equals the colocated engine's.

Ray runs with token authentication (a random token of this test) and its own temp dir; everything it started is
found by the test's directory in its environment and killed by pid, never `ray stop` (other clusters may run on
this machine).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from hybridpd.deploy.ray_launcher import free_port
from hybridpd.engine import LLM, SamplingParams

from tests.integration.test_serve_ray import REPO, Serve, _processes
from tests.oracle import random_prompts

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))


def _ray_start(args: list[str], env: dict[str, str]) -> None:
    out = subprocess.run(
        [RAY, "start", "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--disable-usage-stats", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_serve_attaches_to_a_two_node_ray_cluster(tmp_path: Path, checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    model = checkpoint_dir("nemotron_attn_mid")
    ray_tmp = tempfile.mkdtemp(prefix="hpdray2-", dir="/tmp")  # short: Ray's unix sockets live under it
    marker = f"{tmp_path}{os.sep}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_TMPDIR=ray_tmp,
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        HYBRIDPD_HOME=str(tmp_path / "home"),
        HPD_TEST_MARKER=marker,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
    )
    port = free_port()
    serve = None
    try:
        _ray_start(
            [
                "--head",
                "--port",
                str(port),
                "--include-dashboard",
                "false",
                "--temp-dir",
                ray_tmp,
                "--resources",
                '{"node_a": 1}',
            ],
            env,
        )
        _ray_start(["--address", f"127.0.0.1:{port}", "--resources", '{"node_b": 1}'], env)
        serve = Serve(
            [
                "--model",
                model,
                "--address",
                f"127.0.0.1:{port}",
                "--prefill-resources",
                '{"node_a": 1}',
                "--decode-resources",
                '{"node_b": 1}',
                "--routing",
                "cache_aware",
                "--kv-cache-memory-bytes",
                str(32 * 2**20),
            ],
            env,
            tmp_path / "serve.log",
            marker,
        )
        serve.wait_healthy()
        nodes = dict(re.findall(r"^worker (prefill|decode)\s.* node=(\w+)$", serve.log_tail(20000), re.M))
        assert set(nodes) == {"prefill", "decode"} and nodes["prefill"] != nodes["decode"], serve.log_tail()
        members = {w["role"]: w["membership"] for w in serve.cluster()["workers"]}
        assert members["prefill"]["state"] == members["decode"]["state"] == "up"
        prompt = random_prompts([41], vocab=256, seed=3)[0]
        r = httpx.post(
            f"{serve.url}/v1/completions",
            timeout=120,
            json={
                "model": os.path.basename(model),
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        want = LLM(model=model, kv_cache_memory_bytes=32 * 2**20).generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        )
        assert r.json()["choices"][0]["token_ids"] == want[0].token_ids
    finally:
        if serve is not None:
            serve.kill_all()
        for _ in range(5):  # the two raylets, the GCS and Ray's helpers (a dying raylet may still start an agent)
            left = {**_processes(marker), **_processes(ray_tmp)}
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(1)
        shutil.rmtree(ray_tmp, ignore_errors=True)
