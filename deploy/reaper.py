"""Orphan reaper: when `hybridpd serve` dies without cleaning up (SIGKILL, OOM kill), kill what it started.

`start_orphan_reaper()` runs in the driver before Ray starts. It spawns `python -m hybridpd.deploy.reaper`, a
tiny process outside the driver's process tree, holding the read end of a pipe whose write end only the driver
holds. The reaper snapshots the driver's descendants from /proc every half second (Ray's daemons and agents, the
worker actors and their `hybridpd worker` processes); once the pipe reports EOF (the driver is gone, however it
died) it sends SIGTERM to every process of the last snapshot that still runs, then SIGKILL to the survivors 3 s later.

Then it removes the paths it was given (`remove`: the serve's private Ray temp dir, which holds Ray's session logs
and sockets, and its Prometheus targets file deploy/prometheus/targets/serve-<port>.json, so a SIGKILL leaves no
stale targets behind). After a clean exit (Ctrl-C: Ray shut down, workers stopped, the dir removed) the snapshot's
processes are already gone and the reaper just exits. Linux only (/proc); elsewhere `start_orphan_reaper` does nothing.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

POLL_S = 0.5
GRACE_S = 3.0


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> set[int]:
    kids, out, todo = _children_map(), set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a process from a later one that reuses its pid. None once it is gone (or
    a zombie: dead, waiting for a parent to reap it)."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] == "Z" else fields[19]


def _signal_all(known: dict[int, str | None], sig: int) -> int:
    sent = 0
    for pid, started in known.items():
        if pid != os.getpid() and started is not None and _start_time(pid) == started:
            try:
                os.kill(pid, sig)
                sent += 1
            except (ProcessLookupError, PermissionError):
                pass
    return sent


def watch(driver_pid: int, fd: int, remove: Sequence[str] = ()) -> None:
    known: dict[int, str | None] = {}
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready and not os.read(fd, 1):
            break  # EOF: the driver is gone
        for pid in descendants(driver_pid):
            if pid not in known:
                known[pid] = _start_time(pid)
    if _signal_all(known, signal.SIGTERM):
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(_start_time(p) == t for p, t in known.items() if t is not None):
            time.sleep(0.1)
        _signal_all(known, signal.SIGKILL)
    for path in remove:  # directories (the Ray temp dir) and files (the Prometheus targets file serve writes)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            Path(path).unlink(missing_ok=True)


def start_orphan_reaper(remove: Sequence[str] = ()) -> subprocess.Popen | None:
    """Spawn the reaper for this process (call once, before starting anything it should clean up); `remove`:
    directories and files to delete once this process and its descendants are gone."""
    if not sys.platform.startswith("linux"):
        return None
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "hybridpd.deploy.reaper", str(os.getpid()), str(read_fd), *remove],
                            pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL)
    os.close(read_fd)
    os.set_inheritable(write_fd, False)  # only this process holds it: its death is the EOF
    _keep.append(write_fd)
    return proc


_keep: list[int] = []

if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
