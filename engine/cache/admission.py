"""Checkpoint admission: where a request saves recurrent states (block boundaries, named by the attention chain).

"reuse" (default; Marconi's admission, MLSys 2025):
    branch point   the longest prefix of the new prompt that any earlier request already contained (seen block
                   hashes, kept here without any device memory): the next request sharing it hits there;
    prompt end     the last block boundary of what this request computes of its prompt (re-asks, chat turns);
    request end    while decoding, a rolling checkpoint at each block boundary; the previous one is dropped, so
                   a finished request leaves the state at its last boundary (multi-turn: prompt + answer);
    interval       every `interval` tokens, only if interval > 0 (a coarse fallback, off by default).

    prompt  |---- shared with an earlier request ----|--- new ---|          decode
            0                                        ^ branch    ^ prompt end   ^ ^ ^ rolling end
"interval" (the old behaviour and the vLLM-style baseline): every multiple of `interval`, prefill and decode.

Ownership: the coordinator calls `targets` once when a request is admitted and `note` for every hash the engine
computes; this class keeps only hashes (a bounded, insertion-ordered set). Tensor-free.
"""

from __future__ import annotations

from dataclasses import dataclass

ADMISSIONS = ("reuse", "interval")


@dataclass(frozen=True)
class CachePolicy:
    """How the prefix cache admits checkpoints (here) and weighs value in eviction (tree.py)."""

    admission: str = "reuse"
    interval: int = 0
    """Fallback checkpoint interval in tokens (a multiple of block_size); 0 = off. Required for "interval"."""
    alpha: float = 1.0
    """Weight of compute-saved-per-byte against recency in eviction."""
    seen_capacity: int = 1 << 18
    """Block hashes remembered for branch-point detection (about 100 bytes each on the host)."""

    def validate(self, block_size: int) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"checkpoint admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.interval < 0 or self.interval % block_size:
            raise ValueError(f"checkpoint_interval {self.interval} is not a multiple of block_size {block_size}")
        if self.admission == "interval" and self.interval <= 0:
            raise ValueError("interval admission needs checkpoint_interval > 0")


class SeenHashes:
    """Block hashes of every prefix computed (or admitted) so far, oldest forgotten first past `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._seen: dict[bytes, None] = {}

    def __contains__(self, h: bytes) -> bool:
        return h in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, hashes: list[bytes]) -> None:
        seen = self._seen
        seen.update(dict.fromkeys(hashes))  # a hash seen before keeps its place (update never moves a key)
        while len(seen) > self.capacity:
            del seen[next(iter(seen))]

    def common_prefix(self, hashes: list[bytes], limit: int) -> int:
        """How many of hashes[:limit] lead the list and were all seen."""
        seen = self._seen
        n = 0
        while n < limit and hashes[n] in seen:
            n += 1
        return n


class Admission:
    def __init__(self, policy: CachePolicy, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.seen = SeenHashes(policy.seen_capacity)

    @property
    def align(self) -> int:
        """Granularity of checkpoint boundaries (and so of recurrent hits)."""
        return self.policy.interval if self.policy.admission == "interval" else self.block_size

    def targets(self, hashes: list[bytes], hit_tokens: int, prompt_end: int) -> list[int]:
        """Boundaries (tokens) in (hit_tokens, prompt_end] where a newly admitted request saves its state, sorted.
        `prompt_end`: how far this request computes its prompt (N, or N - 1 on a prefill worker)."""
        bs, interval = self.block_size, self.policy.interval
        if self.policy.admission == "interval":
            return list(range((hit_tokens // interval + 1) * interval, prompt_end + 1, interval))
        limit = min(prompt_end // bs, len(hashes))
        out = set()
        branch = self.seen.common_prefix(hashes, limit) * bs
        if branch > hit_tokens:
            out.add(branch)
        if limit * bs > hit_tokens:
            out.add(limit * bs)
        if interval:
            out.update(range((hit_tokens // interval + 1) * interval, limit * bs + 1, interval))
        return sorted(out)

    def decode_boundary(self, end: int, prompt_tokens: int) -> bool:
        """True when a decode chunk ending at `end` tokens should leave a rolling request-end checkpoint."""
        if self.policy.admission == "interval":
            return False  # "interval" plans decode boundaries like prefill ones
        return end > prompt_tokens and end % self.block_size == 0

    def note(self, hashes: list[bytes]) -> None:
        if self.policy.admission == "reuse":
            self.seen.add(hashes)
