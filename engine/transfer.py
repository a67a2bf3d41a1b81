"""The engine's side of a P/D handoff: what a prefilled request exports and how a consumer imports it. Tensor-free
values; the PD services translate them to and from protobuf and never touch the cache manager, scheduler or runner
themselves. All functions run on the engine's step thread.

    P (producer)                                   D (consumer)
    core.add_request(..., compute_target=N-1)      req = core.new_request(...)
      ... finishes as "prefilled" (caches kept)    imp = begin_import(core, req, n, src)   allocate, choose pages
    exp = export_prefilled(core, req)  pin         ... pull imp's src pages into its dst pages (NIXL) ...
      ... lease: D pulls, then commits ...         complete_import(core, req, imp)  publish + schedule at n
    release_export(core, req, exp)     unpin       or abort_import(core, req, imp, reusable) + schedule_local/fail

Ownership: an Export's pages stay allocated (the prefilled request's blocks, its running slot, plus a pinned
checkpoint slot) until `release_export`. An Import's destination pages belong to the request from `begin_import`
until `complete_import` (they become its running caches) or `abort_import` (freed, or quarantined when a READ
might still write them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.core import EngineCore
from engine.request import Request


@dataclass(frozen=True)
class Export:
    """A prefilled request's caches, pinned for a consumer. Ids are the producer's."""

    request_id: str
    num_tokens: int
    """Tokens computed (N-1 for hybrid models); the consumer computes the rest."""
    blocks: Mapping[int, tuple[int, ...]]
    """Attention group id -> block ids holding those tokens, in order."""
    state_slots: Mapping[int, int]
    """Recurrent group id -> slot holding the state after `num_tokens`."""
    checkpoint: tuple[int, int] | None
    """(tokens, slot) of the last cached state checkpoint within the prompt, pinned too; None if there is none."""
    pinned: Mapping[int, tuple[int, ...]]
    """Group id -> every page the export holds (what a lease accounts for)."""


@dataclass(frozen=True)
class ImportSource:
    """Where the producer holds what the consumer wants (from the transfer params)."""

    num_tokens: int
    blocks: Mapping[int, Sequence[int]]
    """Attention group id -> the producer's block ids for those tokens, in order."""
    state_slot: int | None
    """The producer's slot holding the state after `num_tokens` (the recurrent group's; the wire format carries
    one recurrent group)."""
    checkpoint: tuple[int, int] | None = None
    """(tokens, the producer's slot) of its last checkpoint within the prompt, if it offers one."""


@dataclass(frozen=True)
class Import:
    """Pages to read, paired position by position: {group id: ids} on the source and here."""

    request_id: str
    num_tokens: int
    local_hit_tokens: int
    src_blocks: Mapping[int, tuple[int, ...]]
    dst_blocks: Mapping[int, tuple[int, ...]]
    src_state_slots: Mapping[int, tuple[int, ...]]
    dst_state_slots: Mapping[int, tuple[int, ...]]
    checkpoint: tuple[int, bytes] | None
    """(our slot, block hash) reserved for the producer's checkpoint, published on completion."""


# -- producer ------------------------------------------------------------------------------------------------------
def export_prefilled(core: EngineCore, req: Request) -> Export:
    """Pin a request that finished as "prefilled" (its blocks and running slot are still allocated) together with
    the last cached checkpoint of its prompt, and describe them."""
    cache, n = core.cache, req.num_computed_tokens
    ckpt = None
    rec, attn = cache.recurrent, cache.attention
    if rec is not None and cache.enable_prefix_caching:
        ckpt_tokens, ckpt_slot = rec.find_hit(req.block_hashes, n)
        if ckpt_slot is not None:
            rec.pool.touch([ckpt_slot])
            ckpt = (ckpt_tokens, ckpt_slot)
    blocks: dict[int, tuple[int, ...]] = {}
    states: dict[int, int] = {}
    pinned: dict[int, tuple[int, ...]] = {}
    if attn is not None:
        all_blocks = tuple(cache.block_ids(req.request_id))
        blocks[attn.group.group_id] = all_blocks[: -(-n // cache.block_size)]
        pinned[attn.group.group_id] = all_blocks
    if rec is not None:
        slot = cache.state_slot(req.request_id)
        states[rec.group.group_id] = slot
        pinned[rec.group.group_id] = (slot,) + ((ckpt[1],) if ckpt is not None else ())
    return Export(req.request_id, n, blocks, states, ckpt, pinned)


def release_export(core: EngineCore, req: Request, exp: Export) -> None:
    """Unpin an export (its lease ended: committed, released or expired)."""
    core.scheduler.release(req)
    if exp.checkpoint is not None and core.cache.recurrent is not None:
        core.cache.recurrent.pool.free([exp.checkpoint[1]])


def export_pages_needed(core: EngineCore, num_tokens: int) -> dict[int, int]:
    """Attention blocks an export of `num_tokens` tokens pins (admission control counts these)."""
    attn = core.cache.attention
    return {} if attn is None else {attn.group.group_id: -(-num_tokens // core.cache.block_size)}


def pool_totals(core: EngineCore) -> dict[int, tuple[str, int]]:
    """Group id -> (kind, pages in the pool)."""
    return {int(s["group_id"]): (str(s["kind"]), int(s["total"])) for s in core.cache.pool_stats()}  # type: ignore[call-overload]


# -- consumer ------------------------------------------------------------------------------------------------------
def begin_import(core: EngineCore, req: Request, src: ImportSource) -> Import | None:
    """Allocate what `req` needs to receive the producer's first `src.num_tokens` tokens, keeping our own prefix
    hit (attention blocks only: the running state comes from the producer). None when the pools cannot hold it now.
    Raises ValueError (nothing kept allocated) when the source does not name exactly the blocks needed."""
    cache = core.cache
    alloc = cache.allocate_for_transfer(req, src.num_tokens)
    if alloc is None:
        return None
    attn, rec = cache.attention, cache.recurrent
    src_blocks: dict[int, tuple[int, ...]] = {}
    dst_blocks: dict[int, tuple[int, ...]] = {}
    src_states: dict[int, tuple[int, ...]] = {}
    dst_states: dict[int, tuple[int, ...]] = {}
    ckpt = None
    if attn is not None:
        gid = attn.group.group_id
        wanted = tuple(int(b) for b in src.blocks.get(gid, ()))[alloc.first_block_index:]
        if len(wanted) != len(alloc.block_ids):
            cache.free(req)
            raise ValueError(f"transfer source names {len(wanted)} blocks, expected {len(alloc.block_ids)}")
        src_blocks[gid], dst_blocks[gid] = wanted, tuple(alloc.block_ids)
    if rec is not None:
        gid = rec.group.group_id
        if src.state_slot is None:
            cache.free(req)
            raise ValueError("transfer source names no recurrent state slot")
        s_ids, d_ids = [int(src.state_slot)], [alloc.state_slot]
        if src.checkpoint is not None and src.checkpoint[0] > alloc.local_hit_tokens:
            ckpt = cache.reserve_checkpoint(req, src.checkpoint[0])
            if ckpt is not None:
                s_ids.append(int(src.checkpoint[1]))
                d_ids.append(ckpt[0])
        src_states[gid], dst_states[gid] = tuple(s_ids), tuple(d_ids)
    return Import(req.request_id, src.num_tokens, alloc.local_hit_tokens, src_blocks, dst_blocks, src_states,
                  dst_states, ckpt)


def complete_import(core: EngineCore, req: Request, imp: Import) -> None:
    """The pulled pages are in place and confirmed: zero the untrusted tail of the last block, publish the blocks
    and the checkpoint in our prefix cache, and schedule the request to continue at token `imp.num_tokens`."""
    cache, n = core.cache, imp.num_tokens
    tail = n % cache.block_size
    for ids in imp.dst_blocks.values():
        if tail and ids:
            core.runner.zero_block_tail(ids[-1], tail)
    req.num_computed_tokens = n
    req.num_cached_tokens = n
    req.external_computed_tokens = n - imp.local_hit_tokens
    cache.publish_transferred(req, n)
    if imp.checkpoint is not None:
        cache.publish_checkpoint(*imp.checkpoint)
    cache.count_external(req, req.external_computed_tokens)
    core.scheduler.add_transferred(req)


def abort_import(core: EngineCore, req: Request, imp: Import | None, reusable: bool) -> bool:
    """Give the import's pages back unpublished. `reusable` False: a READ may still write them, so they are kept
    out of use (quarantined) instead. Returns whether they were freed."""
    if not reusable:
        return False
    core.cache.free(req)
    if imp is not None and imp.checkpoint is not None:
        core.cache.drop_checkpoint(imp.checkpoint[0])
    return True


def schedule_local(core: EngineCore, req: Request) -> None:
    """Compute the whole prompt here (colocated, or a refused/failed transfer)."""
    req.num_computed_tokens = 0
    core.scheduler.add_request(req)


def end_unscheduled(core: EngineCore, req: Request, finish_reason: str, stop_reason: str | None = None) -> None:
    """End a request that is not scheduled (refused or aborted while importing; its caches were already given back
    or quarantined): "error" or "abort"."""
    req.stop_reason = stop_reason
    core.finish(req, finish_reason, free_caches=False)
