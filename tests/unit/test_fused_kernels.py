"""The fast path's fused kernels against the reference modules, on CPU under TRITON_INTERPRET=1 (the checks:
tests/support/fused_checks.py; the same run strictly on the GPU in tests/gpu/test_fused_kernels_cuda.py)."""

from __future__ import annotations

import os
import sys

import pytest

if "engine.kernels.paged_attention" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
    pytest.skip("Triton kernels already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402

from tests.support import fused_checks as fc  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _cpu() -> None:
    fc.setup("cpu", strict=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, zero_centered: bool) -> None:
    fc.check_rms_norm_with_and_without_residual(dtype, zero_centered)


def test_rms_norm_per_head_of_a_strided_view() -> None:
    fc.check_rms_norm_per_head_of_a_strided_view()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_group_norm(dtype: torch.dtype) -> None:
    fc.check_gated_group_norm(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_head_norm(dtype: torch.dtype) -> None:
    fc.check_gated_head_norm(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    fc.check_silu_mul(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba_decode_matches_reference_step(dtype: torch.dtype) -> None:
    fc.check_mamba_decode_matches_reference_step(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_decode_matches_reference_step(dtype: torch.dtype) -> None:
    fc.check_gdn_decode_matches_reference_step(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_varlen_matches_reference_chunks(dtype: torch.dtype) -> None:
    fc.check_conv_varlen_matches_reference_chunks(dtype)

