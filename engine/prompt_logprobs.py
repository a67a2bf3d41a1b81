"""Prompt logprobs (vLLM's `prompt_logprobs=k`): for every prompt token after the first, its logprob under the
model given the tokens before it, its rank in that distribution, and the k most likely tokens there.

    prompt      t0    t1    t2   ...  t(N-1)
    logits at   p0    p1    p2   ...  p(N-2)   p(N-1) -> samples the first output token
    entry       None  e1    e2   ...  e(N-1)           e(i) = (t(i), log_softmax(p(i-1))[t(i)], rank, top-k of p(i-1))

Host data only (the control plane reads it; engine/prompt_scoring.py computes it on the device). The runner scores
the rows of each prefill chunk as it computes them (top-k per chunk: never a vocabulary x prompt tensor), so a
chunked prefill collects them across chunks; `PromptLogprobs.extend` keeps each position once (a recomputed chunk
after a preemption adds nothing). Prefix-cache hits have no logits: a request that asks skips reading the prefix
cache for what it has not scored yet (as vLLM does), so every entry is computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple


class Logprob(NamedTuple):
    """vLLM's `Logprob`: one token's logprob at a position, its rank (1 = most likely; ties share the worse rank),
    and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(frozen=True)
class ScoredRows:
    """Scores of consecutive prompt positions (one chunk): row j is position `start + j`, scoring token
    `token_ids[j]` (the prompt token at start + j + 1)."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class PromptLogprobs:
    """A request's prompt logprobs so far: entry i scores prompt token i + 1 (rows 0 .. N-2)."""

    k: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, rows: ScoredRows) -> None:
        """Append the rows past those already held (rows must not leave a gap)."""
        skip = len(self) - rows.start
        if skip < 0:
            raise ValueError(f"prompt logprobs of position {rows.start} arrive before position {len(self)}")
        self.token_ids += rows.token_ids[skip:]
        self.logprobs += rows.logprobs[skip:]
        self.ranks += rows.ranks[skip:]
        self.top_ids += rows.top_ids[skip:]
        self.top_logprobs += rows.top_logprobs[skip:]

    def as_dicts(self, decode: Callable[[int], str | None] | None = None) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: None for the first prompt token, then per position {token id: Logprob} with the prompt
        token first (its own rank) and the top k (ranks 1..k; the prompt token keeps its place if among them)."""
        out: list[dict[int, Logprob] | None] = [None]
        text = decode or (lambda _t: None)
        for tid, lp, rank, ids, lps in zip(
            self.token_ids, self.logprobs, self.ranks, self.top_ids, self.top_logprobs, strict=True
        ):
            entry = {tid: Logprob(lp, rank, text(tid))}
            for r, (t, v) in enumerate(zip(ids, lps, strict=True), start=1):
                entry[t] = Logprob(v, r, text(t))
            out.append(entry)
        return out


def clamp(value: float) -> float:
    """-inf as vLLM's server writes it (-9999.0): JSON has no infinity."""
    return -9999.0 if value == -math.inf else value


def check_k(k: object, max_k: int, name: str = "prompt_logprobs") -> str | None:
    """Why `k` is not a valid prompt_logprobs (vLLM's rules with max_logprobs `max_k`), or None."""
    if isinstance(k, bool) or not isinstance(k, int):
        return f"{name} must be an integer, got {k!r}"
    if k < -1:
        return f"{name} must be a positive value or -1, got {k}"
    if k == -1 or k > max_k:
        wanted = "the whole vocabulary" if k == -1 else str(k)
        return f"requested {name} of {wanted}, which is greater than max allowed: {max_k}"
    return None
