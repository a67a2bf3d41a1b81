"""Cache- and cost-aware placement of one request (routing policy `cache_aware`): which prefill worker, which
decode worker, or no prefill worker at all (skip-P: the decode worker prefills the rest itself).

Costs, in prompt-token units (one token a prefill worker computes = 1):

    P  uncached tokens (prompt - its usable hit) + prefill_queue_cost x prompt tokens it has in flight
    D  pull_token_cost x (tokens to pull: N-1 - its attention hit) + decode_running_cost x requests in flight
       + decode_full_cost x the share of its attention pages neither free nor evictable (its last Stats)
    D, skip-P   decode_prefill_cost x (N-1 - its usable hit, which needs a recurrent checkpoint) + the same load

A worker whose cache index is not usable (no snapshot yet, stream down) has no hit: it is routed by load alone.

Skip-P: the request goes to D without params (D computes the remainder itself, as a colocated worker does) when no
prefill worker is routable (down or drained), when the remainder is at most `skip_max_tokens`, or when D's estimated
time to the first token is below the PD path's:

    skip_s = decode_prefill_cost x remainder x step.decode_token_s
    pd_s   = P's cost x step.prefill_token_s         (P samples the first token: the proxy streams it at once)

The PD handoff (pull, commit, resume) comes after the first token and delays only the second, one gap of a whole
stream, so it is measured (`StepCosts.handoff_s`, shown in /v1/cluster) but not weighed against D's prefill.

`StepCosts` starts from configurable defaults and follows measured times (moving averages): P's seconds per
computed token (Prefill RPC time / tokens P computed), D's seconds per token it prefilled itself (skip-P: time to
first token / remainder) and the PD handoff (Generate sent -> D's first token, the request's second). Event loop
only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hybridpd.proxy.cache_index import prompt_block_hashes
from hybridpd.proxy.config import RoutingWeights
from hybridpd.proxy.membership import Membership
from hybridpd.proxy.routing import Router

log = logging.getLogger(__name__)


class StepCosts:
    """Measured step costs (moving averages), seeded from the weights."""

    def __init__(self, w: RoutingWeights) -> None:
        self.alpha = w.ewma
        self.prefill_token_s = w.prefill_token_s
        self.decode_token_s = w.prefill_token_s
        self.handoff_s = w.handoff_s

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def prefill_done(self, seconds: float, computed_tokens: int) -> None:
        if computed_tokens > 0:
            self.prefill_token_s = self._mix(self.prefill_token_s, seconds / computed_tokens)

    def local_prefill_done(self, seconds: float, computed_tokens: int) -> None:
        if computed_tokens > 0:
            self.decode_token_s = self._mix(self.decode_token_s, seconds / computed_tokens)

    def handoff_done(self, seconds: float) -> None:
        self.handoff_s = self._mix(self.handoff_s, seconds)


@dataclass(frozen=True)
class Placement:
    prefill_addr: str | None
    """None: skip-P (or colocated)."""
    decode_addr: str
    expected_hit: int
    """Tokens D should find locally: its usable hit (skip-P) or its attention hit (PD)."""
    expected_prefill_hit: int = 0
    reason: str = ""
    hashes: tuple[bytes, ...] = ()
    """The prompt's block hashes (empty while no worker's index is usable)."""


class Placer:
    def __init__(self, membership: Membership, prefill: Router | None, decode: Router, weights: RoutingWeights) -> None:
        self.membership = membership
        self.prefill = prefill
        self.decode = decode
        self.w = weights
        self.costs = StepCosts(weights)

    def _hashes(self, prompt: tuple[int, ...], salt: str) -> list[bytes]:
        """The prompt's block hashes at the block size of the workers' caches ([] while no index is usable)."""
        for addr in (*self.decode.addrs, *(self.prefill.addrs if self.prefill else ())):
            idx = self.membership.index(addr)
            if idx is not None:
                return prompt_block_hashes(prompt, idx.shape.block_size, salt)
        return []

    def place(self, prompt: tuple[int, ...], salt: str = "", exclude_decode: tuple[str, ...] = ()) -> Placement:
        """Choose workers for a prompt (raises NoWorkerError when a role has no routable worker)."""
        n = len(prompt)
        hashes = self._hashes(prompt, salt)
        w = self.w
        d_addrs = [a for a in self.decode.addrs if a not in exclude_decode] or list(self.decode.addrs)
        if not d_addrs:
            self.decode.choose()  # raises NoWorkerError
        best_pd: tuple[float, str, int] | None = None
        best_skip: tuple[float, str, int] | None = None
        for addr in self.decode.rotation(d_addrs):
            idx = self.membership.index(addr) if hashes else None
            t_hit = idx.transfer_hit(hashes, n - 1) if idx else 0
            u_hit = idx.usable_hit(hashes, n) if idx else 0
            room = self.membership.room.get(addr, 1.0)
            load = w.decode_running_cost * self.decode.in_flight(addr) + w.decode_full_cost * (1.0 - room)
            pd = w.pull_token_cost * (n - 1 - t_hit) + load
            skip = w.decode_prefill_cost * (n - 1 - u_hit) + load
            if best_pd is None or pd < best_pd[0]:  # strict: the first of equal costs in rotation order wins
                best_pd = (pd, addr, t_hit)
            if best_skip is None or skip < best_skip[0]:
                best_skip = (skip, addr, u_hit)
        assert best_pd is not None and best_skip is not None
        if self.prefill is None:  # colocated: D computes everything itself
            return Placement(None, best_skip[1], best_skip[2], reason="colocated", hashes=tuple(hashes))
        p_addr, p_cost, p_hit = self._best_prefill(hashes, n)
        remainder = n - 1 - best_skip[2]
        if w.skip_prefill != "never" and p_addr is not None:
            skip_s = w.decode_prefill_cost * remainder * self.costs.decode_token_s
            pd_s = p_cost * self.costs.prefill_token_s
            if w.skip_prefill == "always" or remainder <= w.skip_max_tokens or skip_s < pd_s:
                return Placement(
                    None,
                    best_skip[1],
                    best_skip[2],
                    hashes=tuple(hashes),
                    reason=f"skip-P: remainder {remainder}, {1e3 * skip_s:.1f} < {1e3 * pd_s:.1f} ms",
                )
        if p_addr is None:
            if w.skip_prefill != "never":  # no prefill worker up: the decode worker computes the prompt itself
                return Placement(None, best_skip[1], best_skip[2], hashes=tuple(hashes), reason="skip-P: no prefill")
            self.prefill.choose()  # raises NoWorkerError
        return Placement(p_addr, best_pd[1], best_pd[2], p_hit, reason="pd", hashes=tuple(hashes))

    def expect(self, addr: str, hashes: tuple[bytes, ...], num_prompt_tokens: int, checkpoint_tokens: int) -> None:
        """`addr` was sent the prompt: it will publish the full blocks of the N-1 tokens it computes or pulls, and
        keep the recurrent checkpoint at `checkpoint_tokens` (0: none)."""
        idx = self.membership.index(addr)
        if idx is None or not hashes:
            return
        bs, align = idx.shape.block_size, idx.shape.align
        blocks = hashes[: (num_prompt_tokens - 1) // bs]
        boundary = checkpoint_tokens // align * align
        ckpt = [hashes[boundary // bs - 1]] if 0 < boundary <= len(hashes) * bs else []
        expected: dict[int, list[bytes]] = {g: list(blocks) for g in idx.shape.attention_groups}
        expected.update({g: ckpt for g in idx.shape.recurrent_groups})
        idx.expect(expected, self.w.expect_ttl_s)

    def _best_prefill(self, hashes: list[bytes], n: int) -> tuple[str | None, float, int]:
        assert self.prefill is not None
        best: tuple[float, str, int] | None = None
        for addr in self.prefill.rotation(self.prefill.addrs):
            idx = self.membership.index(addr) if hashes else None
            hit = idx.usable_hit(hashes, n) if idx else 0
            cost = (n - 1 - hit) + self.w.prefill_queue_cost * self.prefill.tokens_in_flight(addr)
            if best is None or cost < best[0]:
                best = (cost, addr, hit)
        if best is None:
            return None, 0.0, 0
        return best[1], best[0], best[2]
