"""The router's view of one worker's prefix cache, fed by that worker's cache events.

A worker streams what its cache made findable and what it dropped (engine/cache/events.py): per attention group
the chained hashes of full blocks, per recurrent group the hashes of the blocks its checkpoints end on. This index
replays them into one hash set per group and answers, for a prompt's block hashes, the hits the worker itself would
compute:

- `usable_hit`: the longest prefix every group serves -- attention blocks from the start, up to the deepest
  checkpoint boundary (a multiple of `align`) that every recurrent group holds -- capped at N-1 tokens. Exactly
  `HybridCacheManager.find_prefix_hit` when the index is in sync: what a worker that computes the prompt itself
  (colocated, skip-prefill) does not recompute.
- `transfer_hit`: attention blocks only (`find_transfer_hit`): what a decode worker that pulls the prompt from a
  prefill worker does not pull (the pulled running states replace its own).

Expectations: when the router sends a prompt to a worker it `expect`s the entries that worker will publish for
it (its full blocks; the checkpoint it will keep), for `ttl_s`, so that the next request with the same prefix finds
them before the worker's events arrive, or when they are lost. A real event for a hash replaces the expectation.

Staleness: an index is *synced* after a snapshot; a gap in sequence numbers, a log overflow or a new worker epoch
makes it unsynced until the next snapshot. Lost or reordered events only make a guess worse: the worker always
decides its real hit. Tensor-free; owned by the proxy's event loop (no lock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hybridpd.engine.cache.hashing import append_block_hashes, extra_keys


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as every worker computes them (engine/cache/hashing.py)."""
    out: list[bytes] = []
    full = len(token_ids) // block_size * block_size
    if full:
        append_block_hashes(out, list(token_ids[:full]), block_size, extra_keys(cache_salt or None))
    return out


@dataclass(frozen=True)
class CacheShape:
    """What a worker's index needs to know about its cache: the same on every worker of one model."""

    block_size: int
    attention_groups: tuple[int, ...]
    recurrent_groups: tuple[int, ...]
    align: int
    """Checkpoint boundary granularity in tokens (block_size, or the fixed checkpoint interval)."""


@dataclass
class WorkerCacheIndex:
    """One worker's cached hashes per group, replayed from its events."""

    shape: CacheShape
    epoch: str = ""
    groups: dict[int, set[bytes]] = field(default_factory=dict)
    seq: int = 0
    """Sequence number of the last event applied (the worker's `CacheEventLog.seq` after it)."""
    synced: bool = False
    """False until a snapshot arrived, and again after a gap, an overflow or an epoch change."""
    updated_at: float = 0.0
    """time.monotonic() of the last snapshot or event batch."""
    events_applied: int = 0
    expected: dict[int, dict[bytes, float]] = field(default_factory=dict)
    """group -> hash -> time.monotonic() until which the router expects the worker to hold it (see `expect`)."""

    def __post_init__(self) -> None:
        for g in (*self.shape.attention_groups, *self.shape.recurrent_groups):
            self.groups.setdefault(g, set())

    # -- feeding ---------------------------------------------------------------------------------------------------
    def load_snapshot(self, epoch: str, seq: int, groups: Mapping[int, Iterable[bytes]]) -> None:
        """Replace everything with a snapshot taken at sequence number `seq`."""
        self.epoch = epoch
        self.groups = {g: set() for g in (*self.shape.attention_groups, *self.shape.recurrent_groups)}
        for g, hashes in groups.items():
            self.groups.setdefault(g, set()).update(hashes)
        self.seq = seq
        self.expected = {}
        self.synced = True
        self.updated_at = time.monotonic()

    def apply(self, first_seq: int, events: Iterable[tuple[bool, int, bytes]], count: int | None = None) -> bool:
        """Apply a batch of (stored, group, hash) events whose first has sequence number `first_seq` + 1 (`count`:
        how many the batch held, when some were left out). Returns False (and marks the index unsynced: the
        caller asks for a snapshot) when events before the batch were missed."""
        if first_seq != self.seq:
            self.synced = False
        n = 0
        for stored, group, h in events:
            hashes = self.groups.setdefault(group, set())
            guess = self.expected.get(group)
            if guess:
                guess.pop(h, None)
            if stored:
                hashes.add(h)
            else:
                hashes.discard(h)
            n += 1
        self.seq = first_seq + (n if count is None else count)
        self.events_applied += n
        self.updated_at = time.monotonic()
        return self.synced

    def expect(self, group_hashes: Mapping[int, Iterable[bytes]], ttl_s: float) -> None:
        """The worker will soon hold these (it was just sent a prompt that makes them): count them as held for
        `ttl_s` seconds unless an event says otherwise first."""
        until = time.monotonic() + ttl_s
        for group, hashes in group_hashes.items():
            held, guess = self.groups.get(group, set()), self.expected.setdefault(group, {})
            for h in hashes:
                if h not in held:
                    guess[h] = until
        if sum(len(g) for g in self.expected.values()) > 1 << 16:
            self._forget_expired()

    def _forget_expired(self) -> None:
        now = time.monotonic()
        for group, guess in self.expected.items():
            self.expected[group] = {h: t for h, t in guess.items() if t > now}

    def _held(self, group: int) -> Callable[[bytes], bool]:
        """`h in` the group's entries, expectations that have not expired included."""
        held, guess = self.groups[group], self.expected.get(group)
        if not guess:
            return held.__contains__
        now = time.monotonic()
        return lambda h: h in held or guess.get(h, 0.0) > now

    def mark_stale(self) -> None:
        self.synced = False

    def staleness_s(self, now: float | None = None) -> float:
        """Seconds since the index last heard from its worker (inf before the first snapshot)."""
        if not self.updated_at:
            return float("inf")
        return (time.monotonic() if now is None else now) - self.updated_at

    # -- queries ---------------------------------------------------------------------------------------------------
    def _attention_run(self, hashes: Sequence[bytes], max_tokens: int) -> int:
        bs = self.shape.block_size
        n = 0
        for group in self.shape.attention_groups:
            held = self._held(group)
            run = 0
            for h in hashes[: max_tokens // bs]:
                if not held(h):
                    break
                run += 1
            max_tokens = run * bs
            n = max_tokens
        return n

    def _checkpoint(self, group: int, hashes: Sequence[bytes], max_tokens: int) -> int:
        bs, align = self.shape.block_size, self.shape.align
        held = self._held(group)
        b = min(max_tokens, len(hashes) * bs) // align * align
        while b > 0:
            if held(hashes[b // bs - 1]):
                return b
            b -= align
        return 0

    def usable_hit(self, hashes: Sequence[bytes], num_prompt_tokens: int) -> int:
        """Tokens of the prompt a worker computing it itself would take from its cache (find_prefix_hit)."""
        n = max(0, num_prompt_tokens - 1)
        if self.shape.attention_groups:
            n = min(n, len(hashes) * self.shape.block_size) // self.shape.block_size * self.shape.block_size
        while True:  # every pass can only shrink n; stop once every group serves it
            agreed = n
            if self.shape.attention_groups:
                n = self._attention_run(hashes, n)
            for g in self.shape.recurrent_groups:
                n = self._checkpoint(g, hashes, n)
            if n == agreed:
                return n

    def transfer_hit(self, hashes: Sequence[bytes], max_tokens: int) -> int:
        """Tokens a decode worker already holds of a prompt it pulls (attention blocks only, find_transfer_hit)."""
        if not self.shape.attention_groups:
            return 0
        bs = self.shape.block_size
        return self._attention_run(hashes, min(max_tokens, len(hashes) * bs) // bs * bs)

    def sizes(self) -> dict[int, int]:
        return {g: len(h) for g, h in self.groups.items()}
