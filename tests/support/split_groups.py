"""Several cache groups of one kind from a tiny model with one group of each (tests only).

A real model gets several attention groups from layers with different KV shapes (or sliding windows) and several
recurrent groups from different state shapes; the tiny test models have equal shapes per kind. vLLM's hybrid
allocator also splits the layers of one spec into several groups (equal-sized runs of layers); `split_group_layers`
does the same with two runs per spec, so every layer of a kind still has the same shape, each run gets its own
tensor view of the arena (engine/cache/arena.py: page j holds block j of every attention group, back to back; a
slot one state of every recurrent group), and the engine's outputs must not change.

    layers      0:F  1:L  2:L  3:L  4:F              (F attention, L linear attention)
    one group   attention (0, 4)   recurrent (1, 2, 3)
    split       attention (0,) (4,)   recurrent (1, 2) (3,)

Every group of a kind shares one block table (one slot) per request: `split_llm` builds an `LLM` with split groups
and checks, on every step the runner launches, that every group of a kind got the same ids (`check_same_ids`). A
runner reading one group's view for another group's layers reads another part of the page: the wrong numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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


def same_ids(out: SchedulerOutput) -> None:
    """Every attention group got the same block table and fresh pages, every recurrent group the same slot and
    checkpoints, in `out`."""
    for s in out.seqs:
        assert len({ids for _, ids in s.group_block_ids}) <= 1, s.group_block_ids
        assert len({slot for _, slot in s.group_state_slots}) <= 1, s.group_state_slots
        assert len({c for _, c in s.group_checkpoints}) <= 1, s.group_checkpoints
    assert len({ids for _, ids in out.group_fresh_blocks}) <= 1, out.group_fresh_blocks


def check_same_ids(llm: Any) -> list[int]:
    """Check `same_ids` on every step the engine's runner launches; returns a list that counts them (its one item)."""
    runner, seen = llm.engine.runner, [0]
    launch = runner.launch

    def checked(out: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
        same_ids(out)
        seen[0] += 1
        return launch(out, *args, **kwargs)

    runner.launch = checked
    return seen


def split_llm(**kwargs: Any) -> Any:
    """`LLM(**kwargs)` with each kind's layers split into two cache groups, every step checked by `check_same_ids`
    (the count in `llm.split_steps_checked`)."""
    from hybridpd.engine import LLM

    with split_cache_groups():
        llm = LLM(**kwargs)
    llm.split_steps_checked = check_same_ids(llm)
    return llm


__all__ = ["check_same_ids", "same_ids", "split_cache_groups", "split_group_layers", "split_llm"]
