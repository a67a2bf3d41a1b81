"""What D's step thread spends on one handoff besides the READ, in process (no RPC, no NIXL): for prompts of
--tokens, the median over --requests of new_request (validation, block hashes), the prompt digest, begin_import
(pages for the pull) and complete_import (tail zeroing, publishing the pulled blocks into the prefix cache, cache
events), then D's first step. P is a second EngineCore whose export stands in for the pulled pages (the data is
not copied: only the bookkeeping is timed).

    python benchmarks/handoff_import_cost.py --tokens 1024,4096,8192
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("new_request", "digest", "begin_import", "complete_import", "first_step")


def measure(model: str, n: int, requests: int, device: str) -> dict[str, float]:
    from hybridpd.engine import SamplingParams
    from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from hybridpd.engine.core import EngineCore
    from hybridpd.engine.transfer import ImportSource, begin_import, complete_import, export_prefilled, release_export
    from hybridpd.kvtransfer.binding import prompt_digest

    def core() -> EngineCore:
        return EngineCore(
            EngineConfig(
                model=ModelConfig(path=model, max_model_len=n + 64, device=device),
                cache=CacheConfig(block_size=16, kv_cache_memory_bytes=512 * 2**20),
                scheduler=SchedulerConfig(max_num_batched_tokens=8192),
            )
        )

    p, d = core(), core()
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    for i in range(requests + 1):  # the first is a warm-up
        prompt = [rng.randrange(1, 500) for _ in range(n)]
        preq = p.add_request(f"r{i}", prompt, greedy, compute_target=n - 1)
        while p.has_unfinished():
            p.step()
        exp = export_prefilled(p, preq)
        t = [time.perf_counter()]
        dreq = d.new_request(f"r{i}", prompt, greedy)
        t.append(time.perf_counter())
        prompt_digest(prompt, n - 1, None)
        t.append(time.perf_counter())
        imp = begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
        t.append(time.perf_counter())
        complete_import(d, dreq, imp)
        t.append(time.perf_counter())
        d.step()
        t.append(time.perf_counter())
        release_export(p, preq, exp)
        while d.has_unfinished():
            d.step()
        if i:
            for k, a, b in zip(PHASES, t, t[1:], strict=False):
                times[k].append(1e3 * (b - a))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    print("prompt tokens | " + " | ".join(f"{k} ms" for k in PHASES))
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_checkpoint(
            f"{tmp}/m", "nemotron_h", seed=0, hidden_size=64, pattern="MMMM*MMMM-", vocab_size=512,
            max_position_embeddings=max(4096, *(int(x) + 64 for x in args.tokens.split(","))),
        )
        for n in (int(x) for x in args.tokens.split(",")):
            row = measure(model, n, args.requests, args.device)
            print(f"{n} | " + " | ".join(f"{row[k]:.2f}" for k in PHASES), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
