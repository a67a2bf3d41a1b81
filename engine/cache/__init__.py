"""Tensor-free cache control plane (a test enforces it): specs, the arena's layout and id pools, hashing, admission
(what is cached), the tree (what is evicted), the manager (coordinator.py) and the capacity planner."""
