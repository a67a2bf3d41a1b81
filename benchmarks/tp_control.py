"""Tensor-parallel control messages: how long from rank 0 deciding a step to a follower holding it, and what rank 0
spends sending it. CPU only, plain processes (rank 0 here, followers spawned; gloo + the engine's command channel).

The messages are real: an `EngineCore` (a tiny random model with the Nemotron-H-8B layer pattern, so the same
cache groups as the 8B preset) schedules requests whose prompts have about --context tokens (0.5x to 1.5x); its
runner's `execute` is replaced by a recorder that returns a token for every sampling sequence, so the scheduler,
cache manager and sampling parameters are the engine's. Kinds, each --steps consecutive steps: decode at batch 1,
16, 64 (block tables of about context/16 pages; a table changes when its sequence starts a page) and prefill (the
first steps of 64 such prompts: max_num_batched_tokens chunks).

Transports, the steps sent in order (cycling) --repeats times after --warmup, rank 0 busy (a Python loop standing
for its own step) for --gap-ms after each send so that sends never queue:

    gloo     torch.distributed.broadcast_object_list of (name, (out, params), {}) over the gloo group (the old path:
             sizes, then bytes; rank 0 returns once both collectives are done)
    raw      the channel (engine.parallel.channel: one length-prefixed pickle per follower over a Unix socket,
             rank 0 does not wait) with the same (name, (out, params), {}) message
    channel  what the engine sends now: the channel with the compact step (engine.parallel.commands: the
             scheduler output as tuples, no sampling params, block tables only when changed), rebuilt into a
             SchedulerOutput on the follower

    latency  = follower has the decoded command (perf_counter_ns, one clock on one host) - rank 0 starts sending;
               with --world > 2, the last follower's (the step starts when every rank has it)
    send     = rank 0's time inside the send call (pickling included)

    python benchmarks/tp_control.py --out out/tp_control.json       (under a minute; --world 4 for TP 4)

--engine PRESET (or "tiny"): the decode step through the whole engine instead, control path included: for each of
--tp-sizes, `LLM(tensor_parallel_size=N)` (a preset: config only, `load_format="dummy"`, bf16 on CUDA) runs --batch
requests of --context-token prompts to decode, then `EngineCore.step` is timed over --engine-steps decode steps
(wall clock; the step ends with rank 0 reading the sampled tokens, so it waits for every rank's GPU work), with
rank 0's time inside its broadcast of each command. This mode runs on an engine from before the channel as well
(copy this file out and run it in that checkout): the before / after of the same step.

    python benchmarks/tp_control.py --engine nemotron-h-8b --device cuda --tp-sizes 1,2 --out out/tp_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

TRANSPORTS = ("gloo", "raw", "channel")


def build_messages(context: int, steps: int) -> dict[str, list[tuple[Any, Any]]]:
    """kind -> consecutive (SchedulerOutput, params) as EngineCore.step hands them to its runner."""
    from hybridpd.engine import LLM, SamplingParams
    from hybridpd.engine.models.checkpoint import NEMOTRON_H_8B_PATTERN, write_random_checkpoint

    path = write_random_checkpoint(tempfile.mkdtemp(), "nemotron_h", seed=0, pattern=NEMOTRON_H_8B_PATTERN)
    llm = LLM(model=path, max_num_seqs=64, kv_cache_memory_bytes=1 << 30, max_model_len=2 * context + 4 * steps)
    core = llm.engine
    seen: list[tuple[Any, Any]] = []

    def record(out: Any, params: Any) -> dict[str, tuple[int, float]]:
        seen.append((out, params))
        return {s.request_id: (65, -0.5) for s in out.seqs if s.sample}

    core.runner.execute = record
    rnd = random.Random(0)
    params = SamplingParams(max_tokens=4 * steps, temperature=0.7, top_p=0.95)
    found: dict[str, list[tuple[Any, Any]]] = {}
    for batch in (64, 16, 1):
        rids = [f"cmpl-{rnd.getrandbits(128):032x}-0" for _ in range(batch)]
        for rid in rids:  # lengths spread, so that sequences cross page boundaries at different steps
            prompt = [rnd.randrange(1, 256) for _ in range(rnd.randrange(context // 2, 3 * context // 2 + 1))]
            core.add_request(rid, prompt, params)
        seen.clear()
        while not seen or seen[-1][0].num_tokens != len(seen[-1][0].seqs):
            core.step()
        if batch == 64:
            found["prefill"] = seen[:steps]
        start = len(seen) - 1
        for _ in range(steps - 1):
            core.step()
        found[f"decode b{batch}"] = seen[start:]
        for rid in rids:
            core.abort(rid)
    llm.shutdown()
    return {k: found[k] for k in ("decode b1", "decode b16", "decode b64", "prefill")}


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _send(tp: Any, transport: str, step: tuple[Any, Any], encoder: Any) -> None:
    import torch.distributed as dist

    if transport == "gloo":
        dist.broadcast_object_list([("execute", step, {})], src=0, group=tp.control)
    elif transport == "raw":
        tp.broadcast(("execute", step, {}))
    else:
        tp.broadcast(encoder.encode("execute", step, {}))


def _recv(tp: Any, transport: str, decoder: Any) -> Any:
    import torch.distributed as dist

    if transport == "gloo":
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=tp.control)
        return box[0]
    msg = tp.broadcast(None)
    return decoder.decode(msg) if transport == "channel" else msg


def _wire_bytes(transport: str, steps: list[tuple[Any, Any]]) -> int:
    """The median pickled size of a message of `steps` (sent in that order)."""
    from hybridpd.engine.parallel.commands import StepEncoder

    encoder = StepEncoder()
    wire = [encoder.encode("execute", s, {}) if transport == "channel" else ("execute", s, {}) for s in steps]
    return int(statistics.median(len(pickle.dumps(w, protocol=pickle.HIGHEST_PROTOCOL)) for w in wire))


def rank_cpus(world: int) -> list[int] | None:
    """One CPU per rank (as a GPU rank runs on its own core: a follower woken on rank 0's core would preempt it and
    count its own decoding as rank 0's send); None when there are fewer CPUs than ranks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cpus[:world] if len(cpus) >= world else None


def follower(rank: int, world: int, init: str, cpu: int | None) -> None:
    import torch.distributed as dist
    from hybridpd.engine.parallel.commands import StepDecoder
    from hybridpd.engine.parallel.group import init_tp

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    tp = init_tp(rank, world, init, "cpu")
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    for transport, count in box[0]:
        decoder = StepDecoder()
        dist.barrier(group=tp.control)
        stamps = []
        for _ in range(count):
            _recv(tp, transport, decoder)
            stamps.append(time.perf_counter_ns())
        tp.gather_objects(stamps)
    assert tp.broadcast(None) is None  # rank 0's stop


def leader(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from hybridpd.engine.parallel.commands import StepEncoder
    from hybridpd.engine.parallel.group import free_port, init_tp

    messages = build_messages(args.context, args.steps)
    init = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cpus = None if args.no_pin else rank_cpus(args.world)
    argv = [sys.executable, os.path.abspath(__file__), "--init", init, "--world", str(args.world)]
    procs = []
    for r in range(1, args.world):
        pinning = ["--cpu", str(cpus[r])] if cpus else []
        procs.append(subprocess.Popen([*argv, "--rank", str(r), *pinning], env=env))
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    tp = init_tp(0, args.world, init, "cpu")
    count = args.warmup + args.repeats
    plan = [(t, count) for _ in messages for t in TRANSPORTS]
    dist.broadcast_object_list([plan], src=0, group=tp.control)
    rows = []
    for kind, steps in messages.items():
        for transport in TRANSPORTS:
            encoder = StepEncoder()
            dist.barrier(group=tp.control)
            starts, sends = [], []
            for i in range(count):
                step = steps[i % len(steps)]
                t0 = time.perf_counter_ns()
                _send(tp, transport, step, encoder)
                t1 = time.perf_counter_ns()
                starts.append(t0)
                sends.append(t1 - t0)
                _busy(args.gap_ms / 1e3)
            got = tp.gather_objects([])[1:]
            last = [max(f[i] for f in got) for i in range(count)]
            lat = [(b - a) / 1e3 for a, b in zip(starts, last, strict=True)][args.warmup :]
            send_us = [s / 1e3 for s in sends][args.warmup :]
            rows.append(
                {
                    "kind": kind,
                    "transport": transport,
                    "seqs": len(steps[0][0].seqs),
                    "tokens": steps[0][0].num_tokens,
                    "bytes": _wire_bytes(transport, steps),
                    "latency_us_median": statistics.median(lat),
                    "latency_us_p90": statistics.quantiles(lat, n=10)[-1],
                    "send_us_median": statistics.median(send_us),
                    "send_us_p90": statistics.quantiles(send_us, n=10)[-1],
                }
            )
    tp.broadcast(None)
    for p in procs:
        p.wait(timeout=60)
    return {
        "world": args.world,
        "context": args.context,
        "repeats": args.repeats,
        "gap_ms": args.gap_ms,
        "cpus": cpus,
        "rows": rows,
    }


def _time_sends(tp: Any) -> list[float]:
    """Seconds of every later `tp.broadcast` on rank 0 (its time sending a command; this works on engines from
    before the channel too, whose broadcast was gloo's broadcast_object_list)."""
    sends: list[float] = []
    broadcast = tp.broadcast

    def timed(obj: Any) -> Any:
        t0 = time.perf_counter()
        out = broadcast(obj)
        sends.append(time.perf_counter() - t0)
        return out

    object.__setattr__(tp, "broadcast", timed)  # TPGroup is frozen; the instance attribute shadows the method
    return sends


def _engine_row(path: str, tp: int, settings: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One engine at `tp`: its decode step, timed; the engine is shut down before returning."""
    from hybridpd.engine import LLM, SamplingParams

    n = args.engine_steps
    llm = LLM(
        model=path,
        tensor_parallel_size=tp,
        max_num_seqs=args.batch,
        max_model_len=2 * args.context + n + 64,
        **settings,
    )
    core = llm.engine
    sends = _time_sends(core.followers.tp) if core.followers is not None else []
    rnd = random.Random(0)
    params = SamplingParams(max_tokens=n + 64, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rnd.randrange(1, 256) for _ in range(rnd.randrange(args.context // 2, 3 * args.context // 2))]
        core.add_request(f"r{i}", prompt, params)
    try:
        for _ in range(100 * args.batch):  # prefill, then a few decode steps (CUDA graphs captured, allocator warm)
            core.step()
            decoding = all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in core.scheduler.running)
            if decoding and len(core.scheduler.running) == args.batch:
                break
        else:
            raise RuntimeError(f"the {args.batch} requests never decoded together (cache too small?)")
        for _ in range(8):
            core.step()
        sends.clear()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        sends = list(sends)  # not the stop command
    finally:
        llm.shutdown()
    return {
        "tp": tp,
        "batch": args.batch,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_p90": statistics.quantiles(times, n=10)[-1] * 1e3,
        "send_us_median": statistics.median(sends) * 1e6 if sends else None,
        "sends_per_step": len(sends) / n,
    }


def engine_steps(args: argparse.Namespace) -> dict[str, Any]:
    """The decode step of the whole engine at each TP size (see the module docstring)."""
    import gc

    import torch
    from hybridpd.engine.models.checkpoint import (
        NEMOTRON_H_8B_PATTERN,
        write_preset_checkpoint,
        write_random_checkpoint,
    )

    cuda = args.device.startswith("cuda")
    settings: dict[str, Any] = {"device": args.device, "dtype": "bfloat16" if cuda else "float32"}
    if cuda:  # room for what an engine before it may still hold
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.engine == "tiny":
        path = write_random_checkpoint(tempfile.mkdtemp(), "nemotron_h", seed=0, pattern=NEMOTRON_H_8B_PATTERN)
    else:
        path = write_preset_checkpoint(tempfile.mkdtemp(), args.engine, weights=False)
        settings["load_format"] = "dummy"
    if not cuda:  # a smoke test: ranks share the cores, no spinning thread pools
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
    rows = []
    for tp in (int(t) for t in args.tp_sizes.split(",")):
        start = time.perf_counter()
        rows.append(_engine_row(path, tp, settings, args))
        took = time.perf_counter() - start  # progress: a call that runs out of time still shows the sizes done
        print(f"engine TP {tp}: step p50 {rows[-1]['step_ms_median']:.2f} ms ({took:.0f} s with start-up)", flush=True)
        gc.collect()  # the engine's memory back before the next one plans its cache
        if cuda:
            torch.cuda.empty_cache()
    base = rows[0]["step_ms_median"]
    for r in rows:
        r["vs_first"] = r["step_ms_median"] / base
    return {
        "engine": args.engine,
        "device": args.device,
        "context": args.context,
        "steps": args.engine_steps,
        "rows": rows,
    }


def engine_table(result: dict[str, Any]) -> str:
    lines = [
        f"engine decode step: {result['engine']} on {result['device']}, context ~{result['context']}, "
        f"median of {result['steps']} steps",
        f"{'tp':>3} {'batch':>5} {'step ms (p50/p90)':>18} {'vs first':>9} {'rank-0 send us':>15} {'sends/step':>10}",
    ]
    for r in result["rows"]:
        step = f"{r['step_ms_median']:.2f} / {r['step_ms_p90']:.2f}"
        send = "-" if r["send_us_median"] is None else f"{r['send_us_median']:.0f}"
        lines.append(
            f"{r['tp']:>3} {r['batch']:>5} {step:>18} {r['vs_first']:>9.2f} {send:>15} {r['sends_per_step']:>10.1f}"
        )
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    head = f"{'message':<11} {'seqs':>4} {'tokens':>6} {'transport':<8} {'bytes':>7} "
    head += f"{'latency us (p50/p90)':>21} {'rank-0 send us (p50/p90)':>25}"
    title = f"TP control messages: world {result['world']}, context {result['context']}, {result['repeats']} repeats, "
    title += f"ranks on CPUs {result['cpus']}" if result["cpus"] else "ranks not pinned"
    lines = [title, head]
    for r in result["rows"]:
        lat = f"{r['latency_us_median']:.0f} / {r['latency_us_p90']:.0f}"
        send = f"{r['send_us_median']:.0f} / {r['send_us_p90']:.0f}"
        lines.append(
            f"{r['kind']:<11} {r['seqs']:>4} {r['tokens']:>6} {r['transport']:<8} {r['bytes']:>7} {lat:>21} {send:>25}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks (rank 0 + world-1 followers)")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence in the decode steps")
    ap.add_argument("--steps", type=int, default=32, help="consecutive steps recorded per kind, sent in a cycle")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=2.0, help="rank 0's own work after each send")
    ap.add_argument("--engine", default=None, help="a preset (or tiny): time the whole engine's decode step")
    ap.add_argument("--device", default="cpu", help="--engine: cuda or cpu")
    ap.add_argument("--tp-sizes", default="1,2", help="--engine: TP sizes, the first is the reference")
    ap.add_argument("--batch", type=int, default=64, help="--engine: requests decoding together")
    ap.add_argument("--engine-steps", type=int, default=50, help="--engine: decode steps timed")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="--engine on CUDA: each engine's share")
    ap.add_argument("--no-pin", action="store_true", help="leave the ranks unpinned (default: one CPU per rank)")
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        follower(args.rank, args.world, args.init, args.cpu)
        return
    result = engine_steps(args) if args.engine else leader(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(engine_table(result) if args.engine else table(result))


if __name__ == "__main__":
    main()
