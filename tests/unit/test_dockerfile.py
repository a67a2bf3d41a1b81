"""The Dockerfile installs what scripts/setup.sh installs (by running it), on the Ray version the Helm chart runs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _values() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "deploy/helm/hybridpd/values.yaml").read_text())


def test_dockerfile_runs_setup_and_matches_the_chart() -> None:
    docker = (ROOT / "Dockerfile").read_text()
    runs = [line for line in docker.splitlines() if line.startswith("RUN ")]
    assert len(runs) == 1 and "HYBRIDPD_PYTHON=python bash scripts/setup.sh gpu" in runs[0]
    assert not re.search(r"pip install (?!-q)", docker.replace("pip cache purge", "")), "install only via setup.sh"
    base = re.search(r"ARG BASE_IMAGE=rayproject/ray:([0-9.]+)-py\d+-cu\d+", docker)
    assert base is not None
    ray_version = next(v["spec"]["rayVersion"] for k, v in _values().items()
                       if isinstance(v, dict) and "spec" in v and "rayVersion" in v.get("spec", {}))
    assert base.group(1) == ray_version
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None and _values()["image"] == f"hybridpd:{version.group(1)}"


def test_setup_installs_the_requested_extras(tmp_path: Path) -> None:
    """setup.sh with a fake interpreter: the pip commands it runs (the image runs the same script)."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(0o755)
    subprocess.run(["bash", str(ROOT / "scripts/setup.sh"), "gpu"], check=True, env={"HYBRIDPD_PYTHON": str(fake),
                                                                                        "PATH": "/usr/bin:/bin"})
    calls = log.read_text().splitlines()
    assert "-m pip install -q torch==2.13.0" in calls
    assert calls[-1] == "-m pip install -q -e .[gpu]"
    r = subprocess.run(["bash", str(ROOT / "scripts/setup.sh"), "cuda"], capture_output=True, text=True,
                       env={"HYBRIDPD_PYTHON": str(fake), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "unknown extra" in r.stderr
