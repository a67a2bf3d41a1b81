"""Benchmark: zeroing fresh attention KV blocks (engine.kernels.zero_blocks) against two torch baselines.

For each (layers, blocks) it times, median over --repeats after --warmup:
- ours:       BlockZeroer.zero(ids): ids staged in pinned memory, one H2D copy, ONE kernel over all layers;
- memset:     zero_() of one contiguous buffer of the same total bytes (the bandwidth ceiling);
- index_fill: kv.index_fill_(0, ids, 0) per layer (the obvious torch code; ids already on the device).
Random non-contiguous ids out of a pool of --pool-blocks. The goal: ours >= 0.9 x memset at >= 512 blocks,
with one launch per call.

On CUDA the GB/s columns are device time (CUDA events; a short device sleep is queued first, so host-side
launch cost is not counted as device time); `host us` is the host time of one zero() call. `--device cpu`
runs the torch path with wall-clock timing (no kernel: launches/call reads 0), so the script runs anywhere.

    python benchmarks/zeroing.py --out zeroing.json      # GPU box (H100/H200), defaults as in the brief
    python benchmarks/zeroing.py --device cpu            # anywhere
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridpd.engine.kernels.zero_blocks import DEFAULT_CHUNK_BYTES, DEFAULT_NUM_WARPS, BlockZeroer  # noqa: E402

SLEEP_CYCLES = 2_000_000  # ~1 ms at H100/H200 clocks: covers the host side of one timed call


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, nargs="+", help="attention layers (default: 8 32 on cuda, 2 on cpu)")
    p.add_argument("--blocks", type=int, nargs="+", help="blocks per call (default: 1 30 512 4096; cpu 1 30 256)")
    p.add_argument("--pool-blocks", type=int, help="blocks per layer (default: 16384 on cuda, 512 on cpu)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    p.add_argument("--num-warps", type=int, default=DEFAULT_NUM_WARPS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="zeroing.json")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.layers = args.layers or ([8, 32] if cuda else [2])
    args.blocks = args.blocks or ([1, 30, 512, 4096] if cuda else [1, 30, 256])
    args.pool_blocks = args.pool_blocks or (16384 if cuda else 512)
    if max(args.blocks) >= args.pool_blocks:
        p.error("--blocks must stay below --pool-blocks (block 0 is the null block)")
    return args


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _host_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _check(zeroer: BlockZeroer, kvs: list[torch.Tensor], ids: list[int], others: torch.Tensor) -> None:
    """The listed blocks become zero, a sample of the others keeps its (all-ones) contents."""
    idx = torch.tensor(ids, device=kvs[0].device)
    for kv in kvs:
        kv.index_fill_(0, torch.cat([idx, others]), 1)
    zeroer.zero(ids)
    for kv in kvs:
        if kv.index_select(0, idx).count_nonzero().item() != 0 or not bool((kv.index_select(0, others) == 1).all()):
            raise SystemExit(f"WRONG RESULT: zeroing {len(ids)} blocks did not zero exactly those blocks")


def _run_layers(args: argparse.Namespace, layers: int, rng: torch.Generator) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = (args.pool_blocks, 2, args.block_size, args.kv_heads, args.head_dim)
    kvs = [torch.ones(shape, dtype=dtype, device=device) for _ in range(layers)]
    page_bytes = kvs[0][0].numel() * kvs[0].element_size()
    memset_buf = torch.empty(max(args.blocks) * layers * page_bytes, dtype=torch.uint8, device=device)
    backend = "triton" if device.type == "cuda" else "torch"
    zeroer = BlockZeroer(kvs, backend=backend, chunk_bytes=args.chunk_bytes, num_warps=args.num_warps)
    rows = []
    for n in args.blocks:
        perm = torch.randperm(args.pool_blocks - 1, generator=rng) + 1
        ids = perm[:n].tolist()  # random, non-contiguous, unsorted
        others = perm[n : n + 64].to(device)
        _check(zeroer, kvs, ids, others)
        idx = torch.tensor(ids, device=device)
        nbytes = n * layers * page_bytes
        launches, calls = zeroer.launches, 0

        def ours(ids: list[int] = ids) -> None:
            nonlocal calls
            calls += 1
            zeroer.zero(ids)

        def index_fill(idx: torch.Tensor = idx) -> None:
            for kv in kvs:
                kv.index_fill_(0, idx, 0)

        t_ours = _median_seconds(ours, device, args.repeats, args.warmup)
        per_call = (zeroer.launches - launches) / calls
        host = _host_seconds(ours, device, args.repeats)
        t_memset = _median_seconds(memset_buf[:nbytes].zero_, device, args.repeats, args.warmup)
        t_fill = _median_seconds(index_fill, device, args.repeats, args.warmup)
        rows.append(
            {
                "layers": layers,
                "blocks": n,
                "bytes": nbytes,
                "ours_us": t_ours * 1e6,
                "ours_gbps": nbytes / t_ours / 1e9,
                "memset_us": t_memset * 1e6,
                "memset_gbps": nbytes / t_memset / 1e9,
                "ratio": t_memset / t_ours,
                "index_fill_us": t_fill * 1e6,
                "index_fill_gbps": nbytes / t_fill / 1e9,
                "launches_per_call": per_call,
                "host_us_per_call": host * 1e6,
            }
        )
        print(_format_row(rows[-1]), flush=True)
    return rows


HEADER = (
    f"{'layers':>6} {'blocks':>6} {'MiB':>9} {'ours us':>9} {'ours GB/s':>10} {'memset GB/s':>12} {'ratio':>6} "
    f"{'idx_fill GB/s':>13} {'launch/call':>11} {'host us':>8}"
)


def _format_row(r: dict) -> str:
    return (
        f"{r['layers']:>6} {r['blocks']:>6} {r['bytes'] / 2**20:>9.1f} {r['ours_us']:>9.1f} {r['ours_gbps']:>10.1f} "
        f"{r['memset_gbps']:>12.1f} {r['ratio']:>6.2f} {r['index_fill_gbps']:>13.1f} {r['launches_per_call']:>11.2f} "
        f"{r['host_us_per_call']:>8.1f}"
    )


def main() -> None:
    args = _parse()
    rng = torch.Generator().manual_seed(args.seed)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(
        f"device: {device_name}; torch {torch.__version__}; pages: {args.block_size} tokens x {args.kv_heads} "
        f"heads x {args.head_dim} dims {args.dtype}; pool {args.pool_blocks} blocks/layer"
    )
    print(HEADER, flush=True)
    rows = []
    for layers in args.layers:
        rows += _run_layers(args, layers, rng)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    big = [r for r in rows if r["blocks"] >= 512]
    goal = all(r["ratio"] >= 0.9 and r["launches_per_call"] == 1 for r in big) if big else None
    print(HEADER)
    for r in rows:
        print(_format_row(r))
    print(f"goal (>= 0.9 x memset at >= 512 blocks, 1 launch/call): {'n/a' if goal is None else goal}")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton_version,
        "args": vars(args),
        "goal_met": goal,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
