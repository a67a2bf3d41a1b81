"""KV transfer benchmark: a producer process (P) and this process (D) pull synthetic hybrid caches over NIXL.

Scenarios:
  realistic-contig  4k tokens of KV (4 attention layers, 8 KV heads x 128, block 16, bf16: 64 MiB) + one state slot
                    of 4 Mamba-2 layers; P's and D's blocks in one run each
  realistic-frag    the same bytes with P's and D's block ids drawn at random (about one descriptor per block)
  deep-frag         48 attention layers of 4 KiB pages, 256 random blocks: 12,288 descriptors of 4 KiB (48 MiB)
  large             16k tokens of KV, 4 layers: 256 MiB, contiguous
  xlarge            64k tokens of KV, 4 layers: 1 GiB, contiguous

For each scenario and descriptor mode ("prepped": page lists prepared once per peer, pulls pass indices;
"per_transfer": coalesced descriptors built per pull) it reports medians over --repeats of:
  start     start_pull() call (plan + descriptors + post; with UCX's CMA transport the copy runs inside the post)
  handover  transfer params in hand -> KV ready on D (start_pull .. poll() == DONE; UCX reports DONE once the copy's
            CUDA event completed). A device sync follows, timed apart ("sync"): the engine does not sync there
  wire      NIXL's own telemetry: first READ posted -> last READ complete
  GB/s      bytes / handover
  phases    the handover cut by PullHandle.marks: plan, make (NIXL descriptors + request), post, wait (posted ->
            first poll that sees DONE), finish (release, metrics); a second table
Every scenario runs in both cache layouts (--layouts): "stacked", one tensor per group and kind with the layer as
dimension 1 (what the engine allocates: a run of blocks is one descriptor for all layers), and "per_layer"; and
against two raw copies of the same page runs for reference: "torch" inside one process (device-local, or a peer copy
between two GPUs), and on CUDA "ipc" from P's tensors opened in D through CUDA IPC (the path cuda_ipc takes).
Data are verified against P's (seeded) contents after the runs.

    python benchmarks/transfer.py [--device cpu|cuda] [--src-gpu 0 --dst-gpu 1] [--repeats 10] [--json PATH]
    python benchmarks/transfer.py --device cuda --parallel-reads 4     # a pull as 4 READs posted together
    UCX_TLS=tcp python benchmarks/transfer.py    # UCX settings come from the environment (P inherits it)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from math import prod
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from hybridpd.kvtransfer import AgentConfig, CacheLayout, PullSpec, PullState, TransferAgent, start_pull  # noqa: E402
from hybridpd.kvtransfer.descriptors import plan_pull  # noqa: E402

from tests.support.kvtransfer_harness import ATTN_GROUP, STATE_GROUP, ToyCacheSpec, make_caches, serve_producer  # noqa: E402

SEED = 11
REALISTIC = ToyCacheSpec(
    model_id="bench",
    attn_layers=4,
    num_blocks=600,
    block_size=16,
    kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    state_layers=4,
    num_slots=8,
    conv_shape=(1536, 3),
    ssm_shape=(24, 64, 128),
)
DEEP = ToyCacheSpec(
    model_id="bench",
    attn_layers=48,
    num_blocks=600,
    block_size=16,
    kv_heads=1,
    head_dim=64,
    dtype="bfloat16",
    state_layers=0,
)
LARGE = ToyCacheSpec(
    model_id="bench",
    attn_layers=4,
    num_blocks=1025,
    block_size=16,
    kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    state_layers=0,
)
XLARGE = replace(LARGE, num_blocks=4097)


@dataclass(frozen=True)
class Scenario:
    name: str
    spec: ToyCacheSpec
    src: list[int]
    dst: list[int]
    slots: tuple[list[int], list[int]] | None


def scenarios() -> list[Scenario]:
    rng = random.Random(SEED)
    n = 256
    frag_src = rng.sample(range(1, REALISTIC.num_blocks), n)
    frag_dst = rng.sample(range(1, REALISTIC.num_blocks), n)
    return [
        Scenario("realistic-contig", REALISTIC, list(range(1, n + 1)), list(range(1, n + 1)), ([3], [5])),
        Scenario("realistic-frag", REALISTIC, frag_src, frag_dst, ([3], [5])),
        Scenario("deep-frag", DEEP, frag_src, frag_dst, None),
        Scenario("large", LARGE, list(range(1, 1025)), list(range(1, 1025)), None),
        Scenario("xlarge", XLARGE, list(range(1, 4097)), list(range(1, 4097)), None),
    ]


def pull_spec(sc: Scenario, epoch: str, rid: str) -> PullSpec:
    slots = {} if sc.slots is None else {STATE_GROUP: sc.slots[0]}
    dslots = {} if sc.slots is None else {STATE_GROUP: sc.slots[1]}
    return PullSpec(rid, epoch, {ATTN_GROUP: sc.src}, {ATTN_GROUP: sc.dst}, slots, dslots)


def page_pairs(sc: Scenario) -> list[tuple[int, list[int], list[int]]]:
    out = [(ATTN_GROUP, sc.src, sc.dst)]
    if sc.slots is not None:
        out.append((STATE_GROUP, *sc.slots))
    return out


def tensors_by_group(groups: list[Any]) -> dict[int, list[torch.Tensor]]:
    return {
        g.group_id: [t for layer in g.tensors for t in ([layer] if torch.is_tensor(layer) else layer)] for g in groups
    }


def verify(sc: Scenario, dst_groups: list[Any]) -> None:
    ref = tensors_by_group(make_caches(replace(sc.spec, device="cpu"), SEED))
    got = tensors_by_group(dst_groups)
    for gid, src, dst in page_pairs(sc):
        for r, g in zip(ref[gid], got[gid], strict=True):
            if not torch.equal(r[src], g[dst].cpu()):
                raise SystemExit(f"{sc.name}: data mismatch in group {gid}")


def torch_copy_ms(sc: Scenario, src_dev: str, dst_dev: str, repeats: int) -> float:
    """Raw copy of the same page runs between two cache sets inside one process."""
    src = tensors_by_group(make_caches(replace(sc.spec, device=src_dev), SEED))
    dst = tensors_by_group(make_caches(replace(sc.spec, device=dst_dev), None))
    runs = {gid: plan_pull_runs(s, d) for gid, s, d in page_pairs(sc)}

    def once() -> float:
        sync(dst_dev)
        t0 = time.perf_counter()
        for gid, rr in runs.items():
            for s_t, d_t in zip(src[gid], dst[gid], strict=True):
                for s, d, n in rr:
                    d_t[d : d + n].copy_(s_t[s : s + n], non_blocking=True)
        sync(dst_dev)
        return (time.perf_counter() - t0) * 1e3

    once()
    return statistics.median(once() for _ in range(repeats))


def ipc_copy_ms(sc: Scenario, shared: list[Any], dst_dev: str, repeats: int) -> float:
    """Raw copy of the same page runs from P's tensors, opened in this process through CUDA IPC, into ours."""
    src = {gid: [t for layer in ts for t in ([layer] if torch.is_tensor(layer) else layer)] for gid, ts in shared}
    dst = tensors_by_group(make_caches(replace(sc.spec, device=dst_dev), None))
    runs = {gid: plan_pull_runs(s, d) for gid, s, d in page_pairs(sc)}
    stream = torch.cuda.Stream(dst_dev)

    def once() -> float:
        sync(dst_dev)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for gid, rr in runs.items():
                for s_t, d_t in zip(src[gid], dst[gid], strict=True):
                    for s, d, n in rr:
                        d_t[d : d + n].copy_(s_t[s : s + n], non_blocking=True)
        stream.synchronize()
        return (time.perf_counter() - t0) * 1e3

    once()
    ms = statistics.median(once() for _ in range(repeats))
    for gid, s, d in page_pairs(sc):  # the copy really read P's pages
        for s_t, d_t in zip(src[gid], dst[gid], strict=True):
            if not torch.equal(s_t[s].to(dst_dev), d_t[d]):
                raise SystemExit(f"{sc.name}: IPC copy mismatch in group {gid}")
    return ms


def plan_pull_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    from hybridpd.kvtransfer.descriptors import coalesce

    return [tuple(r) for r in coalesce(src, dst)]  # type: ignore[misc]


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def bench_mode(
    sc: Scenario,
    blob: bytes,
    mode: str,
    dst_dev: str,
    repeats: int,
    args: argparse.Namespace,
    samples: dict[str, list[float]],
) -> int:
    """One round of one descriptor mode: a fresh D agent, 50 timed descriptor preparations (plan + make the READ,
    not posted; "plan" = the plan alone), 2 warm-up pulls, `repeats` timed pulls. Appends to `samples`; returns
    descriptors."""
    groups = make_caches(replace(sc.spec, device=dst_dev), None)
    layout = CacheLayout.from_tensors(groups, model_id=sc.spec.model_id)
    config = AgentConfig(
        descriptor_mode=mode,  # type: ignore[arg-type]
        progress_thread=d_progress_thread(args),
        telemetry=True,
        parallel_reads=args.parallel_reads,
        num_workers=args.num_workers,
        release_notice=args.release_notice,
    )
    with TransferAgent(f"D-{mode}", layout, config=config) as agent:
        peer = agent.add_peer(blob)
        for _ in range(50):
            t0 = time.perf_counter()
            plan = plan_pull(peer.layout, layout, pull_spec(sc, peer.epoch, "x").pages_by_group(layout))
            t1 = time.perf_counter()
            agent.release_xfer(agent.make_read(peer, plan, b""))
            samples["plan"].append((t1 - t0) * 1e3)
            samples["prep"].append((time.perf_counter() - t0) * 1e3)
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            handle = start_pull(peer, pull_spec(sc, peer.epoch, f"{mode}-{i}"), timeout_s=60)
            t1 = time.perf_counter()
            while handle.poll() is PullState.PENDING:
                pass
            t2 = time.perf_counter()  # DONE: UCX saw the copy's completion event; the engine goes on from here
            sync(dst_dev)  # not part of the handover (the engine does not sync); timed apart as a check
            t3 = time.perf_counter()
            assert handle.result is not None and handle.result.state is PullState.DONE, handle.result
            if i >= 2:  # two warm-up pulls
                samples["start"].append((t1 - t0) * 1e3)
                samples["handover"].append((t2 - t0) * 1e3)
                samples["sync"].append((t3 - t2) * 1e3)
                if handle.result.nixl_seconds is not None:
                    samples["wire"].append(handle.result.nixl_seconds * 1e3)
                if handle.result.nixl_post_seconds is not None:
                    samples["nixl_post"].append(handle.result.nixl_post_seconds * 1e3)
                m = handle.marks
                for phase, (a, b) in PHASES.items():
                    if a in m and b in m:
                        samples[phase].append((m[b] - m[a]) * 1e3)
        verify(sc, groups)
    return plan.num_descriptors


PHASES = {  # handover broken down by PullHandle.marks: phase -> (from mark, to mark)
    "ph_plan": ("begin", "planned"),
    "ph_make": ("planned", "made"),
    "ph_post": ("made", "posted"),
    "ph_wait": ("posted", "done"),
    "ph_finish": ("done", "finished"),
}


def d_progress_thread(args: argparse.Namespace) -> bool:
    return args.d_progress_thread == "on" or (args.d_progress_thread == "auto" and args.device == "cpu")


def summarize(sc: Scenario, mode: str, nbytes: int, descs: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    ms = statistics.median(samples["handover"])
    return {
        "scenario": sc.name,
        "mode": mode,
        "bytes": nbytes,
        "descriptors": descs,
        "bytes_per_descriptor": nbytes // max(descs, 1),
        "plan_ms": statistics.median(samples["plan"]),
        "prep_ms": statistics.median(samples["prep"]),
        "start_ms": statistics.median(samples["start"]),
        "handover_ms": ms,
        "wire_ms": statistics.median(samples["wire"]) if samples["wire"] else None,
        "handover_ms_min": min(samples["handover"]),
        "handover_ms_max": max(samples["handover"]),
        "gbps": nbytes / ms / 1e6,
        "samples": len(samples["handover"]),
        **{f"{k}_ms": statistics.median(samples[k]) if samples[k] else None for k in (*PHASES, "nixl_post", "sync")},
    }


def run_scenario(sc: Scenario, args: argparse.Namespace, ctx: Any) -> list[dict[str, Any]]:
    src_dev = "cpu" if args.device == "cpu" else f"cuda:{args.src_gpu}"
    dst_dev = "cpu" if args.device == "cpu" else f"cuda:{args.dst_gpu}"
    parent, child = ctx.Pipe()
    p = ctx.Process(target=serve_producer, args=(child, replace(sc.spec, device=src_dev), "P-bench", SEED), daemon=True)
    p.start()
    try:
        _, blob = parent.recv()
        repeats = max(2, args.repeats // 2) if sc.name == "large" else args.repeats
        keys = ("plan", "prep", "start", "handover", "wire", "nixl_post", "sync", *PHASES)
        samples = {m: {k: [] for k in keys} for m in args.modes}  # type: dict[str, Any]
        descs = 0
        for _ in range(args.rounds):  # modes alternate round by round, so load drift hits both alike
            for mode in args.modes:
                descs = bench_mode(sc, blob, mode, dst_dev, repeats, args, samples[mode])
        nbytes = plan_bytes(sc)
        rows = [summarize(sc, mode, nbytes, descs, samples[mode]) for mode in args.modes]
        ipc_ms = None
        if args.device == "cuda":
            parent.send(("tensors",))
            _, shared = parent.recv()
            ipc_ms = ipc_copy_ms(sc, shared, dst_dev, repeats)
            del shared
            torch.cuda.empty_cache()
    finally:
        parent.send(("stop",))
        p.join(10)
    copy_ms = torch_copy_ms(sc, src_dev, dst_dev, repeats)
    for r in rows:
        r.update(torch_copy_ms=copy_ms, torch_gbps=r["bytes"] / copy_ms / 1e6, ipc_copy_ms=ipc_ms)
        r["ipc_gbps"] = None if ipc_ms is None else r["bytes"] / ipc_ms / 1e6
        r["ratio_torch"] = r["gbps"] / r["torch_gbps"]
        r["ratio_ipc"] = None if ipc_ms is None else r["gbps"] / r["ipc_gbps"]
        r["handover_over_wire"] = None if r["wire_ms"] is None else r["handover_ms"] / r["wire_ms"]
    return rows


def plan_bytes(sc: Scenario) -> int:
    spec = sc.spec
    elem = torch.empty(0, dtype=getattr(torch, spec.dtype)).element_size()
    total = len(sc.src) * spec.attn_layers * 2 * spec.block_size * spec.kv_heads * spec.head_dim * elem
    if sc.slots is not None:
        state_elem = torch.empty(0, dtype=getattr(torch, spec.state_dtype)).element_size()
        per_slot = (prod(spec.conv_shape) + prod(spec.ssm_shape)) * state_elem * spec.state_layers
        total += len(sc.slots[0]) * per_slot
    return total


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        "scenario",
        "mode",
        "MiB",
        "descs",
        "KiB/desc",
        "prep ms",
        "start ms",
        "handover ms",
        "wire ms",
        "GB/s",
        "torch GB/s",
        "ipc GB/s",
        "x torch",
        "x ipc",
    )
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        print(
            " | ".join(
                [
                    f"{r['scenario']} ({r['layout']})",
                    r["mode"],
                    f"{r['bytes'] / 2**20:.1f}",
                    str(r["descriptors"]),
                    f"{r['bytes_per_descriptor'] / 1024:.0f}",
                    f"{r['prep_ms']:.2f}",
                    f"{r['start_ms']:.2f}",
                    f"{r['handover_ms']:.3f}",
                    fmt(r["wire_ms"], ".3f"),
                    f"{r['gbps']:.2f}",
                    f"{r['torch_gbps']:.2f}",
                    fmt(r["ipc_gbps"], ".2f"),
                    f"{r['ratio_torch']:.2f}",
                    fmt(r["ratio_ipc"], ".2f"),
                ]
            )
        )


def print_phases(rows: list[dict[str, Any]]) -> None:
    """Where the handover goes (medians, ms): plan, make (NIXL descriptors + request), post (our call; NIXL's own
    post time beside it), wait (posted -> first poll that sees DONE), finish (release, metrics); then the device
    sync that follows DONE in the benchmark (not part of the handover)."""
    head = ("scenario", "mode", "plan", "make", "post", "nixl post", "wait", "finish", "handover", "wire", "h/w")
    head += ("sync",)
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        cells = [f"{r['scenario']} ({r['layout']})", r["mode"]]
        phases = ("ph_plan", "ph_make", "ph_post", "nixl_post", "ph_wait", "ph_finish")
        cells += [fmt(r[f"{k}_ms"], ".3f") for k in phases]
        cells += [f"{r['handover_ms']:.3f}", fmt(r["wire_ms"], ".3f"), fmt(r["handover_over_wire"], ".2f")]
        cells += [fmt(r["sync_ms"], ".3f")]
        print(" | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--src-gpu", type=int, default=0)
    ap.add_argument("--dst-gpu", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=10, help="timed pulls per mode and round (large: half)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; descriptor modes alternate round by round")
    ap.add_argument(
        "--d-progress-thread",
        choices=("auto", "on", "off"),
        default="auto",
        help="NIXL progress thread in D; auto = as decode workers run: off on CUDA (D polls), on on CPU",
    )
    ap.add_argument("--modes", default="prepped,per_transfer")
    ap.add_argument("--parallel-reads", type=int, default=1, help="READs per pull, posted together")
    ap.add_argument("--num-workers", type=int, default=0, help="UCX workers of D's NIXL backend (0: default)")
    ap.add_argument("--release-notice", choices=("with_read", "after_done"), default="with_read")
    ap.add_argument("--scenarios", default="realistic-contig,realistic-frag,deep-frag,large")
    ap.add_argument("--json", default="out/bench_transfer.json")
    ap.add_argument(
        "--layouts",
        default="stacked,per_layer",
        help="cache layouts: stacked (one tensor per group, layer as dim 1: what the engine allocates) and/or "
        "per_layer (one tensor per layer)",
    )
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    ctx = mp.get_context("spawn")
    wanted = set(args.scenarios.split(","))
    rows = []
    for sc in scenarios():
        for lay in args.layouts.split(","):
            if sc.name in wanted:
                stacked = lay == "stacked"
                for r in run_scenario(replace(sc, spec=replace(sc.spec, stacked=stacked)), args, ctx):
                    rows.append({**r, "layout": lay})
    print_table(rows)
    print()
    print_phases(rows)
    env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
    report = {
        "benchmark": "kv_transfer",
        "device": args.device,
        "src_gpu": args.src_gpu,
        "dst_gpu": args.dst_gpu,
        "host": {
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "d_progress_thread": d_progress_thread(args),
        "parallel_reads": args.parallel_reads,
        "num_workers": args.num_workers,
        "release_notice": args.release_notice,
        "env": env,
        "specs": {
            "realistic": asdict(REALISTIC),
            "deep": asdict(DEEP),
            "large": asdict(LARGE),
            "xlarge": asdict(XLARGE),
        },
        "results": rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
