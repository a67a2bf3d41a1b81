"""Checkpoint admission: where a request saves recurrent states (block boundaries, named by the attention chain).

Marconi's admission (MLSys 2025), the engine's one policy:
    branch point   the longest prefix of the new prompt that any earlier request already contained (seen block
                   hashes, kept here without any device memory): the next request sharing it hits there;
    prompt end     the last block boundaries of what this request computes of its prompt (re-asks, chat turns);
    request end    while decoding, a rolling checkpoint at each block boundary; the previous one is dropped, so
                   a finished request leaves the state at its last boundary (multi-turn: prompt + answer);
    interval       every `interval` tokens, only if interval > 0 (a coarse fallback, off by default).

    prompt  |---- shared with an earlier request ----|--- new ---|          decode
            0                                        ^ branch    ^ prompt end   ^ ^ ^ rolling end

The vLLM-style baseline (a checkpoint every n tokens) is `IntervalAdmission` in benchmarks/cache_policies.py.
Ownership: the coordinator calls `admit` once per request, `due` for each chunk it schedules and `note` for every
hash computed; this class keeps only hashes (a bounded, insertion-ordered set). Tensor-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CachePolicy:
    """How the prefix cache admits checkpoints (here) and weighs value in eviction (tree.py)."""

    interval: int = 0
    """Fallback checkpoint interval in tokens (a multiple of block_size); 0 = off."""
    alpha: float = 1.0
    """Weight of compute-saved-per-byte against recency in eviction."""
    seen_capacity: int = 1 << 18
    """Block hashes remembered for branch-point detection (about 100 bytes each on the host)."""

    def validate(self, block_size: int) -> None:
        if self.interval < 0 or self.interval % block_size:
            raise ValueError(f"checkpoint_interval {self.interval} is not a multiple of block_size {block_size}")


class Admission:
    name = "reuse"

    def __init__(self, policy: CachePolicy, block_size: int) -> None:
        policy.validate(block_size)
        self.policy = policy
        self.block_size = block_size
        self.seen: dict[bytes, None] = {}
        """Block hashes of every prefix computed (or admitted) so far, in insertion order (`note`)."""
        self.every_chunk = policy.interval > 0
        """Checkpoints may fall mid-block (interval boundaries): the coordinator plans every chunk."""
        self.last_branch: int | None = None
        """The branch point `targets` found last (None: this admission knows no branch points)."""

    @property
    def align(self) -> int:
        """Granularity of checkpoint boundaries (and so of recurrent hits)."""
        return self.block_size

    def targets(self, hashes: list[bytes], hit_tokens: int, prompt_end: int) -> list[int]:
        """Boundaries (tokens) in (hit_tokens, prompt_end] where a newly admitted request saves its state, sorted.
        `prompt_end`: how far this request computes its prompt (N, or a compute target set below it)."""
        bs, interval = self.block_size, self.policy.interval
        limit = min(prompt_end // bs, len(hashes))
        out, seen, n = set(), self.seen, 0
        while n < limit and hashes[n] in seen:  # the longest prefix seen before: where this prompt branches off
            n += 1
        self.last_branch = branch = n * bs
        if branch > hit_tokens:
            out.add(branch)
        if limit * bs > hit_tokens:
            out.add(limit * bs)
        if interval:
            out.update(range((hit_tokens // interval + 1) * interval, limit * bs + 1, interval))
        return sorted(out)

    def admit(self, hashes: list[bytes], hit_tokens: int, prompt_end: int) -> tuple[list[int], list[int]] | None:
        """A new request's (targets, own boundaries): `targets` plus the last block boundary before the prompt's
        end (an identical prompt hits there: the N-1 cap), and the boundaries on its own path (its hit, its prompt
        ends) that its first request-end checkpoint supersedes. None: nothing to keep per request."""
        targets = self.targets(hashes, hit_tokens, prompt_end)
        bs = self.block_size
        last = (prompt_end - 1) // bs * bs
        if hit_tokens < last and last not in targets:
            targets = sorted([*targets, last])
        own = [b for b in (hit_tokens, last, prompt_end // bs * bs) if 0 < b <= len(hashes) * bs]
        return targets, own

    def due(self, targets: list[int] | None, start: int, end: int, prompt_tokens: int) -> tuple[list[int], int | None]:
        """Boundaries to save in the chunk (start, end] (taken off the front of `targets`), and the rolling
        request-end one (None when there is none)."""
        bs, due = self.block_size, []
        while targets and targets[0] <= end:
            b = targets.pop(0)
            if b > start:
                due.append(b)
        if self.policy.interval:
            due = sorted(set(due) | {b for b in range((start // bs + 1) * bs, end + 1, bs) if b > prompt_tokens})
        rolling = end if end > prompt_tokens and end % bs == 0 and end not in due else None
        return due, rolling

    def note(self, hashes: list[bytes]) -> None:
        """Remember hashes computed; past `seen_capacity` the oldest are forgotten first."""
        seen = self.seen
        seen.update(dict.fromkeys(hashes))  # a hash seen before keeps its place (update never moves a key)
        while len(seen) > self.policy.seen_capacity:
            del seen[next(iter(seen))]

