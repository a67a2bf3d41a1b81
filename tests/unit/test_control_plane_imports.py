"""The control plane is tensor-free: importing engine.cache.* and engine.scheduler loads no torch."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import hybridpd.engine.cache as cache

REPO = Path(__file__).resolve().parents[2]
CONTROL_PLANE = sorted(
    [f"hybridpd.engine.cache.{m.name}" for m in pkgutil.iter_modules(cache.__path__)]
    + ["hybridpd.engine.cache", "hybridpd.engine.scheduler", "hybridpd.engine.request", "hybridpd.engine.config"]
)

PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
heavy = sorted(m for m in ("torch", "triton") if m in sys.modules)
print(json.dumps(heavy))
"""


def test_control_plane_modules_are_listed() -> None:
    for name in ("arena", "pools", "tree", "coordinator", "hashing", "planner", "specs"):
        assert f"hybridpd.engine.cache.{name}" in CONTROL_PLANE


def test_control_plane_imports_no_torch() -> None:
    res = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(CONTROL_PLANE)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
