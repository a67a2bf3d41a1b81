"""Where a PD request's time to first token goes, for a model whose recurrent state is large next to its compute.

    python benchmarks/pd_handoff.py --out docs/results/pd_handoff_cpu.json
    python benchmarks/pd_handoff.py --device cuda --dtype bfloat16 --preset nemotron-h-8b --num-prompts 64 \
        --concurrency 16 --input-len 512 --output-len 32
    python benchmarks/pd_handoff.py --modes pd --commit-overlap off,on --concurrency 1   # the phases before/after

Starts the real stack (deploy/local_cluster.py: 1 prefill + 1 decode worker and the proxy; then one colocated
worker), drives `hybridpd bench serve` against each, and reads the workers' hybridpd_kv_handoff_seconds{role,
phase} histograms (means and request counts over the run) next to the client's TTFT. The default CPU model has a
17 MB recurrent state per request (8 Mamba-2 layers of 64 heads x 64 x 128 fp32) and little compute, the ratio
that made Nemotron-H-8B's PD TTFT 20x the colocated one. Prints one table per mode and writes JSON.
`--commit-overlap off,on` runs PD once per value (HYBRIDPD_COMMIT_OVERLAP=0/1 on the decode worker: whether the
request decodes while D's Commit is in flight) and prints the decode phases side by side; `--gpus 0,1` puts P on
the first GPU and D on the second (colocated on the first).
HYBRIDPD_TRANSFER_PROGRESS_S=0 (inherited by the workers) turns kvtransfer/progress.py off for an A/B run;
`UCX_TLS=tcp` makes the CPU pull need both sides' progress, as a transport staging through the host would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = {"prefill": ("queue", "prefill", "lease"),
          "decode": ("handshake", "admit", "pull", "commit", "resume", "total", "commit_rpc")}
"""D's commit_rpc is the Commit RPC alone (hybridpd_kv_transfer_commit_seconds); its commit phase runs from the READ
seen done to P's answer applied on the step thread, and holds the request's first decode step with the overlap."""


def _totals(c, w, role: str) -> dict[str, tuple[float, float]]:  # type: ignore[no-untyped-def]
    """{phase: (sum of seconds, count)} of one worker's hybridpd_kv_handoff_seconds so far."""
    out = {ph: (c.metric(w, "hybridpd_kv_handoff_seconds_sum", role=role, phase=ph),
                c.metric(w, "hybridpd_kv_handoff_seconds_count", role=role, phase=ph))
           for ph in PHASES[role] if ph != "commit_rpc"}
    if role == "decode":
        out["commit_rpc"] = (c.metric(w, "hybridpd_kv_transfer_commit_seconds_sum", role=role),
                             c.metric(w, "hybridpd_kv_transfer_commit_seconds_count", role=role))
    return out


def _phases(after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]] | None = None
            ) -> dict[str, tuple[float, int]]:
    """{phase: (mean seconds, count)} of the requests between two `_totals` readings."""
    out = {}
    for ph, (s, n) in after.items():
        s0, n0 = (before or {}).get(ph, (0.0, 0.0))
        out[ph] = ((s - s0) / (n - n0) if n > n0 else float("nan"), int(n - n0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--preset", default=None, help="full-size shape (engine.models.checkpoint.PRESETS), dummy weights")
    ap.add_argument("--mamba-heads", type=int, default=64, help="CPU model: Mamba-2 heads per layer (state size)")
    ap.add_argument("--pattern", default="MMMM*MMMM-", help="CPU model: layer pattern (M Mamba-2, * attention, - MLP)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="requests sent and left out of every figure before the measured run (default: --concurrency;"
                         " the first steps of a fresh worker compile kernels)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--modes", default="pd,colocated")
    ap.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (repeatable)")
    ap.add_argument("--prefill-arg", action="append", default=[], help="extra flag of the PD prefill worker only, "
                    "e.g. --prefill-arg=--nixl-progress-thread")
    ap.add_argument("--decode-arg", action="append", default=[], help="extra flag of the PD decode worker only")
    ap.add_argument("--commit-overlap", default="on", help="on, off or off,on: PD runs, one per value")
    ap.add_argument("--gpus", default=None, help="CUDA devices: P on the first, D on the second")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from hybridpd.deploy.bench_serve import main as bench_main
    from hybridpd.deploy.local_cluster import start_cluster
    from hybridpd.engine.models.checkpoint import write_preset_checkpoint, write_random_checkpoint

    results = []
    warmup = args.concurrency if args.warmup_prompts is None else args.warmup_prompts
    with tempfile.TemporaryDirectory() as tmp:
        wargs = ["--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(max(args.concurrency, 8))]
        if args.preset:
            model = write_preset_checkpoint(f"{tmp}/model", args.preset, weights=False)
            wargs += ["--load-format", "dummy", "--max-model-len", str(args.input_len + args.output_len + 16)]
        else:
            model = write_random_checkpoint(f"{tmp}/model", "nemotron_h", seed=0, hidden_size=256,
                                            pattern=args.pattern, mamba_num_heads=args.mamba_heads, mamba_head_dim=64,
                                            ssm_state_size=128, n_groups=4, vocab_size=512)
        if args.device == "cpu":
            wargs += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
        else:
            wargs += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        wargs += args.worker_arg
        gpus = args.gpus.split(",") if args.gpus else []
        runs = [(m, o) for m in args.modes.split(",") for o in (args.commit_overlap.split(",") if m == "pd" else [""])]
        for mode, overlap in runs:
            envs = [{"CUDA_VISIBLE_DEVICES": g} for g in gpus] or None
            c = start_cluster(model, colocated=(mode == "colocated"), worker_args=wargs, prefill_args=args.prefill_arg,
                              decode_args=args.decode_arg, worker_envs=envs,
                              decode_env={"HYBRIDPD_COMMIT_OVERLAP": "0" if overlap == "off" else "1"})
            try:
                def bench(n: int, seed: int, out: str, c=c) -> None:  # type: ignore[no-untyped-def]
                    bench_main(["--base-url", c.url, "--model", c.model_name, "--dataset", "random", "--num-prompts",
                                str(n), "--max-concurrency", str(args.concurrency), "--random-input-len",
                                str(args.input_len), "--random-output-len", str(args.output_len), "--vocab-size",
                                "256", "--seed", str(seed), "--quiet", "--out", out])

                if warmup:
                    bench(warmup, 1, os.path.join(tmp, f"{mode}-warmup.json"))
                before = {}
                if mode == "pd":
                    before = {"prefill": _totals(c, c.prefill[0], "prefill"),
                              "decode": _totals(c, c.decode[0], "decode")}
                out = os.path.join(tmp, f"{mode}.json")
                bench(args.num_prompts, 0, out)
                with open(out) as f:
                    s = json.load(f)["summary"]
                row = {"mode": mode, "commit_overlap": overlap or None, "completed": s["completed"],
                       "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"], "duration_s": s["duration_s"],
                       "warmup_prompts": warmup}
                if mode == "pd":
                    row["prefill"] = _phases(_totals(c, c.prefill[0], "prefill"), before["prefill"])
                    row["decode"] = _phases(_totals(c, c.decode[0], "decode"), before["decode"])
                results.append(row)
            finally:
                c.stop()
    def label(r: dict) -> str:  # type: ignore[type-arg]
        return r["mode"] + (f" (overlap {r['commit_overlap']})" if r.get("commit_overlap") else "")

    print("\nmode | done | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | duration s")
    for r in results:
        print(f"{label(r)} | {r['completed']} | {r['ttft_ms']['p50']:.1f} | {r['ttft_ms']['p99']:.1f} | "
              f"{r['tpot_ms']['p50']:.1f} | {r['duration_s']:.2f}")
    pd = [r for r in results if "decode" in r]
    for role in ("prefill", "decode"):
        if pd:
            print(f"\n{role} handoff phase | " + " | ".join(f"{label(r)} mean ms (n)" for r in pd))
            for ph in PHASES[role]:
                print(f"{ph} | " + " | ".join(f"{1e3 * r[role][ph][0]:.2f} ({r[role][ph][1]})" for r in pd))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
