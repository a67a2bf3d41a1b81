"""Worker selection within one role: round robin, or least loaded by the proxy's own in-flight counts.

One `Router` per role (prefill, decode). Its members change at run time (proxy/membership.py adds, drains and
removes workers); a removed or draining worker gets no new request but keeps its in-flight count until each of its
requests is released. Cache- and cost-aware placement across both roles lives in proxy/placement.py and picks
among `Router.addrs`. The event loop is the only thread that touches it, so no lock.
Ownership: `acquire()` counts a request against the chosen worker; the caller must `release()` it exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from hybridpd.proxy.config import RoutingPolicy


class NoWorkerError(RuntimeError):
    """No worker of the role is routable now (none registered, all draining or down)."""


class Router:
    """Chooses among the routable members.

    round_robin:  addrs[0], addrs[1], ..., wrapping around, whatever the load.
    least_loaded: the worker with the fewest in-flight requests; ties go round robin (the first tied worker at or
                  after the rotating cursor), so an idle cluster still spreads sequential requests.
    (cache_aware routes like least_loaded here; proxy/placement.py chooses by cost before asking.)

    `dynamic`: members come and go (membership); it may then start empty.
    """

    def __init__(self, addrs: Sequence[str], policy: RoutingPolicy = "round_robin", dynamic: bool = False) -> None:
        if not addrs and not dynamic:
            raise ValueError("Router needs at least one address")
        if len(set(addrs)) != len(addrs):
            raise ValueError(f"duplicate worker addresses: {list(addrs)}")
        self.policy = policy
        self._members: list[str] = list(addrs)
        self._blocked: set[str] = set()
        """Members that get no new request (draining, or down until they are heard from again)."""
        self._unresponsive: set[str] = set()
        """Members whose last health probe got no answer (frozen, wedged): skipped while another member answers."""
        self._readers: dict[str, set[Callable[[], None]]] = {}
        """Member -> streams waiting on it (`watch`), woken when it turns unresponsive while another answers."""
        self._in_flight = dict.fromkeys(self._members, 0)
        self._tokens = dict.fromkeys(self._members, 0)
        self._cursor = 0

    # -- membership ------------------------------------------------------------------------------------------------
    @property
    def addrs(self) -> tuple[str, ...]:
        """The routable members, in join order: neither blocked nor unresponsive, or, when every unblocked member
        is unresponsive, those (a slow worker may still answer; refusing would be certain to fail)."""
        up = tuple(a for a in self._members if a not in self._blocked)
        return tuple(a for a in up if a not in self._unresponsive) or up

    @property
    def members(self) -> tuple[str, ...]:
        """Every member, routable or not."""
        return tuple(self._members)

    def add(self, addr: str) -> None:
        if addr not in self._members:
            self._members.append(addr)
        self._in_flight.setdefault(addr, 0)
        self._tokens.setdefault(addr, 0)
        self._blocked.discard(addr)

    def remove(self, addr: str) -> None:
        if addr in self._members:
            self._members.remove(addr)
        self._blocked.discard(addr)
        self._unresponsive.discard(addr)
        if not self._in_flight.get(addr):
            self._in_flight.pop(addr, None)
            self._tokens.pop(addr, None)

    def block(self, addr: str, blocked: bool = True) -> None:
        """Take a member out of rotation (draining, down) or put it back."""
        if blocked:
            self._blocked.add(addr)
        elif addr in self._members:
            self._blocked.discard(addr)

    def set_unresponsive(self, addr: str, unresponsive: bool) -> None:
        """The health probe's verdict on a member: no answer in time (skip it while others answer, and wake the
        streams waiting on it), or answered."""
        if not unresponsive:
            self._unresponsive.discard(addr)
            return
        newly = addr not in self._unresponsive
        self._unresponsive.add(addr)
        answering = [a for a in self._members if a not in self._blocked and a not in self._unresponsive]
        if newly and answering:
            for wake in list(self._readers.get(addr, ())):
                wake()

    def watch(self, addr: str, wake: Callable[[], None]) -> None:
        """Call `wake()` if `addr` turns unresponsive while another member answers, until `unwatch` (a stream
        reading from it gives it up then). Event loop only."""
        self._readers.setdefault(addr, set()).add(wake)

    def unwatch(self, addr: str, wake: Callable[[], None]) -> None:
        readers = self._readers.get(addr)
        if readers is not None:
            readers.discard(wake)
            if not readers:
                del self._readers[addr]

    def is_unresponsive(self, addr: str) -> bool:
        return addr in self._unresponsive

    def is_routable(self, addr: str) -> bool:
        return addr in self.addrs

    # -- load ------------------------------------------------------------------------------------------------------
    def in_flight(self, addr: str) -> int:
        return self._in_flight.get(addr, 0)

    def tokens_in_flight(self, addr: str) -> int:
        """Prompt tokens of the worker's in-flight requests that the caller counted (`acquire(tokens=...)`)."""
        return self._tokens.get(addr, 0)

    def snapshot(self) -> dict[str, int]:
        """In-flight requests per worker (a copy)."""
        return dict(self._in_flight)

    def choose(self, exclude: Collection[str] = ()) -> str:
        """The next worker under the policy, skipping `exclude` unless it holds every worker (advances the cursor;
        does not count the request). Raises NoWorkerError when no member is routable."""
        addrs = self.addrs
        n = len(addrs)
        if not n:
            raise NoWorkerError("no worker is available")
        start = self._cursor % n
        order = [addrs[(start + i) % n] for i in range(n)]
        order = [a for a in order if a not in exclude] or order
        if self.policy == "round_robin":
            chosen = order[0]
        else:
            fewest = min(self._in_flight[a] for a in order)
            chosen = next(a for a in order if self._in_flight[a] == fewest)
        self._cursor = (addrs.index(chosen) + 1) % n
        return chosen

    def rotation(self, addrs: Sequence[str]) -> list[str]:
        """`addrs` starting at the rotating cursor: a cost-based chooser that keeps the first of equal costs spreads
        them round robin (`take` advances the cursor past its choice)."""
        k = self._cursor % len(addrs) if addrs else 0
        return [*addrs[k:], *addrs[:k]]

    def acquire(self, exclude: Collection[str] = (), tokens: int = 0) -> str:
        """Choose a worker (not in `exclude` where possible) and count one in-flight request on it."""
        addr = self.choose(exclude)
        self._in_flight[addr] += 1
        self._tokens[addr] += tokens
        return addr

    def take(self, addr: str, tokens: int = 0) -> str:
        """Count one in-flight request (of `tokens` prompt tokens) on `addr`, chosen elsewhere; the rotation moves
        past it."""
        addrs = self.addrs
        if addr in addrs:
            self._cursor = (addrs.index(addr) + 1) % len(addrs)
        self._in_flight[addr] = self._in_flight.get(addr, 0) + 1
        self._tokens[addr] = self._tokens.get(addr, 0) + tokens
        return addr

    def settle(self, addr: str, tokens: int) -> None:
        """`tokens` prompt tokens counted on `addr` are computed (a whole request's first token is out): they leave
        its queue; the request stays in flight until `release(addr)`."""
        if addr in self._tokens:
            self._tokens[addr] = max(0, self._tokens[addr] - tokens)

    def release(self, addr: str, tokens: int = 0) -> None:
        if self._in_flight.get(addr, 0) <= 0:
            raise RuntimeError(f"release of {addr} without a matching acquire")
        self._in_flight[addr] -= 1
        self._tokens[addr] = max(0, self._tokens.get(addr, 0) - tokens)
        if not self._in_flight[addr] and addr not in self._members:
            self._in_flight.pop(addr)
            self._tokens.pop(addr, None)
