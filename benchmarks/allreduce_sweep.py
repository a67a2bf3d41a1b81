"""The collectives of a tensor-parallel decode step, each timed alone inside a CUDA graph on two GPUs: the
all-reduce of [rows, hidden] (one per block) and the LM head's logits gather of [rows, vocab / tp]. NCCL reads
its tuning variables (NCCL_PROTO, NCCL_ALGO, ...) at start-up, so compare settings by running this once per
setting; each run prints one JSON line per shape and a table.

    NCCL_PROTO=LL python benchmarks/allreduce_sweep.py --rows 1,16,64,256 --hidden 4096 --vocab 131072
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.roofline import timed  # noqa: E402

REPS = 50


def _graph_us(body: Any, x: torch.Tensor) -> float:
    """Median replay time of `REPS` chained calls of body captured in one graph, per call, in us."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body(x.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    y = x.clone()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            y = body(y)
    return statistics.median(timed(graph.replay, 3, 20)) * 1e6 / REPS


def rank_main(rank: int, args: argparse.Namespace, init: str, queue: Any) -> None:
    from hybridpd.engine.parallel.group import init_tp

    device = f"cuda:{rank}"
    tp = init_tp(rank, 2, init, device)
    rows = []
    for n in args.rows:
        x = torch.randn(n, args.hidden, dtype=torch.bfloat16, device=device) * 1e-3
        ar = _graph_us(lambda y: tp.all_reduce(y) * 0.5, x)
        logits = torch.randn(n, args.vocab // 2, dtype=torch.bfloat16, device=device)
        gather = _graph_us(lambda y: tp.all_gather_last(y)[:, : args.vocab // 2] * 0.5, logits)
        rows.append({"rows": n, "hidden": args.hidden, "all_reduce_us": ar, "logits_gather_us": gather})
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        queue.put([{**r, "env": env, "nccl": ".".join(map(str, torch.cuda.nccl.version()))} for r in rows])
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--out", default=None, help="append the JSON lines here")
    args = p.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    import torch.multiprocessing as mp
    from hybridpd.engine.parallel.group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, args, init, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=180)
    for proc in procs:
        proc.join(timeout=30)
    setting = " ".join(f"{k}={v}" for k, v in sorted(rows[0]["env"].items())) or "defaults"
    for r in rows:
        print(json.dumps(r))
        print(
            f"{setting:40} rows {r['rows']:4d}: all-reduce {r['all_reduce_us']:6.1f} us, "
            f"logits gather {r['logits_gather_us']:7.1f} us"
        )
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
