"""Tensor-free cache control plane: specs, block pools, hashing, per-group managers, coordinator, planner.

Nothing in this package imports torch (a test enforces it)."""
