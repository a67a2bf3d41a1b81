"""Where a decode step's GPU time goes: per-kernel totals of one eager decode step (torch.profiler), next to the
CUDA-graph step time, on the full-size presets of benchmarks/roofline.py.

    python benchmarks/profile_decode.py --presets nemotron-h-8b,qwen3.5-9b --batch 64 --context 1024

Prints, per preset: graph and eager step (median of --steps), the sum of kernel durations in the eager step
(the graph step minus that is launch gaps and host time), and the top kernels by total duration with counts.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import statistics

import torch
from hybridpd.engine.sampling_params import SamplingParams

from benchmarks.roofline import build_runner, copy_bandwidth, decode_output, prefill_output, timed


def kernel_table(fn, ops: list | None = None) -> tuple[float, list[tuple[str, int, float]]]:  # type: ignore[no-untyped-def]
    """(sum of kernel us, [(kernel, count, us)] by total). With `ops` (a list), also appends the torch ops that
    launched them, by their own device time, with input shapes: [(op [shapes], count, us)]."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops is not None else [])
    with profile(activities=acts, record_shapes=ops is not None) as prof:
        fn()
        torch.cuda.synchronize()
    if ops is not None:
        for e in prof.key_averages(group_by_input_shape=True):
            if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0:
                ops.append((f"{e.key} {str(e.input_shapes)[:80]}", int(e.count), float(e.self_device_time_total)))
        ops.sort(key=lambda r: -r[2])
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]
            a[0] += 1
            a[1] += e.device_time
    rows = sorted(((k, int(v[0]), v[1]) for k, v in agg.items()), key=lambda r: -r[2])
    return sum(r[2] for r in rows), rows


def run(name: str, args: argparse.Namespace, bw: float) -> dict:  # type: ignore[type-arg]
    b, ctx = args.batch, args.context
    model, runner, shape, _ = build_runner(name, "bfloat16", b, max(ctx, args.prefill_tokens))
    params = {f"r{i}": SamplingParams(max_tokens=1, temperature=0) for i in range(b)}
    params["p0"] = SamplingParams(max_tokens=1, temperature=0)
    out = decode_output(b, ctx, -(-ctx // 16))
    step = functools.partial(runner.execute, out, params)
    graphs = runner.graphs
    res: dict = {"preset": name, "batch": b, "context": ctx}  # type: ignore[type-arg]
    if not args.skip_decode:
        for mode in ("graph", "eager"):
            runner.graphs = graphs if mode == "graph" else None
            res[f"{mode}_ms"] = statistics.median(timed(step, 3, args.steps)) * 1e3
        runner.graphs = None
        total_us, rows = kernel_table(step)
        runner.graphs = graphs
        nbytes = shape.weights_read(b) + b * ctx * shape.kv_bytes_per_token + 2 * b * shape.state_bytes
        res.update(roofline_ms=nbytes / bw * 1e3, kernel_sum_ms=total_us / 1e3, kernels=sum(r[1] for r in rows),
                   state_bytes_per_seq=shape.state_bytes, weight_bytes=shape.weight_bytes,
                   top=[{"kernel": k, "count": c, "us": round(t, 1)} for k, c, t in rows[:args.top]])
        print(f"\n== {name} batch {b} ctx {ctx}: graph {res['graph_ms']:.2f} ms, eager {res['eager_ms']:.2f} ms, "
              f"kernel sum {res['kernel_sum_ms']:.2f} ms in {res['kernels']} kernels, roofline {res['roofline_ms']:.2f}"
              f" ms (state {shape.state_bytes / 2**20:.1f} MiB/seq, weights {shape.weight_bytes / 1e9:.2f} GB)")
        for k, c, t in rows[:args.top]:
            print(f"  {t / 1e3:7.3f} ms {c:5d}x {t / c:8.1f} us  {k}")
    if args.prefill_tokens:
        pstep = functools.partial(runner.execute, prefill_output(args.prefill_tokens), params)
        runner.graphs = None
        res["prefill_ms"] = statistics.median(timed(pstep, 1, 3)) * 1e3
        ops: list = []  # type: ignore[type-arg]
        ptotal, prows = kernel_table(pstep, ops if args.ops else None)
        runner.graphs = graphs
        res["prefill_top"] = [{"kernel": k, "count": c, "us": round(t, 1)} for k, c, t in prows[:args.top]]
        res["prefill_ops"] = [{"op": k, "count": c, "us": round(t, 1)} for k, c, t in ops[:args.top]]
        print(f"-- prefill {args.prefill_tokens} tokens: {res['prefill_ms']:.1f} ms, kernel sum {ptotal / 1e3:.1f} ms")
        for k, c, t in prows[:args.top]:
            print(f"  {t / 1e3:7.3f} ms {c:5d}x {t / c:8.1f} us  {k}")
        if ops:
            print("-- prefill by torch op (own device time, input shapes)")
            for k, c, t in ops[:args.top]:
                print(f"  {t / 1e3:7.3f} ms {c:5d}x {t / c:8.1f} us  {k}")
    del runner, model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="nemotron-h-8b,qwen3.5-9b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--prefill-tokens", type=int, default=0, help="also profile one prefill step of this length")
    p.add_argument("--ops", action="store_true", help="prefill: also list the torch ops by device time, with shapes")
    p.add_argument("--skip-decode", action="store_true", help="profile the prefill step only")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bw = copy_bandwidth()
    results = []
    for name in args.presets.split(","):
        try:
            results.append(run(name, args, bw))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
