"""Several cache groups of one kind from a tiny model with one group of each (tests only).

A real model gets several attention groups from layers with different KV shapes (or sliding windows) and several
recurrent groups from different state shapes; the tiny test models have equal shapes per kind. vLLM's hybrid
allocator also splits the layers of one spec into several groups (equal-sized runs of layers); `split_group_layers`
does the same with two runs per spec, so every layer of a kind still has the same shape, each run gets its own
pool, tensor and ids, and the engine's outputs must not change.

    layers      0:F  1:L  2:L  3:L  4:F              (F attention, L linear attention)
    one group   attention (0, 4)   recurrent (1, 2, 3)
    split       attention (0,) (4,)   recurrent (1, 2) (3,)

`split_llm` builds an `LLM` with split groups whose pages live at different indices (`permute_rider_pages`), so
a runner reading one group's ids for another's layers reads the wrong pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any
from unittest import mock

from engine.cache.specs import CacheGroup, CacheSpec, group_layers
from engine.scheduler import SchedulerOutput


def split_group_layers(specs: dict[int, CacheSpec]) -> list[CacheGroup]:
    """`group_layers`, then every group of two or more layers split into two runs (first half, rest); attention
    groups first, ids renumbered in order."""
    parts: list[tuple[CacheSpec, tuple[int, ...]]] = []
    for g in group_layers(specs):
        half = (len(g.layer_ids) + 1) // 2
        parts += [(g.spec, run) for run in (g.layer_ids[:half], g.layer_ids[half:]) if run]
    return [CacheGroup(i, spec, layers) for i, (spec, layers) in enumerate(parts)]


@contextmanager
def split_cache_groups() -> Iterator[None]:
    """EngineCores built inside get split groups (EngineCore reads its groups from `group_layers`)."""
    with mock.patch("engine.core.group_layers", split_group_layers):
        yield


def permute_rider_pages(llm: Any) -> None:
    """Make every group but the first of each kind keep page i at physical index n - i (n: the group's pages; the
    null page 0 and PAD_SLOT_ID stay): the engine's runner gets each step's ids of those groups mapped so (block
    tables, slots, checkpoints, restores, fresh blocks). The groups' pools may hand out the same ids for a request;
    their pages still live at different indices, so a runner that reads one group's ids for another group's layers
    reads the wrong pages. Nothing else (transfers, the prefix cache) sees the mapping.

    Only where every group's tensors have their own memory: in one arena, pages of different groups (and
    checkpoint slots and attention blocks) may share memory by id, and a mapping would break what the cache
    manager keeps apart. There nothing is mapped (the groups then differ only where their pools' ids do)."""
    runner = llm.engine.runner
    storages = [t.untyped_storage().data_ptr() for ts in runner.group_tensors.values() for t in ts]
    if len(set(storages)) < len(storages):
        return
    size = {g.group_id: runner.group_tensors[g.group_id][0].shape[0] for g in llm.engine.groups}
    kinds = ([g for g in llm.engine.groups if g.is_attention], [g for g in llm.engine.groups if not g.is_attention])
    riders = {g.group_id for groups in kinds for g in groups[1:]}

    def page(gid: int, i: int) -> int:
        return size[gid] - i if gid in riders and i > 0 else i

    def pages(gid: int, ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(page(gid, i) for i in ids)

    def remap(out: SchedulerOutput) -> SchedulerOutput:
        seqs = tuple(replace(
            s, group_block_ids=tuple((g, pages(g, ids)) for g, ids in s.group_block_ids),
            group_state_slots=tuple((g, page(g, slot)) for g, slot in s.group_state_slots),
            group_checkpoints=tuple((g, tuple((n, page(g, d)) for n, d in c)) for g, c in s.group_checkpoints),
        ) for s in out.seqs)
        return replace(
            out, seqs=seqs,
            group_state_copies=tuple((g, tuple((page(g, a), page(g, b)) for a, b in c))
                                     for g, c in out.group_state_copies),
            group_fresh_blocks=tuple((g, pages(g, ids)) for g, ids in out.group_fresh_blocks))

    execute = runner.execute
    runner.execute = lambda out, params: execute(remap(out), params)


def split_llm(**kwargs: Any) -> Any:
    """`LLM(**kwargs)` with each kind's layers split into two cache groups whose pages live at different indices
    (`permute_rider_pages`)."""
    from engine import LLM

    with split_cache_groups():
        llm = LLM(**kwargs)
    permute_rider_pages(llm)
    return llm


__all__ = ["permute_rider_pages", "split_cache_groups", "split_group_layers", "split_llm"]
