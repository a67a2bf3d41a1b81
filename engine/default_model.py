"""The built-in tiny model: a random-weight NemotronH checkpoint written on first use (deterministic seed)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_FAMILY = "nemotron_h"


def default_model_dir() -> Path:
    root = os.environ.get("HYBRIDPD_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "hybridpd")
    return Path(root) / "models" / f"tiny-{DEFAULT_FAMILY}"


def default_model_path() -> str:
    """Path of the built-in tiny model, writing it first if absent (atomically: temp dir + rename)."""
    path = default_model_dir()
    if (path / "config.json").exists():
        return str(path)
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
    write_random_checkpoint(str(tmp), DEFAULT_FAMILY, seed=0)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)
