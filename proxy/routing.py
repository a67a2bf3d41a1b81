"""Worker selection: round robin, or least loaded by the proxy's own count of in-flight requests per worker.

One `Router` per role (prefill, decode). The event loop is the only thread that touches it, so no lock.
Ownership: `acquire()` counts a request against the chosen worker; the caller must `release()` it exactly once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from proxy.config import RoutingPolicy


class Router:
    """Chooses among `addrs`.

    round_robin:  addrs[0], addrs[1], ..., wrapping around, whatever the load.
    least_loaded: the worker with the fewest in-flight requests; ties go round robin (the first tied worker at or
                  after the rotating cursor), so an idle cluster still spreads sequential requests.
    """

    def __init__(self, addrs: Sequence[str], policy: RoutingPolicy = "round_robin") -> None:
        if not addrs:
            raise ValueError("Router needs at least one address")
        if len(set(addrs)) != len(addrs):
            raise ValueError(f"duplicate worker addresses: {list(addrs)}")
        self.addrs: tuple[str, ...] = tuple(addrs)
        self.policy = policy
        self._in_flight = dict.fromkeys(self.addrs, 0)
        self._cursor = 0

    def in_flight(self, addr: str) -> int:
        return self._in_flight[addr]

    def snapshot(self) -> dict[str, int]:
        """In-flight requests per worker (a copy)."""
        return dict(self._in_flight)

    def choose(self, exclude: Collection[str] = ()) -> str:
        """The next worker under the policy, skipping `exclude` unless it holds every worker (advances the cursor;
        does not count the request)."""
        n = len(self.addrs)
        order = [self.addrs[(self._cursor + i) % n] for i in range(n)]
        order = [a for a in order if a not in exclude] or order
        if self.policy == "least_loaded":
            fewest = min(self._in_flight[a] for a in order)
            chosen = next(a for a in order if self._in_flight[a] == fewest)
        else:
            chosen = order[0]
        self._cursor = (self.addrs.index(chosen) + 1) % n
        return chosen

    def acquire(self, exclude: Collection[str] = ()) -> str:
        """Choose a worker (not in `exclude` where possible) and count one in-flight request on it."""
        addr = self.choose(exclude)
        self._in_flight[addr] += 1
        return addr

    def release(self, addr: str) -> None:
        if self._in_flight[addr] <= 0:
            raise RuntimeError(f"release of {addr} without a matching acquire")
        self._in_flight[addr] -= 1
