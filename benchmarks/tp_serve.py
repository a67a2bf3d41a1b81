"""A preset served at tensor parallelism through the whole serving path: one colocated worker whose ranks span the
GPUs (`--tensor-parallel-size`), the proxy, concurrent OpenAI completions. For models that do not fit one GPU, or
barely (Nemotron-3-Nano-30B-A3B: ~63 GB of bf16 weights), this is the check that they serve at all, and what they
serve at. Plain processes (deploy.local_cluster: no Ray), random weights (`--load-format dummy`), bf16.

    python benchmarks/tp_serve.py --preset nemotron-3-nano-30b-a3b --tp 2 --out out/tp_serve.json

Prints one row: requests ok, prompt/output tokens, TTFT p50/p99, TPOT p50, output tokens/s, cluster start time,
and from the worker's ready line its device, dtype, path and cache. Exit code 1 when any request fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stream_one(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: TTFT and the times between content chunks, from the client's side."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"{r.status_code} {r.read()[:200]!r}"}
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    if not stamps:
        return {"ok": False, "error": "no chunks"}
    gaps = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {"ok": True, "ttft": stamps[0] - t0, "tpot": gaps, "chunks": len(stamps), "end": stamps[-1] - t0}


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
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from hybridpd.deploy.local_cluster import start_cluster
    from hybridpd.engine.models.checkpoint import write_preset_checkpoint

    model = write_preset_checkpoint(tempfile.mkdtemp(prefix="tp-serve-"), args.preset, weights=False)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    worker_args = ["--device", args.device, "--dtype", dtype, "--load-format", "dummy"]
    worker_args += ["--tensor-parallel-size", str(args.tp), "--max-model-len", str(args.max_model_len)]
    t0 = time.time()
    cluster = start_cluster(model, colocated=True, worker_args=worker_args, ready_timeout_s=600)
    started = time.time() - t0
    try:
        ready = cluster.decode[0].info
        prompts = [[(37 * i + 11 * j) % 30000 + 100 for j in range(args.prompt_tokens)] for i in range(args.requests)]
        stream_one(cluster.url, cluster.model_name, prompts[0][:64], 8)  # warm-up
        t1 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda q: stream_one(cluster.url, cluster.model_name, q, args.max_tokens), prompts))
        wall = time.perf_counter() - t1
    finally:
        cluster.stop()
    ok = [r for r in results if r["ok"]]
    ttft = sorted(r["ttft"] for r in ok)
    row = {
        "preset": args.preset,
        "tp": args.tp,
        "requests": args.requests,
        "ok": len(ok),
        "errors": [r["error"] for r in results if not r["ok"]][:3],
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else None,
        "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
        "tpot_p50_ms": 1e3 * statistics.median(r["tpot"] for r in ok) if ok else None,
        "output_tok_per_s": sum(r["chunks"] for r in ok) / wall,
        "cluster_start_s": round(started, 1),
        "worker": {k: ready.get(k) for k in ("device", "dtype", "fast_path", "cuda_graphs", "kv_cache")},
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(row, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    sys.exit(0 if len(ok) == args.requests else 1)


if __name__ == "__main__":
    main()
