"""Live cluster membership: which workers the proxy routes to, changed at run time without a restart.

One mechanism for every deployment: workers *register* with each proxy they are given (`POST
/v1/cluster/workers`, the cluster token as `x-hybridpd-token`) and renew the registration every heartbeat; a
registration expires after its `ttl_s` (a crashed worker stops renewing). Static workers (`--prefill` / `--decode`)
are members from the start and never expire. Every member has a cache-event feed (proxy/cache_feed.py); a broken
feed or a failed call marks the worker *down* at once (no new requests) until its feed reconnects; a new epoch
(worker restarted) is taken from its registration or its feed's snapshot. `drain(addr)` takes a worker out of
rotation while its running requests finish.

A drain names a (role, address), not a process: a worker's id and epoch are new with every process, so the address
is the only identity a worker keeps across a restart. A drain through this proxy holds until it is undone, whatever
happens to the process meanwhile: a restart, a crash that outlives the registration's lease, a deregistration; the
next worker of that role at that address joins drained and is told so (Drain RPC). A worker of the other role at
that address is not drained by it. At most `max_members` drains are remembered for addresses with no member.

    states: up -> down (feed broke / call failed) -> up (feed back)
            up | down -> draining (drain) -> up (undrain) | gone (deregister / expiry)

Ownership: the app owns one `Membership`; event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from hybridpd.proxy.cache_feed import CacheFeed
from hybridpd.proxy.cache_index import WorkerCacheIndex
from hybridpd.proxy.routing import Router
from hybridpd.proxy.workers import Role, WorkerClients

log = logging.getLogger(__name__)


@dataclass
class Member:
    role: Role
    address: str
    static: bool
    worker_id: str = ""
    epoch: str = ""
    drained_here: bool = False
    """Drained through this proxy (`drain`)."""
    drained_by_worker: bool = False
    """The worker says it is drained (its registration or Health: drained through any proxy)."""
    down: bool = False
    expires_at: float = float("inf")
    """time.monotonic() after which a registered member is dropped unless renewed."""
    joined_at: float = field(default_factory=time.time)
    restarts: int = 0

    @property
    def draining(self) -> bool:
        return self.drained_here or self.drained_by_worker


MAX_MEMBERS = 512
"""Workers one proxy keeps at most (static ones included): each has a cache-event feed and a health probe, so an
open proxy (no cluster token) cannot be made to hold connections without bound by registrations."""


class MembershipFullError(Exception):
    """A registration of a new worker past `Membership.max_members`."""


class Membership:
    def __init__(
        self,
        clients: WorkerClients,
        routers: dict[Role, Router],
        event_drop_fraction: float = 0.0,
        expiry_interval_s: float = 0.25,
    ) -> None:
        self.clients = clients
        self.routers = routers
        self.members: dict[str, Member] = {}
        self.feeds: dict[str, CacheFeed] = {}
        self.room: dict[str, float] = {}
        """Decode worker -> share of its attention pages free or evictable (last Stats; 1.0 until known)."""
        self.capacity: dict[str, int] = {}
        """Worker -> whole requests (Generate) it takes at once (last Stats' max_generate: a decode worker's
        max_num_seqs, a prefill worker's mixed-role share; absent until known)."""
        self._drop = event_drop_fraction
        self._expiry_interval_s = expiry_interval_s
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self.max_members = MAX_MEMBERS
        self._drained: dict[tuple[Role, str], None] = {}
        """(role, address) drained through this proxy and not undrained, oldest first (see the module doc)."""

    # -- lifecycle -------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._started = True
        for role, router in self.routers.items():
            for addr in router.members:
                self.members[addr] = Member(role, addr, static=True, drained_here=(role, addr) in self._drained)
                self._start_feed(role, addr)
        self._task = asyncio.get_running_loop().create_task(self._expire_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(f.stop() for f in self.feeds.values()), return_exceptions=True)
        self.feeds.clear()

    def _start_feed(self, role: Role, addr: str) -> None:
        if not self._started or addr in self.feeds:
            return
        feed = CacheFeed(self.clients, role, addr, self._feed_up, self.mark_down, self._drop)
        self.feeds[addr] = feed
        feed.start()

    # -- changes ---------------------------------------------------------------------------------------------------
    def register(
        self, role: Role, addr: str, worker_id: str, epoch: str, ttl_s: float, draining: bool | None = None
    ) -> Member:
        """Add or renew a worker (a registration or heartbeat). Raises ValueError for a role the proxy has no
        router for (a prefill worker at a colocated proxy) or an address registered under the other role."""
        router = self.routers.get(role)
        if router is None:
            raise ValueError(f"this proxy routes no {role} workers")
        m = self.members.get(addr)
        if m is not None and m.role != role:
            raise ValueError(f"{addr} is a {m.role} worker here, not {role}")
        if m is None:
            if len(self.members) >= self.max_members:
                raise MembershipFullError(
                    f"this proxy already has {len(self.members)} workers (at most "
                    f"{self.max_members}); a worker leaves, or expires, before another joins"
                )
            m = self.members[addr] = Member(role, addr, static=False, drained_here=(role, addr) in self._drained)
            log.info("%s worker %s joined (epoch %s)%s", role, addr, epoch[:8], " drained" if m.drained_here else "")
            router.add(addr)
            self._start_feed(role, addr)
            if m.drained_here:  # drained here before it left: a new process has forgotten it
                self._sync_router(m)
                self.clients.spawn(self.tell_worker_draining(addr, True))
        elif epoch and m.epoch and epoch != m.epoch:
            self._restarted(m, epoch)
        m.worker_id, m.epoch = worker_id or m.worker_id, epoch or m.epoch
        if not m.static:
            m.expires_at = time.monotonic() + ttl_s
        if draining is not None:
            self.worker_draining(addr, draining)
        if m.down and m.epoch:  # a live worker renewing: routable again (its feed confirms it soon)
            self._set_down(m, False)
        return m

    def deregister(self, addr: str) -> bool:
        m = self.members.pop(addr, None)
        if m is None:
            return False
        self.routers[m.role].remove(addr)
        self.room.pop(addr, None)
        self.capacity.pop(addr, None)
        feed = self.feeds.pop(addr, None)
        if feed is not None:
            self.clients.spawn(feed.stop())
        self._forget_old_drains()
        log.info("%s worker %s left%s", m.role, addr, " (drained: it joins again drained)" if m.drained_here else "")
        return True

    def drain(self, addr: str, draining: bool = True) -> Member:
        """Drain (or undrain) through this proxy; `worker_draining` hears what the worker says."""
        m = self.members.get(addr)
        if m is None:
            raise KeyError(addr)
        m.drained_here = draining
        key = (m.role, addr)
        self._drained.pop(key, None)
        if draining:
            self._drained[key] = None
            self._forget_old_drains()
        else:
            m.drained_by_worker = False
        self._sync_router(m)
        return m

    def _forget_old_drains(self) -> None:
        """Bound the remembered drains: past `max_members` of addresses with no member, the oldest go."""
        gone = [(role, a) for role, a in self._drained if getattr(self.members.get(a), "role", None) != role]
        for key in gone[: max(0, len(gone) - self.max_members)]:
            del self._drained[key]

    async def tell_worker_draining(self, addr: str, draining: bool) -> bool:
        """Send the worker its drain state (it reports it to every proxy); False when it could not be told."""
        m = self.members.get(addr)
        if m is None:
            return False
        try:
            await self.clients.drain_worker(m.role, addr, draining)
        except grpc.aio.AioRpcError as err:
            log.warning("Drain(%s) on %s failed: %s", draining, addr, err.code().name)
            return False
        return True

    def worker_draining(self, addr: str, draining: bool) -> None:
        m = self.members.get(addr)
        if m is not None and m.drained_by_worker != draining:
            m.drained_by_worker = draining
            self._sync_router(m)

    def mark_down(self, addr: str) -> None:
        """A call to the worker failed as unreachable, or its feed broke: no new requests until it is back."""
        m = self.members.get(addr)
        if m is not None and not m.down:
            log.warning("%s worker %s is down", m.role, addr)
            self._set_down(m, True)

    def _feed_up(self, addr: str, epoch: str) -> None:
        m = self.members.get(addr)
        if m is None:
            return
        if m.epoch and epoch != m.epoch:
            self._restarted(m, epoch)
        m.epoch = epoch
        if m.down:
            log.info("%s worker %s is up", m.role, addr)
            self._set_down(m, False)

    def _restarted(self, m: Member, epoch: str) -> None:
        """`m` came back as a new process (`epoch`). One drained through this proxy has forgotten it: tell it again,
        or every other proxy would route to it on its first registration."""
        m.restarts += 1
        log.info("%s worker %s restarted (epoch %s -> %s)", m.role, m.address, m.epoch[:8], epoch[:8])
        if m.drained_here:
            self.clients.spawn(self.tell_worker_draining(m.address, True))

    def _set_down(self, m: Member, down: bool) -> None:
        m.down = down
        self._sync_router(m)

    def _sync_router(self, m: Member) -> None:
        self.routers[m.role].block(m.address, m.draining or m.down)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self._expiry_interval_s)
            now = time.monotonic()
            for addr in [a for a, m in self.members.items() if m.expires_at < now]:
                log.warning("worker %s stopped renewing its registration: removed", addr)
                self.deregister(addr)

    # -- views -----------------------------------------------------------------------------------------------------
    def index(self, addr: str) -> WorkerCacheIndex | None:
        feed = self.feeds.get(addr)
        return feed.usable() if feed is not None else None

    def view(self) -> list[dict[str, Any]]:
        out = []
        now = time.monotonic()
        for m in self.members.values():
            feed = self.feeds.get(m.address)
            idx = feed.index if feed is not None else None
            state = "draining" if m.draining else "down" if m.down else "up"
            entry: dict[str, Any] = {
                "role": m.role,
                "address": m.address,
                "state": state,
                "static": m.static,
                "worker_id": m.worker_id,
                "epoch": m.epoch,
                "restarts": m.restarts,
                "lease_left_s": None if m.static else round(max(0.0, m.expires_at - now), 2),
                "cache_index": None
                if idx is None
                else {
                    "synced": idx.synced and bool(feed and feed.connected),
                    "seq": idx.seq,
                    "staleness_s": round(min(idx.staleness_s(), 1e9), 3),
                    "hashes": idx.sizes(),
                    "resyncs": feed.resyncs if feed else 0,
                },
            }
            out.append(entry)
        return out
