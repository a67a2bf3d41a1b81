"""Cache- and cost-aware placement of one request (routing policy `cache_aware`): which prefill worker, which
decode worker, no prefill worker at all (skip-P: the decode worker prefills the rest itself), or no decode worker
(P-alone: a prefill worker runs the whole request, its mixed role).

Costs, in prompt-token units (one token a prefill worker computes = 1):

    P  uncached tokens (prompt - its usable hit) + prefill_queue_cost x prompt tokens it has in flight
    D  pull_token_cost x (tokens to pull: N-1 - its attention hit) + decode_running_cost x requests in flight
       + decode_full_cost x the share of its attention pages neither free nor evictable (its last Stats)
    D, skip-P   decode_prefill_cost x (N-1 - its usable hit, which needs a recurrent checkpoint) + the same load

A worker whose cache index is not usable (no snapshot yet, stream down) has no hit: it is routed by load alone.

Skip-P: the request goes to D without params (D computes the remainder itself, as a colocated worker does) when no
prefill worker is routable (down or drained), when the remainder is at most `skip_max_tokens`, or when D's
estimated time to the first token is below the PD path's:

    skip_s = decode_prefill_cost x remainder x step.decode_token_s
    pd_s   = P's cost x step.prefill_token_s         (P samples the first token: the proxy streams it at once)

The PD handoff (pull, commit, resume) comes after the first token and delays only the second, one gap of a whole
stream, so it is measured (`StepCosts.handoff_s`, shown in /v1/cluster) but not weighed against D's prefill.

Balance (`decode_balance` > 0; off by default, see below), checked first: with anything in flight on the pair, the
request goes WHOLE to the less loaded of the least loaded prefill worker (P-alone) and the decode worker (skip-P),
by request counts and caps alone, as least-loaded routing between two colocated replicas does: P while it would
then hold at most `decode_balance` x what D holds (P's router count: its whole requests and the prompts it
computes) and is below its cap; else D below its cap; else whichever has room; both full: D. So under load the
pair is two colocated replicas (neither GPU idles on a load the P:D split does not match) and PD is kept for low
load, where it costs the first token nothing and decodes without prefill chunks in the way. No pace rule: earlier
forms that shut P out when its streams were slower than a TPOT target sent the rest through PD, made P compute
D's prompts and slowed P further (docs/BENCHMARKS.md). P's cap is its mixed-role share of max_num_seqs
(`--max-decode-share`): for balance it should be 1.

P-alone without balance: the request goes whole to a prefill worker (DecodeService.Generate on it, no params; P's
engine mixes its decode steps with its prefill chunks) when the decode worker the PD path would use is saturated

    in flight >= decode_saturation x its capacity (Stats' max_generate: its max_num_seqs), or
    its measured seconds per output token > tpot_budget_s (when set; while it runs any request)

and a routable prefill worker has room: fewer whole requests in flight than its capacity (its mixed-role share of
max_num_seqs, from Stats; unknown: none), its queue (prompt tokens in flight x measured seconds per token) at most
prefill_decode_max_queue_s, and (tpot_budget_s set) while it runs whole requests, their measured time per token
at most tpot_budget_s (and below D's when D is saturated by time alone; with none running, a stale figure is
ignored and the next request probes it). Among those, the cheapest by P's cost + decode_running_cost x its whole
requests. Its time to the first token is P's prefill, as under PD; what it saves is D's queue and the handoff, at
the price of decode steps slowed by P's prefill chunks. `prefill_decode` never / always turn it off / force it.

`StepCosts` starts from configurable defaults and follows measured times (moving averages): P's seconds per
computed token (Prefill RPC time / tokens P computed; P-alone: time to its first token / tokens it computed), D's
seconds per token it prefilled itself (skip-P: time to first token / remainder), the PD handoff (Generate sent ->
D's first token, the request's second) and, per worker, the time per output token of its streams (gaps between
chunks after the first, per token). Event loop only.
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
        self.token_s: dict[str, float] = {}
        """Worker -> seconds per output token of its streams (moving average; absent until measured)."""

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

    def token_gap(self, addr: str, seconds_per_token: float) -> None:
        """A stream from `addr` delivered tokens `seconds_per_token` apart (after its first chunk)."""
        old = self.token_s.get(addr)
        self.token_s[addr] = seconds_per_token if old is None else self._mix(old, seconds_per_token)


PATHS = ("pd", "skip_prefill", "prefill_alone", "colocated")
"""Placement kinds (the `path` label of hybridpd_proxy_route_decisions_total)."""


@dataclass(frozen=True)
class Placement:
    prefill_addr: str | None
    """None: skip-P, P-alone or colocated (no Prefill call)."""
    decode_addr: str
    """The worker Generate goes to: a decode worker, or (P-alone) a prefill worker."""
    expected_hit: int
    """Tokens the Generate worker should find locally: its usable hit (skip-P, P-alone) or attention hit (PD)."""
    expected_prefill_hit: int = 0
    reason: str = ""
    hashes: tuple[bytes, ...] = ()
    """The prompt's block hashes (empty while no worker's index is usable)."""
    kind: str = "pd"
    """One of PATHS."""

    @property
    def on_prefill(self) -> bool:
        """P-alone: Generate goes to a prefill worker (counted on the prefill router)."""
        return self.kind == "prefill_alone"


class Placer:
    def __init__(self, membership: Membership, prefill: Router | None, decode: Router, weights: RoutingWeights) -> None:
        self.membership = membership
        self.prefill = prefill
        self.decode = decode
        self.w = weights
        self.costs = StepCosts(weights)
        self.whole_on_prefill: dict[str, int] = {}
        """Prefill worker -> whole requests (P-alone) in flight on it from this proxy."""
        self.decisions: dict[str, int] = dict.fromkeys(PATHS, 0)
        """Placements made, by kind (shown in /v1/cluster)."""

    def whole_started(self, addr: str) -> None:
        self.whole_on_prefill[addr] = self.whole_on_prefill.get(addr, 0) + 1

    def whole_ended(self, addr: str) -> None:
        left = self.whole_on_prefill.get(addr, 0) - 1
        if left > 0:
            self.whole_on_prefill[addr] = left
        else:
            self.whole_on_prefill.pop(addr, None)

    def _decided(self, p: Placement) -> Placement:
        self.decisions[p.kind] += 1
        return p

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
        h = tuple(hashes)
        if self.prefill is None:  # colocated: D computes everything itself
            return self._decided(
                Placement(None, best_skip[1], best_skip[2], reason="colocated", hashes=h, kind="colocated")
            )
        if w.decode_balance > 0:
            shared = self._balanced(best_skip[1], best_skip[2], hashes, n)
            if shared is not None:
                return self._decided(shared)
        alone = self._prefill_alone(best_pd[1], hashes, n)
        if alone is not None:
            return self._decided(alone)
        p_addr, p_cost, p_hit = self._best_prefill(hashes, n)
        remainder = n - 1 - best_skip[2]
        if w.skip_prefill != "never" and p_addr is not None:
            skip_s = w.decode_prefill_cost * remainder * self.costs.decode_token_s
            pd_s = p_cost * self.costs.prefill_token_s
            why = None
            if w.skip_prefill == "always" or remainder <= w.skip_max_tokens or skip_s < pd_s:
                why = f"remainder {remainder}, {1e3 * skip_s:.1f} < {1e3 * pd_s:.1f} ms"
            if why is not None:
                return self._decided(
                    Placement(None, best_skip[1], best_skip[2], hashes=h, kind="skip_prefill", reason=f"skip-P: {why}")
                )
        if p_addr is None:
            if w.skip_prefill != "never":  # no prefill worker up: the decode worker computes the prompt itself
                return self._decided(
                    Placement(
                        None, best_skip[1], best_skip[2], hashes=h, kind="skip_prefill", reason="skip-P: no prefill"
                    )
                )
            self.prefill.choose()  # raises NoWorkerError
        return self._decided(Placement(p_addr, best_pd[1], best_pd[2], p_hit, reason="pd", hashes=h))

    def _balanced(self, d_addr: str, d_hit: int, hashes: list[bytes], n: int) -> Placement | None:
        """Balance (module doc): with something in flight, the request goes whole to prefill worker P or to decode
        worker `d_addr` (its usable hit `d_hit`), whichever holds less, as least-loaded routing between two
        colocated replicas would: P while it would hold at most `decode_balance` x D's count, below its cap; else
        D (skip-P) below its cap; else whichever has room; both full: D. None: nothing in flight (the cost model
        decides: PD at low load), or no P can take whole requests."""
        assert self.prefill is not None
        w = self.w
        d_holds = self.decode.in_flight(d_addr)
        found = self._least_loaded_prefill(hashes, n)
        if found is None or w.prefill_decode == "never":
            return None
        p_addr, p_hit = found
        p_holds = self.prefill.in_flight(p_addr)  # its whole requests and the prompts it computes for D
        if p_holds + d_holds == 0:
            return None
        p_room = self.whole_on_prefill.get(p_addr, 0) < self.membership.capacity.get(p_addr, 0)
        d_cap = self.membership.capacity.get(d_addr)
        d_room = d_cap is None or d_holds < d_cap
        to_p = p_room and (p_holds + 1 <= w.decode_balance * d_holds or not d_room)
        if not to_p and w.skip_prefill == "never":
            return None
        why = f"balance: {p_holds} in flight on {p_addr}, {d_holds} on {d_addr}"
        if to_p:
            return Placement(None, p_addr, p_hit, hashes=tuple(hashes), kind="prefill_alone", reason=f"P-alone: {why}")
        return Placement(None, d_addr, d_hit, hashes=tuple(hashes), kind="skip_prefill", reason=f"skip-P: {why}")

    def _least_loaded_prefill(self, hashes: list[bytes], n: int) -> tuple[str, int] | None:
        """The routable prefill worker holding the fewest requests (then the most cached), with its usable hit."""
        assert self.prefill is not None
        best: tuple[tuple[int, int], str, int] | None = None
        for addr in self.prefill.rotation(self.prefill.addrs):
            idx = self.membership.index(addr) if hashes else None
            hit = idx.usable_hit(hashes, n) if idx else 0
            key = (self.prefill.in_flight(addr), -hit)
            if best is None or key < best[0]:
                best = (key, addr, hit)
        return None if best is None else (best[1], best[2])

    # -- P-alone -----------------------------------------------------------------------------------------------------
    def decode_saturated(self, addr: str) -> str | None:
        """Why decode worker `addr` should take no more requests now (None: it is not saturated)."""
        w, running = self.w, self.decode.in_flight(addr)
        cap = self.membership.capacity.get(addr)
        if cap is not None and cap > 0 and running >= w.decode_saturation * cap:
            return f"{running} of {cap} in flight"
        gap = self.costs.token_s.get(addr)
        if w.tpot_budget_s > 0 and running > 0 and gap is not None and gap > w.tpot_budget_s:
            return f"{1e3 * gap:.1f} ms per token"
        return None

    def _prefill_alone(self, d_addr: str, hashes: list[bytes], n: int) -> Placement | None:
        """A prefill worker to run the whole request, when D is saturated or busier than it, and one has room
        (module doc)."""
        assert self.prefill is not None
        w = self.w
        if w.prefill_decode == "never":
            return None
        auto = w.prefill_decode == "auto"
        why = self.decode_saturated(d_addr) if auto else "always"
        if why is None:
            return None
        d_running = self.decode.in_flight(d_addr)
        d_gap = self.costs.token_s.get(d_addr)
        by_time = why is not None and why.endswith("per token")
        best: tuple[float, str, int] | None = None
        for addr in self.prefill.rotation(self.prefill.addrs):
            whole = self.whole_on_prefill.get(addr, 0)
            if auto and not self._has_room(addr, whole, by_time, d_gap):
                continue
            idx = self.membership.index(addr) if hashes else None
            hit = idx.usable_hit(hashes, n) if idx else 0
            cost = (
                (n - 1 - hit)
                + w.prefill_queue_cost * self.prefill.tokens_in_flight(addr)
                + w.decode_running_cost * whole
            )
            if best is None or cost < best[0]:
                best = (cost, addr, hit)
        if best is None:
            return None
        why = f"decode worker {d_addr} saturated ({why}, {d_running} in flight)"
        return Placement(None, best[1], best[2], hashes=tuple(hashes), kind="prefill_alone", reason=f"P-alone: {why}")

    def _has_room(self, addr: str, whole: int, by_time: bool, d_gap: float | None) -> bool:
        """May prefill worker `addr`, running `whole` whole requests, take one more (auto)?"""
        assert self.prefill is not None
        w = self.w
        if whole >= self.membership.capacity.get(addr, 0):
            return False  # its cap (unknown: none)
        gap = self.costs.token_s.get(addr) if whole else None  # its own pace (stale once it runs none: probe)
        if gap is not None and w.tpot_budget_s > 0 and gap > w.tpot_budget_s:
            return False
        if self.prefill.tokens_in_flight(addr) * self.costs.prefill_token_s > w.prefill_decode_max_queue_s:
            return False  # its prefill role comes first
        return not (by_time and gap is not None and d_gap is not None and gap >= d_gap and w.tpot_budget_s > 0)

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
