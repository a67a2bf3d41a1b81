"""Benchmark: the device cost of a recurrent-state checkpoint stored as k scattered attention pages, against one
contiguous state slot (how the arena stores it).

A checkpoint of the issue's model (`cache_manager.py`: 12 Mamba-2 layers, conv (10240, 3) bf16 + SSM (64, 64, 128)
fp32 = 24.7 MiB) is k = ceil(state bytes / page bytes) = 99 attention pages of 256 KiB. Per batch of n checkpoints:
- slot copy: what the runner does today for a restore (checkpoint slot -> running slot) and for a decode-step
  checkpoint (running slot -> checkpoint slot): `t.index_copy_(0, dst, t.index_select(0, src))` over the conv and
  the SSM tensor ([slots, layers, ...] views of one byte arena, slot stride = k pages);
- scattered write: the running (or a staging) slot's k page-sized pieces -> k random free pages, one
  `index_copy_` over the arena viewed as [units, page bytes / 8] int64;
- scattered restore: k random pages -> the running slot's k pieces, the same one copy.
Before timing, each batch writes random slots out and restores them into other slots and checks the bytes.

On CUDA the figures are device time (CUDA events, median over --repeats after --warmup); `--device cpu` uses
wall-clock time and a small arena (the script runs anywhere; CPU figures say nothing about the GPU).

    python benchmarks/cache_checkpoint_pages.py --out cache_checkpoint_pages.json     # GPU box, < 1 minute
    python benchmarks/cache_checkpoint_pages.py --device cpu        # anywhere: one layer per state, 0.5 GiB
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch

PAGE_BYTES = 4 * 2 * 16 * 8 * 128 * 2
"""One attention page of the issue's model: 4 layers x (K, V) x 16 tokens x 8 heads x 128 x bf16 = 256 KiB."""
CONV = ((10240, 3), torch.bfloat16)
SSM = ((64, 64, 128), torch.float32)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--state-layers", type=int, default=None, help="recurrent layers in one state (12; cpu: 1)")
    p.add_argument("--arena-gib", type=float, default=None, help="arena size (default: 16 on cuda, 0.5 on cpu)")
    p.add_argument("--running-slots", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="checkpoints per call")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="cache_checkpoint_pages.json")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.state_layers = args.state_layers if args.state_layers is not None else (12 if cuda else 1)
    args.arena_gib = args.arena_gib if args.arena_gib is not None else (16.0 if cuda else 0.5)
    return args


class Arena:
    """One byte buffer: `slots` state slots of k pages each, then the attention pages; typed views over it."""

    def __init__(self, layers: int, arena_bytes: int, running_slots: int, device: torch.device, batch: int) -> None:
        conv_bytes = layers * math.prod(CONV[0]) * CONV[1].itemsize
        self.state_bytes = conv_bytes + layers * math.prod(SSM[0]) * SSM[1].itemsize
        self.k = -(-self.state_bytes // PAGE_BYTES)
        self.slots = running_slots + 1
        units = arena_bytes // PAGE_BYTES
        self.pages = units - self.slots * self.k
        if self.pages < self.k * batch or self.slots <= 2 * batch:
            raise ValueError(f"arena too small: {self.slots} slots, {self.pages} pages for {batch} x k = {self.k}")
        self.raw = torch.zeros(units * PAGE_BYTES, dtype=torch.uint8, device=device)
        self.units = self.raw.view(torch.int64).view(units, PAGE_BYTES // 8)  # 8 bytes per element copied
        slot_stride = self.k * PAGE_BYTES
        self.conv = self._view(CONV, layers, 0, slot_stride)
        self.ssm = self._view(SSM, layers, conv_bytes, slot_stride)

    def _view(self, part: tuple[tuple[int, ...], torch.dtype], layers: int, offset: int, stride: int) -> torch.Tensor:
        shape, dtype = part
        typed = self.raw.view(dtype)
        elem = dtype.itemsize
        inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        per_layer = math.prod(shape)
        return typed.as_strided((self.slots, layers, *shape), (stride // elem, per_layer, *inner), offset // elem)

    def slot_units(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor([s * self.k + i for s in slots for i in range(self.k)], device=self.raw.device)

    def page_units(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor([self.slots * self.k + p for p in pages], device=self.raw.device)


def copy_units(units: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    units.index_copy_(0, dst, units.index_select(0, src))


def slot_copy(arena: Arena, src: torch.Tensor, dst: torch.Tensor) -> None:
    for t in (arena.conv, arena.ssm):
        t.index_copy_(0, dst, t.index_select(0, src))


def check(arena: Arena, n: int, gen: torch.Generator) -> None:
    """Write n slots out to random pages, restore them into n other slots: the state bytes come back."""
    src_slots, dst_slots = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    for t in (arena.conv, arena.ssm):
        t[src_slots] = torch.randn(t[src_slots].shape, generator=gen).to(t.dtype).to(t.device)
    pages = torch.randperm(arena.pages, generator=gen)[: n * arena.k].tolist()
    copy_units(arena.units, arena.slot_units(src_slots), arena.page_units(pages))
    copy_units(arena.units, arena.page_units(pages), arena.slot_units(dst_slots))
    for t in (arena.conv, arena.ssm):
        assert torch.equal(t[src_slots], t[dst_slots]), "a restored checkpoint differs from the written one"


def timed(fn: Callable[[], None], device: str, repeats: int, warmup: int) -> float:
    """Median microseconds of one call (CUDA: device time from events)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def measure(arena: Arena, n: int, gen: torch.Generator, args: argparse.Namespace) -> dict[str, float]:
    """Median device microseconds of the three copies for a batch of n checkpoints."""
    dev = arena.raw.device
    slots, others = torch.arange(1, n + 1, device=dev), torch.arange(n + 1, 2 * n + 1, device=dev)
    pages = torch.randperm(arena.pages, generator=gen)[: n * arena.k].tolist()
    s_units, p_units = arena.slot_units(list(range(1, n + 1))), arena.page_units(pages)

    def time_of(fn: Callable[[], None]) -> float:
        return timed(fn, args.device, args.repeats, args.warmup)

    row = {
        "batch": n,
        "slot_copy_us": time_of(lambda: slot_copy(arena, slots, others)),
        "scatter_write_us": time_of(lambda: copy_units(arena.units, s_units, p_units)),
        "scatter_restore_us": time_of(lambda: copy_units(arena.units, p_units, s_units)),
    }
    row["write_gb_s"] = n * arena.state_bytes / row["scatter_write_us"] / 1e3
    return row


def main() -> None:
    args = _parse()
    dev = torch.device(args.device)
    arena = Arena(args.state_layers, int(args.arena_gib * 2**30), args.running_slots, dev, max(args.batch))
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"state {arena.state_bytes / 2**20:.2f} MiB = k {arena.k} pages of {PAGE_BYTES >> 10} KiB; "
        f"{arena.slots} slots, {arena.pages} pages; device {args.device}"
    )
    print(f"{'batch':>5} {'slot copy us':>13} {'scatter write us':>17} {'scatter restore us':>19} {'write GB/s':>11}")
    rows = []
    for n in args.batch:
        check(arena, n, gen)
        row = measure(arena, n, gen, args)
        rows.append(row)
        print(
            f"{n:5d} {row['slot_copy_us']:13.1f} {row['scatter_write_us']:17.1f} {row['scatter_restore_us']:19.1f} "
            f"{row['write_gb_s']:11.1f}"
        )
    report = {
        "benchmark": "cache_checkpoint_pages",
        "args": vars(args),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "state_bytes": arena.state_bytes,
        "page_bytes": PAGE_BYTES,
        "k": arena.k,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
