"""An anonymous attacker against a proxy in front of FAKE workers, and what a legitimate client sees meanwhile.

    with Observer(target, Limits(seqs=64, per_client=32), attacker_prompts={...}) as obs:
        flood(target.url, "127.0.0.2", ...)   # or slowloris / abandoned streams
    report = obs.report("n=128 flood", attacks_tried=..., wrong_200s=...)

`target` is a `ProxyProcess` (the proxy in its own process, as deployed: its /health latency and RSS are its own)
or a `LiveStack`. What was accepted is measured where it lands: the sequences running on the fake decode worker,
sampled every 5 ms, against the global budget and (for the attacker's prompts) one client's share. Attackers
connect from other loopback addresses (127.0.0.2, ...: Linux routes all of 127/8 to `lo`), so the proxy sees them
as other clients, as it would see other hosts; attackers that post run in processes of their own. The legitimate
client is 127.0.0.1.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

import httpx

from tests.support.fake_workers import FakeDecodeWorker
from tests.support.flood_client import flood_client, wrong_choices

LEGIT_PROMPT = list(range(1, 9))
LEGIT_MAX_TOKENS = 8


class Target(Protocol):
    url: str
    decode: list[FakeDecodeWorker]


class Limits(NamedTuple):
    seqs: int  # the proxy's global budget of sequences
    per_client: int  # one client's share of it


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of `pid` (default: this process)."""
    for line in open(f"/proc/{pid or 'self'}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def client(url: str, source_ip: str, timeout: float = 30.0) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout, transport=httpx.HTTPTransport(local_address=source_ip))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def legit_latency(url: str, n: int = 5, headers: dict[str, str] | None = None,
                  expected: list[int] | None = None) -> list[float]:
    """Seconds per legitimate request (LEGIT_PROMPT, greedy), sequentially. Each must be a 200 answering
    `expected` token ids (default: the fake decode worker's answer)."""
    out = []
    body = {"prompt": LEGIT_PROMPT, "max_tokens": LEGIT_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with client(url, "127.0.0.1") as c:
        c.headers.update(headers or {})
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json=body)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            assert wrong_choices(r.json(), LEGIT_PROMPT, LEGIT_MAX_TOKENS, True, expected) == 0, r.text
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
    max_decode_running: int
    max_attacker_running: int
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


class _Ledger:
    """Sequences running on the fake decode workers, split into the attacker's (by prompt) and the rest."""

    def __init__(self, decode: list[FakeDecodeWorker], attacker_prompts: set[tuple[int, ...]]) -> None:
        self.decode = decode
        self.attacker_prompts = attacker_prompts
        self._prompt_of: dict[str, tuple[int, ...]] = {}
        self._seen = [0] * len(decode)

    def sample(self) -> tuple[int, int]:
        """(running, of which the attacker's)."""
        running = attacker = 0
        for i, d in enumerate(self.decode):
            new = d.generates[self._seen[i]:]
            self._seen[i] += len(new)
            self._prompt_of.update((g.request_id, tuple(g.prompt_token_ids)) for g in new)
            ids = list(d.running)
            running += len(ids)
            attacker += sum(self._prompt_of.get(r) in self.attacker_prompts for r in ids)
        return running, attacker


class Observer:
    """Background threads: /health probes, sequential legitimate requests, samples of what runs on the workers."""

    def __init__(self, target: Target, limits: Limits, attacker_prompts: set[tuple[int, ...]] | None = None,
                 headers: dict[str, str] | None = None, pid: int | None = None,
                 ledger: Callable[[], tuple[int, int]] | None = None, expected: list[int] | None = None,
                 legit_delay_s: float = 1.0) -> None:
        """`ledger()` -> (sequences running, of which the attacker's); default: counted on the fake workers.
        `expected`: the legitimate request's answer (default: the fake decode worker's). `legit_delay_s`: when
        the legitimate requests start (attackers in spawned processes start about 1 s after the Observer)."""
        self.legit_delay_s = legit_delay_s
        self.url = target.url
        self.limits = limits
        self.headers = headers
        self.pid = pid
        self.expected = expected
        self.ledger = ledger or _Ledger(target.decode, attacker_prompts or set()).sample
        self.idle = legit_latency(self.url, 3, headers, expected)
        self.health: list[float] = []
        self.health_at: list[float] = []  # perf_counter() at each probe's start
        self.latencies: list[float] = []
        self.legit_failed = 0
        self.beyond = 0
        self.max_running = 0
        self.max_attacker = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=t, daemon=True) for t in (self._probe, self._sample, self._legit)]
        self.rss_before = rss_mb(pid)

    def __enter__(self) -> Observer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _probe(self) -> None:
        with client(self.url, "127.0.0.1", timeout=10) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = c.get("/health")
                self.health.append(time.perf_counter() - t0)
                self.health_at.append(t0)
                assert r.status_code == 200
                time.sleep(0.02)

    def _sample(self) -> None:
        while not self._stop.is_set():
            running, attacker = self.ledger()
            self.max_running = max(self.max_running, running)
            self.max_attacker = max(self.max_attacker, attacker)
            self.beyond += int(running > self.limits.seqs or attacker > self.limits.per_client)
            time.sleep(0.005)

    def _legit(self) -> None:
        time.sleep(self.legit_delay_s)
        while not self._stop.is_set():
            try:
                self.latencies += legit_latency(self.url, 1, self.headers, self.expected)
            except (AssertionError, httpx.HTTPError):
                self.legit_failed += 1

    def report(self, attack: str, attacks_tried: int, wrong_200s: int, **extra: Any) -> AttackReport:
        r = AttackReport(attack=attack, attacks_tried=attacks_tried, accepted_beyond_limits=self.beyond,
                         wrong_200s=wrong_200s, legit_ok=len(self.latencies), legit_failed=self.legit_failed,
                         legit_p50_s=pct(self.latencies, 0.5), legit_p99_s=pct(self.latencies, 0.99),
                         idle_p50_s=pct(self.idle, 0.5), health_p99_s=pct(self.health, 0.99),
                         health_max_s=max(self.health, default=float("nan")), health_probes=len(self.health),
                         max_decode_running=self.max_running, max_attacker_running=self.max_attacker,
                         rss_before_mb=self.rss_before, rss_after_mb=rss_mb(self.pid), extra=extra)
        r.emit()
        return r


def flood(url: str, source_ip: str, clients: int, body: dict[str, Any], seconds: float,
          headers: dict[str, str] | None = None, expected: list[int] | None = None,
          check: bool = True) -> dict[str, int]:
    """`clients` attacker processes (spawned: their CPU is not the proxy's) posting `body` back to back for
    `seconds`; their summed counts by status, and wrong 200s (answers that are not `expected`, default the
    fake's; `check=False`: not checked)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    content = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    summary = {"prompt": body["prompt"], "max_tokens": body["max_tokens"], "ignore_eos": body.get("ignore_eos"),
               "expected": expected, "check": check}
    start_at = time.time() + 1.0  # spawning takes about that; they all start together
    procs = [ctx.Process(target=flood_client, args=(url, source_ip, content, hdrs, start_at, seconds, summary, out))
             for _ in range(clients)]
    for p in procs:
        p.start()
    total: dict[str, int] = {}
    for _ in procs:
        for k, v in out.get(timeout=seconds + 60).items():
            total[k] = total.get(k, 0) + v
    for p in procs:
        p.join(10)
    return total
