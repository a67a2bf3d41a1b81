"""Proxy configuration: one frozen dataclass, built by the CLI (`hybridpd proxy`, `hybridpd serve`) or by tests."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from proxy.credentials import CLUSTER_TOKEN_ENV

RoutingPolicy = Literal["round_robin", "least_loaded", "cache_aware", "adaptive"]
"""cache_aware: proxy/placement.py (cached prefixes, load, skip-prefill by cost); adaptive: the same (the name the
goodput benchmark uses for a cluster that moves prefill work to decode workers when that is cheaper)."""
ROUTING_POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "cache_aware", "adaptive")

SkipPrefill = Literal["auto", "never", "always"]


@dataclass(frozen=True)
class RoutingWeights:
    """Costs and skip-prefill rule of the cache_aware policy (proxy/placement.py), in prompt-token units."""

    pull_token_cost: float = 0.25
    """A token D pulls, relative to a token P computes."""
    decode_running_cost: float = 16.0
    """A request in flight on D, in prompt tokens (spreads load when hits are equal)."""
    decode_full_cost: float = 32.0
    """A decode worker with no free or evictable attention page, in prompt tokens (scaled by the share in use)."""
    prefill_queue_cost: float = 1.0
    """A prompt token already in flight on P (its queue)."""
    decode_prefill_cost: float = 2.0
    """A token D computes itself (skip-P), relative to one P computes: it also delays D's running decodes."""
    skip_prefill: SkipPrefill = "auto"
    skip_max_tokens: int = 0
    """Skip P whenever D's uncached remainder is at most this many tokens (0: the cost model alone decides)."""
    prefill_token_s: float = 2e-4
    """Starting estimate of P's seconds per computed token (until measured)."""
    handoff_s: float = 0.02
    """Starting estimate of the PD handoff: Generate sent -> first token (until measured)."""
    ewma: float = 0.2
    """Weight of each new measurement in the moving averages."""
    expect_ttl_s: float = 10.0
    """How long the router counts what it just sent a worker as cached there before the worker's events confirm
    it (proxy/cache_index.py, expectations)."""


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs; discovered state (worker stats, in-flight counts) lives elsewhere.

    `prefill_addrs` / `decode_addrs` are gRPC `host:port` strings. With `colocated=True` the prefill workers are
    not used: every request goes straight to a decode worker, which computes the whole prompt itself.
    `tokenizer_path` is the model directory (holding `tokenizer.json`, optionally `tokenizer_config.json`); without
    it only token-id prompts are accepted. `api_key` set: every `/v1/*` request needs `Authorization: Bearer KEY`
    (and `/health` shows worker details only with it). `cluster_token` is sent with every worker RPC as metadata
    `x-hybridpd-token` (default: env HYBRIDPD_CLUSTER_TOKEN; `proxy.credentials` resolves files and env).
    """

    prefill_addrs: tuple[str, ...] = ()
    decode_addrs: tuple[str, ...] = ()
    model_name: str = "hybridpd"
    tokenizer_path: str | None = None
    routing: RoutingPolicy = "round_robin"
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 4 * 1024 * 1024
    max_model_len: int = 4096
    colocated: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    default_completion_max_tokens: int = 16
    """`max_tokens` of a completion request that names none (OpenAI's default); chat defaults to the rest of the
    context (max_model_len - prompt tokens)."""
    request_timeout_s: float = 600.0
    """Deadline of one request, arrival to last token. Every worker call of the request gets what is left of it;
    past it a non-stream request fails with 504 and a stream ends with an error event and `[DONE]`."""
    prefill_timeout_s: float = 300.0
    """Cap on one P.Prefill call (queueing included), within the request's deadline; past it: 504."""
    control_timeout_s: float = 5.0
    """Deadline of Health, Stats, Abort and Release calls."""
    health_interval_s: float = 2.0
    """How often the background task refreshes worker health; `/health` answers from that cache."""
    retry_after_s: int = 1
    """`Retry-After` (seconds) of a 503 sent when every prefill worker answered RESOURCE_EXHAUSTED."""
    cluster_token: str | None = field(default_factory=lambda: os.environ.get(CLUSTER_TOKEN_ENV) or None, repr=False)
    routing_weights: RoutingWeights = field(default_factory=RoutingWeights)
    """Costs and skip-prefill rule of the cache_aware policy (proxy/placement.py)."""
    dynamic_membership: bool = True
    """Workers may register (`POST /v1/cluster/workers`, with the cluster token) and leave at run time; the static
    addresses above may then be empty."""
    cache_event_drop_fraction: float = 0.0
    """Test knob: silently drop this share of the workers' cache events (lossy delivery)."""

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if not self.decode_addrs and not self.dynamic_membership:
            raise ValueError("at least one decode worker address is required")
        if not self.colocated and not self.prefill_addrs and not self.dynamic_membership:
            raise ValueError("at least one prefill worker address is required (or colocated=True)")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.request_timeout_s > 0 or not self.prefill_timeout_s > 0 or not self.health_interval_s > 0:
            raise ValueError("request_timeout_s, prefill_timeout_s and health_interval_s must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
