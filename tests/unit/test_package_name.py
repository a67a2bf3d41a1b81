"""The distribution installs one top-level package, `hybridpd`; the repository's folders are its subpackages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ("engine", "prefill", "decode", "kvtransfer", "proto", "proxy", "deploy", "worker")


def test_import_hybridpd_gives_the_offline_api() -> None:
    from hybridpd.engine.llm import LLM
    from hybridpd.engine.sampling_params import SamplingParams

    import hybridpd

    assert hybridpd.LLM is LLM and hybridpd.SamplingParams is SamplingParams
    assert hybridpd.__version__ and hybridpd.__version__ != "0+unknown"


def test_no_top_level_runtime_package_is_installed(tmp_path: Path) -> None:
    """Outside the repository (no source folder on sys.path), only `hybridpd.*` resolves."""
    code = (
        "import importlib.util as u, json; "
        f"print(json.dumps({{n: (u.find_spec(n) is not None, u.find_spec('hybridpd.' + n) is not None) "
        f"for n in {list(RUNTIME)!r}}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    import json

    found = json.loads(out.stdout)
    assert found == {n: [False, True] for n in RUNTIME}, found


def test_every_subpackage_is_installed_under_hybridpd() -> None:
    """setup.py maps every folder of the runtime packages that has an __init__.py (a new one is never left out)."""
    code = "import runpy, setuptools; setuptools.setup = lambda **kw: print(sorted(kw['packages']))"
    code += f"; runpy.run_path({str(ROOT / 'setup.py')!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    packages = set(ast.literal_eval(out.stdout))
    on_disk = {
        "hybridpd." + ".".join(p.parent.relative_to(ROOT).parts)
        for top in RUNTIME
        for p in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk <= packages and "hybridpd" in packages
