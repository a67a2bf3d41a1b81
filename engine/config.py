"""Frozen config sections composed into one root. What is discovered at run time (block counts, addresses) lives in
the capacity plan / layout objects, never written back here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.errors import InvalidRequestError

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    path: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    """None: the checkpoint's max_position_embeddings."""
    seed: int = 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    checkpoint_admission: str | None = None
    """Where recurrent-state checkpoints are saved. "reuse": branch points, prompt ends, request ends (plus the
    interval fallback when checkpoint_interval > 0). "interval": every checkpoint_interval tokens (pre-v2).
    None: "interval" when checkpoint_interval is set (configs written for v1 keep their meaning), else "reuse"."""
    checkpoint_interval: int | None = None
    """Tokens between (fallback) checkpoints; a multiple of block_size. None: off (0) for "reuse", the largest
    multiple of block_size not above 256 for "interval"."""
    eviction: str = "value"
    """"value": compute saved per byte with recency, blocks and states consistent. "lru": release order."""
    eviction_alpha: float = 1.0
    """Weight of compute saved per byte against recency ("value")."""
    num_checkpoint_slots: int | None = None
    """State-slot ids for cached checkpoints. They share the one memory budget with attention blocks (nothing is
    reserved for them); this only caps how many may exist. None: 2 * max_num_seqs."""
    kv_cache_memory_bytes: int | None = None
    """Explicit budget for all caches (required semantics on CPU; default 256 MiB there)."""
    gpu_memory_utilization: float = 0.9
    zero_fresh_blocks: str = "auto"
    """auto | on | off. auto: on for models with recurrent layers."""

    def resolved_admission(self) -> str:
        if self.checkpoint_admission is not None:
            return self.checkpoint_admission
        return "reuse" if self.checkpoint_interval is None else "interval"

    def resolved_checkpoint_interval(self) -> int:
        if self.checkpoint_interval is not None:
            return self.checkpoint_interval
        if self.resolved_admission() == "reuse":
            return 0
        return max(self.block_size, (256 // self.block_size) * self.block_size)

    def cache_policy(self):  # type: ignore[no-untyped-def]  # -> engine.cache.admission.CachePolicy
        from engine.cache.admission import CachePolicy

        return CachePolicy(self.resolved_admission(), self.eviction, self.resolved_checkpoint_interval(),
                           self.eviction_alpha)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        m, c, s = self.model, self.cache, self.scheduler
        if m.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {DTYPES}, got {m.dtype!r}")
        if not (m.device == "cpu" or m.device.startswith("cuda")):
            raise InvalidRequestError(f"device must be 'cpu' or 'cuda[:N]', got {m.device!r}")
        if c.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {c.block_size}")
        ci = c.resolved_checkpoint_interval()
        if ci < 0 or ci % c.block_size or (ci == 0 and c.resolved_admission() != "reuse"):
            raise InvalidRequestError(f"checkpoint_interval ({ci}) must be a positive multiple of block_size "
                                      f"({c.block_size}), or 0 (off) with checkpoint_admission='reuse'")
        if c.resolved_admission() not in ("reuse", "interval") or c.eviction not in ("value", "lru"):
            raise InvalidRequestError("checkpoint_admission must be reuse|interval and eviction value|lru")
        if c.zero_fresh_blocks not in ("auto", "on", "off"):
            raise InvalidRequestError(f"zero_fresh_blocks must be auto|on|off, got {c.zero_fresh_blocks!r}")
        if not (0.0 < c.gpu_memory_utilization <= 1.0):
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if s.max_num_seqs < 1 or s.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_seqs and max_num_batched_tokens must be >= 1")
