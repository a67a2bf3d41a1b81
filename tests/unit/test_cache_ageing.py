"""A workload shift: multi-turn chats after a shared-prefix phase, in the same cache.

The chats' restored states are superseded by each turn's own request-end checkpoint (demoted, tree.py `demote`); the
few-shot phase's checkpoints stop being restored. Neither may keep outranking the chats' new checkpoints (GreedyDual:
an item's priority is the clock when it was released plus its value, so old popularity ages out): the chats reach
their first-reuse bound, as they do alone.
"""

from __future__ import annotations

import argparse
import random

from benchmarks import cache_manager as cm


def test_chats_after_a_shared_prefix_phase_hit_their_bound() -> None:
    w = cm.chat_after_shared(random.Random(0), 0.1)
    w.budget_gib = 3.0  # eviction throughout at this scale
    args = argparse.Namespace(max_num_seqs=16, max_num_batched_tokens=4096)
    r = cm.run(w, "ours", args)
    phase = r["phase"]
    assert isinstance(phase, dict)
    assert phase["first_reuse_bound"] > 0.5  # the chats can reuse most of their prompts
    assert phase["ratio_to_bound"] >= 0.99, phase
    assert r["evictions"]["group1:mamba2"] > 0  # type: ignore[index]  # checkpoints were contended


def test_ageing_does_not_run_away_on_a_small_arena() -> None:
    """The clock rises only to the priority of what is evicted (tree.py `_evict_victim`), so ageing cannot run away
    on a small arena: the hot prefixes keep their blocks and checkpoints (an ageing that ran away priced them at
    nothing: 0.45 of the theoretical here with the old arena)."""
    w = cm.current(random.Random(0), 0.3)
    w.budget_gib = 4.0
    args = argparse.Namespace(max_num_seqs=32, max_num_batched_tokens=4096)
    r = cm.run(w, "ours", args)
    assert r["ratio"] >= 0.8, r["ratio"]  # type: ignore[operator]
