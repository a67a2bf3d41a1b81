"""tests/conftest.py's HEAVY_FIRST (the files xdist hands out first) names files that exist, once each: a renamed
heavy file would otherwise drop back to the end of the order unnoticed, and one worker finish long after the other."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY_FIRST

ROOT = Path(__file__).resolve().parents[2]


def test_heavy_first_names_existing_test_files_once() -> None:
    missing = [path for path in HEAVY_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"HEAVY_FIRST names files that are gone: {missing}"
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)
    assert all(Path(path).name.startswith("test_") for path in HEAVY_FIRST)
