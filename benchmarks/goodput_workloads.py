"""Workloads and arrival processes of benchmarks/goodput.py (synthesised; token-id prompts, so lengths are exact).

Workloads (lengths in tokens, before --len-scale):
  long    input ~ U[2048, 8192], output ~ U[128, 256]: long-document work (summarisation, RAG), prefill-heavy.
  chat    input ~ lognormal(median 700, sigma 1.0) clipped to [32, 6000] (mean ~1,150), output ~ lognormal(median
          200, sigma 0.8) clipped to [16, 1024] (mean ~270): a heavy-tailed spread like that of public chat logs,
          most requests short, a few long. Synthesised from these parameters, not sampled from a dataset.
  prefix  agentic / multi-turn: every request starts with one shared 1,024-token system prompt; sessions add a
          512-token session header, then per turn the previous turns (user U[64, 256] + a 128-token stand-in for
          the assistant's reply) and a new user message; up to 6 turns, then the session is replaced. Each arrival
          takes the next turn of a random open session (8 open at a time), so later turns share long prefixes with
          earlier requests (open loop: a turn may arrive before the previous one finished). Output U[64, 192].
Arrivals at a mean rate R (req/s): poisson (exponential gaps) or bursty (gamma gaps of shape 1/cv^2, cv = 2: the
same mean rate, bunched; vLLM's `--burstiness 0.25`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    max_tokens: int


Workload = Callable[[random.Random, int], list[Req]]
"""(rng, number of requests) -> requests in arrival order."""


@dataclass(frozen=True)
class Shape:
    """Token lengths of a run: `scale` multiplies every length (CPU smoke runs use ~0.01), `vocab` bounds the ids."""

    vocab: int
    scale: float = 1.0

    def n(self, tokens: float, least: int = 1) -> int:
        return max(least, int(round(tokens * self.scale)))

    def ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.vocab) for _ in range(n)]


def long_prompts(shape: Shape) -> Workload:
    def make(rng: random.Random, count: int) -> list[Req]:
        return [
            Req(shape.ids(rng, shape.n(rng.randint(2048, 8192), 2)), shape.n(rng.randint(128, 256), 2))
            for _ in range(count)
        ]

    return make


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def chat(shape: Shape) -> Workload:
    def make(rng: random.Random, count: int) -> list[Req]:
        return [
            Req(
                shape.ids(rng, shape.n(_lognormal(rng, 700, 1.0, 32, 6000), 2)),
                shape.n(_lognormal(rng, 200, 0.8, 16, 1024), 2),
            )
            for _ in range(count)
        ]

    return make


def prefix_sessions(shape: Shape, open_sessions: int = 8, max_turns: int = 6) -> Workload:
    def make(rng: random.Random, count: int) -> list[Req]:
        system = shape.ids(rng, shape.n(1024))
        sessions: list[list[int]] = []
        turns: list[int] = []
        out = []
        for _ in range(count):
            if len(sessions) < open_sessions:
                sessions.append(system + shape.ids(rng, shape.n(512)))
                turns.append(0)
            i = rng.randrange(len(sessions))
            context = sessions[i] + shape.ids(rng, shape.n(rng.randint(64, 256)))
            out.append(Req(context, shape.n(rng.randint(64, 192), 2)))
            turns[i] += 1
            if turns[i] >= max_turns:  # replaced by a fresh session at the next arrival
                del sessions[i], turns[i]
            else:
                sessions[i] = context + shape.ids(rng, shape.n(128))  # the reply's stand-in joins the history
        return out

    return make


WORKLOADS: dict[str, Callable[[Shape], Workload]] = {"long": long_prompts, "chat": chat, "prefix": prefix_sessions}
LONGEST = {"long": 8192 + 256, "chat": 6000 + 1024, "prefix": 1024 + 512 + 6 * (256 + 128) + 192}
"""Longest prompt + output of each workload at scale 1 (the workers' max_model_len)."""


def arrival_times(
    rng: random.Random, rate: float, duration_s: float, process: str = "poisson", cv: float = 2.0
) -> list[float]:
    """Arrival offsets (seconds from the start) of an open-loop process at mean `rate` over `duration_s`."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if process == "poisson":

        def gap() -> float:
            return rng.expovariate(rate)
    elif process == "bursty":
        k = 1.0 / (cv * cv)

        def gap() -> float:
            return rng.gammavariate(k, 1.0 / (k * rate))
    else:
        raise ValueError(f"arrival process must be poisson or bursty, got {process!r}")
    times, t = [], gap()
    while t < duration_s:
        times.append(t)
        t += gap()
    return times or [0.0]
