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

from hybridpd.engine.cache.specs import CacheGroup, CacheSpec, group_layers
from hybridpd.engine.scheduler import SchedulerOutput


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
    with mock.patch("hybridpd.engine.core.group_layers", split_group_layers):
        yield


def permute_rider_pages(llm: Any) -> None:
    """Make every group but the first of each kind keep its pages at other indices: the engine's runner gets each
    step's ids of those groups mapped by a fixed permutation (block tables, slots, checkpoints, restores, fresh
    blocks; the null page 0 and PAD_SLOT_ID stay). The groups' pools may hand out the same ids for a request; their
    pages then still live at different indices, so a runner that reads one group's ids for another group's layers
    reads the wrong pages. Nothing else (transfers, the prefix cache) sees the mapping.

    The permutation reverses runs of ids that may trade places: without an arena, all of 1 .. n-1. In one arena
    (engine/cache/arena.py) checkpoint slot F + c shares memory with attention blocks [c*k, (c+1)*k) and the cache
    manager keeps them apart by id, so blocks are reversed within each range of k (a block stays in its range) and
    only the running slots 1 .. S are reversed (reserved memory); checkpoint slots stay where they are."""
    runner, arena = llm.engine.runner, llm.engine.plan.arena
    perms: dict[int, list[int]] = {}
    for kind in (True, False):
        for g in [g for g in llm.engine.groups if g.is_attention == kind][1:]:
            n = runner.group_tensors[g.group_id][0].shape[0]
            if arena is None:
                runs = [(1, n)]
            elif kind:
                k = arena.blocks_per_slot
                bounds = sorted({1, n, *range(k, n, k)})
                runs = list(zip(bounds, bounds[1:], strict=False))
            else:
                runs = [(1, 1 + arena.running_slots)]
            perm = list(range(n))
            for a, b in runs:
                perm[a:b] = range(b - 1, a - 1, -1)
            perms[g.group_id] = perm

    def page(gid: int, i: int) -> int:
        perm = perms.get(gid)
        return perm[i] if perm is not None and i > 0 else i

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
    from hybridpd.engine import LLM

    with split_cache_groups():
        llm = LLM(**kwargs)
    permute_rider_pages(llm)
    return llm


__all__ = ["permute_rider_pages", "split_cache_groups", "split_group_layers", "split_llm"]
