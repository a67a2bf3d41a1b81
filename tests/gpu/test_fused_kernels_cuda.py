"""The fast path's fused kernels against the reference modules on CUDA, strictly: bf16 results bit-identical to
the reference in >= 99 % of the elements (the checks: tests/support/fused_checks.py, imported lazily so that
collecting this file compiles no kernel; CPU: tests/unit/test_fused_kernels.py, which also checks that CHECKS
names every check)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

CHECKS = ["conv_varlen_matches_reference_chunks", "gated_group_norm", "gated_head_norm",
          "gdn_decode_matches_reference_step", "mamba_chunk_inputs_and_skip", "mamba_decode_matches_reference_step",
          "moe_combine", "paged_attention_across_key_tiles", "paged_attention_any_group_and_head_dim", "relu2",
          "rms_norm_per_head_of_a_strided_view", "rms_norm_with_and_without_residual", "rope_partial_on_strided_heads",
          "sigmoid_gate", "silu_mul"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CHECKS)
def test_fused_kernel_matches_reference_strictly(name: str, dtype: str) -> None:
    import torch

    from tests.support import fused_checks as fc

    fc.run_check(name, getattr(torch, dtype), "cuda", strict=True)
