"""How `hybridpd serve` hands secrets to the processes it starts on this host, and where Ray writes its files.

Secrets (the cluster token; Ray's own auth token) never travel in an environment variable that Ray records, nor in
a file under a path someone else could read:

    SecretFiles.add(name, value) -> path     an anonymous in-memory file (memfd, mode 0600) that this process holds
                                             open; the path is /proc/<this pid>/fd/<n>. Only processes of the same
                                             user can open it (the kernel checks ptrace-read access to this process),
                                             it exists on no disk, and it disappears with this process. Children get
                                             the *path* (HYBRIDPD_CLUSTER_TOKEN_FILE=...), which may be logged.
                                             Without memfd (not Linux): a 0600 file in a 0700 directory, removed by
                                             `close()`.

Ray's own files go to a temp dir inside a private one (`private_ray_dir`, mode 0700, named after this process's
pid) instead of the shared /tmp/ray: nobody else can read Ray's session logs, and serve removes the directory at
exit; after a SIGKILL the orphan reaper (deploy/reaper.py) removes it, and a later `serve` sweeps any left by a
dead one (`sweep_stale_ray_dirs`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

RAY_DIR_PREFIX = "hpd"
"""Short: Ray's unix sockets live under the temp dir and a socket path may hold 107 bytes."""
_RAY_DIR_RE = re.compile(rf"^{RAY_DIR_PREFIX}(\d+)-[A-Za-z0-9_]+$")


class SecretFiles:
    """Secrets of one serve, readable by path from this host's processes of the same user while this process lives.
    `close()` drops them (call at exit; a dead process drops them by itself)."""

    def __init__(self) -> None:
        self._fds: list[int] = []
        self._dir: str | None = None

    def add(self, name: str, value: str) -> str:
        data = value.encode()
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(f"hybridpd-{name}", os.MFD_CLOEXEC)
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            self._fds.append(fd)
            return f"/proc/{os.getpid()}/fd/{fd}"
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="hybridpd-secrets-")  # 0700
        path = os.path.join(self._dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


SECRET_ENV = ("HYBRIDPD_CLUSTER_TOKEN", "HYBRIDPD_API_KEY")
"""Environment variables that hold a secret itself (their *_FILE variants hold a path)."""


def scrub_secret_env() -> None:
    """Drop secrets from this process's environment once read, so that no process started from here (Ray's
    daemons and workers inherit the driver's environment) carries them."""
    for name in SECRET_ENV:
        os.environ.pop(name, None)


def ray_temp_root() -> str:
    """Where Ray's temp dirs go: $RAY_TMPDIR, else the system temp dir (usually /tmp)."""
    return os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()


def private_ray_dir() -> str:
    """A fresh 0700 directory (named after this process) to hold Ray's temp dir: Ray makes its own temp dir
    world-writable (0777), so it goes one level down, in `<this>/r`."""
    return tempfile.mkdtemp(prefix=f"{RAY_DIR_PREFIX}{os.getpid()}-", dir=ray_temp_root())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_ray_dirs(root: str | None = None) -> list[str]:
    """Remove the private Ray dirs of serves that died (their pid is gone) without cleaning up; only this user's
    dirs. Returns what was removed."""
    removed: list[str] = []
    base = Path(root or ray_temp_root())
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _RAY_DIR_RE.match(entry.name)
        try:
            mine = m is not None and entry.is_dir() and not entry.is_symlink() and entry.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and m is not None and not _alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed
