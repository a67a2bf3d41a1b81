"""Cache-aware routing versus round robin on a prefix-heavy workload, through the proxy (plain processes, no Ray).

    python benchmarks/routing.py --device cuda --dtype bfloat16 --preset nemotron-h-8b --gpus 0,1 \
        --configs 1p1d:round_robin,1p1d:cache_aware,1p3d:round_robin,1p3d:cache_aware --rates 4,8,16 \
        --out routing_h100x2.json
    python benchmarks/routing.py --device cpu --num-prompts 24 --rates 4      # a dry run on the tiny model

Configurations `<P>p<D>d:<routing>`: P prefill workers on the first GPU of --gpus, D decode workers on the second
(several decode workers share it, each with --gpu-memory-utilization / D). Workload (open loop, Poisson arrivals
at each rate): prefixes of odd lengths drawn around --prefix-len, each reused --reuse times with a fresh suffix,
interleaved; every (configuration, rate) run draws its own prefixes, so runs never share cached blocks. A warm-up
of a few requests precedes each configuration.

Per run: TTFT / TPOT percentiles, goodput (requests per second meeting both SLOs, --slo-ttft / --slo-tpot),
decode-side prefix-cache hit tokens (what the decode workers found in their own caches: the proxy's
`hybridpd_proxy_route_real_hit_tokens_total`), and the skip-prefill fraction (requests a decode worker prefilled
itself). Writes JSON; prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridpd.deploy.bench_serve import RequestSpec, run_load, summarize  # noqa: E402

from benchmarks.offline_throughput import SIZES  # noqa: E402


def prefix_heavy(
    rng: random.Random, num_prompts: int, prefix_len: int, suffix_len: int, reuse: int, output_len: int, vocab: int
) -> list[RequestSpec]:
    """Prefixes of odd lengths in [prefix_len/2, 3*prefix_len/2], each used `reuse` times, shuffled."""
    specs = []
    for _ in range(max(1, num_prompts // reuse)):
        n = rng.randrange(prefix_len // 2, 3 * prefix_len // 2) | 1
        prefix = [rng.randrange(vocab) for _ in range(n)]
        for _ in range(reuse):
            tail = [rng.randrange(vocab) for _ in range(rng.randrange(max(1, suffix_len // 2), suffix_len + 1))]
            specs.append(RequestSpec(prefix + tail, n + len(tail), output_len))
    rng.shuffle(specs)
    return specs[:num_prompts]


def proxy_counters(url: str) -> dict[str, float]:
    """hybridpd_proxy_route_* counters of the proxy, summed per metric and path."""
    out: dict[str, float] = {}
    for m in re.finditer(r'^(hybridpd_proxy_route_\w+)\{path="(\w+)"\} (\S+)$', httpx.get(f"{url}/metrics").text, re.M):
        out[f"{m.group(1)}:{m.group(2)}"] = float(m.group(3))
    return out


def _delta(before: dict[str, float], after: dict[str, float], metric: str) -> dict[str, float]:
    keys = {k.split(":", 1)[1] for k in after if k.startswith(metric + ":")}
    return {p: after.get(f"{metric}:{p}", 0.0) - before.get(f"{metric}:{p}", 0.0) for p in keys}


def run_rate(url: str, model: str, specs: list[RequestSpec], rate: float, args: argparse.Namespace) -> dict[str, Any]:
    load = argparse.Namespace(
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        request_rate=rate,
        quiet=True,
        stream=True,
        endpoint="completions",
        temperature=0.0,
        ignore_eos=True,
    )
    before = proxy_counters(url)

    async def go() -> tuple[list[Any], float]:
        limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
            return await run_load(client, load, model, specs)

    results, duration = asyncio.run(go())
    after = proxy_counters(url)
    summary = summarize(results, duration)
    good = [
        r
        for r in results
        if r.ok
        and r.ttft is not None
        and r.ttft <= args.slo_ttft
        and (r.output_tokens <= 1 or (r.e2e - r.ttft) / (r.output_tokens - 1) <= args.slo_tpot)
    ]
    decisions = _delta(before, after, "hybridpd_proxy_route_decisions_total")
    hits = _delta(before, after, "hybridpd_proxy_route_real_hit_tokens_total")
    expected = _delta(before, after, "hybridpd_proxy_route_expected_hit_tokens_total")
    total = sum(decisions.values())
    return {
        "rate": rate,
        "summary": summary,
        "goodput_rps": len(good) / duration if duration else 0.0,
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "decode_hit_tokens": sum(hits.values()),
        "expected_hit_tokens": sum(expected.values()),
        "prompt_tokens": sum(s.prompt_len for s in specs),
        "decisions": decisions,
        "skip_prefill_fraction": decisions.get("skip_prefill", 0.0) / total if total else 0.0,
    }


def parse_config(text: str) -> tuple[int, int, str]:
    m = re.fullmatch(r"(\d+)p(\d+)d:(round_robin|least_loaded|cache_aware)", text.strip())
    if not m:
        raise SystemExit(f"bad configuration {text!r}: want e.g. 1p3d:cache_aware")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def model_and_args(args: argparse.Namespace, tmp: str) -> tuple[str, list[str]]:
    from hybridpd.engine.models.checkpoint import write_preset_checkpoint, write_random_checkpoint

    wargs = ["--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(max(args.max_concurrency, 8))]
    if args.preset:
        model = write_preset_checkpoint(f"{tmp}/model", args.preset, weights=False)
        longest = 3 * args.prefix_len // 2 + args.suffix_len + args.output_len + 16
        wargs += ["--load-format", "dummy", "--max-model-len", str(longest)]
    else:
        sizes: dict = SIZES[args.size]
        model = str(write_random_checkpoint(f"{tmp}/model", args.family, seed=0, **sizes))
    return model, wargs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--family", default="nemotron_h")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--preset", default=None, help="full-size shape (engine.models.checkpoint.PRESETS), dummy weights")
    ap.add_argument("--gpus", default="0,1", help="CUDA devices of the prefill and the decode workers")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="per GPU (split among its workers)")
    ap.add_argument("--configs", default="1p1d:round_robin,1p1d:cache_aware,1p3d:round_robin,1p3d:cache_aware")
    ap.add_argument("--rates", default="4,8", help="request rates (req/s), comma-separated")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=96)
    ap.add_argument("--reuse", type=int, default=4, help="requests per prefix")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.06, help="seconds per output token")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="routing.json")
    args = ap.parse_args(argv)

    from hybridpd.deploy.local_cluster import start_cluster

    rows: list[dict[str, Any]] = []
    gp, gd = (args.gpus.split(",") + ["0"])[:2]
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model, wargs = model_and_args(args, tmp)
        for k, text in enumerate(args.configs.split(",")):
            num_p, num_d, routing = parse_config(text)
            gpu = args.device != "cpu"
            share = [f"--gpu-memory-utilization={args.gpu_memory_utilization / max(1, n):.3f}" for n in (num_p, num_d)]
            t0 = time.time()
            c = start_cluster(
                model,
                worker_args=wargs,
                num_prefill=num_p,
                num_decode=num_d,
                prefill_env={"CUDA_VISIBLE_DEVICES": gp} if gpu else None,
                decode_env={"CUDA_VISIBLE_DEVICES": gd} if gpu else None,
                prefill_args=share[:1] if gpu else None,
                decode_args=share[1:] if gpu else None,
                proxy_args=["--routing", routing],
            )
            print(f"{text}: cluster up in {time.time() - t0:.0f} s", flush=True)
            try:
                warm = prefix_heavy(random.Random(10_000 + k), 8, args.prefix_len, args.suffix_len, 2, 8, args.vocab)
                run_rate(c.url, c.model_name, warm, 4.0, args)
                for j, rate in enumerate(rates):
                    rng = random.Random(args.seed * 1000 + j)  # the same requests for every configuration
                    specs = prefix_heavy(
                        rng, args.num_prompts, args.prefix_len, args.suffix_len, args.reuse, args.output_len, args.vocab
                    )
                    row = run_rate(c.url, c.model_name, specs, rate, args)
                    row.update(config=text, routing=routing, prefill=num_p, decode=num_d)
                    rows.append(row)
                    print(
                        f"  rate {rate:g}: goodput {row['goodput_rps']:.2f} req/s, decode hits "
                        f"{row['decode_hit_tokens']:.0f}, skip-P {row['skip_prefill_fraction']:.2f}",
                        flush=True,
                    )
            finally:
                c.stop()
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": rows}, f, indent=2, default=str)
    print_table(rows)
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    base = {(r["decode"], r["rate"]): r for r in rows if r["routing"] == "round_robin"}
    cols = [
        "config",
        "rate",
        "ok",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "goodput_rps",
        "vs_rr",
        "decode_hit_tok",
        "hit_vs_rr",
        "skip_P",
    ]
    print(" | ".join(cols))
    for r in rows:
        s, rr = r["summary"], base.get((r["decode"], r["rate"]))
        ratio = f"{r['goodput_rps'] / rr['goodput_rps']:.2f}x" if rr and rr["goodput_rps"] else "-"
        hit = f"{r['decode_hit_tokens'] / rr['decode_hit_tokens']:.2f}x" if rr and rr["decode_hit_tokens"] else "-"
        print(
            " | ".join(
                [
                    r["config"],
                    f"{r['rate']:g}",
                    f"{s['completed']}/{s['completed'] + s['failed']}",
                    f"{s['ttft_ms']['p50']:.0f}",
                    f"{s['ttft_ms']['p99']:.0f}",
                    f"{s['tpot_ms']['p50']:.1f}",
                    f"{r['goodput_rps']:.2f}",
                    ratio,
                    f"{r['decode_hit_tokens']:.0f}",
                    hit,
                    f"{r['skip_prefill_fraction']:.2f}",
                ]
            )
        )


if __name__ == "__main__":
    raise SystemExit(main())
