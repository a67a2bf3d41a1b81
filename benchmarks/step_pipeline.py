"""The engine's steady-state decode step, synchronous vs asynchronous scheduling, at each TP size.

What is timed is the real step loop: `EngineCore.step()` called back to back (schedule, inputs, the TP followers'
command, forward, sampling, reading the tokens, stop checks, finishes), wall clock per call, with --batch requests
of --context to --context + --spread - 1 token prompts all decoding (spread lengths: rows cross page boundaries at
different steps, so with prefix caching on, nearly every step saves some rolling checkpoints). Asynchronous
scheduling (`async_scheduling=True`) launches step N+1 before reading step N's tokens; its row shows the share of
steps launched ahead. On CPU (a smoke test, tiny model) the model's forward time is
measured too, and "host ms" = the step thread's CPU time outside the model per step (thread CPU time, so a loaded
machine does not inflate it): the host work of a step, which a GPU step overlaps when run ahead.

With --identity 1 (default) each configuration then generates greedily for 16 fixed prompts, once with ends known
in advance (max_tokens) and once ending at stop tokens (overrun rows under asynchronous scheduling), and the table
says whether asynchronous scheduling gave the synchronous engine's tokens and logprobs at each TP size.

With --profile N each configuration then runs --profile-steps more steps under cProfile and lists its N costliest
functions (own and cumulative ms per step, wall clock, profiler overhead included): where a GPU step's host time
goes.

Each (TP, mode) runs in its own process (plain processes, no Ray; the TP followers are the engine's own), with a
time limit, so a configuration that fails or hangs reports that and the others still run. Progress lines
(load, prefill, warm-up, timing) are printed as they happen: a run cut short shows where it stopped.

    source benchmarks/gpu_env.sh && python benchmarks/step_pipeline.py --preset nemotron-h-8b --device cuda \\
        --tp-sizes 1,2 --out out/step_pipeline.json                                  (two GPUs, ~4-6 min)
    python benchmarks/step_pipeline.py --preset tiny --device cpu --tp-sizes 1 --batch 64 --context 64  (CPU)

The bar (8B preset, batch 64): TP 2 step <= 0.6 x TP 1 step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_checkpoint(preset: str) -> tuple[str, dict[str, Any]]:
    """(model directory, extra LLM settings): a full-size preset as config only (dummy weights drawn on the device
    at load), or "tiny", a small random model with the 8B preset's layer pattern."""
    from hybridpd.engine.models.checkpoint import (
        NEMOTRON_H_8B_PATTERN,
        write_preset_checkpoint,
        write_random_checkpoint,
    )

    if preset == "tiny":
        return write_random_checkpoint(tempfile.mkdtemp(), "nemotron_h", seed=0, pattern=NEMOTRON_H_8B_PATTERN), {}
    return write_preset_checkpoint(tempfile.mkdtemp(), preset, weights=False), {"load_format": "dummy"}


class ModelClock:
    """Seconds inside the model's forward and logits (CPU: the host waits for them, so this is the model's time)."""

    def __init__(self, model: Any) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        """This thread's CPU time inside the model (one intra-op thread: the model's compute), robust to a loaded
        machine taking the core away."""
        for name in ("forward_reference", "forward_varlen", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.cpu_seconds += time.thread_time() - c

        return run


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One engine at (args.tp, args.mode): its steady-state decode step."""
    import torch
    from hybridpd.engine import LLM, SamplingParams

    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    t_start = time.perf_counter()
    settings: dict[str, Any] = json.loads(args.settings)
    if cuda:
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    total = args.warmup + args.steps + (args.profile_steps if args.profile else 0)
    llm = LLM(
        model=args.path,
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        tensor_parallel_size=args.tp,
        async_scheduling=args.mode == "async",
        max_num_seqs=args.batch,
        max_model_len=args.context + args.spread + total + 64,
        max_num_batched_tokens=args.max_batched_tokens,
        enable_prefix_caching=args.prefix_caching == "on",
        **settings,
    )
    core = llm.engine
    log(
        f"[tp {args.tp} {args.mode}] engine up in {time.perf_counter() - t_start:.0f} s "
        f"({'fast path' if core.runner.fast_path else 'reference path'})"
    )
    try:
        rnd = random.Random(0)
        params = SamplingParams(max_tokens=total + 32, temperature=0.0, ignore_eos=True)
        for i in range(args.batch):
            n = args.context + (i % args.spread if args.spread else 0)
            core.add_request(f"r{i}", [rnd.randrange(1, 256) for _ in range(n)], params)
        t = time.perf_counter()
        for n in range(10_000):  # prefill, until every request decodes
            core.step()
            running = core.scheduler.running
            if len(running) == args.batch and all(r.output_token_ids for r in running):
                break
            if time.perf_counter() - t > args.phase_timeout:
                raise RuntimeError(
                    f"prefill not done after {n + 1} steps ({len(running)} running, "
                    f"{len(core.scheduler.waiting)} waiting; max_num_seqs "
                    f"{core.config.scheduler.max_num_seqs})"
                )
        log(f"[tp {args.tp} {args.mode}] prefill: {n + 1} steps, {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        for _ in range(args.warmup):  # CUDA graph capture, allocator warm
            core.step()
        log(f"[tp {args.tp} {args.mode}] warm-up: {args.warmup} steps, {time.perf_counter() - t:.1f} s")
        clock = ModelClock(core.model) if not cuda else None
        pipe = core.pipeline
        before = dict(vars(pipe)) if pipe is not None else {}
        times = []
        cpu0 = time.thread_time()
        for _ in range(args.steps):
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
        cpu_seconds = time.thread_time() - cpu0
        log(f"[tp {args.tp} {args.mode}] timing: {args.steps} steps, median {statistics.median(times) * 1e3:.2f} ms")
        after = dict(vars(pipe)) if pipe is not None else {}
        model_seconds = clock.seconds if clock is not None else 0.0
        model_cpu_seconds = clock.cpu_seconds if clock is not None else 0.0
        if pipe is not None:
            pipe.drain()
        if len(core.scheduler.running) != args.batch:
            raise RuntimeError(f"only {len(core.scheduler.running)} of {args.batch} requests ran the timed steps")
        profile = profile_steps(core, args.profile_steps, args.profile) if args.profile else None
        identity = outputs(llm) if args.identity else None
    finally:
        llm.shutdown()
    row: dict[str, Any] = {
        "tp": args.tp,
        "mode": args.mode,
        "batch": args.batch,
        "context": args.context,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_mean": statistics.fmean(times) * 1e3,
        "step_ms_p90": statistics.quantiles(times, n=10)[-1] * 1e3,
        "ahead_fraction": (after["num_ahead"] - before["num_ahead"]) / args.steps if pipe is not None else 0.0,
    }
    if pipe is not None:
        row["late_checkpoints"] = after["num_late_checkpoints"] - before["num_late_checkpoints"]
        row["sync_fallbacks"] = after["num_sync_fallbacks"] - before["num_sync_fallbacks"]
    if identity is not None:
        row["identity"] = identity
    if profile is not None:
        row["profile"] = profile
    if clock is not None:
        row["model_ms_mean"] = model_seconds / args.steps * 1e3
        row["host_ms_mean"] = row["step_ms_mean"] - row["model_ms_mean"]
        row["host_cpu_ms_mean"] = (cpu_seconds - model_cpu_seconds) / args.steps * 1e3
    return row


def profile_steps(core: Any, steps: int, top: int) -> list[dict[str, Any]]:
    """cProfile of `steps` more decode steps (wall clock; on CPU the model's forward is in it too): the `top`
    functions by own time, each with calls, own and cumulative ms per step. The timing above ran without it."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        core.step()
    prof.disable()
    if core.pipeline is not None:
        core.pipeline.drain()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        {
            "function": f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({name})",
            "calls_per_step": nc / steps,
            "own_ms_per_step": tt / steps * 1e3,
            "cum_ms_per_step": ct / steps * 1e3,
        }
        for (file, line, name), (_cc, nc, tt, ct, _callers) in rows
    ]


def outputs(llm: Any) -> dict[str, Any]:
    """Greedy outputs of 16 fixed prompts after the timing (its requests aborted): ends known in advance
    (max_tokens: every step's batch is the synchronous one) and ends at a stop token taken from the first run
    (overrun rows). The parent compares them across modes."""
    from hybridpd.engine import SamplingParams

    core = llm.engine
    for rid in list(core.scheduler.requests):
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    rnd = random.Random(1)
    longest = min(300, core.max_model_len - 30)
    prompts = [[rnd.randrange(1, 256) for _ in range(rnd.randrange(8, longest))] for _ in range(16)]
    plain = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    stop = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=[
            SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(o.token_ids[4 + i % 12],))
            for i, o in enumerate(plain)
        ],
    )
    return {k: [[o.token_ids, o.logprobs] for o in outs] for k, outs in (("known_ends", plain), ("stops", stop))}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per run: same tokens, same logprobs bit for bit, the largest logprob difference."""
    out = {}
    for k in a:
        toks = all(x[0] == y[0] for x, y in zip(a[k], b[k], strict=True))
        diffs = [abs(u - v) for x, y in zip(a[k], b[k], strict=True) for u, v in zip(x[1], y[1], strict=False)]
        out[k] = {
            "same_tokens": toks,
            "bitwise": toks and all(x[1] == y[1] for x, y in zip(a[k], b[k], strict=True)),
            "max_logprob_diff": max(diffs, default=0.0),
        }
    return out


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    path, settings = make_checkpoint(args.preset)
    deadline = time.monotonic() + args.budget_s
    rows = []
    for tp in (int(t) for t in args.tp_sizes.split(",")):
        for mode in args.modes.split(","):
            left = deadline - time.monotonic()
            if left < 20:
                rows.append({"tp": tp, "mode": mode, "error": "not run: the time budget is spent"})
                continue
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                "--path",
                path,
                "--tp",
                str(tp),
                "--mode",
                mode,
                "--settings",
                json.dumps(settings),
                *args.passthrough,
            ]
            start = time.monotonic()
            try:
                done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=min(args.job_timeout, left))
                lines = done.stdout.strip().splitlines()
                row = (
                    json.loads(lines[-1])
                    if done.returncode == 0 and lines
                    else {"tp": tp, "mode": mode, "error": f"exit code {done.returncode}"}
                )
            except subprocess.TimeoutExpired:
                row = {"tp": tp, "mode": mode, "error": "timed out (see the progress lines above)"}
            row["seconds"] = time.monotonic() - start
            rows.append(row)
            log(f"[tp {tp} {mode}] {json.dumps(row)}")
    checks = {}
    by = {(r["tp"], r["mode"]): r.get("identity") for r in rows}
    for tp in sorted({t for t, _ in by}):
        sync, fast = by.get((tp, "sync")), by.get((tp, "async"))
        if sync and fast:
            checks[f"tp{tp}: async vs sync"] = compare(sync, fast)
    return {
        "identity": checks,
        "preset": args.preset,
        "device": args.device,
        "device_name": device_name(args.device),
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "prefix_caching": args.prefix_caching,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "rows": rows,
    }


def device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def table(result: dict[str, Any]) -> str:
    ok = {(r["tp"], r["mode"]): r for r in result["rows"] if "error" not in r}
    lines = [
        f"engine decode step, {result['preset']} on {result['device_name']}, batch {result['batch']}, context "
        f"{result['context']}, prefix caching {result['prefix_caching']}, median of {result['steps']} steps",
        f"{'tp':>3} {'mode':>6} {'step ms p50':>11} {'p90':>7} {'ahead':>6} {'host ms':>8} {'vs TP 1':>8} "
        f"{'async/sync':>10}",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['tp']:>3} {r['mode']:>6} FAILED: {r['error']}")
            continue
        base, sync = ok.get((1, r["mode"])), ok.get((r["tp"], "sync"))
        vs_tp1 = f"{r['step_ms_median'] / base['step_ms_median']:.3f}" if base else "-"
        vs_sync = f"{r['step_ms_median'] / sync['step_ms_median']:.3f}" if sync else "-"
        host = f"{r['host_cpu_ms_mean']:.2f}" if "host_cpu_ms_mean" in r else "-"
        lines.append(
            f"{r['tp']:>3} {r['mode']:>6} {r['step_ms_median']:>11.2f} {r['step_ms_p90']:>7.2f} "
            f"{r['ahead_fraction']:>6.0%} {host:>8} {vs_tp1:>8} {vs_sync:>10}"
        )
    for name, check in result.get("identity", {}).items():
        for run, c in check.items():
            lines.append(
                f"identity {name}, {run}: same tokens {c['same_tokens']}, logprobs bit for bit "
                f"{c['bitwise']}, max logprob diff {c['max_logprob_diff']:.2e}"
            )
    for r in result["rows"]:
        for i, f in enumerate(r.get("profile", [])):
            if not i:
                lines.append(f"profile tp {r['tp']} {r['mode']} (ms per step; calls, own, cumulative):")
            own, cum = f["own_ms_per_step"], f["cum_ms_per_step"]
            lines.append(f"  {f['calls_per_step']:>7.1f} {own:>7.3f} {cum:>7.3f}  {f['function']}")
    for tp in sorted({t for t, _ in ok if t > 1}):
        for mode in ("sync", "async"):
            if (tp, mode) in ok and (1, "sync") in ok:
                ratio = ok[(tp, mode)]["step_ms_median"] / ok[(1, "sync")]["step_ms_median"]
                lines.append(
                    f"bar: TP {tp} {mode} / TP 1 sync = {ratio:.3f} (<= 0.6: {'met' if ratio <= 0.6 else 'not met'})"
                )
        if (tp, "async") in ok and (1, "async") in ok:
            ratio = ok[(tp, "async")]["step_ms_median"] / ok[(1, "async")]["step_ms_median"]
            lines.append(f"bar: TP {tp} async / TP 1 async = {ratio:.3f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="nemotron-h-8b", help="a preset name (dummy weights) or tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--budget-s", type=float, default=450.0, help="all configurations together")
    p.add_argument("--job-timeout", type=float, default=170.0, help="one configuration")
    shared = p.add_argument_group("passed to each configuration")
    shared.add_argument("--batch", type=int, default=64)
    shared.add_argument("--context", type=int, default=1024)
    shared.add_argument("--steps", type=int, default=100)
    shared.add_argument("--warmup", type=int, default=12)
    shared.add_argument("--spread", type=int, default=16, help="prompt lengths context .. context + spread - 1")
    shared.add_argument("--max-batched-tokens", type=int, default=8192)
    shared.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    shared.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    shared.add_argument("--phase-timeout", type=float, default=120.0)
    shared.add_argument("--identity", type=int, default=1, help="1: also compare greedy outputs across modes")
    shared.add_argument(
        "--profile",
        type=int,
        default=0,
        help="N > 0: after the timing, cProfile --profile-steps "
        "more steps and report the N costliest functions (ms per step, profiler overhead included)",
    )
    shared.add_argument("--profile-steps", type=int, default=30)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    p.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    args.passthrough = [
        a
        for name in (
            "batch",
            "context",
            "steps",
            "warmup",
            "spread",
            "max_batched_tokens",
            "prefix_caching",
            "gpu_memory_utilization",
            "phase_timeout",
            "identity",
            "profile",
            "profile_steps",
            "device",
        )
        for a in (f"--{name.replace('_', '-')}", str(getattr(args, name)))
    ]
    result = run_all(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
