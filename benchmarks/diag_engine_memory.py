"""Diagnostic: does deleting an `LLM` give its GPU cache memory back? Builds one tiny engine on CUDA, runs it,
deletes it, collects garbage, and prints torch.cuda.memory_allocated before/after plus whatever still refers to
the cache tensors (nothing should).

    python benchmarks/diag_engine_memory.py
"""

from __future__ import annotations

import gc
import sys
import tempfile
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from hybridpd.engine import LLM, SamplingParams  # noqa: E402
from hybridpd.engine.models.checkpoint import write_random_checkpoint  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(f"{tmp}/n", "nemotron_h", seed=0)
        before = torch.cuda.memory_allocated()
        llm = LLM(model=path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, enable_prefix_caching=False)
        greedy = SamplingParams(max_tokens=8, temperature=0)
        llm.generate(prompt_token_ids=[[5, 6, 7, 8] * 8] * 4, sampling_params=greedy)
        runner = llm.engine.runner
        refs = [weakref.ref(t) for t in runner.attention_tensors + runner.state_tensors]
        during = torch.cuda.memory_allocated()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
        after = torch.cuda.memory_allocated()
        alive = [r() for r in refs if r() is not None]
        print(f"allocated GiB: before {before / 2**30:.2f} during {during / 2**30:.2f} after {after / 2**30:.2f}")
        print(f"cache tensors still alive: {len(alive)} of {len(refs)}")
        for t in alive[:1]:
            for ref in gc.get_referrers(t):
                print("  referrer:", type(ref).__name__, str(ref)[:300].replace("\n", " "))
                for ref2 in gc.get_referrers(ref)[:6]:
                    print("    <-", type(ref2).__name__, str(ref2)[:200].replace("\n", " "))


if __name__ == "__main__":
    main()
