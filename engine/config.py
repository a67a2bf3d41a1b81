"""Frozen config sections composed into one root. What is discovered at run time (block counts, addresses) lives in
the capacity plan / layout objects, never written back here.

Every field has a docstring (the string literal under it): it is the field's documentation and, through
`field_docs`, the help text of the command-line flag that `deploy.engine_flags` generates for it. A field added
here is a new flag of every command that runs an engine, and a new `LLM(...)` keyword."""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import os
import re
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from hybridpd.engine.errors import InvalidRequestError

Dtype = Literal["float32", "bfloat16", "float16"]
DtypeSetting = Literal["auto", "float32", "bfloat16", "float16", "half", "float"]
"""`half` and `float` are vLLM's other names of float16 and float32."""
ZeroMode = Literal["auto", "on", "off"]
LoadFormat = Literal["auto", "dummy"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
DEFAULT_MAX_MODEL_LEN = 4096
"""max_model_len of a checkpoint whose config.json names no max_position_embeddings."""
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
"""Set to 1 (or true) to allow a max_model_len past the checkpoint's max_position_embeddings (vLLM's variable)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    path: str
    """HF-format checkpoint directory (config.json, weights, tokenizer). LLM() and the hybridpd commands default to
    the built-in tiny model."""
    dtype: DtypeSetting = "auto"
    """Weight and activation dtype. auto (as vLLM): on CUDA the checkpoint's config.json dtype, bfloat16 for a
    float32 one (float16 where the GPU lacks bf16); float32 on CPU. half = float16, float = float32."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N. auto: cuda when a CUDA device is visible, else cpu."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens. None: the checkpoint's max_position_embeddings (4096 when its config.json
    has none). Larger than max_position_embeddings is refused unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (as vLLM).
    -1 (flag: auto): that length, or the longest one request of which the cache budget holds (vLLM's auto-fit)."""
    seed: int = 0
    """Random seed of the engine's sampler."""
    load_format: LoadFormat = "auto"
    """auto: read the checkpoint's weights. dummy: random weights drawn on the device from config.json alone (no
    weight files needed; vLLM's --load-format dummy), for benchmarks at full size."""
    allow_reference_path: bool = False
    """On CUDA, start on the slow reference path when the fast path's packages (fla-core: pip install
    'hybridpd[gpu]') are missing, instead of refusing to start."""
    tokenizer: str | None = None
    """Directory (or Hugging Face model id) of the tokenizer and chat template, when not the checkpoint's (vLLM's
    --tokenizer). None: the checkpoint directory."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per attention KV block."""
    enable_prefix_caching: bool = True
    """Reuse the cached KV blocks and recurrent-state checkpoints of earlier prompts with the same prefix."""
    checkpoint_interval: int | None = None
    """Recurrent-state checkpoints go where reuse happens (branch points, prompt ends, request ends); this adds one
    every checkpoint_interval tokens (a multiple of block_size). None or 0: off."""
    eviction_alpha: float = 1.0
    """Weight of compute saved per byte against recency in eviction (GreedyDual: engine/cache/tree.py)."""
    num_checkpoint_slots: int | None = None
    """At most this many cached checkpoints. Each one is the memory of k attention blocks of the one arena (nothing
    is reserved for them). None: as many as the arena holds."""
    kv_cache_memory_bytes: int | None = None
    """Cache budget in bytes for all caches. None: 256 MiB on CPU, from gpu_memory_utilization on GPU."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU this worker may use (weights, activations and cache)."""
    zero_fresh_blocks: ZeroMode = "auto"
    """Zero newly allocated KV blocks before use. auto: on for models with recurrent layers."""

    def resolved_checkpoint_interval(self) -> int:
        return self.checkpoint_interval or 0

    def cache_policy(self):  # type: ignore[no-untyped-def]  # -> engine.cache.admission.CachePolicy
        from hybridpd.engine.cache.admission import CachePolicy

        return CachePolicy(self.resolved_checkpoint_interval(), self.eviction_alpha)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running at once per worker."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step."""
    async_scheduling: bool | None = None
    """Launch decode step N+1 (its input tokens fed on the device from step N's samples) before reading step N's
    tokens, so that scheduling, input preparation and output processing overlap the GPU's step. Outputs are
    identical; steps whose requests need the last token on the host (structured output, prefill-only and
    unconfirmed-transfer requests) or that save checkpoints other than decode's rolling ones run
    synchronously. Unset: on for CUDA, off on the CPU (where the host is also the device, so nothing overlaps)."""


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks (GPUs) one worker spreads the model over: attention, Mamba-2 and Gated-DeltaNet heads, MLP and expert
    intermediates and the vocabulary are split; rank r runs on cuda:N+r (CPU: gloo processes)."""
    enable_expert_parallel: bool = False
    """MoE blocks keep whole routed experts per rank (experts divided over the tensor-parallel ranks) instead of
    a slice of every expert; the shared expert stays split. Needs the routed expert count divisible by the size."""


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_settings(cls, path: str, **settings: Any) -> EngineConfig:
        """A config from flat keywords, each the name of a field of one section (`block_size=32`, `seed=1`).
        An unknown name raises TypeError, as an unknown keyword argument does."""
        parts: dict[str, Any] = {}
        for name, section in config_sections().items():
            own = {f.name: settings.pop(f.name) for f in fields(section) if f.name in settings}
            parts[name] = section(path=path, **own) if section is ModelConfig else section(**own)
        if settings:
            raise TypeError(f"unknown engine settings: {', '.join(sorted(settings))}")
        return cls(**parts)

    def validate(self) -> None:
        m, c, s = self.model, self.cache, self.scheduler
        if m.dtype not in typing.get_args(DtypeSetting):
            raise InvalidRequestError(f"dtype must be one of {typing.get_args(DtypeSetting)}, got {m.dtype!r}")
        if m.max_model_len is not None and m.max_model_len < -1:
            raise InvalidRequestError(f"max_model_len must be >= 1 (or -1: auto-fit), got {m.max_model_len}")
        if m.load_format not in typing.get_args(LoadFormat):
            raise InvalidRequestError(f"load_format must be auto|dummy, got {m.load_format!r}")
        if not (m.device in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", m.device)):
            raise InvalidRequestError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {m.device!r}")
        if c.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {c.block_size}")
        ci = c.resolved_checkpoint_interval()
        if ci < 0 or ci % c.block_size:
            raise InvalidRequestError(f"checkpoint_interval ({ci}) must be a multiple of block_size "
                                      f"({c.block_size}), or 0 (off)")
        if c.zero_fresh_blocks not in typing.get_args(ZeroMode):
            raise InvalidRequestError(f"zero_fresh_blocks must be auto|on|off, got {c.zero_fresh_blocks!r}")
        if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes < 1:
            raise InvalidRequestError(f"kv_cache_memory_bytes must be >= 1 (bytes; e.g. 4G), or unset for the "
                                      f"default budget, got {c.kv_cache_memory_bytes}")
        if not (0.0 < c.gpu_memory_utilization <= 1.0):
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if s.max_num_seqs < 1 or s.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.parallel.tensor_parallel_size < 1:
            raise InvalidRequestError(
                f"tensor_parallel_size must be >= 1, got {self.parallel.tensor_parallel_size}")


def checkpoint_max_len(hf_config: Mapping[str, Any]) -> int | None:
    """The checkpoint's trained context: max_position_embeddings of config.json (of its text_config in a multimodal
    checkpoint). None when it names none."""
    text = hf_config.get("text_config")
    for cfg in (hf_config, text if isinstance(text, Mapping) else {}):
        value = cfg.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def resolve_max_model_len(requested: int | None, hf_config: Mapping[str, Any], model: str = "the model") -> int:
    """The engine's max_model_len: `requested`, or (None / 0 / -1) the checkpoint's max_position_embeddings. As vLLM, a
    requested length past the checkpoint's (and past its model_max_length, when config.json has one) is refused
    with InvalidRequestError unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; a checkpoint naming neither accepts any."""
    limit = checkpoint_max_len(hf_config)
    if not requested or requested == -1:  # -1: auto-fit, from this length down (the engine's planner)
        return limit or DEFAULT_MAX_MODEL_LEN
    if requested < 0:
        raise InvalidRequestError(f"max_model_len must be >= 1 (or -1: auto-fit), got {requested}")
    override = hf_config.get("model_max_length")
    if limit is None or requested <= limit or (isinstance(override, int) and requested <= override):
        return requested
    msg = f"max_model_len ({requested}) is greater than max_position_embeddings ({limit}) of {model} (config.json)"
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "0").strip().lower() in ("1", "true"):
        log.warning("%s; allowed by %s: positions past the trained length may give garbage", msg,
                    ALLOW_LONG_MAX_MODEL_LEN_ENV)
        return requested
    raise InvalidRequestError(f"{msg}. Lower --max-model-len, or set {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to allow it "
                              f"(positions past the trained length may give garbage output)")


def config_sections(root: type = EngineConfig) -> dict[str, type]:
    """The root's sections by field name: {"model": ModelConfig, "cache": CacheConfig, ...}."""
    hints = typing.get_type_hints(root)
    return {f.name: hints[f.name] for f in fields(root)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under it in the class body), whitespace folded. Fields
    without one are absent."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, doc in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            docs[stmt.target.id] = " ".join(doc.value.value.split())
    return docs
