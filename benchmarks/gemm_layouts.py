"""The decode step's GEMMs at each TP size, as the model runs them and in the other weight layout.

Every projection of a preset's model is an `nn.Linear` run as `F.linear(x, W)` with W stored [out, in]. At decode
(M = batch rows) a GEMM is a weight read; cuBLAS picks its kernel per shape, and at half width (TP 2) some shapes get
a kernel far from the HBM bandwidth. This measures, per distinct weight shape of a rank (the model built on the meta
device and cut by engine.parallel.shard for rank 0 of `tp`), the time of one GEMM

    linear   x @ W^T, W [out, in]          (what the model's F.linear runs; written with out= like mm_t)
    mm_t     torch.mm(x, Wt), Wt [in, out] (the weight stored transposed)

inside a CUDA graph that cycles through enough weight copies to exceed L2 (as the step does: every layer's weights
are read once), median of repeats; beside the device's copy bandwidth (a large D2D copy). Prints a table last.

    python benchmarks/gemm_layouts.py --preset nemotron-h-8b --tp-sizes 1,2 --rows 64 --out out/gemm_layouts.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_linear_shapes(preset_name: str, tp_size: int) -> collections.Counter[tuple[int, int]]:
    """(out, in) of every nn.Linear of rank 0's slice (the LM head included), with how many layers have it."""
    from hybridpd.engine.models.checkpoint import hf_config, preset
    from hybridpd.engine.models.registry import ARCHITECTURES
    from hybridpd.engine.parallel.group import TPGroup
    from hybridpd.engine.parallel.shard import shard_model

    family, overrides = preset(preset_name)
    config = hf_config(family, **overrides)
    cls = ARCHITECTURES["NemotronHForCausalLM" if family == "nemotron_h" else "Qwen3_5ForCausalLM"]
    with torch.device("meta"):
        model = cls(config.to_dict(), "bfloat16")
        if tp_size > 1:
            shard_model(model, TPGroup(rank=0, world=tp_size, group=None, control=None), False)
    shapes: collections.Counter[tuple[int, int]] = collections.Counter()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[tuple(m.weight.shape)] += 1  # type: ignore[index]
    return shapes


def _graph_time_us(fn: Any, calls: int, repeats: int = 15) -> float:
    """Median time of one of `calls` fn() captured in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def time_shape(n_out: int, k_in: int, rows: int, min_bytes: float = 6e8) -> dict[str, float]:
    w_bytes = n_out * k_in * 2
    copies = max(2, int(min_bytes // w_bytes) + 1)
    ws = [torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    wts = [w.t().contiguous() for w in ws]
    x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
    outs = {"linear": torch.empty(rows, n_out, device="cuda", dtype=torch.bfloat16)}
    outs["mm_t"] = torch.empty_like(outs["linear"])

    def run_linear() -> None:  # F.linear's kernel (x @ W^T on W [out, in]) written in place, as mm_t is
        for w in ws:
            torch.mm(x, w.t(), out=outs["linear"])

    def run_mm_t() -> None:
        for wt in wts:
            torch.mm(x, wt, out=outs["mm_t"])

    row = {"out": n_out, "in": k_in, "weight_mb": w_bytes / 1e6, "copies": copies}
    row["linear_us"] = _graph_time_us(run_linear, copies)
    row["mm_t_us"] = _graph_time_us(run_mm_t, copies)
    row["max_abs_diff"] = float((F.linear(x, ws[0]) - torch.mm(x, wts[0])).abs().max())
    ws.clear()
    wts.clear()
    torch.cuda.empty_cache()
    return row


def copy_gbps() -> float:
    src = torch.empty(int(1 << 30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _graph_time_us(lambda: dst.copy_(src), 1)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nemotron-h-8b")
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--rows", default="64")
    ap.add_argument("--out", default="out/gemm_layouts.json")
    a = ap.parse_args()
    bw = copy_gbps()
    rows: list[dict[str, Any]] = []
    for tp in (int(t) for t in a.tp_sizes.split(",")):
        for (n_out, k_in), count in sorted(rank_linear_shapes(a.preset, tp).items()):
            for m in (int(r) for r in a.rows.split(",")):
                r = {"preset": a.preset, "tp": tp, "rows": m, "layers": count, **time_shape(n_out, k_in, m)}
                for k in ("linear", "mm_t"):
                    r[f"{k}_of_copy_bw"] = r["weight_mb"] * 1e6 / (r[f"{k}_us"] * 1e-6) / 1e9 / bw
                rows.append(r)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": bw, "rows": rows}, f, indent=1)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s")
    print("| TP | rows | out x in | layers | linear us (of copy bw) | mm_t us (of copy bw) | step ms saved by mm_t |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        saved = (r["linear_us"] - r["mm_t_us"]) * r["layers"] / 1e3
        print(
            f"| {r['tp']} | {r['rows']} | {r['out']} x {r['in']} | {r['layers']} | {r['linear_us']:.1f} "
            f"({r['linear_of_copy_bw']:.2f}) | {r['mm_t_us']:.1f} ({r['mm_t_of_copy_bw']:.2f}) | {saved:+.3f} |"
        )


if __name__ == "__main__":
    main()
