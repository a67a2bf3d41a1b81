"""deploy/reaper.py: a SIGKILLed driver's descendants (here a child and a grandchild that detached into their own
session, as Ray's daemons do) are killed by its orphan reaper; a driver that exits cleanly leaves nothing to kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

DRIVER = """
import subprocess, sys, time
from hybridpd.deploy.reaper import start_orphan_reaper
start_orphan_reaper()
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
    "subprocess.Popen(['sleep', '300'], start_new_session=True); time.sleep(300)"])
time.sleep(1.0)  # the reaper snapshots every 0.5 s
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
"""


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _descendants(pid: int) -> set[int]:
    from hybridpd.deploy.reaper import descendants

    return descendants(pid)


def _run_driver(sleep_s: float) -> tuple[subprocess.Popen, set[int]]:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(sleep_s)], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=repo)
    assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
    return driver, _descendants(driver.pid)


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.time() + timeout
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


def test_sigkilled_driver_leaves_no_descendant() -> None:
    driver, procs = _run_driver(300)
    assert len(procs) >= 3  # the reaper, the child, the detached grandchild
    try:
        driver.kill()
        driver.wait()
        assert _wait_gone(procs, 10) == set()
    finally:
        for p in procs:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_clean_exit_then_reaper_exits() -> None:
    driver, procs = _run_driver(0)
    driver.wait(timeout=10)
    # the driver's own children outlive a clean exit here (it did not stop them): the reaper still ends them,
    # and ends itself
    assert _wait_gone(procs, 10) == set()


def test_sigkilled_driver_leaves_no_stale_targets_file(tmp_path: Path) -> None:
    """`serve` writes deploy/prometheus/targets/serve-<port>.json and removes it at exit; after a SIGKILL the reaper
    removes it."""
    targets = tmp_path / "serve-8123.json"
    targets.write_text("[]")
    repo = Path(__file__).resolve().parents[2]
    code = (f"import time; from deploy.reaper import start_orphan_reaper; start_orphan_reaper([{str(targets)!r}]); "
            "print('ready', flush=True); time.sleep(300)")
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo)
    assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
    assert targets.exists()
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 10
    while time.time() < deadline and targets.exists():
        time.sleep(0.1)
    assert not targets.exists()
