"""An anonymous attacker against a `LiveStack` proxy, and what a legitimate client sees meanwhile. Test support.

    with Observer(stack) as obs:          # probes /health, sends legitimate requests, samples the admission ledger
        flood(stack, ...)                 # or slowloris / abandoned streams
    report = obs.report("n=128 flood", attacks=..., wrong_200s=...)

Attackers connect from other loopback addresses (127.0.0.2, ...: Linux routes all of 127/8 to `lo`), so the proxy
sees them as other clients, as it would see other hosts. The legitimate client is 127.0.0.1.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tests.support.flood_client import flood_client, wrong_choices
from tests.support.live_stack import LiveStack

LEGIT_PROMPT = list(range(1, 9))
LEGIT_MAX_TOKENS = 8


def rss_mb() -> float:
    """This process's resident memory (the proxy and the fake workers run in it)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def client(stack: LiveStack, source_ip: str, timeout: float = 30.0) -> httpx.Client:
    return httpx.Client(base_url=stack.url, timeout=timeout,
                        transport=httpx.HTTPTransport(local_address=source_ip))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def legit_latency(stack: LiveStack, n: int = 5, headers: dict[str, str] | None = None) -> list[float]:
    """Seconds per legitimate request, sequentially (each must be a correct 200)."""
    out = []
    with client(stack, "127.0.0.1") as c:
        c.headers.update(headers or {})
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": LEGIT_PROMPT, "max_tokens": LEGIT_MAX_TOKENS})
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            assert wrong_choices(r.json(), LEGIT_PROMPT, LEGIT_MAX_TOKENS) == 0
    return out


@dataclass
class AttackReport:
    attack: str
    attacks_tried: int
    accepted_beyond_limits: int
    wrong_200s: int
    legit_ok: int
    legit_failed: int
    legit_p50_s: float
    legit_p99_s: float
    idle_p50_s: float
    health_p99_s: float
    health_max_s: float
    health_probes: int
    max_seqs_in_flight: int
    max_decode_running: int
    rss_before_mb: float
    rss_after_mb: float
    extra: dict[str, Any] = field(default_factory=dict)

    def emit(self) -> None:
        """Print one line, and append it as JSON to $HYBRIDPD_ATTACK_REPORT when set (BENCHMARKS figures)."""
        print(f"\nATTACK {self.attack}: {json.dumps(asdict(self))}")
        path = os.environ.get("HYBRIDPD_ATTACK_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(asdict(self)) + "\n")


class Observer:
    """Background threads: /health probes, sequential legitimate requests, samples of the admission ledger."""

    def __init__(self, stack: LiveStack, legit: bool = True, headers: dict[str, str] | None = None) -> None:
        self.stack = stack
        self.headers = headers
        self.admission = stack.app.state.proxy.admission
        self.idle = legit_latency(stack, 3, headers) if legit else []
        self.legit = legit
        self.health: list[float] = []
        self.health_at: list[float] = []  # perf_counter() at each probe's start
        self.latencies: list[float] = []
        self.legit_failed = 0
        self.beyond = 0
        self.max_seqs = 0
        self.max_running = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=t, daemon=True) for t in (self._probe, self._sample, self._legit)]
        self.rss_before = rss_mb()

    def __enter__(self) -> Observer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _probe(self) -> None:
        with client(self.stack, "127.0.0.1", timeout=10) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = c.get("/health")
                self.health.append(time.perf_counter() - t0)
                self.health_at.append(t0)
                assert r.status_code == 200
                time.sleep(0.02)

    def _sample(self) -> None:
        a = self.admission
        while not self._stop.is_set():
            used = a.used
            self.max_seqs = max(self.max_seqs, used.seqs)
            self.max_running = max(self.max_running, sum(len(d.running) for d in self.stack.decode))
            try:
                tenants = list(a._tenants.values())
            except RuntimeError:  # resized by the event loop mid-copy: sample again
                continue
            over = used.seqs > a.caps.seqs or used.prompt_tokens > a.caps.prompt_tokens or any(
                t.usage.seqs > a.tenant_caps.seqs or t.usage.prompt_tokens > a.tenant_caps.prompt_tokens
                for t in tenants)
            self.beyond += int(over)
            time.sleep(0.005)

    def _legit(self) -> None:
        if not self.legit:
            return
        time.sleep(0.3)  # let the attack build up
        while not self._stop.is_set():
            try:
                self.latencies += legit_latency(self.stack, 1, self.headers)
            except (AssertionError, httpx.HTTPError):
                self.legit_failed += 1

    def report(self, attack: str, attacks_tried: int, wrong_200s: int, **extra: Any) -> AttackReport:
        r = AttackReport(attack=attack, attacks_tried=attacks_tried, accepted_beyond_limits=self.beyond,
                         wrong_200s=wrong_200s, legit_ok=len(self.latencies), legit_failed=self.legit_failed,
                         legit_p50_s=pct(self.latencies, 0.5), legit_p99_s=pct(self.latencies, 0.99),
                         idle_p50_s=pct(self.idle, 0.5), health_p99_s=pct(self.health, 0.99),
                         health_max_s=max(self.health, default=float("nan")), health_probes=len(self.health),
                         max_seqs_in_flight=self.max_seqs, max_decode_running=self.max_running,
                         rss_before_mb=self.rss_before, rss_after_mb=rss_mb(), extra=extra)
        r.emit()
        return r


def flood(url: str, source_ip: str, clients: int, body: dict[str, Any], seconds: float,
          headers: dict[str, str] | None = None) -> dict[str, int]:
    """`clients` attacker processes (spawned: their CPU is not the proxy's) posting `body` back to back for
    `seconds`; their summed counts by status, and wrong 200s (answers that are not the fake's)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    content = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    procs = [ctx.Process(target=flood_client, args=(url, source_ip, content, hdrs, seconds, body["prompt"],
                                                     body["max_tokens"], out)) for _ in range(clients)]
    for p in procs:
        p.start()
    total: dict[str, int] = {}
    for _ in procs:
        for k, v in out.get(timeout=seconds + 60).items():
            total[k] = total.get(k, 0) + v
    for p in procs:
        p.join(10)
    return total
