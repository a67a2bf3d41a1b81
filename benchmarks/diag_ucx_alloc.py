"""Does the size of the registered GPU allocation change how NIXL/UCX moves a READ between two processes on one GPU?

Why: serving workers at Nemotron-H-8B hand over 110 MB per request in 0.5-7 s (about 0.2 GB/s; UCX staged the READs
through host memory), while benchmarks/transfer.py moves 67 MB in 0.15-0.5 ms with cuda_ipc. The workers register
one allocation of tens of GB (the arena); the benchmark's tensors are at most 1 GiB. This script registers one
allocation of each size on P and on D (as the workers do: NIXL without its progress thread, P progressing its agent
every --p-poll-ms as a busy step loop would), READs --read-mb from P's allocation into D's, and prints the median
time and GB/s per size. Data are checked.

    python benchmarks/diag_ucx_alloc.py --sizes-gb 1,8,40 --read-mb 100
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def _backend_params(err_mode: str) -> dict:  # type: ignore[type-arg]
    return {"ucx_error_handling_mode": err_mode} if err_mode else {}


def _producer(conn, nbytes: int, p_poll_s: float, err_mode: str) -> None:  # type: ignore[no-untyped-def]
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    t = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    agent = nixl_agent("P", nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", _backend_params(err_mode))
    agent.register_memory([(t.data_ptr(), nbytes, 0, "")], "VRAM")
    conn.send((agent.get_agent_metadata(), t.data_ptr()))
    while not conn.poll(p_poll_s):  # a busy P: its step loop progresses the agent once per step
        agent.get_new_notifs()


def run_size(nbytes: int, read: int, repeats: int, p_poll_s: float, err_mode: str = "") -> dict:  # type: ignore[type-arg]
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, nbytes, p_poll_s, err_mode), daemon=True)
    proc.start()
    meta, p_ptr = parent.recv()
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    agent = nixl_agent("D", nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", _backend_params(err_mode))
    agent.register_memory([(dst.data_ptr(), nbytes, 0, "")], "VRAM")
    name = agent.add_remote_agent(meta)
    times = []
    try:
        for i in range(repeats + 1):
            off = (i * read) % max(nbytes - read, 1)
            local = agent.get_xfer_descs([(dst.data_ptr() + off, read, 0)], "VRAM")
            remote = agent.get_xfer_descs([(p_ptr + off, read, 0)], "VRAM")
            h = agent.initialize_xfer("READ", local, remote, name, b"")
            t0 = time.perf_counter()
            state = agent.transfer(h)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(h)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            agent.release_xfer_handle(h)
            if state == "ERR":
                raise RuntimeError("READ failed")
            ok = bool((dst[off:off + read] == 7).all())
            if not ok:
                raise RuntimeError("READ returned wrong bytes")
            if i:
                times.append(dt)
    finally:
        parent.send("stop")
        proc.join(10)
    med = statistics.median(times)
    return {"alloc_gb": nbytes / 2**30, "read_mb": read / 2**20, "median_ms": med * 1e3, "gbps": read / med / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gb", default="1,8,40")
    ap.add_argument("--read-mb", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--p-poll-ms", type=float, default=50.0)
    ap.add_argument("--err-mode", default="", help="NIXL ucx_error_handling_mode: none | peer (default: peer)")
    args = ap.parse_args()
    print("alloc GB | read MB | median ms | GB/s")
    for g in args.sizes_gb.split(","):
        r = run_size(int(float(g) * 2**30), args.read_mb * 2**20, args.repeats, args.p_poll_ms / 1e3, args.err_mode)
        print(f"{r['alloc_gb']:.0f} | {r['read_mb']:.0f} | {r['median_ms']:.2f} | {r['gbps']:.1f}", flush=True)


if __name__ == "__main__":
    main()
