"""Capacity planner: split a memory budget between recurrent-state slots and attention blocks, exactly.

One arena (a `policy` is given; the engine always gives one): only the running requests' states are reserved;
cached checkpoints and cached attention blocks share the rest *physically*: a checkpoint slot is k attention
blocks of memory (arena.py has the picture, overlay.py the rule that keeps them apart), so the split follows the
workload and nothing beyond the budget is allocated:

    k                = ceil(bytes_per_state / bytes_per_block)     (a state page rounded up to whole blocks)
    attention_blocks = floor((budget - (1 + max_num_seqs) * k * bytes_per_block) / bytes_per_block) (0 = null)
    state_slots      = 1 (null) + max_num_seqs (running) + 1 (pinned) + checkpoint ids
    checkpoint ids   = attention_blocks // k - 1, at most num_checkpoint_slots (None: no cap)
    token_capacity   = (attention_blocks - 1) * block_size     (with no cached checkpoint: the optimum, less the
                                                                 rounding of the reserved slots to k blocks)
    physical_bytes   = the arena = budget - (less than one block)

A model without attention layers has nothing to overlay: its checkpoint slots are reserved from the budget.

Separate tensors (no policy: what the GPU kernel benchmarks plan; the engine always passes a policy): checkpoint
slots are reserved up front and attention gets the rest (the cache manager still runs its one tree over them):

    state_slots      = 1 (null) + max_num_seqs (running) + num_checkpoint_slots
    attention_blocks = floor((budget - state_slots * bytes_per_state) / bytes_per_block)     (block 0 = null)

Each pool keeps its natural page size: no padding to a common page, no inflated block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.arena import ArenaLayout, plan_arena
from hybridpd.engine.cache.coordinator import PoolLayout
from hybridpd.engine.cache.managers import cdiv
from hybridpd.engine.cache.specs import CacheGroup


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
    blocks_per_checkpoint: int = 0
    """Arena: k, the attention blocks one checkpoint slot covers."""
    policy: CachePolicy | None = field(default=None, compare=False)
    arena: ArenaLayout | None = field(default=None, compare=False)
    """Where every group's tensor lives in the one arena (None: separate tensors, no policy)."""

    @property
    def state_slots(self) -> int:
        if self.arena is not None and self.arena.state_bytes:
            return self.arena.state_slots
        return 1 + self.state_slots_running + self.state_slots_checkpoint if self.bytes_per_state else 0

    def layout(self) -> PoolLayout:
        return PoolLayout(
            attention_blocks=self.attention_blocks,
            state_slots=self.state_slots,
            checkpoint_interval=self.checkpoint_interval,
            block_size=self.block_size,
            budget_bytes=self.budget_bytes if self.shared_budget else None,
            policy=self.policy,
            arena=self.arena,
        )

    def as_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.__dict__.items() if k not in ("policy", "arena")}

    def log_line(self) -> str:
        return (
            f"KV cache plan: {self.kv_cache_memory_bytes / 2**20:.1f} MiB -> attention {self.attention_blocks} blocks "
            f"x {self.block_size} tokens = {self.token_capacity} tokens ({self.bytes_per_token} B/token), state slots "
            f"{self.state_slots_running} running + {self.state_slots_checkpoint} checkpoint ({self.bytes_per_state} "
            f"B/state), max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency}"
            + (f"; one arena of {self.physical_bytes / 2**20:.1f} MiB: cached blocks and up to "
               f"{self.state_slots_checkpoint} checkpoints share it (a checkpoint covers {self.blocks_per_checkpoint} "
               f"blocks; none reserved)" if self.arena is not None and self.blocks_per_checkpoint else "")
            + (f"; one budget of {self.budget_bytes / 2**20:.1f} MiB shared by cached blocks and up to "
               f"{self.state_slots_checkpoint} checkpoints" if self.shared_budget and self.arena is None else "")
        )


def plan_capacity(
    groups: list[CacheGroup],
    budget_bytes: int,
    max_num_seqs: int,
    num_checkpoint_slots: int | None,
    max_model_len: int,
    checkpoint_interval: int,
    policy: CachePolicy | None = None,
    block_size: int = 0,
) -> CapacityPlan:
    """`num_checkpoint_slots`: at most this many checkpoint ids (None: as many as the arena holds; without a
    policy, 2 * max_num_seqs). `block_size`: the hashing block of a model without attention layers (its states'
    checkpoint boundaries; default: `checkpoint_interval`); an attention group's own block size otherwise."""
    if policy is not None and any(g.is_attention for g in groups):
        return _plan_arena(groups, budget_bytes, max_num_seqs, num_checkpoint_slots, max_model_len,
                           checkpoint_interval, policy)
    if num_checkpoint_slots is None:
        num_checkpoint_slots = 2 * max_num_seqs
    if policy is not None:  # states only: checkpoint slots are reserved, within the budget
        per_state = sum(g.page_bytes_all_layers for g in groups)
        num_checkpoint_slots = min(num_checkpoint_slots, max(0, budget_bytes // max(per_state, 1) - 1 - max_num_seqs))
    return _plan_separate(groups, budget_bytes, max_num_seqs, num_checkpoint_slots, max_model_len,
                          checkpoint_interval, policy, block_size)


def _plan_separate(groups: list[CacheGroup], budget_bytes: int, max_num_seqs: int, num_ckpt: int,
                   max_model_len: int, checkpoint_interval: int, policy: CachePolicy | None,
                   states_block_size: int = 0) -> CapacityPlan:
    """One tensor per group: state slots first (with a policy only the running ones count), attention the rest."""
    attn = [g for g in groups if g.is_attention]
    rec = [g for g in groups if not g.is_attention]
    block_size = attn[0].spec.block_size if attn else (states_block_size or checkpoint_interval)  # type: ignore[union-attr]
    if block_size <= 0:
        raise CapacityError("a model without attention layers needs a block size for its checkpoints")
    bytes_per_block = sum(g.page_bytes_all_layers for g in attn)
    bytes_per_state = sum(g.page_bytes_all_layers for g in rec)
    num_ckpt = num_ckpt if rec else 0
    num_slots = (1 + max_num_seqs + num_ckpt) if rec else 0
    reserved_slots = num_slots if policy is None else (1 + max_num_seqs if rec else 0)
    state_bytes = reserved_slots * bytes_per_state
    remaining = budget_bytes - state_bytes
    blocks = remaining // bytes_per_block if attn and remaining > 0 else 0
    if attn and blocks < 2:
        raise CapacityError(
            f"KV cache budget of {budget_bytes} bytes is too small: {reserved_slots} state slots take {state_bytes} "
            f"bytes and attention needs at least 2 blocks of {bytes_per_block} bytes (raise the budget or lower "
            f"max_num_seqs / num_checkpoint_slots)")
    if remaining < 0:
        raise CapacityError(f"KV cache budget of {budget_bytes} bytes cannot hold {num_slots} state slots")
    token_capacity = max(0, blocks - 1) * block_size
    per_seq_tokens = cdiv(max_model_len, block_size) * block_size if attn else 0
    return CapacityPlan(
        kv_cache_memory_bytes=budget_bytes, block_size=block_size, attention_blocks=blocks,
        token_capacity=token_capacity, bytes_per_token=bytes_per_block // block_size if attn else 0,
        bytes_per_block=bytes_per_block, state_slots_running=max_num_seqs if rec else 0,
        state_slots_checkpoint=num_ckpt, bytes_per_state=bytes_per_state, state_bytes=state_bytes,
        attention_bytes=blocks * bytes_per_block,
        max_concurrency=min(max_num_seqs, token_capacity // per_seq_tokens) if attn else max_num_seqs,
        max_model_len=max_model_len, checkpoint_interval=checkpoint_interval, shared_budget=int(policy is not None),
        budget_bytes=budget_bytes - (bytes_per_block if attn else 0) - (bytes_per_state if rec else 0),
        checkpoint_bytes_max=num_ckpt * bytes_per_state if policy is not None else 0,
        physical_bytes=blocks * bytes_per_block + num_slots * bytes_per_state, policy=policy,
    )


def _plan_arena(groups: list[CacheGroup], budget_bytes: int, max_num_seqs: int, max_checkpoints: int | None,
                max_model_len: int, checkpoint_interval: int, policy: CachePolicy) -> CapacityPlan:
    arena = plan_arena(groups, budget_bytes, max_num_seqs, max_checkpoints)
    attn = [g for g in groups if g.is_attention]
    block_size = attn[0].spec.block_size  # type: ignore[union-attr]
    rec = any(not g.is_attention for g in groups)
    blocks, bpb = arena.attention_blocks, arena.block_bytes
    reserved = arena.attention_offset
    if blocks < 2:
        raise CapacityError(
            f"KV cache budget of {budget_bytes} bytes is too small: {1 + max_num_seqs} state slots take {reserved} "
            f"bytes and attention needs at least 2 blocks of {bpb} bytes (raise the budget or lower max_num_seqs)")
    per_state = sum(g.page_bytes_all_layers for g in groups if not g.is_attention)
    token_capacity = (blocks - 1) * block_size
    per_seq_tokens = cdiv(max_model_len, block_size) * block_size
    return CapacityPlan(
        kv_cache_memory_bytes=budget_bytes,
        block_size=block_size,
        attention_blocks=blocks,
        token_capacity=token_capacity,
        bytes_per_token=bpb // block_size,
        bytes_per_block=bpb,
        state_slots_running=arena.running_slots,
        state_slots_checkpoint=arena.checkpoint_slots,
        bytes_per_state=per_state,
        state_bytes=reserved,
        attention_bytes=blocks * bpb,
        max_concurrency=min(max_num_seqs, token_capacity // per_seq_tokens),
        max_model_len=max_model_len,
        checkpoint_interval=checkpoint_interval,
        shared_budget=1,
        budget_bytes=(blocks - 1) * bpb + arena.running_slots * per_state,
        checkpoint_bytes_max=arena.checkpoint_slots * arena.slot_stride if rec else 0,
        physical_bytes=arena.total_bytes,
        blocks_per_checkpoint=arena.blocks_per_slot,
        policy=policy,
        arena=arena,
    )
