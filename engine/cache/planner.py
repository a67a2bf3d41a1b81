"""Capacity planner: split a memory budget between running states and pages, exactly.

One arena (arena.py has the picture): only the running requests' states (and a few staging slots) are reserved;
attention blocks and cached checkpoints share the pages, a checkpoint taking k of them while it is cached, so the
split follows the workload and nothing beyond the budget is allocated:

    k                = ceil(bytes_per_state / bytes_per_page)     (a page: one block of every attention group)
    state slots      = 1 (null) + max_num_seqs (running) + STAGING_SLOTS, k pages' worth each
    pages            = floor((budget - state slots * k * bytes_per_page) / bytes_per_page)     (page 0 = null)
    token_capacity   = (pages - 1) * block_size     (with no cached checkpoint)

A model without attention: a page is one state (k = 1) and the pages hold checkpoints only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.arena import ArenaLayout, plan_arena
from hybridpd.engine.cache.coordinator import PoolLayout
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
    """Checkpoints the pages could hold at most (or the configured cap)."""
    bytes_per_state: int
    state_bytes: int
    """Bytes reserved for state slots (null, running, staging)."""
    attention_bytes: int
    max_concurrency: int
    max_model_len: int
    checkpoint_interval: int
    physical_bytes: int = 0
    blocks_per_checkpoint: int = 0
    """k: the pages one checkpoint takes."""
    max_checkpoints: int | None = None
    policy: CachePolicy | None = field(default=None, compare=False)
    arena: ArenaLayout | None = field(default=None, compare=False)

    @property
    def state_slots(self) -> int:
        return self.arena.num_slots if self.arena is not None else 0

    def layout(self) -> PoolLayout:
        a = self.arena
        assert a is not None
        return PoolLayout(a.num_pages, a.num_slots, self.checkpoint_interval, self.block_size, a.pages_per_state,
                          self.policy, self.max_checkpoints)

    def as_dict(self) -> dict[str, int]:
        return {k: int(v or 0) for k, v in self.__dict__.items() if k not in ("policy", "arena")}

    def log_line(self) -> str:
        return (
            f"KV cache plan: {self.kv_cache_memory_bytes / 2**20:.1f} MiB -> {self.attention_blocks} pages "
            f"x {self.block_size} tokens = {self.token_capacity} tokens ({self.bytes_per_token} B/token), "
            f"{self.state_slots_running} running states ({self.bytes_per_state} B/state), max concurrency at "
            f"max_model_len={self.max_model_len}: {self.max_concurrency}"
            + (f"; a cached checkpoint takes {self.blocks_per_checkpoint} pages (none reserved)"
               if self.blocks_per_checkpoint else "")
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
    """`num_checkpoint_slots`: at most this many cached checkpoints (None: as many as the pages hold). `block_size`:
    the hashing block of a model without attention layers (its checkpoints' boundaries; default:
    `checkpoint_interval`); an attention group's own block size otherwise."""
    attn = [g for g in groups if g.is_attention]
    per_state = sum(g.page_bytes_all_layers for g in groups if not g.is_attention)
    block_size = attn[0].spec.block_size if attn else (block_size or checkpoint_interval)  # type: ignore[union-attr]
    if block_size <= 0:
        raise CapacityError("a model without attention layers needs a block size for its checkpoints")
    arena = plan_arena(groups, budget_bytes, max_num_seqs)
    pages, k = arena.num_pages, arena.pages_per_state
    if pages < 2:
        what = f"attention needs at least 2 blocks of {arena.page_bytes} bytes" if attn else "no checkpoint page fits"
        raise CapacityError(f"KV cache budget of {budget_bytes} bytes is too small: {arena.num_slots} state slots take "
                            f"{arena.pages_offset} bytes and {what} (raise the budget or lower max_num_seqs)")
    fits = (pages - 1) // k if k and pages else 0
    cap = fits if num_checkpoint_slots is None else min(fits, num_checkpoint_slots)
    bpb = arena.page_bytes if attn else 0
    token_capacity = (pages - 1) * block_size if attn else 0
    per_seq = -(-max_model_len // block_size) * block_size
    return CapacityPlan(
        kv_cache_memory_bytes=budget_bytes, block_size=block_size, attention_blocks=pages if attn else 0,
        token_capacity=token_capacity, bytes_per_token=bpb // block_size, bytes_per_block=bpb,
        state_slots_running=max_num_seqs if per_state else 0, state_slots_checkpoint=cap, bytes_per_state=per_state,
        state_bytes=arena.pages_offset, attention_bytes=pages * bpb,
        max_concurrency=min(max_num_seqs, token_capacity // per_seq) if attn else max_num_seqs,
        max_model_len=max_model_len, checkpoint_interval=checkpoint_interval, physical_bytes=arena.total_bytes,
        blocks_per_checkpoint=k, max_checkpoints=num_checkpoint_slots, policy=policy, arena=arena,
    )
