"""What prompt logprobs cost: prefill time and peak device memory of the colocated engine with `prompt_logprobs`
off, 0 and 20 (every prompt token scored, per prefill chunk, at most engine.prompt_scoring.ROWS_PER_PASS rows of
logits at once), on the same prompts. One plain process, no Ray.

    python benchmarks/prompt_logprobs.py --device cuda --dtype bfloat16 --preset nemotron-h-8b --out pl_8b.json
    python benchmarks/prompt_logprobs.py --device cpu --num-prompts 4 --input-len 256   # a smoke run

Each setting generates one token for `--num-prompts` random prompts of `--input-len` tokens (prefix caching off,
so every setting computes every prompt), `--repeats` times after a warm-up; the table gives the median seconds,
prompt tokens/s, the time relative to no prompt logprobs, and the peak device memory allocated during the runs
(CUDA only). Presets are the full-size public shapes with random weights drawn on the device (load_format dummy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

SETTINGS: tuple[int | None, ...] = (None, 0, 20)


def _llm(args: argparse.Namespace, tmp: str) -> Any:
    from hybridpd.engine import LLM
    from hybridpd.engine.models.checkpoint import write_preset_checkpoint, write_random_checkpoint

    if args.preset:
        path = write_preset_checkpoint(f"{tmp}/{args.preset}", args.preset, weights=False)
    else:
        path = write_random_checkpoint(
            f"{tmp}/small",
            "nemotron_h",
            seed=0,
            hidden_size=512,
            num_hidden_layers=12,
            vocab_size=32000,
            pattern="M-M*-M-M-",
        )
    cuda = args.device.startswith("cuda")
    return LLM(
        model=path,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=None if cuda else 512 * 2**20,
        max_model_len=args.input_len + 16,
        load_format="dummy" if args.preset else "auto",
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from hybridpd.engine import SamplingParams

    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(args, tmp)
        g = torch.Generator().manual_seed(0)
        vocab = min(llm.engine.vocab_size, 32000)
        prompts = [torch.randint(3, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.num_prompts)]
        rows = []
        for k in SETTINGS:
            sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k)
            llm.generate(prompt_token_ids=prompts[:2], sampling_params=sp)  # warm-up
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            if k is not None:
                assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == args.input_len for o in outs)
            seconds = statistics.median(times)
            rows.append(
                {
                    "prompt_logprobs": k,
                    "seconds": seconds,
                    "prompt_tokens_per_s": args.num_prompts * args.input_len / seconds,
                    "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                }
            )
    base = rows[0]["seconds"]
    for r in rows:
        r["relative_time"] = r["seconds"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--preset", default="", help="a full-size public shape (engine.models.checkpoint.PRESETS)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rows = run(args)
    print(f"{'prompt_logprobs':>15} {'seconds':>9} {'prompt tok/s':>13} {'x no-scores':>11} {'peak MiB':>10}")
    for r in rows:
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        k = "off" if r["prompt_logprobs"] is None else str(r["prompt_logprobs"])
        print(f"{k:>15} {r['seconds']:>9.3f} {r['prompt_tokens_per_s']:>13.0f} {r['relative_time']:>11.2f} {peak:>10}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
