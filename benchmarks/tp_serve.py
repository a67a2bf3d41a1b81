"""A preset served at tensor parallelism through the whole serving path: one colocated worker whose ranks span the
GPUs (`--tensor-parallel-size`), the proxy, and `hybridpd bench serve` (deploy/bench_serve.py) against it. For
models that do not fit one GPU, or barely (Nemotron-3-Nano-30B-A3B: ~63 GB of bf16 weights), this is the check that
they serve at all, and what they serve at. Plain processes (deploy.local_cluster: no Ray), random weights
(`--load-format dummy`), bf16 on CUDA.

    python benchmarks/tp_serve.py --preset nemotron-3-nano-30b-a3b --tp 2 --out out/tp_serve.json

Prints bench serve's report (TTFT, TPOT, ITL, throughput) and writes its JSON, with the worker's ready line
(device, dtype, path, cache) and the cluster's start time added. Exit code 1 when any request fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="nemotron-3-nano-30b-a3b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (gloo ranks, float32)")
    p.add_argument("--out", default="tp_serve.json")
    args = p.parse_args()

    from hybridpd.deploy import bench_serve
    from hybridpd.deploy.local_cluster import start_cluster
    from hybridpd.engine.models.checkpoint import write_preset_checkpoint

    model = write_preset_checkpoint(tempfile.mkdtemp(prefix="tp-serve-"), args.preset, weights=False)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    worker_args = ["--device", args.device, "--dtype", dtype, "--load-format", "dummy"]
    worker_args += ["--tensor-parallel-size", str(args.tp), "--max-model-len", str(args.max_model_len)]
    t0 = time.time()
    cluster = start_cluster(model, colocated=True, worker_args=worker_args, ready_timeout_s=600)
    started = time.time() - t0
    load = [
        "--base-url",
        cluster.url,
        "--dataset",
        "random",
        "--random-range-ratio",
        "0",
        "--ignore-eos",
        "--random-input-len",
        str(args.prompt_tokens),
        "--random-output-len",
        str(args.max_tokens),
        "--max-concurrency",
        str(args.concurrency),
        "--quiet",
        "--out",
        args.out,
    ]
    try:
        bench_serve.main([*load, "--num-prompts", "1", "--random-input-len", "64", "--out", os.devnull])  # warm-up
        rc = bench_serve.main([*load, "--num-prompts", str(args.requests)])
        ready = cluster.decode[0].info
    finally:
        cluster.stop()
    with open(args.out) as f:
        doc = json.load(f)
    doc.update(
        preset=args.preset,
        tp=args.tp,
        cluster_start_s=round(started, 1),
        date=time.strftime("%Y-%m-%d"),
        worker={k: ready.get(k) for k in ("device", "dtype", "fast_path", "cuda_graphs", "kv_cache")},
    )
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    sys.exit(rc)


if __name__ == "__main__":
    main()
