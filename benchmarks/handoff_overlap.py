"""What overlapping D's Commit with the request's first decode step saves, isolated from CPU contention.

    python benchmarks/handoff_overlap.py --commit-delay-ms 0,5,20 --out docs/results/handoff_overlap_cpu.json

One process: the real PrefillServicer and DecodeServicer over two CPU engines of the pd_handoff.py model (17 MB
recurrent state, hidden 256), a pull that copies pages between them (tests/support/pd_pair.py), and P's Commit
answered after an injected delay that costs no CPU (asyncio.sleep: a network round trip's shape). For each delay,
N requests one at a time with the overlap off and on, interleaved; D's time from Generate to its first chunk (the
request's second token) is reported as a median. Off it is (Commit + first step), on max(Commit, first step):
this is the mechanism alone. benchmarks/pd_handoff.py --commit-overlap off,on measures the real stack, where the
Commit's own CPU (both processes' gRPC) competes with the step on a small CPU box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def measure(model: str, delays_s: list[float], n: int) -> list[dict[str, Any]]:
    import pytest
    from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig
    from hybridpd.proto import hybridpd_pb2 as pb

    import tests.support.pd_pair as pd_pair

    mp = pytest.MonkeyPatch()
    mp.setattr(
        pd_pair,
        "engine_config",
        lambda m: EngineConfig(
            model=ModelConfig(path=m, dtype="float32", device="cpu", max_model_len=1024),
            cache=CacheConfig(block_size=16, checkpoint_interval=32, kv_cache_memory_bytes=256 * 2**20),
        ),
    )
    pair = await pd_pair.make_pair(model, mp)
    delay = [0.0]

    class Delayed(pd_pair.DirectStub):
        async def Commit(self, req: Any, timeout: float, metadata: Any) -> Any:
            await asyncio.sleep(delay[0])
            return await super().Commit(req, timeout, metadata)

    mp.setattr(pair.d, "_prefill_stub", lambda address: Delayed(pair.p))
    sp = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rows, k = [], 0
    try:
        for d in delays_s:
            delay[0] = d
            got: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(n):
                for overlap in (False, True):
                    pair.d.consumer.overlap = overlap
                    k += 1
                    prompt = [(7 * i + k) % 500 + 3 for i in range(140)]  # no prefix hit on either side
                    rid = f"r{k}"
                    resp = await pair.p.Prefill(
                        pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp),
                        pd_pair.FakeContext(),
                    )
                    req = pb.GenerateRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        sampling_params=sp,
                        params=resp.params,
                        first_token=pb.FirstToken(token_id=resp.first.token_ids[0]),
                    )
                    t0, first = time.perf_counter(), None
                    async for chunk in pair.d.Generate(req, pd_pair.FakeContext()):
                        if chunk.token_ids and first is None:
                            first = time.perf_counter() - t0
                    assert first is not None
                    got[overlap].append(first)
            off, on = (1e3 * statistics.median(got[o]) for o in (False, True))
            rows.append({"commit_delay_ms": 1e3 * d, "off_ms": off, "on_ms": on, "requests": n})
            print(
                f"commit delay {1e3 * d:.0f} ms: Generate -> token 2 median off {off:.1f} ms, on {on:.1f} ms",
                flush=True,
            )
    finally:
        pair.close()
        mp.undo()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit-delay-ms", default="0,5,20")
    ap.add_argument("--requests", type=int, default=12, help="per delay and setting")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(
            write_random_checkpoint(
                tmp,
                "nemotron_h",
                seed=0,
                hidden_size=256,
                pattern="MMMM*MMMM-",
                mamba_num_heads=64,
                mamba_head_dim=64,
                ssm_state_size=128,
                n_groups=4,
                vocab_size=512,
            )
        )
        delays = [float(x) / 1e3 for x in args.commit_delay_ms.split(",") if x]
        rows = asyncio.run(measure(model, delays, args.requests))
    print("\ncommit delay ms | Generate -> token 2, overlap off (median ms) | overlap on | saved")
    for r in rows:
        print(f"{r['commit_delay_ms']:.0f} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | {r['off_ms'] - r['on_ms']:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
