"""A light progress thread for a worker's NIXL agent: it progresses the agent only while transfers are in flight.

Why: workers run without NIXL's own progress thread (it busy-polls a core even when idle), so without this one
the step loop was the only thing progressing the agent, once per engine step while the engine is busy. A pull over
a transport that needs both sides to progress (UCX over TCP: DRAM between processes when CMA is ruled out, and
device memory whenever UCX stages it through the host) then moved a slice of its bytes per P step and per D step:
with a 17 MB recurrent state, 2.5 s per pull on CPU against 0.35 s with CMA (benchmarks/pd_handoff.py), and the
cost grows with the state. This thread progresses every `interval_s` while `active()` is true, sleeps on an event
otherwise (no CPU when idle), and never touches the engine: what it drains (release notices on P) goes to
`on_notices`, which hands them to the step thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2e-4


def interval_from_env(device_type: str = "cpu") -> float | None:
    """HYBRIDPD_TRANSFER_PROGRESS_S: seconds between the thread's polls; 0 turns the thread off (the step loop
    alone progresses the agent), for A/B measurements. Default: 2e-4 for agents of DRAM caches, off for VRAM.

    Why off on GPUs: on an H200 (2026-11-24, benchmarks/pd_handoff.py at Nemotron-H-8B, P and D on one GPU) a
    decode worker whose agent was progressed from any thread but its step thread aborted inside UCX on the first
    handoff ("dt.c: mem type unpack failed to uct_ep_put_short() Input/output error", P then "stubs.c Assertion");
    NIXL's own progress thread on D did the same, on P alone it did not. UCX staged those READs through host
    memory over TCP there and unpacks them into device memory in the progressing thread. Setting the variable
    explicitly still starts the thread on a GPU worker (experiments only)."""
    raw = os.environ.get("HYBRIDPD_TRANSFER_PROGRESS_S", "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S if device_type == "cpu" else None
    value = float(raw)
    return value if value > 0 else None


class TransferProgress:
    """`poll()` progresses the agent and returns what it drained (TransferAgent.poll_releases); `active()` says
    whether a transfer may be in flight (P: leases held; D: pulls in flight). Call `wake()` when one starts."""

    def __init__(self, poll: Callable[[], list], active: Callable[[], bool],
                 on_notices: Callable[[list], None] | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 name: str = "nixl-progress") -> None:
        self._poll, self._active, self._on_notices = poll, active, on_notices
        self.interval_s = interval_s
        self.num_polls = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the check: a wake() after it leaves the event set, so the wait returns
            if not self._active():
                self._wake.wait(timeout=1.0)
                continue
            try:
                notices = self._poll()
                self.num_polls += 1
            except Exception:  # noqa: BLE001 - agent closed during shutdown, or a NIXL error: keep the loop alive
                logger.debug("transfer progress poll failed", exc_info=True)
                self._stop.wait(0.01)
                continue
            if notices and self._on_notices is not None:
                self._on_notices(notices)
            self._stop.wait(self.interval_s)
