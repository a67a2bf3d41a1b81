"""Proxy configuration: one frozen dataclass, built by the CLI (`hybridpd proxy`, `hybridpd serve`) or by tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RoutingPolicy = Literal["round_robin", "least_loaded"]


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs; discovered state (worker stats, in-flight counts) lives elsewhere.

    `prefill_addrs` / `decode_addrs` are gRPC `host:port` strings. With `colocated=True` the prefill workers are
    not used: every request goes straight to a decode worker, which computes the whole prompt itself.
    `tokenizer_path` is the model directory (holding `tokenizer.json`, optionally `tokenizer_config.json`); without
    it only token-id prompts are accepted. `api_key` set: every `/v1/*` request needs `Authorization: Bearer KEY`.
    """

    prefill_addrs: tuple[str, ...] = ()
    decode_addrs: tuple[str, ...] = ()
    model_name: str = "hybridpd"
    tokenizer_path: str | None = None
    routing: RoutingPolicy = "round_robin"
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_model_len: int = 4096
    colocated: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    default_completion_max_tokens: int = 16
    """`max_tokens` of a completion request that names none (OpenAI's default); chat defaults to the rest of the
    context (max_model_len - prompt tokens)."""
    prefill_timeout_s: float = 300.0
    """Deadline of one P.Prefill call (queueing included); past it the request fails with 503."""
    control_timeout_s: float = 5.0
    """Deadline of Health, Stats, Abort and Release calls."""

    def __post_init__(self) -> None:
        if self.routing not in ("round_robin", "least_loaded"):
            raise ValueError(f"routing must be 'round_robin' or 'least_loaded', got {self.routing!r}")
        if not self.decode_addrs:
            raise ValueError("at least one decode worker address is required")
        if not self.colocated and not self.prefill_addrs:
            raise ValueError("at least one prefill worker address is required (or colocated=True)")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
