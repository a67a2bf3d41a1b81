"""Tensor-free cache control plane: specs, block pools, hashing, per-group managers, coordinator,
the cache tree (admission.py decides what is cached, tree.py what is evicted), planner.

Nothing in this package imports torch (a test enforces it)."""
