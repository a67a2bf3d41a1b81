"""The models' batched forward under a fused TP block end (engine.parallel.group.BlockReduce): inside the scope the
row-parallel hooks return their partial sums as they are, so every one of them must reach the next residual norm
(which sums it over the ranks) and nothing else; the norm must see nothing already summed (the embedding). Checked
on CPU (Triton under the interpreter) with a stand-in group whose "sum over ranks" doubles a tensor: the hooks of
the real cut (engine.parallel.shard at one rank: every hook registered, nothing sliced) double their outputs on
the NCCL path; the stand-in block end doubles its input instead. The two runs give the same bits only if each
hooked output goes through exactly one block end, and the block ends of a forward number `block_ends`. Cases:
NemotronH's Mamba, attention, MLP and MoE with latent projections under expert parallelism; Qwen3.5's GDN,
attention and sparse MoE (prefill and decode steps, prompt logprobs)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

if "hybridpd.engine.kernels.paged_attention" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
    pytest.skip("Triton kernels already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from hybridpd.engine import LLM, SamplingParams  # noqa: E402
from hybridpd.engine.kernels.fused import rms_norm  # noqa: E402
from hybridpd.engine.parallel import shard  # noqa: E402
from hybridpd.engine.parallel.group import TPGroup  # noqa: E402

from tests.support.forward_path import forward_path  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "nemotron_latent_moe_ep": ("nemotron_h", {"hybrid_override_pattern": "M*E-", "moe_latent_size": 24}, True),
    "qwen_moe": ("qwen3_5_moe", {"layer_types": ["linear_attention", "full_attention"]}, False),
}


class DoublingTP(TPGroup):
    """One rank standing for two identical ones: a sum over the ranks doubles, a gather keeps the tensor."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DoublingBlockEnd:
    """The fused block end's call: the partial sum doubled (summed), added to the residual and normalised."""

    def __init__(self) -> None:
        self.max_rows, self.dtype, self.site = 1 << 20, torch.float32, 0
        self.per_forward: list[int] = []

    def begin(self) -> None:
        self.per_forward.append(0)

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        zero_centered: bool = False,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.per_forward[-1] += 1
        return rms_norm(x * 2, weight, eps, zero_centered, residual)


def _generate(path: str, expert_parallel: bool, fused: bool) -> tuple[list[Any], Any, DoublingBlockEnd]:
    with forward_path(True):
        llm = LLM(
            model=path,
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=16,
            kv_cache_memory_bytes=16 * 2**20,
            max_model_len=64,
        )
    model = llm.engine.runner.model
    tp = DoublingTP(rank=0, world=1, group=None, control=None)
    cut = shard.shard_nemotron_h if model.architecture == "NemotronHForCausalLM" else shard.shard_qwen3_5
    cut(model, tp, expert_parallel)  # one rank of one: every hook, nothing sliced
    model.block_reduce = tp.block_reduce
    end = DoublingBlockEnd()
    if fused:
        tp.block_reduce.fused = end
    prompts = [[3, 14, 15, 92, 65, 35], [89, 79, 32]]
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1),
    )
    return outs, model, end


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_hooked_output_reaches_one_block_end(name: str, tmp_path: Any) -> None:
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    family, overrides, expert_parallel = CASES[name]
    path = write_random_checkpoint(str(tmp_path), family, seed=0, **overrides)
    nccl, _, _ = _generate(path, expert_parallel, fused=False)
    fused, model, end = _generate(path, expert_parallel, fused=True)
    assert end.per_forward and set(end.per_forward) == {model.block_ends}
    for a, b in zip(nccl, fused, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        for ra, rb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):  # the prefill's rows
            assert {t: p.logprob for t, p in ra.items()} == {t: p.logprob for t, p in rb.items()}
