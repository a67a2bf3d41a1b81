"""Sweep NIXL/UCX settings for the KV transfer: runs benchmarks/transfer.py once per setting (fresh P and D
processes each time, so UCX reads its environment anew) and prints one table; all rows go to one JSON file.

    python benchmarks/transfer_sweep.py --pairs 0:0,0:1 --json out/transfer_sweep.json
    python benchmarks/transfer_sweep.py --settings default,pr4 --pairs 0:0    # a subset

A setting is extra environment plus extra transfer.py flags on top of transfer.py's defaults (D without NIXL's
progress thread on CUDA, as decode workers run); see SETTINGS. Pairs are src:dst GPU ids.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NVLINK_TLS = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}

SETTINGS: dict[str, tuple[dict[str, str], list[str]]] = {
    "default": ({}, []),
    "tls": (NVLINK_TLS, []),
    "getzcopy": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}, []),
    "pr4": ({}, ["--parallel-reads", "4"]),
    "pr4w4": ({}, ["--parallel-reads", "4", "--num-workers", "4"]),
    "pr16": ({}, ["--parallel-reads", "16"]),
    "tls_pr4": (NVLINK_TLS, ["--parallel-reads", "4"]),
    "dthread": ({}, ["--d-progress-thread", "on"]),  # D with NIXL's progress thread (decode workers on GPU: off)
    "pr2": ({}, ["--parallel-reads", "2"]),
    "tls_getzcopy": ({**NVLINK_TLS, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}, []),
    "prepped": ({}, ["--modes", "prepped"]),
    "notice_after": ({}, ["--release-notice", "after_done"]),
    "getzcopy_notice_after": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}, ["--release-notice", "after_done"]),
    "protoinfo": ({"UCX_PROTO_INFO": "y"}, []),  # UCX prints the protocols it picked (see the log)
}


def run_one(name: str, src: int, dst: int, args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    env_extra, flags = SETTINGS[name]
    env = {**os.environ, **env_extra, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, str(ROOT / "benchmarks/transfer.py"), "--device", args.device, "--src-gpu", str(src)]
        cmd += ["--dst-gpu", str(dst), "--rounds", "1", "--repeats", str(args.repeats), "--modes", "per_transfer"]
        cmd += ["--scenarios", args.scenarios, "--layouts", args.layouts, "--json", str(out), *flags]
        t0 = time.time()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        log.write(
            f"=== {name} {src}->{dst} rc={p.returncode} {time.time() - t0:.0f}s\n{p.stdout}\n{p.stderr[-4000:]}\n"
        )
        log.flush()
        if p.returncode != 0 or not out.exists():
            print(f"{name} {src}->{dst}: failed rc={p.returncode}: {p.stderr.strip().splitlines()[-1:]}", flush=True)
            return []
        rows = json.loads(out.read_text())["results"]
    for r in rows:
        r.update(setting=name, pair=f"{src}->{dst}", env=env_extra, flags=flags)
    print(f"{name} {src}->{dst}: " + ", ".join(f"{r['scenario']} {r['gbps']:.0f} GB/s" for r in rows), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--pairs", default="0:0")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--scenarios", default="realistic-contig,large,xlarge")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--layouts", default="stacked", help="transfer.py --layouts")
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--json", default="out/transfer_sweep.json")
    ap.add_argument("--log", default="out/transfer_sweep.log")
    args = ap.parse_args()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with open(args.log, "w") as log:
        for pair in args.pairs.split(","):
            src, dst = (int(x) for x in pair.split(":"))
            for name in args.settings.split(","):
                try:
                    rows += run_one(name, src, dst, args, log)
                except subprocess.TimeoutExpired:
                    print(f"{name} {src}->{dst}: timed out after {args.timeout} s", flush=True)
    Path(args.json).write_text(json.dumps({"benchmark": "kv_transfer_sweep", "results": rows}, indent=2))
    head = ["pair", "setting", "scenario", "MiB", "descs", "handover ms", "wire ms", "GB/s", "torch GB/s", "ipc GB/s"]
    head += ["x torch", "x ipc", "handover/wire"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))

    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    for r in rows:
        cells = [r["pair"], r["setting"], r["scenario"], f"{r['bytes'] / 2**20:.0f}", str(r["descriptors"])]
        cells += [f(r["handover_ms"], ".3f"), f(r["wire_ms"], ".3f"), f(r["gbps"], ".0f"), f(r["torch_gbps"], ".0f")]
        cells += [f(r["ipc_gbps"], ".0f"), f(r["ratio_torch"]), f(r["ratio_ipc"]), f(r["handover_over_wire"])]
        print(" | ".join(cells))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
