"""Polling helper for tests that wait on other processes (Prometheus scrapes, Ray restarts)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.5) -> Any:
    """Poll `check()` until it returns something truthy and return that; fail with its last value after
    `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}: last {value!r}"
        time.sleep(interval)
