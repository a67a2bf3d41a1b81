"""PD versus colocated serving on the same machine in the same run, through `hybridpd bench serve`.

    python benchmarks/serve_compare.py --device cpu --out serve_cpu.json
    python benchmarks/serve_compare.py --device cuda --dtype bfloat16 --size medium --gpus 0,0   # one GPU shared
    python benchmarks/serve_compare.py --device cuda --dtype bfloat16 --size medium --gpus 0,1   # P on 0, D on 1
    python benchmarks/serve_compare.py --device cuda --dtype bfloat16 --preset nemotron-h-8b --gpus 0,1
        # full-size shape: config only, workers draw random weights on their GPU (--load-format dummy)

Modes: `pd` (1 prefill + 1 decode worker, KV + state over NIXL) and `colocated` (1 worker). Datasets: random and
prefix-repetition. Prints TTFT / TPOT / throughput / hit rates per (mode, dataset) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.offline_throughput import PATTERN, SIZES  # noqa: E402


def bench(url: str, model: str, dataset: str, args: argparse.Namespace, out: str) -> dict:
    from hybridpd.deploy.bench_serve import main as bench_main

    argv = [
        "--base-url",
        url,
        "--model",
        model,
        "--dataset",
        dataset,
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--out",
        out,
        "--vocab-size",
        "256",
    ]
    if dataset == "random":
        argv += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    else:
        argv += [
            "--prefix-len",
            str(args.prefix_len),
            "--suffix-len",
            str(args.suffix_len),
            "--num-prefixes",
            str(args.num_prefixes),
            "--output-len",
            str(args.output_len),
        ]
    bench_main(argv)
    with open(out) as f:
        return json.load(f)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--family", default="nemotron_h")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--preset", default=None, help="a full-size shape (engine.models.checkpoint.PRESETS) instead of "
                    "--family/--size, loaded with --load-format dummy")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--gpus", default="0,0", help="CUDA devices of prefill,decode (colocated uses the first)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--modes", default="pd,colocated")
    ap.add_argument("--datasets", default="random,prefix-repetition")
    ap.add_argument("--out", default="serve_compare.json")
    args = ap.parse_args(argv)

    from hybridpd.deploy.local_cluster import start_cluster
    from hybridpd.engine.models.checkpoint import write_preset_checkpoint, write_random_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        wargs = ["--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(max(args.concurrency, 8))]
        if args.preset:
            model = write_preset_checkpoint(f"{tmp}/model", args.preset, weights=False)
            longest = max(args.input_len, args.prefix_len + args.suffix_len) + args.output_len + 16
            wargs += ["--load-format", "dummy", "--max-model-len", str(longest)]
        else:
            overrides = {**SIZES[args.size], **(PATTERN[args.family] if args.size != "tiny" else {})}
            model = write_random_checkpoint(f"{tmp}/model", args.family, seed=0, **overrides)
        if args.device == "cpu":
            wargs += ["--kv-cache-memory-bytes", str(256 * 2**20)]
        else:
            wargs += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        gp, gd = (args.gpus.split(",") + ["0"])[:2]
        for mode in args.modes.split(","):
            env_p = {"CUDA_VISIBLE_DEVICES": gp} if args.device != "cpu" else {}
            env_d = {"CUDA_VISIBLE_DEVICES": gd if mode == "pd" else gp} if args.device != "cpu" else {}
            c = start_cluster(
                model, colocated=(mode == "colocated"), worker_args=wargs, prefill_env=env_p, decode_env=env_d
            )
            try:
                for ds in args.datasets.split(","):
                    res = bench(c.url, c.model_name, ds, args, os.path.join(tmp, f"{mode}-{ds}.json"))
                    res.update({"mode": mode, "dataset": ds})
                    rows.append(res)
            finally:
                c.stop()
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": rows}, f, indent=2)
    cols = [
        "mode",
        "dataset",
        "ok",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "out_tok_s",
        "decode_hit",
        "decode_ext_hit",
    ]
    print(" | ".join(cols))
    for r in rows:
        s, w = r["summary"], r.get("worker_prefix_cache") or {}
        d = w.get("decode", {})
        vals = [
            r["mode"],
            r["dataset"],
            f"{s['completed']}/{s['completed'] + s['failed']}",
            f"{s['ttft_ms']['p50']:.1f}",
            f"{s['ttft_ms']['p99']:.1f}",
            f"{s['tpot_ms']['p50']:.2f}",
            f"{s['output_throughput']:.1f}",
            _pct(d.get("hit_rate")),
            _pct(d.get("external_hit_rate")),
        ]
        print(" | ".join(vals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
