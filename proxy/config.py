"""Proxy configuration: one frozen dataclass, built by the CLI (`hybridpd proxy`, `hybridpd serve`) or by tests."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from hybridpd.proxy.api_keys import ApiKey
from hybridpd.proxy.credentials import CLUSTER_TOKEN_ENV

RoutingPolicy = Literal["round_robin", "least_loaded", "cache_aware", "adaptive"]
"""cache_aware: proxy/placement.py (cached prefixes, load, skip-prefill by cost, whole requests on a prefill worker
while the decode workers are saturated or, with decode_balance, busier); adaptive: the same (the name the goodput
benchmark uses for a cluster that moves work between the roles)."""
ROUTING_POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "cache_aware", "adaptive")

SkipPrefill = Literal["auto", "never", "always"]
PrefillDecode = Literal["auto", "never", "always"]


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
    """Starting estimate of the PD handoff: Generate sent -> D's first token, the request's second (until measured;
    reported, not weighed in placement: P's answer carries the first token)."""
    prefill_decode: PrefillDecode = "auto"
    """When a prefill worker runs a whole request itself (P-alone, its mixed role): auto: while the decode worker
    the request would go to is saturated and a prefill worker has room (below), or under balance (decode_balance);
    never; always (tests)."""
    decode_saturation: float = 0.9
    """A decode worker is saturated with this share of the whole requests it takes (its Stats' max_generate, its
    max_num_seqs) in flight from this proxy ..."""
    tpot_budget_s: float = 0.0
    """... or while its measured time per output token (moving average over its streams) is above this, seconds
    (the operator's TPOT target; 0: off, count alone). When set, a prefill worker whose own whole requests stream
    slower than this gets no more."""
    decode_balance: float = 0.0
    """Balance (off by default until measured on GPUs, see docs/BENCHMARKS.md): with anything in flight, every
    request goes whole to the less loaded of a prefill worker (while it would hold at most this many times the
    decode worker's requests, below its --max-decode-share cap) and the decode worker, as two colocated replicas;
    PD only with nothing in flight. 0: off (proxy/placement.py)."""
    prefill_decode_max_queue_s: float = 0.5
    """A prefill worker takes a whole request only while its queue of prompt tokens, at its measured seconds per
    token, is below this (its prefill role comes first; its own cap, --max-decode-share, bounds the rest)."""
    ewma: float = 0.2
    """Weight of each new measurement in the moving averages."""
    expect_ttl_s: float = 10.0
    """How long the router counts what it just sent a worker as cached there before the worker's events confirm
    it (proxy/cache_index.py, expectations)."""


DEFAULT_SEQS_PER_DECODE_WORKER = 256


@dataclass(frozen=True)
class RequestLimits:
    """Per-request shape limits, each a 400 naming the field when exceeded (checked before any worker sees it)."""

    max_stop_strings: int = 32
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_prompts: int = 256
    """Prompts in one completion request (the schema's own ceiling is 256; this may only lower it)."""
    max_schema_depth: int = 64
    """Nesting depth (JSON containers) of a structured-output or tool-parameter JSON schema (proxy.schema_limits)."""
    max_grammar_chars: int = 65536
    """Characters of a structured-output regex or grammar."""
    max_schema_properties: int = 1024
    """Optional properties of one object in a request's JSON schemas; 8 x this: all properties of a field's schemas
    (a request's tools together)."""

    def __post_init__(self) -> None:
        for name in (
            "max_stop_strings",
            "max_stop_string_chars",
            "max_stop_token_ids",
            "max_logit_bias",
            "max_prompts",
            "max_schema_depth",
            "max_grammar_chars",
            "max_schema_properties",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class AdmissionLimits:
    """The global budget of admitted work and how it is shared between tenants (`proxy.admission`).

    `max_num_seqs`: sequences (choices) in flight across the cluster; None: DEFAULT_SEQS_PER_DECODE_WORKER per
    decode worker. `max_queued_prompt_tokens`: prompt tokens admitted and not yet past their first output token
    (waiting for or in prefill, pinned on P); None: 64 x max_model_len per prefill worker (per decode worker when
    colocated). `max_tokens_in_flight`: sum over admitted sequences of prompt + max_tokens (the KV they may grow
    to); None: no such budget. A request that can never fit one of them is a 400; one that does not fit now waits
    up to `queue_timeout_s` in a queue of at most `max_waiting` requests, then gets 503 + Retry-After.
    `max_tenant_share`: the fraction of each budget one tenant (API key, or client address without keys) may
    hold, so one tenant cannot starve the others."""

    max_num_seqs: int | None = None
    max_queued_prompt_tokens: int | None = None
    max_tokens_in_flight: int | None = None
    max_waiting: int = 64
    queue_timeout_s: float = 2.0
    max_tenant_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_queued_prompt_tokens", "max_tokens_in_flight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_waiting < 0 or self.queue_timeout_s < 0:
            raise ValueError("max_waiting and queue_timeout_s must be >= 0")
        if not 0.0 < self.max_tenant_share <= 1.0:
            raise ValueError(f"max_tenant_share must be in (0, 1], got {self.max_tenant_share}")


@dataclass(frozen=True)
class HttpLimits:
    """Connection hardening (`proxy.http_guard`): a client that has not sent a request's headers within
    `header_timeout_s` (from connect or from the previous response) or its body within `body_timeout_s` (from the
    end of the headers) is dropped; at most `max_connections` open connections (more are closed on accept); an
    idle keep-alive connection is closed after `keep_alive_timeout_s`; a client that stops reading a response (its
    socket's buffers full, the proxy's writes blocked) is dropped after `send_timeout_s`."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1000
    keep_alive_timeout_s: int = 5
    send_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_timeout_s, self.send_timeout_s) <= 0:
            raise ValueError("header_timeout_s, body_timeout_s, keep_alive_timeout_s and send_timeout_s must be > 0")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs; discovered state (worker stats, in-flight counts) lives elsewhere.

    `prefill_addrs` / `decode_addrs` are gRPC `host:port` strings. With `colocated=True` the prefill workers are
    not used: every request goes straight to a decode worker, which computes the whole prompt itself.
    `tokenizer_path` is the model directory (holding `tokenizer.json`, optionally `tokenizer_config.json`); without
    it only token-id prompts are accepted. `api_key` set: every `/v1/*` request needs `Authorization: Bearer KEY`
    (and `/health` shows worker details only with it). `cluster_token` is sent with every worker RPC as metadata
    `x-hybridpd-token` (default: env HYBRIDPD_CLUSTER_TOKEN; `proxy.credentials` resolves files and env).
    `admission`, `request_limits` and `http` bound what clients can make the cluster and the proxy hold.
    """

    prefill_addrs: tuple[str, ...] = ()
    decode_addrs: tuple[str, ...] = ()
    model_name: str = "hybridpd"
    tokenizer_path: str | None = None
    chat_template: str | None = None
    """A Jinja chat template (a file path, or the template text itself) used instead of the model's (vLLM's
    --chat-template)."""
    routing: RoutingPolicy = "round_robin"
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 4 * 1024 * 1024
    max_model_len: int = 4096
    colocated: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    model_path: str | None = None
    """The checkpoint directory (its generation_config.json); None: `tokenizer_path`."""
    generation_config: str = "auto"
    """Sampling defaults of requests that set none (vLLM's --generation-config, proxy.sampling_defaults): "auto"
    (the model's generation_config.json), "vllm" (none) or a directory holding one."""
    default_completion_max_tokens: int = 16
    """`max_tokens` of a completion request that names none (OpenAI's default); chat defaults to the rest of the
    context (max_model_len - prompt tokens)."""
    request_timeout_s: float = 600.0
    """Deadline of one request, arrival to last token. Every worker call of the request gets what is left of it;
    past it a non-stream request fails with 504 and a stream ends with an error event and `[DONE]`."""
    prefill_timeout_s: float = 300.0
    """Cap on one P.Prefill call (queueing included), within the request's deadline; past it: 504."""
    inter_token_timeout_s: float = 120.0
    """Progress deadline of a decode worker's stream after its first chunk: a worker that sends nothing for this
    long (frozen, or the request stuck there) is given up for the request, which resumes on another decode worker
    (or fails with 503 when none is left); counted in hybridpd_proxy_decode_failovers_total{cause="stalled"}.
    Long enough by default for a step that compiles GPU kernels for a new shape (tens of seconds on first use).
    0: no such deadline (only `request_timeout_s`). Independently of it, a stream from a decode worker that stops
    answering health probes (a frozen process) while another answers is given up at once."""
    control_timeout_s: float = 5.0
    """Deadline of Health, Stats, Abort and Release calls."""
    health_interval_s: float = 2.0
    """How often the background task refreshes worker health; `/health` answers from that cache."""
    retry_after_s: int = 1
    """`Retry-After` (seconds) of a 503 sent when every prefill worker answered RESOURCE_EXHAUSTED."""
    cluster_token: str | None = field(default_factory=lambda: os.environ.get(CLUSTER_TOKEN_ENV) or None, repr=False)
    api_keys: tuple[ApiKey, ...] = field(default=(), repr=False)
    """Several client keys, each with its own limits (`proxy.api_keys`); `api_key` above counts as one more."""
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    http: HttpLimits = field(default_factory=HttpLimits)
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
        if not self.inter_token_timeout_s >= 0:
            raise ValueError(f"inter_token_timeout_s must be >= 0, got {self.inter_token_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
