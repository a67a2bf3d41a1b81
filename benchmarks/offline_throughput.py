"""Offline generation throughput of the colocated engine (a baseline to beat, not a goal yet).

    python benchmarks/offline_throughput.py --device cpu  --out offline_cpu.json
    python benchmarks/offline_throughput.py --device cuda --dtype bfloat16 --out offline_gpu.json
    python benchmarks/offline_throughput.py --device cuda --dtype bfloat16 --presets nemotron-h-8b,qwen3.5-9b \
        --num-prompts 256 --input-len 512 --output-len 128 --out offline_8b.json

Sizes are small random-weight checkpoints written to disk; presets are the full-size public shapes
(`engine.models.checkpoint.PRESETS`), config only, loaded with `load_format="dummy"` (random weights drawn on the
device).

For each model size: write a random-weight checkpoint, generate `--num-prompts` prompts x `--output-len` tokens
(greedy, ignore_eos), repeat, report the median generated tokens/s and total (prompt + generated) tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

SIZES = {
    "tiny": {"hidden_size": 64},
    "small": {"hidden_size": 512, "num_hidden_layers": 12, "vocab_size": 32000},
    "medium": {"hidden_size": 1024, "num_hidden_layers": 24, "vocab_size": 32000},
}
PATTERN = {"nemotron_h": {"pattern": "M-M*-M-M-"}, "qwen3_5": {}}


def run_one(family: str, size: str, args: argparse.Namespace, tmp: str) -> dict:
    import torch
    from hybridpd.engine import LLM, SamplingParams
    from hybridpd.engine.models.checkpoint import PRESETS, preset, write_preset_checkpoint, write_random_checkpoint

    if size in PRESETS:
        family = preset(size)[0]
        path = write_preset_checkpoint(f"{tmp}/{size}", size, weights=False)
    else:
        overrides = {**SIZES[size], **(PATTERN[family] if size != "tiny" else {})}
        path = write_random_checkpoint(f"{tmp}/{family}-{size}", family, seed=0, **overrides)
    kv_bytes = args.kv_bytes if args.kv_bytes else (None if args.device.startswith("cuda") else 512 * 2**20)
    llm = LLM(
        model=path,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.input_len + args.output_len + 16,
        load_format="dummy" if size in PRESETS else "auto",
    )
    params = sum(p.numel() for p in llm.engine.model.parameters())  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (args.input_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4, temperature=0))
    runner = llm.engine.runner
    zero_time = [0.0, 0]
    inner_zero = runner.zero_blocks
    cuda = args.device.startswith("cuda")

    def timed_zero(ids, *group):  # type: ignore[no-untyped-def]
        # the share of step time spent zeroing fresh blocks (synchronised, so it is the device time)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        n = inner_zero(ids, *group)  # several attention groups: the runner passes the group id
        if cuda:
            torch.cuda.synchronize()
        zero_time[0] += time.perf_counter() - t
        zero_time[1] += 1 if n else 0
        return n

    runner.zero_blocks = timed_zero
    times = []
    for _ in range(args.repeats):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert all(len(o.token_ids) == args.output_len for o in outs)
    t = statistics.median(times)
    gen = args.num_prompts * args.output_len
    steps = llm.engine.stats.num_steps
    zeroer_launches = runner.zero_launches
    del llm, runner, outs  # free this model's caches before the next size allocates its share of the GPU
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {
        "family": family,
        "size": size,
        "params_m": round(params / 1e6, 1),
        "device": args.device,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "median_s": round(t, 3),
        "gen_tok_s": round(gen / t, 1),
        "total_tok_s": round((gen + args.num_prompts * args.input_len) / t, 1),
        "repeats": len(times),
        "zeroing_share": round(zero_time[0] / sum(times), 5),
        "zeroing_launches": zero_time[1],
        "steps": steps,
        "zeroer_launches": zeroer_launches,
    }


def _run_isolated(family: str, size: str, argv: list[str] | None, tmp: str) -> dict:
    """One (family, size) in a fresh interpreter (same flags), its row read back from a JSON file."""
    import subprocess
    import sys

    out = f"{tmp}/{family}-{size}.json"
    base = list(sys.argv[1:] if argv is None else argv)
    one = ["--presets", size] if family == "preset" else ["--families", family, "--sizes", size]
    cmd = [sys.executable, __file__, *base, "--in-process", *one, "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        with open(out) as f:
            return json.load(f)["rows"][0]
    except (OSError, ValueError, IndexError):
        return {"family": family, "size": size, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--families", default="nemotron_h,qwen3_5")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--kv-bytes", type=int, default=None, help="cache budget (default: 512 MiB on CPU, 50%% of the GPU on CUDA)"
    )
    ap.add_argument("--presets", default=None,
                    help="full-size shapes instead of --families x --sizes, e.g. nemotron-h-8b,qwen3.5-9b")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="offline_throughput.json")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run every (family, size) in this process (default: a fresh process each, so no engine's GPU memory "
        "outlives its run)",
    )
    args = ap.parse_args(argv)
    rows = []
    runs = [("preset", p) for p in args.presets.split(",")] if args.presets else [
        (family, size) for family in args.families.split(",") for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for family, size in runs:
            if args.in_process:
                try:
                    rows.append(run_one(family, size, args, tmp))
                except Exception as e:  # noqa: BLE001 - record and go on with the other sizes
                    rows.append({"family": family, "size": size, "error": repr(e)})
            else:
                rows.append(_run_isolated(family, size, argv, tmp))
            print(json.dumps(rows[-1]), flush=True)
    cols = ["family", "size", "params_m", "device", "dtype", "median_s", "gen_tok_s", "total_tok_s", "zeroing_share"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, r.get("error", ""))) for c in cols))
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
