"""The decode kernels alone at full-size shapes, per tile choice: the recurrent ones (engine.kernels.recurrent_step;
bandwidth = state read + written) and paged attention (engine.kernels.paged_attention; bandwidth = K/V read). Time
is the median of 20 CUDA-event timings, against a same-run device-to-device copy (roofline.py's). Prints a table;
--out writes JSON.

    python benchmarks/decode_kernels.py --batch 64
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
from hybridpd.engine.kernels import recurrent_step as rs

from benchmarks.roofline import copy_bandwidth


def median_ms(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def attention_rows(B: int, contexts: list[int], tiles: list[tuple[int, int, int]] | None = None
                   ) -> list[dict]:  # type: ignore[type-arg]
    """Decode attention (one query token per sequence) over a paged cache: the prefill kernel's path (one program
    per sequence and KV head) against the split-KV kernels, with the default and fixed numbers of key ranges."""
    from hybridpd.engine.kernels import paged_attention as pa

    dev, bs, out = "cuda", 16, []
    for name, (H, KVH, D) in {"nemotron-h-8b": (32, 8, 128), "qwen3.5-9b": (16, 4, 256)}.items():
        for ctx in contexts:
            nb = B * ctx // bs
            cache = torch.randn(nb, 2, bs, KVH, D, device=dev, dtype=torch.bfloat16)
            table = torch.randperm(nb, device=dev).to(torch.int32).view(B, ctx // bs)
            q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
            start = torch.arange(B, dtype=torch.int32, device=dev)
            qlen = torch.ones(B, dtype=torch.int32, device=dev)
            clen = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            o = torch.zeros_like(q)
            nbytes = cache.numel() * 2
            default = pa.decode_splits(B, KVH, q.device)
            split = functools.partial(pa.decode_attention, q, cache, o, start, clen, table, D ** -0.5)
            runs = {"one program per (seq, kv head)": functools.partial(
                pa.launch_attention, q, cache, o, start, qlen, clen, table, 1, D ** -0.5,
                pa.attention_config(1, D, q.dtype))}
            for sp in dict.fromkeys([1, 4, default]):
                runs[f"split-KV x{sp}" + (" (default)" if sp == default else "")] = functools.partial(split, sp)
            for t in tiles or ():
                runs[f"split-KV x{default} tile {t}"] = functools.partial(split, default, t)
            for label, fn in runs.items():
                ms = median_ms(fn)
                out.append({"kernel": f"attention {name} ctx {ctx}", "tile": label, "ms": ms,
                            "GBps": nbytes / ms / 1e6})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="1024,8192", help="decode attention: context lengths")
    p.add_argument("--attention-tiles", action="store_true", help="decode attention: also sweep the tile choices")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    B, dev = args.batch, "cuda"
    copy_gbps = copy_bandwidth() / 1e9
    rows, slots = torch.arange(B, device=dev), torch.arange(1, B + 1, device=dev)
    init = torch.ones(B, dtype=torch.int32, device=dev)
    results = []
    # Mamba-2 of Nemotron-H-8B: 128 heads x 64, state 128, 8 groups
    H, P, N, G = 128, 64, 128, 8
    ssm = torch.randn(B + 1, H, P, N, device=dev)
    xc = torch.randn(B, H * P + 2 * G * N, device=dev, dtype=torch.bfloat16)
    dt = torch.randn(B, H, device=dev, dtype=torch.bfloat16)
    yb = torch.zeros(B, H, P, device=dev)
    par = torch.zeros(H, device=dev)
    for tile in [(16, 4), (32, 4), (32, 8), (64, 4), (64, 8)]:
        rs.TILES["mamba"] = tile
        ms = median_ms(lambda: rs.mamba_decode(xc, dt, par, par, par, ssm, slots, init, rows, yb, G, 1e-3))
        nbytes = 2 * B * H * P * N * 4
        results.append({"kernel": "mamba_decode", "tile": tile, "ms": ms, "GBps": nbytes / ms / 1e6})
    # GDN of Qwen3.5-9B: 16 k heads, 32 v heads, 128 x 128
    Hk, Hv, K, V = 16, 32, 128, 128
    st = torch.randn(B + 1, Hv, K, V, device=dev)
    xq = torch.randn(B, 2 * Hk * K + Hv * V, device=dev, dtype=torch.bfloat16)
    ab = torch.randn(B, 2 * Hv, device=dev, dtype=torch.bfloat16)
    out = torch.zeros(B, Hv, V, device=dev)
    par = torch.zeros(Hv, device=dev)
    for tile in [(16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)]:
        rs.TILES["gdn"] = tile
        ms = median_ms(lambda: rs.gdn_decode(xq, ab[:, :Hv], ab[:, Hv:], par, par, st, slots, init, rows, out, Hk))
        nbytes = 2 * B * Hv * K * V * 4
        results.append({"kernel": "gdn_decode", "tile": tile, "ms": ms, "GBps": nbytes / ms / 1e6})
    tiles = [(n, w, st) for n in (32, 64) for w in (4, 8) for st in (2, 3, 4)] if args.attention_tiles else None
    results += attention_rows(B, args.contexts, tiles)
    print(f"copy {copy_gbps:.0f} GB/s (read + write), batch {B}")
    for r in results:
        print(f"{r['kernel']:30} {str(r['tile']):34} {r['ms'] * 1e3:8.1f} us {r['GBps']:7.0f} GB/s "
              f"= {r['GBps'] / copy_gbps:.2f} of copy")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbps, "batch": B,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
