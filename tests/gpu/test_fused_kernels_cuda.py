"""The fast path's fused kernels against the reference modules, on CUDA, strictly: bf16 results bit-identical
to the reference in >= 99 % of the elements (tests/support/fused_checks.py; CPU: tests/unit/test_fused_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support import fused_checks as fc

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _cuda() -> None:
    fc.setup("cuda", strict=True)


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

