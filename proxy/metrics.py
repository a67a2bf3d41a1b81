"""Proxy-side Prometheus metrics (the contract's names, plus `hybridpd_proxy_*` extras).

Each app owns a private `CollectorRegistry`, so several apps can live in one process (tests); `GET /metrics`
renders it. Latencies are seen from the proxy: request arrival -> first token (TTFT), between tokens (ITL; a
chunk carrying k tokens dt seconds after the previous one records dt/k, k times; the first chunk records only
TTFT), arrival -> last token (E2E).

`hybridpd_requests_total{status}`: status is one of
    success  finished normally (any finish_reason)
    invalid  rejected with a 4xx before reaching a worker, or a worker's INVALID_ARGUMENT
    error    worker failure (5xx)
    aborted  the client disconnected before the end

`hybridpd_proxy_decode_failovers_total{cause, outcome}`: a decode worker that failed a request after its first
output, by cause (`lost`: the stream broke as unreachable, the worker died or restarted; `stalled`: nothing came for
the inter-token timeout, or the worker stopped answering health probes or answered them not ready, its engine stuck,
while another decode worker answers: counted before its first output too) and
outcome (`resumed` on another decode worker, the client's stream going on without a repeated or missing token;
`failed`: no decode worker left or too many failovers, the request ended with an error).

`hybridpd_proxy_prefill_failovers_total{cause}`: a Prefill call given up on one prefill worker, by cause (`lost`:
unreachable; `frozen`: it stopped answering health probes, or answered them not ready, while another answers;
`busy`: at its lease cap, RESOURCE_EXHAUSTED); the request then goes to another prefill worker, or to a decode
worker that computes the prompt itself, or fails when neither may.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from hybridpd.proxy.routing import Router
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REQUEST_STATUSES = ("success", "invalid", "error", "aborted")
FAILOVER_CAUSES = ("lost", "stalled")
FAILOVER_OUTCOMES = ("resumed", "failed")
PREFILL_FAILOVER_CAUSES = ("lost", "frozen", "busy")

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_E2E_BUCKETS = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class _InFlightCollector(Collector):
    """`hybridpd_proxy_in_flight_requests{role, worker}`, read from the routers at scrape time."""

    def __init__(self, routers: Mapping[str, Router]) -> None:
        self._routers = routers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(
            "hybridpd_proxy_in_flight_requests",
            "Requests the proxy has in flight per worker",
            labels=["role", "worker"],
        )
        for role, router in self._routers.items():
            for addr, n in router.snapshot().items():
                fam.add_metric([role, addr], n)
        yield fam


class ProxyMetrics:
    """All proxy metrics, registered in one private registry."""

    def __init__(self, routers: Mapping[str, Router]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "hybridpd_time_to_first_token_seconds",
            "Time to first token, seen by the proxy",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "hybridpd_inter_token_latency_seconds",
            "Time between output tokens, seen by the proxy",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "hybridpd_e2e_request_latency_seconds", "Request arrival to last token", buckets=_E2E_BUCKETS, registry=r
        )
        self.prefill_rpc = Histogram(
            "hybridpd_proxy_prefill_seconds", "Duration of the P.Prefill call", buckets=_TTFT_BUCKETS, registry=r
        )
        self.requests = Counter("hybridpd_requests_total", "Finished requests by outcome", ["status"], registry=r)
        for status in REQUEST_STATUSES:
            self.requests.labels(status=status)
        self.prompt_tokens = Counter(
            "hybridpd_proxy_prompt_tokens_total", "Prompt tokens of served requests", registry=r
        )
        self.generation_tokens = Counter("hybridpd_proxy_generation_tokens_total", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            "hybridpd_proxy_cached_prompt_tokens_total",
            "Prompt tokens the decode worker did not compute (local hit + transferred)",
            registry=r,
        )
        self.prefill_cached_tokens = Counter(
            "hybridpd_proxy_prefill_cached_tokens_total",
            "Prompt tokens the prefill worker found in its prefix cache",
            registry=r,
        )
        self.route_decisions = Counter(
            "hybridpd_proxy_route_decisions_total",
            "Requests by path: pd, skip_prefill (D prefilled it itself), prefill_alone "
            "(a prefill worker ran it whole, its mixed role), colocated",
            ["path"],
            registry=r,
        )
        self.route_expected_hit = Counter(
            "hybridpd_proxy_route_expected_hit_tokens_total",
            "Prompt tokens the router expected the chosen decode worker to hold",
            ["path"],
            registry=r,
        )
        self.route_real_hit = Counter(
            "hybridpd_proxy_route_real_hit_tokens_total",
            "Prompt tokens the chosen decode worker found in its own prefix cache",
            ["path"],
            registry=r,
        )
        self.decode_failovers = Counter(
            "hybridpd_proxy_decode_failovers_total",
            "Decode workers that failed a request mid-generation (stalled: before its first output too), by "
            "cause (lost, stalled) and outcome (resumed on another decode worker, failed)",
            ["cause", "outcome"],
            registry=r,
        )
        for cause in FAILOVER_CAUSES:
            for outcome in FAILOVER_OUTCOMES:
                self.decode_failovers.labels(cause=cause, outcome=outcome)
        self.prefill_failovers = Counter(
            "hybridpd_proxy_prefill_failovers_total",
            "Prefill calls given up on a prefill worker (then sent to another, or to a decode worker that computes "
            "the prompt itself, or failed), by cause: lost (unreachable), frozen (stopped answering health probes, "
            "or its engine stuck), busy (at its lease cap)",
            ["cause"],
            registry=r,
        )
        for cause in PREFILL_FAILOVER_CAUSES:
            self.prefill_failovers.labels(cause=cause)
        r.register(_InFlightCollector(routers))

    def route(self, path: str, expected_hit: int, real_hit: int) -> None:
        self.route_decisions.labels(path=path).inc()
        self.route_expected_hit.labels(path=path).inc(expected_hit)
        self.route_real_hit.labels(path=path).inc(real_hit)

    def decode_failover(self, cause: str, outcome: str) -> None:
        self.decode_failovers.labels(cause=cause, outcome=outcome).inc()

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
