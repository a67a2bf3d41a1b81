"""The batched fast path (engine.models.varlen + fast_path + the Triton kernels) against the CPU reference, on CPU:
the Triton kernels run under TRITON_INTERPRET=1; the chunked prefill scans use the reference per sequence there
(fla-core's kernels need a GPU: tests/gpu/test_fast_path_cuda.py). Chunked prefill with prefix states, checkpoint
rounds, MoE, GQA decode; PAD_SLOT_ID rows neither read nor write a slot."""

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
from hybridpd.engine.cache.specs import PAD_SLOT_ID  # noqa: E402

from tests.oracle import random_prompts  # noqa: E402
from tests.support.forward_path import forward_path  # noqa: E402

pytest.importorskip("triton")

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # shapes that are not powers of two (padded in the kernels): GQA group 3, head dim 24, Mamba state 12
    "nemotron_moe": ("nemotron_h", {"hybrid_override_pattern": "M*ME", "num_attention_heads": 3,
                                    "num_key_value_heads": 1, "head_dim": 24, "ssm_state_size": 12}),
    "qwen": ("qwen3_5", {"layer_types": ["linear_attention", "full_attention", "linear_attention"]}),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):  # type: ignore[no-untyped-def]
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    def get(name: str) -> str:
        family, overrides = CASES[name]
        return write_random_checkpoint(str(tmp_path_factory.mktemp(name)), family, seed=0, **overrides)

    return get


def _run(path: str, fast: bool) -> list:  # type: ignore[type-arg]
    with forward_path(fast):
        llm = LLM(model=path, device="cpu", dtype="float32", max_num_batched_tokens=24,
                  kv_cache_memory_bytes=32 * 2**20, max_model_len=256, checkpoint_interval=16)
    runner = llm.engine.runner
    assert runner.fast_path is fast
    other = "forward_reference" if fast else "forward_varlen"

    def refuse(*_: Any) -> None:
        raise AssertionError(f"{other} ran, but the runner chose the other path at construction")

    setattr(runner.model, other, refuse)  # the path is chosen once: the other forward never runs
    prompts = random_prompts([5, 37], vocab=256, seed=3)
    return llm.generate(prompt_token_ids=prompts,  # prompt logprobs: rows of the step's hidden states
                        sampling_params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2))


@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_path_matches_reference_fp32(name, model_path, one_torch_thread):  # type: ignore[no-untyped-def]
    path = model_path(name)
    ref, fast = _run(path, False), _run(path, True)
    for a, b in zip(ref, fast, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        for ra, rb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):  # over 24-token chunks
            assert list(ra) == list(rb) and all(abs(ra[t].logprob - rb[t].logprob) < 1e-4 for t in ra)


def test_decode_kernels_skip_pad_rows():  # type: ignore[no-untyped-def]
    from hybridpd.engine.kernels.recurrent_step import conv_step, gdn_decode, mamba_decode

    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([2, PAD_SLOT_ID, 1])
    has_init = torch.tensor([1, 1, 0], dtype=torch.int32)
    rows = torch.arange(3)
    conv = torch.randn(3, 8, 3, generator=g)
    before = conv.clone()
    conv_step(torch.randn(3, 8, generator=g), conv, torch.randn(8, 4, generator=g), None, slots, has_init, rows)
    assert torch.equal(conv[0], before[0])  # slot 0 (null) untouched by the padded row
    assert not torch.equal(conv[2], before[2]) and not torch.equal(conv[1], before[1])
    H, P, G, N = 4, 8, 2, 16
    ssm = torch.randn(3, H, P, N, generator=g)
    before = ssm.clone()
    xc = torch.randn(3, H * P + 2 * G * N, generator=g)
    dt_raw = torch.randn(3, H, generator=g)
    y = torch.zeros(3, H, P)
    mamba_decode(xc, dt_raw, torch.zeros(H), torch.zeros(H), torch.ones(H), ssm, slots, has_init, rows, y, G, 1e-3)
    assert torch.equal(ssm[0], before[0])
    # row 2 starts from zeros (has_init = 0): its new state is dt x B^T alone, whatever slot 1 held
    dt = torch.nn.functional.softplus(dt_raw[2]).clamp(min=1e-3)
    x, B = xc[2, :H * P].view(H, P), xc[2, H * P:H * P + G * N].view(G, N).repeat_interleave(H // G, dim=0)
    torch.testing.assert_close(ssm[1], (dt[:, None] * x)[..., None] * B[:, None, :])
    state = torch.randn(3, 4, 16, 8, generator=g)
    before = state.clone()
    out = torch.zeros(3, 4, 8)
    ab = torch.randn(3, 8, generator=g)
    gdn_decode(torch.randn(3, 2 * 2 * 16 + 4 * 8, generator=g), ab[:, :4], ab[:, 4:], torch.zeros(4), torch.zeros(4),
               state, slots, has_init, rows, out, 2)
    assert torch.equal(state[0], before[0])
    assert not torch.equal(state[2], before[2])


def test_grouped_moe_matches_expert_loop():  # type: ignore[no-untyped-def]
    """moe_routed (tokens sorted by expert, torch._grouped_mm, no host sync) against the reference expert loop, bf16
    on CPU (torch._grouped_mm has a CPU kernel here; the GPU runs it in the CUDA graph)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    from hybridpd.engine.models.checkpoint import random_engine_model
    from hybridpd.engine.models.fast_path import moe_routed

    model = random_engine_model("nemotron_h", "bfloat16", "cpu", pattern="E", hidden_size=64, n_routed_experts=8,
                                num_experts_per_tok=3)
    moe = model.backbone.layers[0].mixer
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = moe(x)
    moe.use_grouped_gemm()
    weights, idx = moe.gate(x)
    try:
        fast = moe_routed(moe, x, weights, idx).to(x.dtype) + moe.shared_experts(x)
    except (RuntimeError, NotImplementedError) as e:  # older torch: no CPU kernel
        pytest.skip(f"torch._grouped_mm on CPU: {e}")
    assert idx.unique().numel() > 3  # several experts are really used
    torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert moe(x).shape == ref.shape  # after stacking, the reference loop still runs on the experts' views


def test_fast_path_async_scheduling_feeds_tokens_on_the_device(model_path, one_torch_thread):  # type: ignore[no-untyped-def]
    """The batched path's fed steps (asynchronous scheduling: a decode step's input ids copied from the previous
    step's samples on the device, over the uploaded placeholders) give the synchronous engine's tokens, with the
    request ending at a stop token while the next step already holds it."""
    path = model_path("nemotron_moe")
    prompt = random_prompts([7], vocab=256, seed=4)
    engines = []
    for asynchronous in (False, True):
        with forward_path(True):
            engines.append(LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=32 * 2**20,
                               max_model_len=64, async_scheduling=asynchronous))
    probe = engines[0].generate(prompt_token_ids=prompt,
                                sampling_params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    stop = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(probe.token_ids[2],))
    sync, fast = (llm.generate(prompt_token_ids=prompt, sampling_params=stop)[0] for llm in engines)
    assert fast.token_ids == sync.token_ids == probe.token_ids[: len(sync.token_ids)]
    assert fast.logprobs == sync.logprobs
    pipeline = engines[1].engine.pipeline
    assert engines[1].engine.runner.fast_path and pipeline.num_ahead > 0 and pipeline.num_overrun > 0
