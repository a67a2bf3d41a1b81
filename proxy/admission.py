"""Fair admission: a global budget of admitted work, shared between tenants, with a short bounded wait.

    request --(auth, parse, tokenize)--> Demand(seqs, prompt_tokens, reserved_tokens)
        never fits the budget, the tenant's share or the key's limits  -> 400  (reason never_fits)
        key over max_concurrency / tokens_per_minute                   -> 429 + Retry-After
        fits now                                                       -> Ticket
        else waits (at most max_waiting requests, queue_timeout_s)     -> Ticket, or 503 + Retry-After

Budgets (`AdmissionLimits`, `Caps`): sequences in flight (a request holds n x len(prompts)), prompt tokens
queued (admitted, before each prompt's first output token: what waits for or sits in prefill, pinned on P) and,
when configured, reserved tokens (prompt + max_tokens per sequence: the KV they may grow to). A tenant (the API
key's name, or the client address when no keys are configured) may hold at most `max_tenant_share` of each, so a
flood from one tenant leaves room for the others. Waiters are served by least usage first (the tenant holding the
fewest sequences), then arrival: a tenant that holds nothing goes ahead of a flooding one.

Ownership: the app creates one `Admission` per proxy; every admitted request holds one `Ticket` and calls
`Ticket.release()` exactly once in a `finally` (idempotent). Event loop only; every operation is O(waiters).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from hybridpd.proxy.api_keys import ApiKey
from hybridpd.proxy.config import DEFAULT_SEQS_PER_DECODE_WORKER, ProxyConfig
from hybridpd.proxy.errors import ApiError, bad_request
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REJECTION_REASONS = ("never_fits", "queue_full", "queue_timeout", "key_concurrency", "key_tokens_per_minute",
                     "request_limits", "connection_cap", "header_timeout", "body_timeout", "send_timeout")
_QUEUED_PROMPT_TOKENS_PER_WORKER = 64  # x max_model_len, when not configured


@dataclass(frozen=True)
class Demand:
    """What one request asks for: sequences, prompt tokens (each prompt once) and prompt + max_tokens per sequence."""

    seqs: int
    prompt_tokens: int
    reserved_tokens: int


@dataclass
class Usage:
    seqs: int = 0
    prompt_tokens: int = 0
    reserved_tokens: int = 0

    def add(self, d: Demand, sign: int = 1) -> None:
        self.seqs += sign * d.seqs
        self.prompt_tokens += sign * d.prompt_tokens
        self.reserved_tokens += sign * d.reserved_tokens


@dataclass(frozen=True)
class Caps:
    """The global budget in force (None: no such budget)."""

    seqs: int
    prompt_tokens: int
    reserved_tokens: int | None

    @classmethod
    def from_config(cls, cfg: ProxyConfig) -> Caps:
        lim = cfg.admission
        token_workers = len(cfg.decode_addrs) if cfg.colocated else len(cfg.prefill_addrs)
        # static workers only: with workers registering at run time (none listed) the defaults count one per role
        return cls(seqs=lim.max_num_seqs or DEFAULT_SEQS_PER_DECODE_WORKER * max(1, len(cfg.decode_addrs)),
                   prompt_tokens=lim.max_queued_prompt_tokens
                   or _QUEUED_PROMPT_TOKENS_PER_WORKER * cfg.max_model_len * max(1, token_workers),
                   reserved_tokens=lim.max_tokens_in_flight)

    def share(self, fraction: float) -> Caps:
        def part(cap: int) -> int:
            return max(1, int(cap * fraction))

        return Caps(part(self.seqs), part(self.prompt_tokens),
                    None if self.reserved_tokens is None else part(self.reserved_tokens))

    def holds(self, used: Usage, d: Demand) -> bool:
        return (used.seqs + d.seqs <= self.seqs and used.prompt_tokens + d.prompt_tokens <= self.prompt_tokens
                and (self.reserved_tokens is None or used.reserved_tokens + d.reserved_tokens <= self.reserved_tokens))

    def first_exceeded(self, d: Demand) -> str | None:
        """Which budget `d` alone exceeds (a message fragment), or None."""
        if d.seqs > self.seqs:
            return f"{d.seqs} sequences (n x prompts) exceed the {self.seqs} allowed"
        if d.prompt_tokens > self.prompt_tokens:
            return f"{d.prompt_tokens} prompt tokens exceed the {self.prompt_tokens} allowed"
        if self.reserved_tokens is not None and d.reserved_tokens > self.reserved_tokens:
            return (f"{d.reserved_tokens} tokens (prompt + max_tokens per sequence) exceed the "
                    f"{self.reserved_tokens} allowed")
        return None


class TokenBucket:
    """`rate_per_minute` tokens per minute, at most one minute's worth banked. Event loop only."""

    def __init__(self, rate_per_minute: int) -> None:
        self.capacity = float(rate_per_minute)
        self.tokens = float(rate_per_minute)
        self._rate = rate_per_minute / 60.0
        self._at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self._rate)
        self._at = now

    def take(self, n: int) -> float:
        """Take `n` tokens and return 0, or take nothing and return the seconds until `n` would be there."""
        self._refill()
        if n <= self.tokens:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self._rate

    def give(self, n: int) -> None:
        self._refill()
        self.tokens = min(self.capacity, self.tokens + n)


@dataclass
class Tenant:
    name: str
    key: ApiKey | None
    usage: Usage = field(default_factory=Usage)
    bucket: TokenBucket | None = None
    waiting: int = 0


@dataclass
class _Waiter:
    tenant: Tenant
    demand: Demand
    order: int
    granted: asyncio.Future[None]


class Ticket:
    """One admitted request's hold on the budget. `prompts_done()` once every prompt has produced output (its
    prompt tokens stop counting as queued); `release(unused_tokens)` when the request ends, giving back to the
    key's tokens-per-minute the max_tokens it did not use. Both idempotent."""

    def __init__(self, admission: Admission, tenant: Tenant, demand: Demand, charged: int) -> None:
        self._admission = admission
        self.tenant = tenant
        self.demand = demand
        self._charged = charged
        self._prompts_held = True
        self._released = False

    def prompts_done(self) -> None:
        if self._prompts_held and not self._released:
            self._prompts_held = False
            self._admission._give_back(self.tenant, Demand(0, self.demand.prompt_tokens, 0))

    def release(self, unused_tokens: int = 0) -> None:
        if self._released:
            return
        self._released = True
        prompt = self.demand.prompt_tokens if self._prompts_held else 0
        self._admission._give_back(self.tenant, Demand(self.demand.seqs, prompt, self.demand.reserved_tokens))
        if self.tenant.bucket is not None and self._charged:
            self.tenant.bucket.give(max(0, min(unused_tokens, self._charged)))


class Admission:
    """The proxy's admission control (see the module doc). One per app; event loop only."""

    def __init__(self, cfg: ProxyConfig, registry: CollectorRegistry) -> None:
        self.limits = cfg.admission
        self.caps = Caps.from_config(cfg)
        self.tenant_caps = self.caps.share(self.limits.max_tenant_share)
        self.retry_after_s = cfg.retry_after_s
        self.used = Usage()
        self._tenants: dict[str, Tenant] = {}
        self._waiters: list[_Waiter] = []
        self._order = 0
        self.rejected = Counter("hybridpd_admission_rejected_total",
                                "Requests and connections refused by admission control and HTTP limits",
                                ["reason"], registry=registry)
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason=reason)
        registry.register(_AdmissionCollector(self))

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def count_rejection(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def reject(self, reason: str, err: ApiError) -> ApiError:
        self.count_rejection(reason)
        return err

    def tenant(self, name: str, key: ApiKey | None) -> Tenant:
        t = self._tenants.get(name)
        if t is None:
            bucket = TokenBucket(key.tokens_per_minute) if key is not None and key.tokens_per_minute else None
            t = self._tenants[name] = Tenant(name, key, bucket=bucket)
        return t

    def check_seqs(self, key: ApiKey | None, seqs: int) -> None:
        """400 now when `seqs` alone can never fit (known before tokenization: n x prompts)."""
        self._check_ever_fits(key, Demand(seqs, 0, 0))

    async def admit(self, tenant: Tenant, demand: Demand) -> Ticket:
        """A Ticket once `demand` fits; raises ApiError (400 / 429 / 503) otherwise. Cancellation-safe."""
        self._check_ever_fits(tenant.key, demand)
        self._check_key_concurrency(tenant, demand)
        charged = self._charge_tokens(tenant, demand)
        waiter = _Waiter(tenant, demand, self._order, asyncio.get_running_loop().create_future())
        self._order += 1
        self._waiters.append(waiter)
        tenant.waiting += 1
        try:
            self._dispatch()
            if not waiter.granted.done():
                if len(self._waiters) > self.limits.max_waiting or self.limits.queue_timeout_s == 0:
                    raise self._busy("queue_full", "the wait queue is full")
                await asyncio.wait_for(asyncio.shield(waiter.granted), self.limits.queue_timeout_s)
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # cancelled as it was granted: wait_for returned the
                    raise asyncio.CancelledError  # grant anyway, and the caller no longer waits for a Ticket
        except BaseException as exc:
            if waiter.granted.done() and not waiter.granted.cancelled():  # granted as we gave up: hand it back
                self._give_back(tenant, demand)
            waiter.granted.cancel()
            self._refund(tenant, charged)
            if isinstance(exc, asyncio.TimeoutError):
                raise self._busy("queue_timeout", f"no room within {self.limits.queue_timeout_s:g} s") from None
            raise
        finally:
            tenant.waiting -= 1
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self._forget_if_idle(tenant)
        return Ticket(self, tenant, demand, charged)

    # -- checks ------------------------------------------------------------------------------------------------

    def _check_ever_fits(self, key: ApiKey | None, d: Demand) -> None:
        why = self.tenant_caps.first_exceeded(d)
        if why is None and key is not None and key.max_concurrency and d.seqs > key.max_concurrency:
            why = f"{d.seqs} sequences exceed key '{key.name}'s max_concurrency of {key.max_concurrency}"
        if why is None and key is not None and key.tokens_per_minute and d.reserved_tokens > key.tokens_per_minute:
            why = (f"{d.reserved_tokens} tokens (prompt + max_tokens per sequence) exceed key '{key.name}'s "
                   f"tokens_per_minute of {key.tokens_per_minute}")
        if why is not None:
            raise self.reject("never_fits", bad_request(
                f"this request can never be admitted: {why} per client; send fewer prompts, a smaller n or "
                "max_tokens", param="n", code="request_too_large"))

    def _check_key_concurrency(self, tenant: Tenant, d: Demand) -> None:
        key = tenant.key
        if key is not None and key.max_concurrency and tenant.usage.seqs + d.seqs > key.max_concurrency:
            raise self.reject("key_concurrency", self._rate_limited(
                f"key '{key.name}' has {tenant.usage.seqs} sequences in flight; this request's {d.seqs} would pass "
                f"its max_concurrency of {key.max_concurrency}", self.retry_after_s))

    def _charge_tokens(self, tenant: Tenant, d: Demand) -> int:
        if tenant.bucket is None:
            return 0
        wait_s = tenant.bucket.take(d.reserved_tokens)
        if wait_s > 0:
            assert tenant.key is not None
            raise self.reject("key_tokens_per_minute", self._rate_limited(
                f"key '{tenant.key.name}' is over its tokens_per_minute of {tenant.key.tokens_per_minute} "
                f"(this request reserves {d.reserved_tokens}: prompt + max_tokens per sequence)", wait_s))
        return d.reserved_tokens

    def _refund(self, tenant: Tenant, charged: int) -> None:
        if tenant.bucket is not None and charged:
            tenant.bucket.give(charged)

    @staticmethod
    def _rate_limited(message: str, retry_s: float) -> ApiError:
        return ApiError(429, message, code="rate_limit_exceeded",
                        headers={"Retry-After": str(max(1, math.ceil(retry_s)))})

    def _busy(self, reason: str, why: str) -> ApiError:
        u, c = self.used, self.caps
        return self.reject(reason, ApiError(
            503, f"the server is at capacity ({why}; {u.seqs}/{c.seqs} sequences and {u.prompt_tokens}/"
                 f"{c.prompt_tokens} queued prompt tokens in use); retry later", code="overloaded",
            headers={"Retry-After": str(self.retry_after_s)}))

    # -- the budget --------------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Grant every waiter that fits, the least-loaded tenant first, then in arrival order."""
        for w in sorted(self._waiters, key=lambda w: (w.tenant.usage.seqs, w.order)):
            if w.granted.done():
                continue
            if self.caps.holds(self.used, w.demand) and self.tenant_caps.holds(w.tenant.usage, w.demand):
                self.used.add(w.demand)
                w.tenant.usage.add(w.demand)
                w.granted.set_result(None)

    def _give_back(self, tenant: Tenant, d: Demand) -> None:
        self.used.add(d, -1)
        tenant.usage.add(d, -1)
        self._forget_if_idle(tenant)
        self._dispatch()

    def _forget_if_idle(self, tenant: Tenant) -> None:
        """Drop a tenant without a key once it holds and awaits nothing (client addresses are unbounded)."""
        if tenant.key is None and tenant.usage.seqs == 0 and tenant.waiting == 0:
            self._tenants.pop(tenant.name, None)

    def check_integrity(self) -> bool:
        """The global usage is the sum of the tenants' (true whenever no request is mid-flight too)."""
        total = Usage()
        for t in self._tenants.values():
            total.seqs += t.usage.seqs
            total.prompt_tokens += t.usage.prompt_tokens
            total.reserved_tokens += t.usage.reserved_tokens
        return total == self.used and min(total.seqs, total.prompt_tokens, total.reserved_tokens) >= 0


class _AdmissionCollector(Collector):
    """`hybridpd_admission_*` gauges, read at scrape time."""

    def __init__(self, admission: Admission) -> None:
        self._a = admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        a = self._a
        yield GaugeMetricFamily("hybridpd_admission_in_flight_sequences", "Admitted sequences in flight",
                                value=a.used.seqs)
        yield GaugeMetricFamily("hybridpd_admission_queued_prompt_tokens",
                                "Prompt tokens admitted and not yet past their first output token",
                                value=a.used.prompt_tokens)
        yield GaugeMetricFamily("hybridpd_admission_waiting_requests", "Requests waiting for admission",
                                value=a.waiting)
        budget = GaugeMetricFamily("hybridpd_admission_budget", "The global admission budget", labels=["resource"])
        budget.add_metric(["sequences"], a.caps.seqs)
        budget.add_metric(["queued_prompt_tokens"], a.caps.prompt_tokens)
        if a.caps.reserved_tokens is not None:
            budget.add_metric(["reserved_tokens"], a.caps.reserved_tokens)
        yield budget
