"""Precision diagnostic on the GPU: how far each implementation's greedy logprobs sit from the fp32 truth.

The truth is transformers' uncached forward on the same GPU in float64 (`--truth float32` for its fp32 forward).
Every implementation's own greedy continuation is scored under the truth (teacher-forced, so a diverging token
does not cascade): per chosen token, |its logprob - the truth's logprob of that token|, and whether the truth would
have chosen it (if not, by what margin: a near-tie flips in bf16 by rounding alone).

    python benchmarks/diag_precision.py --out diag_precision.json

Implementations: transformers fp32 (GPU and CPU) and bf16 (GPU), the engine's reference path and its fast path
(fla-core kernels, CUDA graphs) in fp32 and bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ["TRITON_F32_DEFAULT"] = "ieee"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]
MODELS = {
    "nemotron_attn_mid": ("nemotron_h", {"hybrid_override_pattern": "M*-MM-"}),
    "nemotron_attn_last": ("nemotron_h", {"hybrid_override_pattern": "MMM-M*"}),
    "nemotron_moe": ("nemotron_h", {"hybrid_override_pattern": "M*ME"}),
    "qwen_attn_last": ("qwen3_5", {"layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "qwen_attn_first": ("qwen3_5", {"layer_types": ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]}),
}


def engine_run(path: str, dtype: str, fast: bool, prompts: list[list[int]], n: int):  # type: ignore[no-untyped-def]
    from hybridpd.engine import LLM, SamplingParams

    from tests.support.forward_path import forward_path

    with forward_path(fast):
        llm = LLM(model=path, device="cuda", dtype=dtype, max_num_batched_tokens=48,
                  kv_cache_memory_bytes=256 * 2**20, max_model_len=512, checkpoint_interval=32)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [(o.token_ids, o.logprobs) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--truth", default="float64", choices=("float64", "float32"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="diag_precision.json")
    args = ap.parse_args()
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    from tests.oracle import hf_greedy, hf_model, random_prompts, score_under

    prompts = random_prompts(LENGTHS, vocab=256, seed=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            family, overrides = MODELS[name]
            path = write_random_checkpoint(f"{tmp}/{name}", family, seed=0, **overrides)
            truth = hf_model(path, args.truth, "cuda")
            impls = {}
            for dtype in args.dtypes.split(","):
                impls[f"hf_{dtype}"] = lambda d=dtype, path=path: [
                    hf_greedy(path, p, args.new_tokens, d, "cuda") for p in prompts]
                if dtype == "float32":
                    impls["hf_float32_cpu"] = lambda path=path: [hf_greedy(path, p, args.new_tokens) for p in prompts]
                impls[f"ref_{dtype}"] = lambda d=dtype, path=path: engine_run(path, d, False, prompts, args.new_tokens)
                impls[f"fast_{dtype}"] = lambda d=dtype, path=path: engine_run(path, d, True, prompts, args.new_tokens)
            for impl, fn in impls.items():
                try:
                    row = {"model": name, "impl": impl, **score_under(truth, prompts, fn(), "cuda")}
                except Exception as e:  # noqa: BLE001 - record and go on
                    row = {"model": name, "impl": impl, "error": repr(e)[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
            hf_model.cache_clear()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    cols = ["model", "impl", "max_lp_err", "mean_lp_err", "p50_lp_err", "non_argmax", "max_margin", "tokens"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.2e}" if isinstance(r.get(c), float) else str(r.get(c, r.get("error", "")))
                         for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
