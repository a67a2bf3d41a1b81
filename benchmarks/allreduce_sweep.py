"""The collectives of a tensor-parallel decode step, each timed alone inside a CUDA graph on two GPUs: the
all-reduce of [rows, hidden] (one per block) and the LM head's logits gather of [rows, vocab / tp]. NCCL reads
its tuning variables (NCCL_PROTO, NCCL_ALGO, ...) at start-up, so compare settings by running this once per
setting; each run prints one JSON line per shape and a table. Every run also times the one-shot symmetric-memory
all-reduce (engine/parallel/allreduce.py, what `TPGroup.all_reduce` uses for small tensors) side by side with NCCL,
and checks it: a chain of all-reduces in one graph (a stale read of a peer's previous buffer changes the sum) must
give exactly NCCL's bits, in fp32 and bf16, on every rank.

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


def _nccl(y: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(y)
    return y


def _chain(body: Any, x: torch.Tensor, steps: int = 64) -> torch.Tensor:
    """`steps` chained all-reduces of x (with a rank-dependent twist each step) captured in one graph, replayed."""
    scale = 1.0 + 0.25 * torch.distributed.get_rank()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body(x.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x.clone()
        for _ in range(steps):
            y = body(y * scale) * 0.25
    graph.replay()
    torch.cuda.synchronize()
    return y.clone()


def _same_bits(tp: Any, rows: int, hidden: int, dtype: torch.dtype, rank: int) -> bool | None:
    """One-shot == NCCL bit for bit on a chain of all-reduces (None: the one-shot kernel does not take this size)."""
    g = torch.Generator(device=f"cuda:{rank}").manual_seed(1234 + rank)
    x = torch.randn(rows, hidden, dtype=dtype, device=f"cuda:{rank}", generator=g)
    if tp.one_shot is None or not tp.one_shot.fits(x):
        return None
    ok = torch.equal(_chain(tp.one_shot, x), _chain(_nccl, x))
    flags = torch.tensor([int(ok)], device=x.device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    return bool(flags.item())


def rank_main(rank: int, args: argparse.Namespace, init: str, queue: Any) -> None:
    from hybridpd.engine.parallel.group import init_tp

    device = f"cuda:{rank}"
    tp = init_tp(rank, 2, init, device)
    rows = []
    for n in args.rows:
        x = torch.randn(n, args.hidden, dtype=torch.bfloat16, device=device) * 1e-3
        ar = _graph_us(lambda y: _nccl(y) * 0.5, x)
        one = _graph_us(lambda y: tp.one_shot(y) * 0.5, x) if tp.one_shot and tp.one_shot.fits(x) else None
        logits = torch.randn(n, args.vocab // 2, dtype=torch.bfloat16, device=device)
        gather = _graph_us(lambda y: tp.all_gather_last(y)[:, : args.vocab // 2] * 0.5, logits)
        exact = {str(dt): _same_bits(tp, n, args.hidden, dt, rank) for dt in (torch.float32, torch.bfloat16)}
        rows.append(
            {
                "rows": n,
                "hidden": args.hidden,
                "all_reduce_us": ar,
                "one_shot_us": one,
                "logits_gather_us": gather,
                "one_shot_equals_nccl": exact,
            }
        )
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
            f"{setting:40} rows {r['rows']:4d}: NCCL all-reduce {r['all_reduce_us']:6.1f} us, one-shot "
            f"{r['one_shot_us'] or float('nan'):6.1f} us (== NCCL: {r['one_shot_equals_nccl']}), "
            f"logits gather {r['logits_gather_us']:7.1f} us"
        )
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
