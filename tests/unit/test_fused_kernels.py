"""The fast path's fused kernels against the reference modules, on CPU under TRITON_INTERPRET=1 (the checks:
tests/support/fused_checks.py; the same checks run strictly on the GPU in tests/gpu/test_fused_kernels_cuda.py)."""

from __future__ import annotations

import os
import sys

import pytest

KERNEL_MODULES = ("hybridpd.engine.kernels.paged_attention", "hybridpd.engine.kernels.fused",
                  "hybridpd.engine.kernels.recurrent_step",
                  "hybridpd.engine.kernels.recurrent_prefill")
if any(m in sys.modules for m in KERNEL_MODULES) and not os.environ.get("TRITON_INTERPRET"):
    pytest.skip("Triton kernels already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402

from tests.gpu.test_fused_kernels_cuda import CHECKS  # noqa: E402
from tests.support import fused_checks as fc  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CHECKS)
def test_fused_kernel_matches_reference(name: str, dtype: torch.dtype) -> None:
    fc.run_check(name, dtype, "cpu", strict=False)


def test_gpu_suite_runs_every_check() -> None:
    assert sorted(CHECKS) == fc.check_names()
