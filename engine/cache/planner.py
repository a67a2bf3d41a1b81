"""Capacity planner: split a memory budget between recurrent-state slots and attention blocks, exactly.

One budget (a `policy` is given; the engine always gives one): only the running requests' states are reserved;
cached checkpoints and cached attention blocks draw from what is left, and the split follows the workload
(reclaim.py enforces it at every allocation):

    attention_blocks = floor((budget - (1 + max_num_seqs) * bytes_per_state) / bytes_per_block)   (block 0 = null)
    state_slots      = 1 (null) + max_num_seqs (running) + num_checkpoint_slots (ids only, not reserved)
    budget_bytes     = budget - the two null pages (what held pages, both kinds, may take together)
    token_capacity   = (attention_blocks - 1) * block_size     (with no cached checkpoint: the optimum)

The two pools are still separate tensors, so the device holds `checkpoint_bytes_max` more than the budget until
the runner backs both from one arena; `physical_bytes` says what is allocated.

Separate pools (no policy; the pre-v2 plan): checkpoint slots are reserved up front and attention gets the rest:

    state_slots      = 1 (null) + max_num_seqs (running) + num_checkpoint_slots
    attention_blocks = floor((budget - state_slots * bytes_per_state) / bytes_per_block)     (block 0 = null)

Each pool keeps its natural page size: no padding to a common page, no inflated block size (seeds 001, 003).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.admission import CachePolicy
from engine.cache.coordinator import PoolLayout
from engine.cache.managers import cdiv
from engine.cache.specs import CacheGroup


class CapacityError(ValueError):
    pass


@dataclass(frozen=True)
class CapacityPlan:
    kv_cache_memory_bytes: int
    block_size: int
    attention_blocks: int
    token_capacity: int
    bytes_per_token: int
    bytes_per_block: int
    state_slots_running: int
    state_slots_checkpoint: int
    bytes_per_state: int
    state_bytes: int
    attention_bytes: int
    max_concurrency: int
    max_model_len: int
    checkpoint_interval: int
    shared_budget: int = 0
    """1: cached checkpoints and blocks share one budget (budget_bytes); 0: fixed checkpoint reservation."""
    budget_bytes: int = 0
    checkpoint_bytes_max: int = 0
    physical_bytes: int = 0
    policy: CachePolicy | None = field(default=None, compare=False)

    @property
    def state_slots(self) -> int:
        return 1 + self.state_slots_running + self.state_slots_checkpoint if self.bytes_per_state else 0

    def layout(self) -> PoolLayout:
        return PoolLayout(
            attention_blocks=self.attention_blocks,
            state_slots=self.state_slots,
            checkpoint_interval=self.checkpoint_interval,
            block_size=self.block_size,
            budget_bytes=self.budget_bytes if self.shared_budget else None,
            policy=self.policy,
        )

    def as_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.__dict__.items() if k != "policy"}

    def log_line(self) -> str:
        return (
            f"KV cache plan: {self.kv_cache_memory_bytes / 2**20:.1f} MiB -> attention {self.attention_blocks} blocks "
            f"x {self.block_size} tokens = {self.token_capacity} tokens ({self.bytes_per_token} B/token), state slots "
            f"{self.state_slots_running} running + {self.state_slots_checkpoint} checkpoint ({self.bytes_per_state} "
            f"B/state), max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency}"
            + (f"; one budget of {self.budget_bytes / 2**20:.1f} MiB shared by cached blocks and checkpoints "
               f"(checkpoints reserve nothing; up to {self.state_slots_checkpoint})" if self.shared_budget else "")
        )


def plan_capacity(
    groups: list[CacheGroup],
    budget_bytes: int,
    max_num_seqs: int,
    num_checkpoint_slots: int,
    max_model_len: int,
    checkpoint_interval: int,
    policy: CachePolicy | None = None,
) -> CapacityPlan:
    attn = [g for g in groups if g.is_attention]
    rec = [g for g in groups if not g.is_attention]
    block_size = attn[0].spec.block_size if attn else checkpoint_interval  # type: ignore[union-attr]
    bytes_per_block = sum(g.page_bytes_all_layers for g in attn)
    bytes_per_state = sum(g.page_bytes_all_layers for g in rec)
    num_ckpt = num_checkpoint_slots if rec else 0
    num_slots = (1 + max_num_seqs + num_ckpt) if rec else 0
    reserved_slots = num_slots if policy is None else (1 + max_num_seqs if rec else 0)
    state_bytes = reserved_slots * bytes_per_state
    remaining = budget_bytes - state_bytes
    if attn:
        blocks = remaining // bytes_per_block if remaining > 0 else 0
        if blocks < 2:
            raise CapacityError(
                f"KV cache budget of {budget_bytes} bytes is too small: {reserved_slots} state slots take "
                f"{state_bytes} "
                f"bytes and attention needs at least 2 blocks of {bytes_per_block} bytes (raise the budget or lower "
                f"max_num_seqs / num_checkpoint_slots)"
            )
    else:
        blocks = 0
        if remaining < 0:
            raise CapacityError(f"KV cache budget of {budget_bytes} bytes cannot hold {num_slots} state slots")
    token_capacity = max(0, blocks - 1) * block_size
    per_seq_tokens = cdiv(max_model_len, block_size) * block_size
    concurrency = min(max_num_seqs, token_capacity // per_seq_tokens) if attn else max_num_seqs
    return CapacityPlan(
        kv_cache_memory_bytes=budget_bytes,
        block_size=block_size,
        attention_blocks=blocks,
        token_capacity=token_capacity,
        bytes_per_token=bytes_per_block // block_size if attn else 0,
        bytes_per_block=bytes_per_block,
        state_slots_running=max_num_seqs if rec else 0,
        state_slots_checkpoint=num_ckpt,
        bytes_per_state=bytes_per_state,
        state_bytes=state_bytes,
        attention_bytes=blocks * bytes_per_block,
        max_concurrency=concurrency,
        max_model_len=max_model_len,
        checkpoint_interval=checkpoint_interval,
        shared_budget=int(policy is not None),
        budget_bytes=budget_bytes - (bytes_per_block if attn else 0) - (bytes_per_state if rec else 0),
        checkpoint_bytes_max=num_ckpt * bytes_per_state if policy is not None else 0,
        physical_bytes=blocks * bytes_per_block + num_slots * bytes_per_state,
        policy=policy,
    )
