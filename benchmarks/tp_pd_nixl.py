"""PD handoffs between tensor-parallel sizes through the serving path (worker processes, gRPC, one NIXL agent per
rank, each D rank reading its head slices from the P ranks that hold them), fp32 greedy tokens against the colocated
TP 1 engine. Plain processes (deploy.local_cluster: no Ray), one cluster per (P TP, D TP) pair and model.

    P TP 2 -> D TP 1:  P's ranks on cuda:0 and cuda:1, D on cuda:0
    P TP 1 -> D TP 2:  P on cuda:0, D's ranks on cuda:0 and cuda:1

    python benchmarks/tp_pd_nixl.py --out out/tp_pd_nixl.json               (2 GPUs)
    python benchmarks/tp_pd_nixl.py --device cpu --pairs 2:1                (CPU smoke test: gloo ranks, DRAM)

Prints one line per (model, pair): identical or not, prompts handed off (transferred_tokens == prompt length), handoff
failures on D; writes the rows as JSON. Exit code 1 when any output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.tp_decode import PROMPTS, _identity_models  # noqa: E402

NEW = 12


T0 = time.time()


def _progress(what: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {what}", flush=True)


def _flags(device: str, tp: int) -> list[str]:
    return ["--device", device, *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])]


def check_pair(family: str, path: str, tp_p: int, tp_d: int, device: str) -> dict[str, Any]:
    from hybridpd.deploy.local_cluster import complete, start_cluster
    from hybridpd.engine import LLM, SamplingParams

    common = ["--dtype", "float32", "--load-format", "dummy", "--max-model-len", "1024", "--checkpoint-interval", "64"]
    common += ["--kv-cache-memory-bytes", str(256 * 2**20)]
    _progress(f"{family} P TP {tp_p} -> D TP {tp_d}: colocated reference (TP 1, fp32)")
    llm = LLM(
        model=path,
        device=device,
        dtype="float32",
        load_format="dummy",
        max_model_len=1024,
        checkpoint_interval=64,
        kv_cache_memory_bytes=256 * 2**20,
    )
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy)]
    llm.shutdown()
    del llm
    _progress(f"{family} P TP {tp_p} -> D TP {tp_d}: colocated reference done")
    t0 = time.time()
    cluster = start_cluster(
        path, worker_args=common, prefill_args=_flags(device, tp_p), decode_args=_flags(device, tp_d)
    )
    try:
        started = time.time() - t0
        _progress(f"cluster up in {started:.0f} s")
        got, handed = [], 0
        for prompt in PROMPTS:
            body = complete(cluster, prompt, NEW)
            _progress(f"prompt of {len(prompt)}: {body['usage']['hybridpd']}")
            got.append(body["choices"][0]["token_ids"])
            handed += body["usage"]["hybridpd"]["transferred_tokens"] == len(prompt)
        failures = cluster.metric(cluster.decode[0], "hybridpd_kv_transfer_failures_total")
    finally:
        cluster.stop()
    return {
        "hetero_nixl": family,
        "p_tp": tp_p,
        "d_tp": tp_d,
        "device": device,
        "identical": got == want,
        "prompts": len(PROMPTS),
        "handed_off": handed,
        "handoff_failures": failures,
        "cluster_start_s": round(started, 1),
        "mismatches": [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default="2:1,1:2", help="P_TP:D_TP pairs, comma-separated")
    p.add_argument("--device", default="cuda", help="cuda (rank r of a worker on cuda:r) or cpu")
    p.add_argument("--models", default="nemotron_h,qwen3_5")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args()
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs.split(",")]
    rows = []
    for family, path in _identity_models().items():
        if family not in args.models.split(","):
            continue
        for tp_p, tp_d in pairs:
            row = check_pair(family, path, tp_p, tp_d, args.device)
            rows.append(row)
            print(
                f"hetero-TP PD over NIXL {family:10} P TP {tp_p} -> D TP {tp_d} fp32 on {args.device}: "
                f"{'IDENTICAL' if row['identical'] else 'DIFFERENT ' + str(row['mismatches'])} to colocated TP 1; "
                f"handed off {row['handed_off']}/{row['prompts']}, handoff failures {row['handoff_failures']:.0f}",
                flush=True,
            )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(0 if rows and all(r["identical"] and r["handed_off"] == r["prompts"] for r in rows) else 1)


if __name__ == "__main__":
    main()
