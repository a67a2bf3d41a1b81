"""What fail-closed costs: the Commit round trip D makes after each READ, next to the pull itself and the request.

    python benchmarks/handoff_commit.py --out docs/results/handoff_commit_cpu.json [--device cuda --dtype bfloat16]

Starts 1 prefill + 1 decode worker (plain processes, real gRPC + NIXL), then for each prompt length sends N
sequential requests straight to the workers (max_tokens 2: P samples token 1, D token 2) and reads D's histograms:
hybridpd_kv_transfer_seconds (pull start -> data in place) and hybridpd_kv_transfer_commit_seconds (READ done ->
P's answer), as means over the run; also the median of N bare Commit RPCs to P from this process (a refused commit:
the same gRPC trip and P step-thread hop). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
from hybridpd.proto import hybridpd_pb2 as pb  # noqa: E402
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc  # noqa: E402


def _hist(c, w, name: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    return (c.metric(w, f"{name}_sum", role="decode"), c.metric(w, f"{name}_count", role="decode"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", default="128,1024,4096")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random NemotronH)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from hybridpd.deploy.local_cluster import start_cluster
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    from tests.oracle import random_prompts

    model = args.model or str(write_random_checkpoint(tempfile.mkdtemp(), "nemotron_h", seed=0,
                                                        max_position_embeddings=8192))
    # two workers may share one GPU: each gets a fixed cache budget rather than a share of the GPU
    c = start_cluster(model, worker_args=["--device", args.device, "--dtype", args.dtype, "--max-model-len", "8192",
                                          "--kv-cache-memory-bytes", str(2 << 30)])
    rows = []
    try:
        p_addr, d_addr = c.prefill[0].info["address"], c.decode[0].info["address"]
        sp = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # P's first token, D's one
        with grpc.insecure_channel(p_addr) as pch, grpc.insecure_channel(d_addr) as dch:
            p, d = pb_grpc.PrefillServiceStub(pch), pb_grpc.DecodeServiceStub(dch)
            rtt = []
            for i in range(args.requests):
                t0 = time.perf_counter()
                p.Commit(pb.CommitRequest(request_id=f"none-{i}", epoch=c.prefill[0].info["epoch"]), timeout=10)
                rtt.append(time.perf_counter() - t0)
            for n in (int(x) for x in args.lengths.split(",")):
                pull0, commit0 = _hist(c, c.decode[0], "hybridpd_kv_transfer_seconds"), \
                    _hist(c, c.decode[0], "hybridpd_kv_transfer_commit_seconds")
                e2e = []
                for i, prompt in enumerate(random_prompts([n] * args.requests, vocab=256, seed=n)):
                    rid = f"len{n}-{i}"
                    t0 = time.perf_counter()
                    resp = p.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp),
                                     timeout=300)
                    t1 = time.perf_counter()
                    first = pb.FirstToken(token_id=resp.first.token_ids[0])
                    list(d.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                                                       params=resp.params, first_token=first), timeout=300))
                    e2e.append(time.perf_counter() - t1)
                    del t0
                pull1, commit1 = _hist(c, c.decode[0], "hybridpd_kv_transfer_seconds"), \
                    _hist(c, c.decode[0], "hybridpd_kv_transfer_commit_seconds")
                pulls, commits = pull1[1] - pull0[1], commit1[1] - commit0[1]
                rows.append({
                    "prompt_tokens": n, "requests": args.requests, "pulls": pulls, "commits": commits,
                    "pull_mean_ms": 1e3 * (pull1[0] - pull0[0]) / max(pulls, 1),
                    "commit_mean_ms": 1e3 * (commit1[0] - commit0[0]) / max(commits, 1),
                    "generate_1_token_median_ms": 1e3 * statistics.median(e2e),
                })
        result = {"device": args.device, "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"),
                  "bare_commit_rpc_median_ms": 1e3 * statistics.median(rtt), "rows": rows}
    finally:
        c.stop()
    print(f"bare Commit RPC (refused, same trip): median {result['bare_commit_rpc_median_ms']:.2f} ms")
    print(f"{'prompt':>7} {'pulls':>6} {'pull ms':>8} {'commit ms':>10} {'commit/pull':>12} {'Generate(1) ms':>15}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['pulls']:>6.0f} {r['pull_mean_ms']:>8.2f} {r['commit_mean_ms']:>10.2f} "
              f"{r['commit_mean_ms'] / max(r['pull_mean_ms'], 1e-9):>12.2f} {r['generate_1_token_median_ms']:>15.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
