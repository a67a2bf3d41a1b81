"""A cluster, not a pair, through the proxy only (real processes, tiny model, CPU): cache-aware routing keeps the
decode workers' prefix-cache hits as the cluster grows, survives lossy cache events, and follows membership
changes (drain, crash, restart, join) without a proxy restart.

One cluster of 1 prefill + 3 decode workers behind a `--routing cache_aware` proxy. Runs of the same prefix-heavy
requests (shared prefixes of odd lengths, each reused a few times) are kept apart by cache salts (a salt hashes
blocks apart, so each run starts from cold caches; greedy outputs do not depend on it):

    1P+1D   two decode workers drained (one call each, to one proxy; a second proxy learns it from the workers)
    1P+3D   the bar: decode-side hit tokens >= 0.9 of 1P+1D, same outputs
    lossy   a second proxy on the same workers drops 30 % of the cache events: hits >= 0.8 of 1P+3D, same outputs
    crash   a decode worker SIGKILLed under load: every answer right, the proxy marks it down within 2 s (its actor-less
            supervisor restarts it: new epoch, back in rotation)
    join    a new decode worker registers with the proxy: it gets traffic within 5 s of being ready
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hybridpd.deploy.ray_launcher import WorkerProcess, free_port
from hybridpd.engine import LLM, SamplingParams

from tests.integration.cluster import start_cluster
from tests.polling import wait_for

pytestmark = pytest.mark.slow

NEW = 4
PREFIX_LENGTHS = (37, 70, 101, 53, 86, 45)


def prefix_heavy(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in PREFIX_LENGTHS]
    prompts = [p + [rng.randrange(256) for _ in range(rng.randrange(2, 12))] for p in prefixes for _ in range(3)]
    rng.shuffle(prompts)
    return prompts


def decode_hits(url: str) -> float:
    """Prompt tokens the decode workers found in their own prefix caches (the proxy's route metric)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^hybridpd_proxy_route_real_hit_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    )


def run(url: str, model: str, prompts: list[list[int]], salt: str) -> list[list[int]]:
    out = []
    for p in prompts:
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=60,
            json={
                "model": model,
                "prompt": p,
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "cache_salt": salt,
            },
        )
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def members(url: str) -> dict[str, dict]:
    workers = httpx.get(f"{url}/v1/cluster", timeout=10).json()["workers"]
    return {w["address"]: w["membership"] for w in workers if w.get("membership")}


def drain(url: str, addr: str, on: bool = True) -> None:
    r = httpx.post(f"{url}/v1/cluster/drain", json={"address": addr, "drain": on}, timeout=10)
    assert r.status_code == 200 and r.json()["draining"] is on, r.text


@pytest.fixture(scope="module")
def cluster(checkpoint_dir):  # type: ignore[no-untyped-def]
    c = start_cluster(
        checkpoint_dir("nemotron_attn_mid"),
        num_decode=3,
        proxy_args=["--routing", "cache_aware"],
        worker_args=["--kv-cache-memory-bytes", str(32 * 2**20)],
    )
    yield c
    c.stop()


def _second_proxy(c, extra: list[str]) -> tuple[subprocess.Popen, str]:  # type: ignore[no-untyped-def]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "hybridpd.deploy.cli",
        "proxy",
        "--model",
        c.model,
        "--port",
        str(port),
        "--routing",
        "cache_aware",
        "--prefill",
        *[w.info["address"] for w in c.prefill],
        "--decode",
        *[w.info["address"] for w in c.decode],
        *extra,
    ]
    log = open(os.path.join(tempfile.gettempdir(), f"hybridpd-proxy-{port}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=c.extra["proxy_env"])
    url = f"http://127.0.0.1:{port}"

    def synced() -> bool:
        try:
            view = members(url)
        except httpx.HTTPError:
            return False
        return len(view) == 4 and all(m["cache_index"] and m["cache_index"]["synced"] for m in view.values())

    wait_for("the second proxy's cache indexes", synced, timeout=120)
    return proc, url


def test_hits_hold_as_decode_workers_are_added_and_under_event_loss(cluster):  # type: ignore[no-untyped-def]
    url, model = cluster.url, cluster.model_name
    prompts = prefix_heavy()
    d = [w.info["address"] for w in cluster.decode]
    wait_for(
        "synced cache indexes",
        lambda: all(m["cache_index"] and m["cache_index"]["synced"] for m in members(url).values()),
        timeout=60,
    )

    drain(url, d[1])
    drain(url, d[2])
    h0 = decode_hits(url)
    one = run(url, model, prompts, salt="one")
    hits_one = decode_hits(url) - h0
    # a second proxy on the same workers (it drops 30 % of their cache events) learns the drain from the workers
    proc, lossy_url = _second_proxy(cluster, ["--cache-event-drop-fraction", "0.3"])
    try:
        wait_for(
            "the drain seen by the second proxy",
            lambda: [m["state"] for a, m in members(lossy_url).items() if a in d] == ["up", "draining", "draining"],
        )
        drain(url, d[1], False)
        drain(url, d[2], False)
        wait_for(
            "the undrain seen by the second proxy", lambda: all(m["state"] == "up" for m in members(lossy_url).values())
        )
        h0 = decode_hits(url)
        three = run(url, model, prompts, salt="three")
        hits_three = decode_hits(url) - h0
        lossy = run(lossy_url, model, prompts, salt="lossy")
        hits_lossy = decode_hits(lossy_url)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert three == one
    llm = LLM(model=cluster.model, kv_cache_memory_bytes=32 * 2**20)  # the colocated engine: the right answers
    want = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    )
    assert one == [w.token_ids for w in want]
    assert hits_one > 0
    assert hits_three >= 0.9 * hits_one, (hits_three, hits_one)
    print(f"decode hit tokens: 1P+1D {hits_one:.0f}, 1P+3D {hits_three:.0f} ({hits_three / hits_one:.2f})")
    assert lossy == one
    assert hits_lossy >= 0.8 * hits_three, (hits_lossy, hits_three)
    print(f"decode hit tokens with 30 % of cache events dropped: {hits_lossy:.0f} ({hits_lossy / hits_three:.2f})")


def test_crash_and_join_take_effect_without_a_proxy_restart(cluster):  # type: ignore[no-untyped-def]
    url, model = cluster.url, cluster.model_name
    prompts = prefix_heavy(seed=2)
    want = {tuple(p): t for p, t in zip(prompts, run(url, model, prompts, salt="ref"), strict=True)}
    victim = cluster.decode[2]
    addr = victim.info["address"]
    results: list[tuple[list[int], list[int]]] = []

    def client(k: int) -> None:
        for p in prompts[k::3]:
            results.append((p, run(url, model, [p], salt=f"load{k}")[0]))

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(client, k) for k in range(3)]
        time.sleep(0.5)
        assert victim.proc is not None
        t_kill = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        wait_for(
            "the killed worker marked down", lambda: members(url)[addr]["state"] == "down", timeout=5, interval=0.05
        )
        moved_s = time.monotonic() - t_kill
        for f in futures:
            f.result(timeout=120)
    assert len(results) == len(prompts)
    assert all(want[tuple(p)] == got for p, got in results), "a wrong answer after a decode worker was killed"
    assert moved_s <= 2.0, moved_s
    print(f"killed decode worker marked down after {moved_s:.2f} s")
    # its supervisor restarts it on the same port (a new epoch) while a new worker starts and registers itself;
    # both take part without a proxy restart
    old_epoch = members(url)[addr]["epoch"]
    args = [
        "--role",
        "decode",
        "--model",
        cluster.model,
        "--register-with",
        url,
        "--kv-cache-memory-bytes",
        str(32 * 2**20),
    ]
    joined = WorkerProcess(args, env={"PYTHONPATH": os.getcwd()}, restart=False)
    try:
        t_ready = time.monotonic()
        new_addr = joined.info["address"]
        rng = random.Random(5)

        def got_traffic() -> bool:
            run(url, model, [[rng.randrange(256) for _ in range(20)]], salt="join")
            return cluster.metric(joined, "hybridpd_prefix_cache_queries_total") > 0

        wait_for("traffic on the joined worker", got_traffic, timeout=5, interval=0.01)
        print(f"joined decode worker served its first request {time.monotonic() - t_ready:.2f} s after ready")
        assert members(url)[new_addr]["static"] is False
        wait_for(
            "the restarted worker up again",
            lambda: (m := members(url)[addr])["state"] == "up" and m["epoch"] != old_epoch,
            timeout=120,
        )
        assert members(url)[addr]["restarts"] >= 1
    finally:
        joined.stop()
    wait_for("the joined worker gone after it left", lambda: new_addr not in members(url), timeout=10)
