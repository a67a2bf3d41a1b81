"""A real Prometheus scraping a real PD cluster (prefill worker, decode worker, proxy; real gRPC and NIXL).

What is checked:

- the scrape config of deploy/prometheus/prometheus.yml, fed with file_sd targets that deploy/prometheus/targets.py
  writes from the proxy's `GET /v1/cluster`, finds the proxy and both workers under the three job names, and the
  series keep the workers' own `role` (no `exported_role`);
- the prefix-cache hit rate of a prefix-repetition workload, read through PromQL over the HTTP API, equals the rate
  the workload implies from first principles (`_expected_counters`, exact: counters count tokens);
- every expression of the Grafana dashboard (deploy/grafana/hybridpd.json, with Grafana's variables substituted
  as tests/unit/test_dashboard.py does) evaluates on the live server, and every metric it names is exported.

Skipped when no `prometheus` binary is installed (scripts/install-prometheus.sh installs Debian's; CI runs it).
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hybridpd.deploy.prometheus.targets import targets_from_cluster, write_targets
from hybridpd.deploy.ray_launcher import free_port

from tests.integration.cluster import Cluster, complete, start_cluster
from tests.polling import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK)
                                             else None)

_spec = importlib.util.spec_from_file_location("hybridpd_dashboard_checks", REPO / "tests" / "unit" /
                                               "test_dashboard.py")
assert _spec is not None and _spec.loader is not None
dashboard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dashboard)

BLOCK = 16             # --block-size (default)
INTERVAL = 32          # --checkpoint-interval
MAX_TOKENS = 4
PREFIX_LEN, SUFFIX_LEN, NUM_PREFIXES, REPEATS = 96, 20, 4, 5
WARM_PREFIX_LEN, WARM_REPEATS = 64, 5
DECODE_MAMBA = '{role="decode",group="mamba2"}'
JOBS = ("hybridpd-proxy", "hybridpd-prefill", "hybridpd-decode")


# ---------------------------------------------------------------------------------------------------------------
# the hit rate a workload implies
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Side:
    """What one worker's prefix cache holds: attention blocks and recurrent checkpoints, keyed by the token prefix
    they cover (the block-hash chain is a function of exactly that prefix), plus its counters per group."""

    blocks: set[tuple[int, ...]] = field(default_factory=set)
    checkpoints: set[tuple[int, ...]] = field(default_factory=set)
    queries: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"attention": 0, "mamba2": 0})

    def attention_hit(self, p: list[int], cap: int) -> int:
        """Left to right over full blocks, at most `cap` tokens."""
        k = 0
        while (k + 1) * BLOCK <= cap and tuple(p[:(k + 1) * BLOCK]) in self.blocks:
            k += 1
        return k * BLOCK

    def checkpoint_hit(self, p: list[int], limit: int) -> int:
        """Right to left over checkpoint boundaries not beyond `limit`."""
        b = limit // INTERVAL * INTERVAL
        while b > 0 and tuple(p[:b]) not in self.checkpoints:
            b -= INTERVAL
        return b

    def count(self, p: list[int], attention: int, mamba2: int) -> None:
        self.queries += len(p)
        self.hits["attention"] += attention
        self.hits["mamba2"] += mamba2

    def publish_blocks(self, p: list[int], upto: int) -> None:
        self.blocks.update(tuple(p[:j * BLOCK]) for j in range(1, upto // BLOCK + 1))


def _expected_counters(prompts: list[list[int]]) -> tuple[dict[str, _Side], list[int]]:
    """Replay the requests, in order, through a model of both workers' caches. Returns both sides' counters and,
    per request, the tokens D served from its own cache (`usage.hybridpd.decode_local_cached_tokens`).

    Per request with N prompt tokens:

    P computes the N prompt tokens (and samples the first output token), so its hit is capped at N-1 (a request
    computes >= 1 token):
        a_P = attention blocks P holds (left to right), h_P = largest checkpoint boundary <= a_P P holds.
    P writes a checkpoint at every boundary it computes, in (h_P, N], caches its full blocks up to N, and hands D
    (with the running state) its largest checkpoint <= N: c_P.
    D receives N tokens. Its own hit, capped at N (never more than it is sent):
        a_D = attention blocks D holds (every full block of an earlier prompt D received: D publishes what it
              pulled), h_D = largest boundary (multiple of 32) <= a_D among the checkpoints D holds.
    D holds a checkpoint only where it pulled one: c_P of an earlier request, pulled when c_P > h_D (D never
    recomputes the prompt, so it writes no checkpoint inside it). D's decode-local hit is h_D tokens: its
    attention hit a_D is cut back to the recurrent group's h_D, as the groups must agree.
    Counters (`hybridpd_prefix_cache_{queries,hits}_total{role,group}`): queries += N in every group; hits +=
    what each group alone could serve: attention a_X, mamba2 h_X.
    """
    p_side, d_side = _Side(), _Side()
    local = []
    for p in prompts:
        n = len(p)
        # D also computes while decoding; the workload keeps that from filling a block or crossing a boundary,
        # so D caches nothing of its own beyond what it pulled.
        assert n // BLOCK == (n + MAX_TOKENS - 1) // BLOCK and n // INTERVAL == (n + MAX_TOKENS - 1) // INTERVAL
        a_p = p_side.attention_hit(p, n - 1)
        h_p = p_side.checkpoint_hit(p, a_p)
        p_side.count(p, a_p, h_p)
        p_side.checkpoints.update(tuple(p[:b]) for b in range(h_p + INTERVAL, n + 1, INTERVAL))
        p_side.publish_blocks(p, n)
        c_p = p_side.checkpoint_hit(p, n)

        a_d = d_side.attention_hit(p, n)
        h_d = d_side.checkpoint_hit(p, a_d)
        d_side.count(p, a_d, h_d)
        if c_p > h_d:
            d_side.checkpoints.add(tuple(p[:c_p]))
        d_side.publish_blocks(p, n)
        local.append(h_d)
    return {"prefill": p_side, "decode": d_side}, local


def _workload(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up, main): the warm-up is one WARM_PREFIX_LEN-token prefix sent WARM_REPEATS times, so that every
    counter series exists (and has been scraped, at a value large enough that `increase()` does not clip its
    extrapolation at zero) before the main workload starts, with a hit rate of its own (4 x 64 / (5 x 84)) so
    that lifetime and windowed rates differ; the main one is NUM_PREFIXES prefixes of PREFIX_LEN tokens, each
    sent REPEATS times with distinct SUFFIX_LEN-token suffixes, the prefixes interleaved."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 256) for _ in range(n)]

    warm_prefix = toks(WARM_PREFIX_LEN)
    warm = [warm_prefix + toks(SUFFIX_LEN) for _ in range(WARM_REPEATS)]
    prefixes = [toks(PREFIX_LEN) for _ in range(NUM_PREFIXES)]
    main = [prefixes[i] + toks(SUFFIX_LEN) for _ in range(REPEATS) for i in range(NUM_PREFIXES)]
    return warm, main


def test_expected_counters_model() -> None:
    """The model on the workload itself (every number by hand): a prefix's first request hits nothing; each
    repeat hits its 96-token prefix in both groups on both sides (6 blocks; checkpoint 96 = 3 x 32, pulled by D with
    the first request); the suffix's first block differs, so no more."""
    _, main = _workload(seed=1)
    sides, local = _expected_counters(main)
    n = PREFIX_LEN + SUFFIX_LEN
    repeats = NUM_PREFIXES * (REPEATS - 1)
    for side in sides.values():
        assert side.queries == len(main) * n
        assert side.hits == {"attention": repeats * PREFIX_LEN, "mamba2": repeats * PREFIX_LEN}
    assert local == [0] * NUM_PREFIXES + [PREFIX_LEN] * repeats
    # a prefix that is not a multiple of the checkpoint interval: P hits its checkpoint at 64, but D only ever
    # pulled the one at 96 (which holds suffix tokens), so D's repeats hit nothing in the recurrent group
    rng = random.Random(2)
    pre = [rng.randrange(3, 256) for _ in range(80)]
    odd = [pre + [rng.randrange(3, 256) for _ in range(28)] for _ in range(3)]
    sides, local = _expected_counters(odd)
    assert sides["prefill"].hits == {"attention": 2 * 80, "mamba2": 2 * 64}
    assert sides["decode"].hits == {"attention": 2 * 80, "mamba2": 0}
    assert local == [0, 0, 0]


# ---------------------------------------------------------------------------------------------------------------
# fixtures: the cluster and a Prometheus scraping it
# ---------------------------------------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{path} {params}: {r.status_code} {r.text}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        assert data["resultType"] == "vector", data
        return data["result"]

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """The value of a one-series result, None when empty."""
        result = self.query(expr, at)
        assert len(result) <= 1, f"{expr}: {result}"
        return float(result[0]["value"][1]) if result else None

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@pytest.fixture(scope="module")
def cluster(checkpoint_dir) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    c = start_cluster(checkpoint_dir("nemotron_attn_mid"), worker_args=["--checkpoint-interval", str(INTERVAL)])
    try:
        yield c
    finally:
        c.stop()


def _prometheus_config(targets_glob: str) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with a 1 s scrape interval and only its file_sd targets (its static ones
    are the fixed ports of the plain-process recipe, which other processes on this machine may hold)."""
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        job.pop("static_configs", None)
        for sd in job["file_sd_configs"]:
            sd["files"] = [targets_glob]
    return config


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if PROMETHEUS is None:
        pytest.skip("no `prometheus` binary on PATH (bash scripts/install-prometheus.sh installs Debian's)")
    tmp = tmp_path_factory.mktemp("prometheus")
    view = httpx.get(f"{cluster.url}/v1/cluster", timeout=10).json()
    proxy_hostport = cluster.url.removeprefix("http://")
    groups = targets_from_cluster(view, proxy_hostport)
    assert {g["labels"]["role"] for g in groups} == {"proxy", "prefill", "decode"}, view
    write_targets(groups, tmp / "targets" / "local.json")
    config_path = tmp / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(_prometheus_config("targets/*.json"), sort_keys=False))
    port = free_port()
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited ({proc.returncode}):\n{prom.log_tail()}"
            try:
                if httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, f"prometheus not ready in 60 s:\n{prom.log_tail()}"
            time.sleep(0.3)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _active_targets(prom: Prometheus) -> list[dict[str, Any]]:
    return [t for t in prom.api("targets", state="active")["activeTargets"] if t["labels"]["job"] in JOBS]


def _run(cluster: Cluster, prompts: list[list[int]]) -> list[int]:
    """Send the prompts one after the other (greedy); returns each one's decode-local cached tokens."""
    local = []
    for p in prompts:
        body = complete(cluster, p, MAX_TOKENS)
        assert len(body["choices"][0]["token_ids"]) == MAX_TOKENS
        local.append(body["usage"]["hybridpd"]["decode_local_cached_tokens"])
    return local


def _counters_settled(prom: Prometheus, cluster: Cluster, role: str, group: str, want: dict[str, int]
                      ) -> dict[str, float] | None:
    """Once the worker exports `want` and Prometheus has scraped it: {queries, hits} as Prometheus has them."""
    worker = (cluster.prefill if role == "prefill" else cluster.decode)[0]
    sel = f'{{role="{role}",group="{group}"}}'
    seen = {}
    for kind in ("queries", "hits"):
        name = f"hybridpd_prefix_cache_{kind}_total"
        if cluster.metric(worker, name, role=role, group=group) != want[kind]:
            return None
        seen[kind] = prom.scalar(f"sum({name}{sel})")
        if seen[kind] != want[kind]:
            return None
    return seen


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------


def test_targets_up_with_their_roles(prometheus: Prometheus, cluster: Cluster) -> None:
    def all_up() -> list[dict[str, Any]] | None:
        targets = _active_targets(prometheus)
        return targets if len(targets) == 3 and all(t["health"] == "up" for t in targets) else None

    targets = wait_for("3 targets up", all_up, timeout=30)
    by_job = {t["labels"]["job"]: t for t in targets}
    assert set(by_job) == set(JOBS), targets
    for job, t in by_job.items():
        assert t["labels"]["role"] == job.removeprefix("hybridpd-")
    decode_port = cluster.decode[0].info["metrics_port"]
    assert by_job["hybridpd-decode"]["labels"]["instance"] == f"127.0.0.1:{decode_port}"
    assert by_job["hybridpd-proxy"]["scrapeUrl"] == f"{cluster.url}/metrics"
    # honor_labels: the workers' own `role` is kept, never renamed
    assert prometheus.query('count({exported_role!=""})') == []
    assert prometheus.query('count({__name__=~"hybridpd_.*", role=""})') == []


def test_decode_hit_rate_through_promql(prometheus: Prometheus, cluster: Cluster) -> None:
    """The decode worker's Mamba-2 prefix-cache hit rate, as PromQL computes it from the scraped counters, equals
    the rate the workload implies (see `_expected_counters`): 4 prefixes x 5 requests of 96 + 20 tokens hit
    (4 x 4 x 96) / (20 x 116) = 0.662 on D, because D pulled the checkpoint at 96 with each prefix's first request.
    Counters count tokens, so raw counter ratios are exact (tolerance 1e-9); `increase()` extrapolates to the
    window's edges from samples 1 s apart and gets a stated 5 % tolerance."""
    wait_for("targets up", lambda: len(_active_targets(prometheus)) == 3
          and all(t["health"] == "up" for t in _active_targets(prometheus)), timeout=30)
    warm, main = _workload(seed=0)
    sides, local_expected = _expected_counters(warm + main)
    warm_sides, _ = _expected_counters(warm)

    def want(sides: dict[str, _Side], role: str, group: str) -> dict[str, int]:
        return {"queries": sides[role].queries, "hits": sides[role].hits[group]}

    # warm-up: both series of every group exist and Prometheus has them before the main workload begins
    local = _run(cluster, warm)
    for role in ("prefill", "decode"):
        for group in ("attention", "mamba2"):
            wait_for(f"warm-up counters of {role}/{group} scraped",
                  lambda r=role, g=group: _counters_settled(prometheus, cluster, r, g, want(warm_sides, r, g)))
    time.sleep(3.0)  # scrapes of the settled warm-up values only: the windows below start in this gap
    main_start = time.time()
    local += _run(cluster, main)
    assert local == local_expected, "per-request decode-local hits differ from the model"

    for role in ("prefill", "decode"):
        for group in ("attention", "mamba2"):
            wait_for(f"counters of {role}/{group} scraped",
                  lambda r=role, g=group: _counters_settled(prometheus, cluster, r, g, want(sides, r, g)))
    end = time.time()

    d = sides["decode"]
    total_rate = d.hits["mamba2"] / d.queries
    main_hits = d.hits["mamba2"] - warm_sides["decode"].hits["mamba2"]
    main_queries = d.queries - warm_sides["decode"].queries
    main_rate = main_hits / main_queries
    assert main_rate == pytest.approx(NUM_PREFIXES * (REPEATS - 1) * PREFIX_LEN
                                      / (NUM_PREFIXES * REPEATS * (PREFIX_LEN + SUFFIX_LEN)))
    assert abs(total_rate - main_rate) > 0.005, "the warm-up must move the lifetime rate, or (2) proves nothing"

    hits, queries = (f"hybridpd_prefix_cache_{k}_total{DECODE_MAMBA}" for k in ("hits", "queries"))
    # 1. lifetime: the counters' instant values
    got = prometheus.scalar(f"sum({hits}) / sum({queries})", at=end)
    assert got is not None and math.isclose(got, total_rate, abs_tol=1e-9), (got, total_rate)
    # 2. the main workload alone: the counters now minus their values half a second before it started, in the
    #    quiet gap after the warm-up (no extrapolation)
    back = f"{int((end - main_start + 0.5) * 1000)}ms"
    got = prometheus.scalar(f"(sum({hits}) - sum({hits} offset {back})) / "
                            f"(sum({queries}) - sum({queries} offset {back}))", at=end)
    assert got is not None and math.isclose(got, main_rate, abs_tol=1e-9), (got, main_rate, back)
    # 3. the dashboard's form, increase() over a window that starts in the gap (so its first sample precedes the
    #    main workload): the same rate up to extrapolation to the window's edges
    window = f"{int((end - main_start + 1.5) * 1000)}ms"
    got = prometheus.scalar(f"sum(increase({hits}[{window}])) / sum(increase({queries}[{window}]))", at=end)
    assert got is not None and math.isclose(got, main_rate, rel_tol=0.05), (got, main_rate, window)
    # the prefill side through the dashboard's own grouping (every role and group at once)
    rows = prometheus.query("sum by (role, group) (hybridpd_prefix_cache_hits_total) / "
                            "sum by (role, group) (hybridpd_prefix_cache_queries_total)", at=end)
    rates = {(r["metric"]["role"], r["metric"]["group"]): float(r["value"][1]) for r in rows}
    assert rates == pytest.approx({(role, g): sides[role].hits[g] / sides[role].queries
                                   for role in ("prefill", "decode") for g in ("attention", "mamba2")}, abs=1e-9)


def _exported_names(prom: Prometheus) -> set[str]:
    return set(prom.api("label/__name__/values"))


def _is_exported(name: str, exported: set[str]) -> bool:
    return name in exported or any(name + s in exported for s in dashboard.HISTOGRAM_SUFFIXES)


# Contract metrics that get their first sample only when the event happens (no pull failed, no lease expired in a
# healthy run): `TransferMetrics` creates their labelled children on first use, so until then a worker exports the
# family's HELP/TYPE and no sample, and the dashboard's panels read "No data" rather than 0.
EVENT_ONLY = {"hybridpd_kv_transfer_failures_total", "hybridpd_kv_lease_expired_total"}


def test_every_dashboard_expression_evaluates_live(prometheus: Prometheus, cluster: Cluster) -> None:
    """Runs after the workload above (module order), so every series a healthy cluster exports exists."""
    if not prometheus.query('hybridpd_requests_total{status="success"} > 0'):  # run alone: make some traffic
        _run(cluster, _workload(seed=3)[1][:6])
        time.sleep(2.5)
    exported = _exported_names(prometheus)
    problems = []
    for expr in dashboard.dashboard_expressions():
        query = dashboard.for_prometheus(expr)
        r = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": query}, timeout=10)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            problems.append(f"{query}: HTTP {r.status_code} {body.get('errorType')} {body.get('error')}")
            continue
        names = dashboard.metric_names(expr)
        missing = {n for n in names if not _is_exported(n, exported)}
        if missing - EVENT_ONLY:
            problems.append(f"{query}: metrics not exported by the live cluster: {sorted(missing - EVENT_ONLY)}")
        elif not missing and not body["data"]["result"]:
            problems.append(f"{query}: no data although every metric it reads is exported")
    assert not problems, "\n".join(problems)


def test_event_only_metrics_are_exported_at_zero(prometheus: Prometheus) -> None:
    exported = _exported_names(prometheus)
    assert EVENT_ONLY <= exported, sorted(EVENT_ONLY - exported)
