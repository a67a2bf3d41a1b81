"""deploy/secret_files.py and the reaper's cleanup: secrets handed on by an in-memory file that only this user's
processes can open and that no disk holds; private Ray temp dirs of dead serves are swept."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hybridpd.deploy.secret_files import SecretFiles, private_ray_dir, scrub_secret_env, sweep_stale_ray_dirs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd, /proc")


def test_a_secret_is_read_by_path_from_another_process_and_gone_after_close(tmp_path: Path) -> None:
    files = SecretFiles()
    path = files.add("token", "s3cret-value")
    assert path.startswith(f"/proc/{os.getpid()}/fd/")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    child = subprocess.run(
        [sys.executable, "-c", f"print(open({path!r}).read())"], capture_output=True, text=True, check=True
    )
    assert child.stdout.strip() == "s3cret-value"
    assert not any(b"s3cret-value" in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    files.close()
    with pytest.raises(OSError):
        open(path).read()


def test_scrub_drops_secret_values_not_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDPD_CLUSTER_TOKEN", "t")
    monkeypatch.setenv("HYBRIDPD_API_KEY", "k")
    monkeypatch.setenv("HYBRIDPD_CLUSTER_TOKEN_FILE", "/some/path")
    scrub_secret_env()
    assert "HYBRIDPD_CLUSTER_TOKEN" not in os.environ and "HYBRIDPD_API_KEY" not in os.environ
    assert os.environ["HYBRIDPD_CLUSTER_TOKEN_FILE"] == "/some/path"


def test_private_ray_dirs_of_dead_serves_are_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    mine = Path(private_ray_dir())
    assert mine.parent == tmp_path and stat.S_IMODE(mine.stat().st_mode) == 0o700
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"hpd{dead.pid}-abcdefgh"
    (stale / "r" / "session_x").mkdir(parents=True)
    other = tmp_path / "hpdray-notours"
    other.mkdir()
    assert sweep_stale_ray_dirs() == [str(stale)]
    assert mine.is_dir() and other.is_dir() and not stale.exists()


def test_the_reaper_removes_what_it_was_given_once_the_driver_is_gone(tmp_path: Path) -> None:
    from hybridpd.deploy.reaper import watch

    leftover = tmp_path / "hpd1-x" / "r"
    leftover.mkdir(parents=True)
    read_fd, write_fd = os.pipe()
    os.close(write_fd)  # the driver is gone
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watch(gone.pid, read_fd, [str(tmp_path / "hpd1-x")])
    os.close(read_fd)
    assert not (tmp_path / "hpd1-x").exists()
