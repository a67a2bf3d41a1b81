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
    checkpoint_interval: int | None = None
    """Tokens between recurrent-state checkpoints; a multiple of block_size. None: the largest multiple of
    block_size not above 256 (so ordinary prompts hit)."""
    num_checkpoint_slots: int | None = None
    """State slots reserved for checkpoints. None: 2 * max_num_seqs."""
    kv_cache_memory_bytes: int | None = None
    """Explicit budget for all caches (required semantics on CPU; default 256 MiB there)."""
    gpu_memory_utilization: float = 0.9
    zero_fresh_blocks: str = "auto"
    """auto | on | off. auto: on for models with recurrent layers."""

    def resolved_checkpoint_interval(self) -> int:
        if self.checkpoint_interval is not None:
            return self.checkpoint_interval
        return max(self.block_size, (256 // self.block_size) * self.block_size)


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
        if ci < c.block_size or ci % c.block_size:
            raise InvalidRequestError(f"checkpoint_interval ({ci}) must be a positive multiple of block_size "
                                      f"({c.block_size})")
        if c.zero_fresh_blocks not in ("auto", "on", "off"):
            raise InvalidRequestError(f"zero_fresh_blocks must be auto|on|off, got {c.zero_fresh_blocks!r}")
        if not (0.0 < c.gpu_memory_utilization <= 1.0):
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if s.max_num_seqs < 1 or s.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_seqs and max_num_batched_tokens must be >= 1")
