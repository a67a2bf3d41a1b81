"""Prefill kernels alone at full-size shapes: the paged attention kernel per tile choice against PyTorch's own
flash attention (scaled_dot_product_attention, causal, GQA) on the same tokens, and the conv buffer fill of the
Mamba-2 prefill (engine.models.fast_path.conv_prefill) as an index_put against a slice copy. Median of 20
CUDA-event timings each; achieved TFLOP/s for attention (causal: 2 x T^2 x heads x head_dim). Prints a table;
--out writes JSON.

    python -m benchmarks.prefill_kernels --tokens 8192
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from hybridpd.engine.kernels.paged_attention import attention_config, launch_attention

from benchmarks.decode_kernels import median_ms

SHAPES = {"nemotron-3-nano-30b-a3b": (32, 2, 128), "nemotron-h-8b": (32, 8, 128), "qwen3.5-9b": (16, 4, 256)}


def attention_rows(name: str, T: int, configs: list[tuple[int, int, int, int]]) -> list[dict]:  # type: ignore[type-arg]
    H, KVH, D = SHAPES[name]
    dev, bs = "cuda", 16
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    nb = T // bs
    perm = torch.randperm(nb, device=dev)
    cache = torch.empty(nb, 2, bs, KVH, D, device=dev, dtype=torch.bfloat16)
    cache[perm, 0] = k.view(nb, bs, KVH, D)
    cache[perm, 1] = v.view(nb, bs, KVH, D)
    table = perm.to(torch.int32)[None]
    i32 = lambda x: torch.tensor([x], dtype=torch.int32, device=dev)  # noqa: E731
    start, qlen, ctx = i32(0), i32(T), i32(T)
    scale = D ** -0.5
    flops = 2 * T * T * H * D
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    rows = []
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                            v.transpose(0, 1)[None], is_causal=True, enable_gqa=True))
    rows.append({"shape": name, "tokens": T, "kernel": "torch sdpa (flash)", "ms": sdpa, "tflops": flops / sdpa / 1e9})
    default = attention_config(T, D, torch.bfloat16)
    for cfg in dict.fromkeys([default] + configs):
        out = torch.zeros_like(q)
        try:
            ms = median_ms(lambda: launch_attention(q, cache, out, start, qlen, ctx, table, T, scale, cfg))  # noqa: B023
        except Exception as e:  # noqa: BLE001 (a config the GPU cannot run: out of shared memory)
            rows.append({"shape": name, "tokens": T, "kernel": f"ours {cfg}", "error": str(e)[:80]})
            continue
        err = (out.float() - ref.float()).abs().max().item()
        rows.append({"shape": name, "tokens": T, "kernel": f"ours {cfg}" + (" (default)" if cfg == default else ""),
                     "ms": ms, "tflops": flops / ms / 1e9, "max_abs_err_vs_sdpa": err, "vs_sdpa": ms / sdpa})
    return rows


def conv_fill_rows(T: int) -> list[dict]:  # type: ignore[type-arg]
    """Nemotron-3-Nano's conv input: 6,144 columns of the in_proj output (a strided view), into a buffer with the
    sequence's 3 conv-state rows first."""
    dev = "cuda"
    proj = torch.randn(T, 16512, device=dev, dtype=torch.bfloat16)
    src = proj[:, 4096:4096 + 6144]
    ext = torch.zeros(T + 3, 6144, device=dev, dtype=torch.bfloat16)
    idx = torch.arange(3, T + 3, device=dev)

    def put() -> None:
        ext[idx] = src

    def sliced() -> None:
        ext[3:] = src

    nbytes = 2 * src.numel() * 2
    out = []
    for name, fn in (("index_put", put), ("slice copy", sliced), ("zero fill", lambda: ext.zero_())):
        ms = median_ms(fn)
        out.append({"kernel": f"conv buffer {name}", "tokens": T, "ms": ms, "GBps": nbytes / ms / 1e6})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--shapes", default="nemotron-3-nano-30b-a3b,nemotron-h-8b")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    configs = [(r, n, w, s) for r in (64, 128) for n in (64, 128) for w in (4, 8) for s in (2, 3, 4)]
    results = []
    for name in args.shapes.split(","):
        results += attention_rows(name, args.tokens, configs)
    results += conv_fill_rows(args.tokens)
    print(f"{'shape':24} {'kernel':34} {'ms':>8} {'TFLOP/s':>8} {'x sdpa':>7} {'err':>8}")
    for r in results:
        if "error" in r:
            print(f"{r.get('shape', ''):24} {r['kernel']:34} failed: {r['error']}")
            continue
        print(f"{r.get('shape', ''):24} {r['kernel']:34} {r['ms']:8.3f} {r.get('tflops', 0):8.1f} "
              f"{r.get('vs_sdpa', 0):7.2f} {r.get('max_abs_err_vs_sdpa', 0):8.4f}"
              + (f" {r['GBps']:.0f} GB/s" if "GBps" in r else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
