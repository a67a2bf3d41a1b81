"""Goodput per GPU of PD versus colocated serving on the same GPUs, behind the same proxy (DistServe's experiment).

    python benchmarks/goodput.py --preset nemotron-h-8b --gpus 0,1 --workloads long --out-dir out/goodput
    python benchmarks/goodput.py --device cpu --len-scale 0.01 --rates 2,4 --duration 1.5 --warmup-requests 0 \
        --low-load 1 --low-load-max-tokens 4 --configs all --workloads all --arrivals all   # CPU, tiny model: ~4 min

For each configuration (`CONFIGS`: N colocated replicas behind least-loaded routing; 1P1D; the adaptive policy
when the proxy offers it: 1P1D whose proxy places each request by cost, PD, the decode worker alone (skip-P) or
the prefill worker alone (its mixed role, while the decode worker is saturated); every rate's JSON row records how
many requests took each path, `placements`) the script starts the workers and the proxy as plain processes
(`hybridpd worker` / `hybridpd proxy`, no Ray), warms them up (kernel compilation and CUDA-graph capture happen
there, never in a measured run), measures latencies at low load (one request at a time: TTFT, TPOT, and the
decode worker's own decode step from its `hybridpd_engine_step_seconds` counters), then sweeps open-loop arrival
rates (Poisson or bursty, benchmarks/goodput_workloads.py) for each workload. SLO attainment, goodput and the
table come from benchmarks/goodput_report.py. Writes goodput.json (+ PNGs with matplotlib) to --out-dir and prints
the table last.

Rates are requests per second to the whole cluster; every configuration uses the same GPUs, so goodput per GPU is
the figure to compare. A sweep stops early at a rate where even the loose SLO's attainment is below --stop-below,
and the whole run skips what would start after --deadline-s (recorded as skipped). The run records the device,
the workers' path (fast / reference) and package versions, and refuses to measure a CUDA worker on the reference
path unless --allow-reference-path.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import os
import random
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridpd.deploy.local_cluster import Cluster, scrape_metric, start_cluster  # noqa: E402
from hybridpd.deploy.vllm_flags import human_readable_int  # noqa: E402
from hybridpd.engine.errors import HybridPDError  # noqa: E402
from hybridpd.proxy.placement import PATHS  # noqa: E402

from benchmarks.goodput_report import Outcome, config_goodput, plot, report, summarize_rate, write_json  # noqa: E402
from benchmarks.goodput_workloads import LONGEST, WORKLOADS, Req, Shape, arrival_times  # noqa: E402


@dataclass(frozen=True)
class ClusterConfig:
    """A way to use the GPUs: `num_prefill` P workers on the first GPUs, `num_decode` D (or colocated) workers on
    the next; `routing` is the proxy's --routing. `num_decode` None: one colocated replica per GPU."""

    name: str
    num_prefill: int
    num_decode: int | None
    colocated: bool
    routing: str
    proxy_args: tuple[str, ...] = ()
    """More proxy flags (the adaptive policy's TPOT target)."""
    prefill_args: tuple[str, ...] = ()
    """More flags of the prefill workers only (the balanced pair's mixed-role cap)."""

    def decode_count(self, num_gpus: int) -> int:
        return self.num_decode if self.num_decode is not None else num_gpus

    def num_gpus(self, num_gpus: int) -> int:
        return self.num_prefill + self.decode_count(num_gpus)


CONFIGS = {
    "colocated": ClusterConfig("colocated", 0, None, True, "least_loaded"),
    "1p1d": ClusterConfig("1p1d", 1, 1, False, "least_loaded"),
    # the TPOT target between the tight and loose SLOs' (25 / 60 ms): a decode worker streaming slower is saturated
    "adaptive": ClusterConfig(
        "adaptive", 1, 1, False, "cache_aware|adaptive", ("--routing-weights", "tpot_budget_s=0.05")
    ),
    # balance on (proxy/placement.py): under load every request whole on the less loaded worker, as two colocated
    # replicas; PD with nothing in flight. P may then run as many whole requests as a colocated replica
    "balanced": ClusterConfig(
        "balanced",
        1,
        1,
        False,
        "cache_aware|adaptive",
        ("--routing-weights", "decode_balance=1"),
        ("--max-decode-share", "1"),
    ),
}
"""Add a configuration here (and name it in --configs). `routing` may list alternatives ("a|b"): the first the
proxy offers is used. One whose routing the proxy does not offer is not run, and says so in the table."""


def proxy_routings() -> tuple[str, ...]:
    from hybridpd.proxy.config import RoutingPolicy

    return typing.get_args(RoutingPolicy)


def resolve_routing(routing: str, offered: tuple[str, ...]) -> str | None:
    """The first of `routing`'s "|"-separated alternatives that the proxy offers; None when it offers none."""
    return next((r for r in routing.split("|") if r in offered), None)


# -- the cluster -------------------------------------------------------------------------------------------------


def launch(
    cfg: ClusterConfig, model: str, gpus: list[str], worker_args: list[str], on_cuda: bool, max_model_len: int
) -> Cluster:
    """One configuration's workers (worker i on GPU gpus[i] when on CUDA) and its proxy, as plain processes."""
    n_dec = cfg.decode_count(len(gpus))
    n_workers = (0 if cfg.colocated else cfg.num_prefill) + n_dec
    if on_cuda and n_workers > len(gpus):
        raise SystemExit(f"{cfg.name} needs {n_workers} GPUs, --gpus names {len(gpus)}")
    return start_cluster(
        model,
        colocated=cfg.colocated,
        worker_args=worker_args,
        num_prefill=cfg.num_prefill,
        num_decode=n_dec,
        prefill_args=list(cfg.prefill_args),
        proxy_args=["--routing", cfg.routing, "--max-model-len", str(max_model_len), *cfg.proxy_args],
        worker_envs=[{"CUDA_VISIBLE_DEVICES": g} for g in gpus[:n_workers]] if on_cuda else None,
        restart=False,
        ready_timeout_s=600,
    )


def scrape(worker: Any, name: str, **labels: str) -> float:
    return scrape_metric(f"http://127.0.0.1:{worker.info['metrics_port']}/metrics", name, **labels)


def decode_step_totals(workers: list[Any]) -> tuple[float, float]:
    """(seconds, steps) of decode-only steps over the decode (or colocated) workers so far."""
    return (
        sum(scrape(w, "hybridpd_engine_step_seconds_total", kind="decode") for w in workers),
        sum(scrape(w, "hybridpd_engine_steps_total", kind="decode") for w in workers),
    )


HANDOFF_PHASES = {
    "prefill": ("queue", "prefill", "lease"),
    "decode": ("handshake", "admit", "pull", "commit", "resume", "total"),
}


PROXY_PHASES = {"ttft": "hybridpd_time_to_first_token_seconds", "prefill_rpc": "hybridpd_proxy_prefill_seconds"}


def handoff_totals(run: Cluster) -> dict[str, tuple[float, float]]:
    """{"role/phase": (seconds, count)} so far: the proxy's TTFT and P.Prefill call, and (PD) the workers'
    hybridpd_kv_handoff_seconds. Under PD the first token is P's: proxy TTFT - prefill_rpc = the proxy's own time
    (routing, tokenization); decode/total is the handoff before D's first token, the request's second."""
    out = {}
    for ph, metric in PROXY_PHASES.items():
        out[f"proxy/{ph}"] = (
            scrape_metric(f"{run.url}/metrics", f"{metric}_sum"),
            scrape_metric(f"{run.url}/metrics", f"{metric}_count"),
        )
    for role, workers in (("prefill", run.prefill), ("decode", run.decode)):
        if not run.prefill:
            break
        if role == "decode":  # the Commit RPC alone (its phase also holds the hops to and from the step thread)
            for key, metric in (
                ("commit_rpc", "hybridpd_kv_transfer_commit_seconds"),
                ("descriptors_per_pull", "hybridpd_kv_transfer_descriptors"),
            ):
                out[f"decode/{key}"] = (
                    sum(scrape(w, f"{metric}_sum", role="decode") for w in workers),
                    sum(scrape(w, f"{metric}_count", role="decode") for w in workers),
                )
        for ph in HANDOFF_PHASES[role]:
            out[f"{role}/{ph}"] = (
                sum(scrape(w, "hybridpd_kv_handoff_seconds_sum", role=role, phase=ph) for w in workers),
                sum(scrape(w, "hybridpd_kv_handoff_seconds_count", role=role, phase=ph) for w in workers),
            )
    return out


def handoff_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """{"role/phase": mean ms (a count for descriptors_per_pull)} of the requests between two `handoff_totals`
    readings."""
    return {
        k: (1 if "descriptors" in k else 1e3) * (s - before[k][0]) / (n - before[k][1])
        for k, (s, n) in after.items()
        if n > before[k][1]
    }


def placement_counts(run: Cluster) -> dict[str, float]:
    """Requests by the path they took so far (the proxy's hybridpd_proxy_route_decisions_total{path}: pd,
    skip_prefill, prefill_alone, colocated; a request whose whole-on-P attempt was refused counts where it ran)."""
    return {p: scrape_metric(f"{run.url}/metrics", "hybridpd_proxy_route_decisions_total", path=p) for p in PATHS}


def placement_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The paths taken between two `placement_counts` readings (those taken at least once)."""
    return {p: int(after[p] - before[p]) for p in PATHS if after[p] > before[p]}


def wait_idle(workers: list[Any], timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if all(
            scrape(w, "hybridpd_num_requests_running") + scrape(w, "hybridpd_num_requests_waiting") == 0
            for w in workers
        ):
            return
        time.sleep(0.5)


# -- the client --------------------------------------------------------------------------------------------------

CLIENT = SimpleNamespace(endpoint="completions", temperature=0.0, ignore_eos=True, stream=True)


def outcome(res: Any) -> Outcome:
    tpot = None
    if res.ok and res.ttft is not None:
        tpot = (res.e2e - res.ttft) / (res.output_tokens - 1) if res.output_tokens > 1 else 0.0
    return Outcome(res.ok and res.ttft is not None, res.ttft, tpot, res.output_tokens)


async def open_loop(
    url: str, model: str, reqs: list[Req], times: list[float], drain_s: float
) -> tuple[list[Outcome], float]:
    """Send each request at its arrival time whatever the others do; wait up to `drain_s` after the last arrival,
    then give up on the rest (counted as misses). Returns the outcomes and the seconds from start to the end."""
    import httpx
    from hybridpd.deploy.bench_serve import RequestSpec, send_one

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for req, at in zip(reqs, times, strict=True):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            spec = RequestSpec(req.prompt, len(req.prompt), req.max_tokens)
            tasks.append(asyncio.create_task(send_one(client, CLIENT, model, spec)))  # type: ignore[arg-type]
        done, pending = await asyncio.wait(tasks, timeout=drain_s)
        for t in pending:
            t.cancel()
        elapsed = time.perf_counter() - t0
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return [outcome(t.result()) if t in done else Outcome(False, None, None, 0) for t in tasks], elapsed


async def one_at_a_time(url: str, model: str, reqs: list[Req]) -> list[Outcome]:
    out = []
    for r in reqs:
        got, _ = await open_loop(url, model, [r], [0.0], drain_s=600)
        out += got
    return out


# -- the experiment ----------------------------------------------------------------------------------------------


def warm_up(run: Cluster, make: Any, args: argparse.Namespace, shape: Shape) -> None:
    """Two rounds of uncapped prompts of the workload, one per decode worker at once (prefill, the handoff and
    batch-1 decode at long contexts: whatever is compiled or set up at the first use of a length happens here, not
    in the low-load figures), then a burst whose batch shrinks through every decode graph size as its requests
    end, its prompts capped at 2,048 tokens (the step budget's chunks are the same)."""
    rng = random.Random(args.seed + 999)
    n = args.warmup_requests
    width = max(1, len(run.decode))
    full = sorted(make(rng, 2 * width), key=lambda r: -len(r.prompt))
    for i in range(0, len(full), width):
        burst = [Req(r.prompt, 4) for r in full[i : i + width]]
        asyncio.run(open_loop(run.url, run.model_name, burst, [0.0] * len(burst), drain_s=300))
    # staggered lengths: the burst's requests end one after another, so its batch passes through every size
    reqs = [Req(r.prompt[: shape.n(2048)], 2 + (i * 64) // max(n, 1)) for i, r in enumerate(make(rng, n))]
    if reqs:
        asyncio.run(open_loop(run.url, run.model_name, reqs, [0.0] * len(reqs), drain_s=300))
    wait_idle(run.prefill + run.decode)


def low_load(run: Cluster, make: Any, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.goodput_report import percentile

    reqs = [
        Req(r.prompt, min(r.max_tokens, args.low_load_max_tokens))
        for r in make(random.Random(args.seed + 7), args.low_load)
    ]
    s0, n0 = decode_step_totals(run.decode)
    h0 = handoff_totals(run)
    paths0 = placement_counts(run)
    got: list[Outcome] = []
    per_request = []
    for r in reqs:  # one at a time, each with its own phases (PD - colocated per prompt length: the report)
        before = handoff_totals(run)
        got += asyncio.run(one_at_a_time(run.url, run.model_name, [r]))
        ttft = got[-1].ttft_s
        per_request.append(
            {
                "prompt_tokens": len(r.prompt),
                "ttft_ms": None if ttft is None else 1e3 * ttft,
                "handoff_ms": handoff_means(before, handoff_totals(run)),
            }
        )
    time.sleep(0.1)
    wait_idle(run.decode, 10)
    s1, n1 = decode_step_totals(run.decode)
    phases = handoff_means(h0, handoff_totals(run))
    ok = [o for o in got if o.ok]
    step_ms = 1e3 * (s1 - s0) / (n1 - n0) if n1 > n0 else None
    tpot_p50 = 1e3 * percentile([o.tpot_s for o in ok if o.tpot_s is not None and o.output_tokens > 1], 0.5)
    return {
        "requests": len(got),
        "completed": len(ok),
        "ttft_p50_ms": 1e3 * percentile([o.ttft_s for o in ok if o.ttft_s is not None], 0.5),
        "tpot_p50_ms": tpot_p50,
        "decode_step_ms": step_ms,
        "tpot_over_step": tpot_p50 / step_ms if step_ms else None,
        "handoff_ms": phases,
        "per_request": per_request,
        "placements": placement_delta(paths0, placement_counts(run)),
    }


def sweep(
    run: Cluster, make: Any, args: argparse.Namespace, arrival: str, deadline: float
) -> tuple[list[dict[str, Any]], list[float]]:
    rows, skipped = [], []
    for i, rate in enumerate(args.rates):
        if time.time() + args.duration > deadline:
            skipped.append(rate)
            continue
        rng = random.Random(args.seed * 1000 + i)
        times = arrival_times(rng, rate, args.duration, arrival)
        reqs = make(rng, len(times))
        s0, n0 = decode_step_totals(run.decode)
        paths0 = placement_counts(run)
        got, elapsed = asyncio.run(open_loop(run.url, run.model_name, reqs, times, args.drain))
        row = summarize_rate(rate, got, elapsed)
        wait_idle(run.prefill + run.decode, 60)
        s1, n1 = decode_step_totals(run.decode)
        # the decode workers' decode-only steps at this load (steps with a prompt chunk excluded: colocated TPOT
        # also waits for those, so its ratio is higher by design)
        row["decode_step_ms"] = 1e3 * (s1 - s0) / (n1 - n0) if n1 > n0 else None
        row["tpot_over_step"] = row["tpot_ms"]["p50"] / row["decode_step_ms"] if row["decode_step_ms"] else None
        row["samples"] = {"ttft_s": [o.ttft_s for o in got], "tpot_s": [o.tpot_s for o in got]}
        row["placements"] = placement_delta(paths0, placement_counts(run))  # which path each request took
        rows.append(row)
        att = row["attainment"]
        print(
            f"  rate {rate:g}/s: {row['completed']}/{row['sent']} done, attainment tight "
            f"{att['tight']['both']:.2f} loose {att['loose']['both']:.2f}, TTFT p50 {row['ttft_ms']['p50']:.0f} "
            f"ms, TPOT p50 {row['tpot_ms']['p50']:.1f} ms, D decode step {row['decode_step_ms'] or 0:.1f} ms, "
            f"paths {' '.join(f'{k} {v}' for k, v in row['placements'].items()) or '-'}",
            flush=True,
        )
        if att["loose"]["both"] < args.stop_below:
            skipped += args.rates[i + 1 :]
            break
    return rows, skipped


def environment(args: argparse.Namespace, on_cuda: bool) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    for pkg in ("torch", "triton", "nixl", "fla-core", "grpcio", "transformers"):
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = None
    try:
        env["commit"] = (
            subprocess.run(
                ["git", "describe", "--always", "--dirty", "--abbrev=10"],  # "-dirty": the files differ from it
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
            or None
        )
    except OSError:
        env["commit"] = None
    if on_cuda:  # from nvidia-smi: no CUDA context in this process (the workers get the whole GPU)
        try:
            names = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.splitlines()
            by_index = dict(line.split(", ", 1) for line in names if ", " in line)
            env["gpus"] = [by_index.get(g.strip(), "?") for g in args.gpus.split(",")]
        except (OSError, subprocess.SubprocessError):
            env["gpus"] = None
    return env


def check_path(run: Cluster, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The workers' device / dtype / path (from their ready line). A CUDA worker on the reference path ends the
    run unless --allow-reference-path."""
    infos = [
        {k: w.info.get(k) for k in ("role", "device", "dtype", "fast_path", "cuda_graphs")}
        for w in run.prefill + run.decode
    ]
    slow = [i for i in infos if str(i["device"]).startswith("cuda") and not i["fast_path"]]
    if slow and not args.allow_reference_path:
        run.stop()
        raise SystemExit(
            "a CUDA worker runs the reference path (fla-core missing?): not measuring it "
            "(--allow-reference-path to measure anyway)"
        )
    return infos


def _covering(overrides: dict[str, Any], longest: int) -> dict[str, Any]:
    """Checkpoint overrides with max_position_embeddings raised to `longest` where below it (the engine refuses a
    max_model_len past it)."""
    return {**overrides, "max_position_embeddings": max(int(overrides.get("max_position_embeddings", 4096)), longest)}


def model_and_args(args: argparse.Namespace, tmp: str, shape: Shape) -> tuple[str, list[str], int, int]:
    from hybridpd.engine.models.checkpoint import preset, write_random_checkpoint

    from benchmarks.offline_throughput import PATTERN, SIZES

    longest = max(shape.n(LONGEST[w]) for w in args.workloads) + 64
    wargs = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(longest),
    ]
    if args.model:
        model = args.model
    elif args.preset:  # the synthetic checkpoint's trained length covers the longest request (else refused)
        family, overrides = preset(args.preset)
        model = write_random_checkpoint(f"{tmp}/model", family, seed=0, weights=False, **_covering(overrides, longest))
        wargs += ["--load-format", "dummy"]
    else:
        overrides = {**SIZES[args.size], **(PATTERN[args.family] if args.size != "tiny" else {})}
        model = write_random_checkpoint(f"{tmp}/model", args.family, seed=0, **_covering(overrides, longest))  # type: ignore[arg-type]
    if args.kv_cache_memory_bytes:
        wargs += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    elif args.device != "cpu":
        wargs += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.allow_reference_path:
        wargs.append("--allow-reference-path")
    import json

    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f).get("vocab_size", 256))
    return model, wargs + list(args.worker_arg or []), longest, vocab


CPU_QUICK = (
    "python benchmarks/goodput.py --device cpu --len-scale 0.01 --rates 2,4 --duration 1.5 --warmup-requests 0 "
    "--low-load 1 --low-load-max-tokens 4 --configs all --workloads all --arrivals all --out-dir out/goodput_cpu"
)
"""Every configuration, workload and arrival process on the built-in tiny model: a complete table in minutes."""

ARRIVALS = ("poisson", "bursty")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")


def _names(ap: argparse.ArgumentParser, flag: str, raw: str, known: Any) -> list[str]:
    """A comma-separated list of names, each one of `known` ("all": every one); an argparse error otherwise."""
    names = list(known) if raw.strip() == "all" else [x.strip() for x in raw.split(",") if x.strip()]
    bad = [x for x in names if x not in known]
    if bad or not names:
        ap.error(
            f"{flag}: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'none given'} (known: "
            f"{', '.join(known)}, or all)"
        )
    return list(dict.fromkeys(names))


def _rates(ap: argparse.ArgumentParser, raw: str) -> list[float]:
    try:
        rates = sorted({float(r) for r in raw.split(",") if r.strip()})  # "": low load only, no sweep
    except ValueError:
        ap.error(f"--rates: expected comma-separated numbers (requests per second), got {raw!r}")
    if any(not 0 < r < float("inf") for r in rates):
        ap.error(f"--rates: every rate must be a positive number of requests per second, got {raw!r}")
    return rates


def _check_ranges(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Numeric flags in their ranges (argparse errors naming the flag)."""
    for flag, ok in (
        ("--duration", args.duration > 0),
        ("--drain", args.drain >= 0),
        ("--len-scale", args.len_scale > 0),
        ("--deadline-s", args.deadline_s > 0),
        ("--max-num-seqs", args.max_num_seqs >= 1),
        ("--warmup-requests", args.warmup_requests >= 0),
        ("--low-load", args.low_load >= 0),
        ("--low-load-max-tokens", args.low_load_max_tokens >= 1),
        ("--stop-below", 0 <= args.stop_below <= 1),
        ("--gpu-memory-utilization", 0 < args.gpu_memory_utilization <= 1),
        ("--kv-cache-memory-bytes", args.kv_cache_memory_bytes is None or args.kv_cache_memory_bytes > 0),
    ):
        if not ok:
            value = getattr(args, flag[2:].replace("-", "_"))
            ap.error(f"{flag} {value}: out of range (see --help)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from hybridpd.deploy.cli import FAMILIES
    from hybridpd.engine.models.checkpoint import PRESETS

    from benchmarks.offline_throughput import SIZES

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Quick complete run on a CPU (tiny built-in model, a few minutes): {CPU_QUICK}",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: the engine's rule (engine/device.py)")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: --preset or --family/--size)")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS), help="full-size shape, dummy weights")
    ap.add_argument("--family", default="nemotron_h", choices=FAMILIES)
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--gpus", default="0,1", help="CUDA devices the configurations share (in order)")
    ap.add_argument("--configs", default="colocated,1p1d,adaptive", help=f"of {', '.join(CONFIGS)}, or all")
    ap.add_argument("--workloads", default="long", help=f"of {', '.join(WORKLOADS)}, or all")
    ap.add_argument("--arrivals", default="poisson", help=f"of {', '.join(ARRIVALS)}, or all")
    ap.add_argument("--rates", default="1,2,3,4,6", help="requests/s to the whole cluster ('': low load only)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    ap.add_argument("--drain", type=float, default=20.0, help="seconds to wait for requests after the last arrival")
    ap.add_argument("--stop-below", type=float, default=0.5, help="stop a sweep once loose attainment falls below")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="skip what would start after this many seconds")
    ap.add_argument("--warmup-requests", type=int, default=48)
    ap.add_argument("--low-load", type=int, default=6, help="requests sent one at a time before the sweep (0: off)")
    ap.add_argument("--low-load-max-tokens", type=int, default=64)
    ap.add_argument("--len-scale", type=float, default=1.0, help="multiplies every token length (CPU: ~0.01)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None, help="e.g. 4G, 512M")
    ap.add_argument(
        "--worker-arg",
        action="append",
        default=None,
        help="an extra worker flag (repeatable; --worker-arg=--enforce-eager)",
    )
    ap.add_argument("--allow-reference-path", action="store_true", help="measure CUDA workers on the reference path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="goodput_out")
    args = ap.parse_args(argv)
    args.rates = _rates(ap, args.rates)
    args.configs = _names(ap, "--configs", args.configs, CONFIGS)
    args.workloads = _names(ap, "--workloads", args.workloads, WORKLOADS)
    args.arrivals = _names(ap, "--arrivals", args.arrivals, ARRIVALS)
    _check_ranges(ap, args)
    if not (args.device in ("auto", "cpu") or args.device.startswith("cuda")):
        ap.error(f"--device {args.device!r}: expected auto, cpu or cuda")
    if args.model:  # a checkpoint directory, or a Hugging Face model id (its snapshot in the local cache)
        from hybridpd.engine.model_source import resolve_model

        try:
            args.model = resolve_model(args.model)
        except HybridPDError as e:
            ap.error(f"--model: {e}")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            ap.error(f"--model {args.model!r}: not a checkpoint directory (no config.json)")
    from hybridpd.engine.device import resolve_device

    args.device = resolve_device(args.device)  # the dtype stays as given: each worker resolves auto (and reports it)
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if args.device.startswith("cuda"):
        need = max(CONFIGS[c].num_gpus(len(gpus)) for c in args.configs)
        if not gpus or need > len(gpus):
            ap.error(f"--gpus {args.gpus!r}: the configurations need {need} GPUs, it names {len(gpus)}")
    return args


def sweep_deadline(deadline: float, reserved_s: float, sweeps_left: int) -> float:
    """When the next sweep must end: an equal share of the time left, after reserving `reserved_s` for the later
    configurations' start and warm-up (estimated by the first configuration's, which pays the cold compilation, so
    a later one's sweeps are never starved by it)."""
    now = time.time()
    return now + max(deadline - now - reserved_s, 0.0) / max(sweeps_left, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.time()
    deadline = start + args.deadline_s
    on_cuda = args.device.startswith("cuda")
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    shape_scale = args.len_scale
    doc: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items()},
        "environment": environment(args, on_cuda),
        "results": [],
        "skipped": [],
    }
    routings = proxy_routings()
    with tempfile.TemporaryDirectory() as tmp:
        model, wargs, longest, vocab = model_and_args(args, tmp, Shape(256, shape_scale))
        shape = Shape(vocab, shape_scale)
        runnable = []
        for name in args.configs:
            routing = resolve_routing(CONFIGS[name].routing, routings)
            if routing is not None:
                runnable.append(dataclasses.replace(CONFIGS[name], routing=routing))
            else:
                why = f"NOT RUN: the proxy has no --routing {CONFIGS[name].routing} (it offers {list(routings)})"
                print(f"== {name}: {why}", flush=True)
                doc["skipped"].append({"config": name, "why": why})
        setup_s: float | None = None  # the first configuration's start + warm-up (cold compilation included)
        for i, cfg in enumerate(runnable):
            name = cfg.name
            t0 = time.time()
            if time.time() + 60 > deadline:
                doc["skipped"].append({"config": name, "why": "deadline"})
                continue
            print(f"== {name}: starting", flush=True)
            try:
                run = launch(cfg, model, gpus, wargs, on_cuda, longest)
            except HybridPDError as e:  # a worker that did not start says why (a model that does not fit, ...)
                print(f"== {name}: NOT RUN: {e}", flush=True)
                doc["skipped"].append({"config": name, "why": f"NOT RUN: {e}"})
                continue
            try:
                workers = check_path(run, args)
                n_gpus = cfg.num_gpus(len(gpus))
                for j, wl in enumerate(args.workloads):
                    make = WORKLOADS[wl](shape)
                    warm_up(run, make, args, shape)
                    low = low_load(run, make, args) if args.low_load else None
                    setup_s = time.time() - t0 if setup_s is None else setup_s
                    for k, arrival in enumerate(args.arrivals):
                        print(f"== {name} / {wl} / {arrival}", flush=True)
                        later = len(runnable) - i - 1
                        sweeps_left = (len(args.workloads) * len(args.arrivals)) * later + (
                            (len(args.workloads) - j) * len(args.arrivals) - k
                        )
                        share = sweep_deadline(deadline, later * setup_s, sweeps_left)
                        rows, skipped = sweep(run, make, args, arrival, share)
                        doc["results"].append(
                            {
                                "config": name,
                                "workload": wl,
                                "arrival": arrival,
                                "routing": cfg.routing,
                                "num_gpus": n_gpus,
                                "workers": workers,
                                "low_load": low,
                                "rates": rows,
                                "skipped_rates": skipped,
                                "goodput": config_goodput(rows, n_gpus) if rows else {},
                            }
                        )
            finally:
                run.stop()
    doc["elapsed_s"] = time.time() - start
    os.makedirs(args.out_dir, exist_ok=True)
    doc["plots"] = plot(doc["results"], args.out_dir)
    write_json(os.path.join(args.out_dir, "goodput.json"), doc)
    dtypes = sorted({str(w["dtype"]) for r in doc["results"] for w in r["workers"]}) or [args.dtype]
    print(
        f"\n{args.device} ({'/'.join(dtypes)}): JSON {os.path.join(args.out_dir, 'goodput.json')}, "
        f"{len(doc['plots'])} PNG plots"
    )
    print("\n".join(report(doc)))  # the bar checks, handoff phases, what was not run; the table last
    return 0 if doc["results"] or not args.configs else 1


if __name__ == "__main__":
    raise SystemExit(main())
