"""`benchmarks/cache_manager.py --digest`: the sha256 over every step's scheduler output that shows two commits
decide alike. It must be the same on every run of one policy (nothing run-dependent, such as an object id, in the
output) and differ when a decision does (here: LRU eviction instead of ours)."""

from __future__ import annotations

import argparse
import random

from benchmarks import cache_manager as cm


def test_decision_digest_is_reproducible_and_sees_a_policy_change() -> None:
    w = cm.current(random.Random(0), 0.01)
    w.budget_gib = 0.5  # eviction throughout
    args = argparse.Namespace(max_num_seqs=8, max_num_batched_tokens=2048, digest=True)
    ours, again, lru = (cm.run(w, p, args) for p in ("ours", "ours", "lru"))
    assert ours["evictions"]["group0:attention"] > 0  # type: ignore[index]
    assert ours["decision_digest"] == again["decision_digest"] != lru["decision_digest"]
