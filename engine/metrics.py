"""Worker-side Prometheus metrics (the contract's names), updated from the engine's counters on the step thread.

Counters are exported as deltas of the engine's monotonic counters, so the engine itself stays free of
prometheus_client. Labels: role = prefill | decode, group = the cache group kind (kind:id for a repeated kind)."""

from __future__ import annotations

import time

from hybridpd.engine.core import EngineCore
from prometheus_client import CollectorRegistry, Counter, Gauge


class WorkerMetrics:
    def __init__(
        self,
        role: str,
        registry: CollectorRegistry | None = None,
        min_interval_s: float = 0.0,
        slow_interval_s: float = 0.0,
    ) -> None:
        """`min_interval_s`: `update` does nothing when called again sooner (the workers' step hooks run every
        0.1-0.5 ms while a transfer is in flight; a scrape every few seconds needs far less). `slow_interval_s`:
        the same for the pools' byte and eviction figures (see `update`)."""
        from prometheus_client import REGISTRY

        reg = registry if registry is not None else REGISTRY
        self.role = role
        g = ["role", "group"]
        self.queries = Counter("hybridpd_prefix_cache_queries", "Prefix-cache queries (tokens)", g, registry=reg)
        self.hits = Counter("hybridpd_prefix_cache_hits", "Prefix-cache hits (tokens)", g, registry=reg)
        self.ext_queries = Counter(
            "hybridpd_external_prefix_cache_queries", "Tokens queried for external (transferred) hits", g, registry=reg
        )
        self.ext_hits = Counter(
            "hybridpd_external_prefix_cache_hits", "Tokens received by KV transfer", g, registry=reg
        )
        self.usage = Gauge(
            "hybridpd_kv_cache_usage_ratio",
            "Fraction of a cache pool's pages that requests reference (cached content is free: 0 when idle)",
            g,
            registry=reg,
        )
        self.zeroed = Counter("hybridpd_zeroed_blocks", "Fresh attention blocks zeroed", ["role"], registry=reg)
        self.running = Gauge("hybridpd_num_requests_running", "Requests running", ["role"], registry=reg)
        self.waiting = Gauge("hybridpd_num_requests_waiting", "Requests waiting", ["role"], registry=reg)
        # the prefix cache's one budget: what each kind holds, and what comes and goes
        self.cache_bytes = Gauge(
            "hybridpd_kv_cache_bytes",
            "Bytes a cache pool holds, by state (in_use: running requests; cached: reusable prefix content)",
            ["role", "group", "state"],
            registry=reg,
        )
        self.evictions = Counter(
            "hybridpd_prefix_cache_evictions", "Cached pages evicted (blocks or states)", g, registry=reg
        )
        self.admitted = Counter(
            "hybridpd_prefix_cache_checkpoints_admitted",
            "Recurrent-state checkpoints admitted to the prefix cache",
            ["role"],
            registry=reg,
        )
        self.admitted.labels(role)
        # step times by kind (decode-only steps vs steps with a prompt chunk): seconds per token for a router's
        # cost model, and the engine's own step to set against the client's TPOT (benchmarks/goodput.py)
        k = ["role", "kind"]
        self.step_seconds = Counter("hybridpd_engine_step_seconds", "Wall time of engine steps", k, registry=reg)
        self.steps = Counter("hybridpd_engine_steps", "Engine steps", k, registry=reg)
        self.step_tokens = Counter("hybridpd_engine_step_tokens", "Tokens computed by engine steps", k, registry=reg)
        self._step_seconds: dict[str, float] = {}
        self._last: dict[tuple[str, str], int] = {}
        self.min_interval_s = min_interval_s
        self.slow_interval_s = slow_interval_s
        self._updated_at = self._full_at = float("-inf")
        self._full_at_state: tuple[int, tuple[float, ...]] | None = None
        """(steps, pool usage) at the last pool scan: an idle engine is scanned again once either moved."""

    def _inc(self, counter: Counter, key: str, group: str, value: int) -> None:
        last = self._last.get((key, group), 0)
        if value > last:
            counter.labels(self.role, group).inc(value - last) if group else counter.labels(self.role).inc(value - last)
        self._last[(key, group)] = value

    def update(self, core: EngineCore, extra_waiting: int = 0) -> None:
        """Step thread only. The pools' byte and eviction figures (`cache_stats`) are read at most every
        `slow_interval_s` while the engine is busy, and once more when it goes idle after steps or its pages move
        while idle (a lease released, a request aborted: engine calls, no step), so a scrape of an idle worker
        always sees its final state. `usage` is the share of each pool's pages that requests reference."""
        now = time.monotonic()
        state = (core.stats.num_steps, tuple(core.cache.usage().values())) if not core.has_unfinished() else None
        idle_after_steps = state is not None and state != self._full_at_state
        if now - self._updated_at < self.min_interval_s and not idle_after_steps:
            return
        self._updated_at = now
        if idle_after_steps or now - self._full_at >= self.slow_interval_s:
            self._full_at = now
            self._full_at_state = state
            self._update_pools(core)
        cache = core.cache
        for kind, c in cache.counters.items():
            self._inc(self.queries, "q", kind, c.queries)
            self._inc(self.hits, "h", kind, c.hits)
        for kind, c in cache.external_counters.items():
            self._inc(self.ext_queries, "eq", kind, c.queries)
            self._inc(self.ext_hits, "eh", kind, c.hits)
        for kind, u in cache.usage().items():
            self.usage.labels(self.role, kind).set(u)
        self._inc(self.zeroed, "z", "", core.runner.num_zeroed_blocks)
        self._export_steps(core)
        running, waiting = core.queue_lengths()
        self.running.labels(self.role).set(running)
        self.waiting.labels(self.role).set(waiting + extra_waiting)

    def _update_pools(self, core: EngineCore) -> None:
        cache = core.cache
        stats = cache.cache_stats()
        for kind in cache.labels.values():  # the kind name, or kind:id where a model repeats a kind
            s = stats.get(kind)
            if isinstance(s, dict):
                self.evictions.labels(self.role, kind)  # exported at 0 from the start (dashboards show 0)
                self.cache_bytes.labels(self.role, kind, "in_use").set(s["bytes_in_use"])
                self.cache_bytes.labels(self.role, kind, "cached").set(s["bytes_cached"])
                self._inc(self.evictions, "ev", kind, int(s["evictions"]))
        self._inc(self.admitted, "adm", "", int(stats.get("checkpoints_admitted", 0)))  # type: ignore[call-overload]

    def _export_steps(self, core: EngineCore) -> None:
        st = core.stats
        for kind, seconds in st.step_seconds.items():
            last = self._step_seconds.get(kind, 0.0)
            if seconds > last:
                self.step_seconds.labels(self.role, kind).inc(seconds - last)
            self._step_seconds[kind] = seconds
            self._inc(self.steps, "steps", kind, st.steps[kind])
            self._inc(self.step_tokens, "step_tokens", kind, st.step_tokens[kind])
