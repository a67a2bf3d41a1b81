"""vLLM's own scheduler + KV cache manager on the traces of `benchmarks/cache_manager.py` (the time comparison).

Runs with a Python that has vLLM installed (not the repo's venv; vLLM pins its own torch): no GPU, no model. It
builds vLLM's v1 `Scheduler` for the issue's model the way vLLM's EngineCore would on a CUDA host (hybrid block-size
alignment for the FlashAttention backend, vLLM's own KV-cache planner for the memory budget, block sizes resolved by
vLLM), then replays the same request streams as ours: every scheduled chunk "runs" instantly, sampled tokens are
`cache_manager.fake_token` of the request's length (the same fixed function of position), sampled only when a
request reached the end of its tokens (partial prefill chunks sample nothing, as vLLM's model runner discards them).

Model (the issue's, as `cache_manager.py`): a NemotronH-style config.json written to a temp dir, 16 layers, pattern
MMM* x 4 (4 attention layers: 8 KV heads x 128, bf16; 12 Mamba-2 layers: conv (3, 10240) bf16 + SSM (64, 64, 128)
fp32 = 2,158,592 bytes per layer, as ours). vLLM's prefix caching for Mamba is `mamba_cache_mode="align"` (set by
vLLM's NemotronH config hook when prefix caching is on); vLLM's platform code then raises the attention block size
so one attention page >= one Mamba page (here 528 tokens) and pads the Mamba page to it; all groups share one
block pool. The budget (10 GiB `current`, 20 GiB `no_reuse`) is handed to vLLM's planner as the KV-cache memory.

Timed (time.process_time and perf_counter), per scheduled (request, step) pair, the same scope as ours
(`cache_manager.run`): schedule() + update_from_output() (which finishes requests that reached max_tokens and frees
their blocks) + the request's prompt hashing, which vLLM does when a request arrives (in its engine core) and ours
inside schedule(); not timed on either side: building the fake model's output (the sampled tokens). KV cache events
are on (`--kv-events`, null publisher): ours always records them (the router's cache index); vLLM's default is off.

    /work/vllm-venv/bin/python benchmarks/vllm_cache_baseline.py --workloads current,no_reuse --repeats 3 \\
        --out docs/results/vllm_cache_current.json
    .venv/bin/python benchmarks/vllm_cache_baseline.py --digest-only   # the same digest from the repo's venv
    .venv/bin/python benchmarks/vllm_cache_baseline.py --combine docs/results/vllm_cache_head_round \\
        --out docs/results/vllm_cache_baseline.json                   # medians over interleaved round files
    .venv/bin/python benchmarks/vllm_cache_baseline.py --profile-ours --workloads current,no_reuse \\
        [--engine-root /tmp/hybridpd_head]                            # where ours spends its time
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

_root = next(
    (
        a.split("=", 1)[1] if "=" in a else sys.argv[i + 2]
        for i, a in enumerate(sys.argv[1:])
        if a.startswith("--engine-root")
    ),
    None,
)
sys.path.insert(0, str(Path(_root).resolve() / "benchmarks") if _root else str(Path(__file__).resolve().parent))
import cache_manager as cm  # noqa: E402  (the trace generators and fake_token; imports no torch)

MODEL_CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": cm.VOCAB,
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "hybrid_override_pattern": "".join("*" if i % 4 == 3 else "M" for i in range(16)),  # ours: attention 3,7,11,15
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_head_dim": 128,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 24,
    "conv_kernel": 4,
    "expand": 2,
    "intermediate_size": 2048,
    "max_position_embeddings": 65536,
    "torch_dtype": "bfloat16",
    "mamba_ssm_cache_dtype": "float32",
}


def trace_digest(w: cm.Workload) -> str:
    """sha256 over every request's prompt tokens, max_tokens, closed-loop parent and expected output stream."""
    h = hashlib.sha256()
    for i, it in enumerate(w.items):
        h.update(f"{i}:{len(it.prompt)}:{it.max_tokens}:{it.after};".encode())
        h.update(",".join(map(str, it.prompt)).encode())
        h.update(b"|" + ",".join(map(str, cm.answer(len(it.prompt), i, it.max_tokens))).encode() + b"\n")
    return h.hexdigest()


def build(budget_bytes: int, args: argparse.Namespace):
    """vLLM's Scheduler as EngineCore._initialize_kv_caches would set it up on a CUDA host (FlashAttention)."""
    import torch
    from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.core import kv_cache_planning as kp
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    d = tempfile.mkdtemp(prefix="vllm_nemh_")
    Path(d, "config.json").write_text(json.dumps(MODEL_CONFIG))
    mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.max_model_len)
    cc = CacheConfig(block_size=16, enable_prefix_caching=True, prefix_match_unit=args.prefix_match_unit)
    sc = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    ev = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if args.kv_events else None
    vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_events_config=ev)  # NemotronH hook:
    # mamba_cache_mode
    Platform._align_hybrid_block_size(vc, FlashAttentionBackend)  # what CUDA's update_block_size_for_backend does
    shapes = NemotronHForCausalLM.get_mamba_state_shape_from_config(vc)
    dtypes = NemotronHForCausalLM.get_mamba_state_dtype_from_config(vc)
    specs = {}
    for i, ch in enumerate(MODEL_CONFIG["hybrid_override_pattern"]):
        if ch == "*":
            specs[f"model.layers.{i}.mixer.attn"] = FlashAttentionBackend.customize_spec(
                FullAttentionSpec(block_size=cc.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
            )
        else:  # MambaBase.get_kv_cache_spec + MambaMixer2's replace(num_prefill_checkpoint_blocks=1, alignment=1)
            specs[f"model.layers.{i}.mixer"] = MambaSpec(
                shapes=tuple(shapes),
                dtypes=tuple(dtypes),
                block_size=cc.mamba_block_size,
                page_size_padded=cc.mamba_page_size_padded,
                mamba_cache_mode=cc.mamba_cache_mode,
                num_speculative_blocks=0,
                num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=1,
            )
    from vllm.v1.attention.backends import utils as bu
    from vllm.v1.attention.selector import get_mamba_attn_backend

    backends = [FlashAttentionBackend, get_mamba_attn_backend(specs["model.layers.0.mixer"].mamba_type)]
    layouts = [[x.name for x in bu.get_supported_kv_cache_layouts(backends)]]
    bu.resolve_kv_cache_layout(vc, layouts, list(specs.values()))  # EngineCore does this first (sets cc)
    groups = kp.get_global_kv_cache_groups(vc, [specs])
    configs = kp.get_kv_cache_configs(vc, [specs], [budget_bytes], groups)
    kcc = ku.generate_scheduler_kv_cache_config(configs)
    cc.num_gpu_blocks = kcc.num_blocks
    part = [g.kv_cache_spec.block_size for g in kcc.kv_cache_groups if g.kv_cache_spec.prefix_cacheable]
    cc.block_size = min(part or [g.kv_cache_spec.block_size for g in kcc.kv_cache_groups])
    ku.update_kv_cache_capacity(vc, kcc)
    vc.validate_block_size()
    block_size, hash_block_size = ku.resolve_kv_cache_block_sizes(kcc, vc)
    align = ku.resolve_cache_hit_alignment_tokens(kcc, vc, block_size, hash_block_size)
    kcc.hash_block_size, kcc.cache_hit_alignment_tokens = hash_block_size, align
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=args.log_stats,
    )
    hash_fn = ku.get_hash_fn_by_name(cc.prefix_caching_hash_algo) if hasattr(ku, "get_hash_fn_by_name") else None
    if hash_fn is None:
        from vllm.utils.hashing import get_hash_fn_by_name

        hash_fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
    ku.init_none_hash(hash_fn)
    hasher = ku.get_request_block_hasher(hash_block_size, hash_fn, vc.num_hash_lookahead_tokens)
    info = {
        "attention_block_size": cc.block_size,
        "mamba_block_size": cc.mamba_block_size,
        "mamba_cache_mode": cc.mamba_cache_mode,
        "mamba_page_size_padded": cc.mamba_page_size_padded,
        "mamba_state_bytes_per_layer": specs["model.layers.0.mixer"].real_page_size_bytes,
        "scheduler_block_size": block_size,
        "hash_block_size": hash_block_size,
        "cache_hit_alignment_tokens": align,
        "num_blocks": kcc.num_blocks,
        "groups": [
            {
                "type": type(g.kv_cache_spec).__name__,
                "layers": len(g.layer_names),
                "block_size": g.kv_cache_spec.block_size,
                "page_bytes": g.kv_cache_spec.page_size_bytes,
            }
            for g in kcc.kv_cache_groups
        ],
        "kv_cache_tensors": len(kcc.kv_cache_tensors),
        "kv_cache_bytes": max(t.size for t in kcc.kv_cache_tensors),  # the tensors alias one allocation
        "prefix_match_unit": cc.prefix_match_unit,
        "prefix_caching_hash_algo": cc.prefix_caching_hash_algo,
        "kv_cache_size_tokens": cc.kv_cache_size_tokens,
    }
    return sched, hasher, info


def run(w: cm.Workload, args: argparse.Namespace) -> dict[str, object]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    budget = int(w.budget_gib * cm.GiB)
    sched, hasher, info = build(budget, args)
    reqs = [
        Request(
            f"r{i}",
            list(it.prompt),
            SamplingParams(max_tokens=it.max_tokens, ignore_eos=True, detokenize=False),
            None,
            block_hasher=None,
        )
        for i, it in enumerate(w.items)
    ]
    hashed = [0.0, 0.0]  # wall, CPU of the prompt hashing (timed: ours hashes prompts inside schedule())

    def add(r: Request) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        r._block_hasher = hasher  # what Request(..., block_hasher=hasher) does on arrival
        r.update_block_hashes()
        hashed[0] += time.perf_counter() - t0
        hashed[1] += time.process_time() - c0
        sched.add_request(r)

    index = {r.request_id: i for i, r in enumerate(reqs)}
    waiters: dict[int, list[int]] = {}
    for i, it in enumerate(w.items):
        if it.after is None:
            add(reqs[i])
        else:
            waiters.setdefault(it.after, []).append(i)
    admitted_hit: dict[str, int] = {}
    steps = scheduled = 0
    timed = cpu = 0.0
    finished = 0
    requests = sched.requests
    while sched.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.process_time()
        out = sched.schedule()
        timed -= t0 - time.perf_counter()
        cpu -= c0 - time.process_time()
        ids = list(out.num_scheduled_tokens)  # the fake model (untimed, as in ours)
        sampled = []
        for rid in ids:
            r = requests[rid]
            sampled.append([cm.fake_token(r.num_tokens, index[rid])] if r.num_computed_tokens >= r.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: k for k, rid in enumerate(ids)}, sampled_token_ids=sampled
        )
        t0, c0 = time.perf_counter(), time.process_time()
        sched.update_from_output(out, mro)
        timed += time.perf_counter() - t0
        cpu += time.process_time() - c0
        for nr in out.scheduled_new_reqs:  # untimed: first-admission hits (tokens computed when first scheduled)
            admitted_hit.setdefault(nr.req_id, nr.num_computed_tokens)
        for rid in ids:
            r = reqs[index[rid]]
            if r.is_finished():
                finished += 1
                for j in waiters.pop(index[rid], []):
                    add(reqs[j])
        steps += 1
        scheduled += len(ids)
    # every request got exactly its expected stream (the fixed function of position): the traces are the same
    for i, (r, it) in enumerate(zip(reqs, w.items, strict=True)):
        assert list(r.output_token_ids) == cm.answer(len(it.prompt), i, it.max_tokens), (i, len(r.output_token_ids))
    prompt_tokens = sum(len(it.prompt) for it in w.items)
    hit_tokens = sum(admitted_hit.values())
    n = max(scheduled, 1)
    return {
        "budget_bytes": budget,
        "steps": steps,
        "scheduled_seqs": scheduled,
        "finished": finished,
        "us_per_seq_step": (timed + hashed[0]) / n * 1e6,
        "cpu_us_per_seq_step": (cpu + hashed[1]) / n * 1e6,
        "cpu_us_per_seq_step_without_prompt_hashing": cpu / n * 1e6,
        "kv_events": args.kv_events,
        "prompt_hashing_cpu_s": hashed[1],
        "prompt_tokens": prompt_tokens,
        "hit_rate": hit_tokens / prompt_tokens,
        "preempted_requests": sum(1 for r in reqs if r.num_preemptions > 0),
        "config": info,
    }


def _medians(runs: list[dict], first: tuple[str, ...]) -> dict[str, object]:
    """One side's rounds: median CPU and wall time per request-step, every round's CPU time, and the fields every
    round shares (hit rate, steps, ... and `first`) from the first round."""
    shared = ("hit_rate", "steps", "scheduled_seqs", *first)
    return {
        "cpu_us_per_seq_step": statistics.median(r["cpu_us_per_seq_step"] for r in runs),
        "wall_us_per_seq_step": statistics.median(r["us_per_seq_step"] for r in runs),
        "cpu_runs": [r["cpu_us_per_seq_step"] for r in runs],
        **{k: runs[0][k] for k in shared},
    }


def combine(pattern: str, out: str) -> None:
    """Medians over interleaved rounds: {pattern}{r}_vllm.json, _vllm_pmu16.json (this script, --repeats 1) and
    _ours.json (cache_manager.py --repeats 1), one file each per round; writes `out` and prints the table."""
    import glob

    def load(kind: str) -> list[dict]:
        return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{pattern}*_{kind}.json"))]

    sides = {"vllm": load("vllm"), "vllm_pmu16": load("vllm_pmu16"), "ours_runs": load("ours")}
    rows: dict[str, dict[str, object]] = {}
    for wl in ("current", "no_reuse"):
        row: dict[str, object] = {}
        for side in ("vllm", "vllm_pmu16"):
            runs = [d["results"][wl] for d in sides[side] if wl in d["results"]]
            if not runs:
                continue
            row[side] = {
                **_medians(runs, ("digest", "config")),
                "cpu_us_per_seq_step_without_prompt_hashing": statistics.median(
                    r.get("cpu_us_per_seq_step_without_prompt_hashing", 0.0) for r in runs
                ),
                "loadavg_end": [d.get("loadavg_end") for d in sides[side]],
            }
        for pol in ("ours", "fixed", "v1"):
            runs = [d["results"][wl][pol] for d in sides["ours_runs"] if pol in d["results"].get(wl, {})]
            if runs:
                row[pol] = _medians(runs, ("theoretical",))
        v = row.get("vllm", {}).get("cpu_us_per_seq_step")  # type: ignore[union-attr]
        for pol in ("ours", "fixed", "v1"):
            if pol in row and v:
                c = row[pol]["cpu_us_per_seq_step"]  # type: ignore[index]
                row[pol]["ratio_to_vllm_cpu"] = c / v  # type: ignore[index]
                # per round (ours' run r against vLLM's run r, taken minutes apart): the spread of the ratio
                per = [o / x for o, x in zip(row[pol]["cpu_runs"], row["vllm"]["cpu_runs"], strict=True)]  # type: ignore[index]
                row[pol]["ratio_to_vllm_cpu_per_round"] = per  # type: ignore[index]
                row[pol]["ratio_to_vllm_cpu_median_of_rounds"] = statistics.median(per)  # type: ignore[index]
        rows[wl] = row
    report = {
        "benchmark": "vllm_cache_baseline (combined)",
        "rounds": len(sides["vllm"]),
        "vllm": sides["vllm"][0]["vllm"] if sides["vllm"] else None,
        "results": rows,
    }
    Path(out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("| trace | vLLM (528 hits) | vLLM (pmu 16) | ours | fixed | v1 | ours / vLLM | hit: vLLM / ours |")
    print("|---|---|---|---|---|---|---|---|")
    for wl, row in rows.items():

        def cell(k: str, row: dict[str, object] = row) -> str:
            x = row.get(k)
            return f"{x['cpu_us_per_seq_step']:.1f}" if isinstance(x, dict) else "-"

        o, vv = row.get("ours"), row.get("vllm")
        ratio = f"{o['ratio_to_vllm_cpu']:.2f}" if isinstance(o, dict) and "ratio_to_vllm_cpu" in o else "-"
        hits = f"{vv['hit_rate']:.3f} / {o['hit_rate']:.3f}" if isinstance(o, dict) and isinstance(vv, dict) else "-"
        print(
            f"| {wl} | {cell('vllm')} | {cell('vllm_pmu16')} | {cell('ours')} | {cell('fixed')} | {cell('v1')} "
            f"| {ratio} | {hits} |"
        )
    print(f"wrote {out}")


def profile_ours(names: list[str], args: argparse.Namespace, top: int = 25) -> None:
    """cProfile of ours (policy 'ours') on the timed calls only (Scheduler.schedule, update_from_output, finish, as
    cache_manager.run times them), sorted by tottime; run with the repo's venv."""
    import cProfile
    import pstats

    pr = cProfile.Profile()

    def wrapped(orig):  # type: ignore[no-untyped-def]
        def wrap(self, *a, **k):  # type: ignore[no-untyped-def]
            pr.enable()
            try:
                return orig(self, *a, **k)
            finally:
                pr.disable()

        return wrap

    for name in ("schedule", "update_from_output", "finish"):
        setattr(cm.Scheduler, name, wrapped(getattr(cm.Scheduler, name)))
    args.arena = getattr(args, "arena", True)  # cache_manager.run's default layout (the arena)
    for n in names:
        pr.clear()
        r = cm.run(cm.WORKLOADS[n](random.Random(args.seed), args.scale), "ours", args)
        st = pstats.Stats(pr)
        total = st.total_tt
        print(
            f"{n}: engine from {sys.modules['hybridpd.engine.cache.coordinator'].__file__}; hit {r['hit_rate']:.4f}; "
            f"profiled {total:.2f} s in the timed calls"
        )
        for (f, line, fn), (_, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]:
            print(
                f"  {tt / total * 100:5.1f}% self  {ct / total * 100:5.1f}% cum  {nc:9d} calls  "
                f"{f.replace(str(cm.Path(cm.__file__).resolve().parents[1]) + '/', '')}:{line}({fn})"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="current,no_reuse")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KV cache events on (null publisher), as ours always records them (default: on)",
    )
    p.add_argument(
        "--log-stats",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Scheduler(log_stats=...): vLLM's serving default is on (prefix-cache and request stats)",
    )
    p.add_argument(
        "--prefix-match-unit",
        type=int,
        default=None,
        help="CacheConfig.prefix_match_unit (default None: hits land on the 528-token block)",
    )
    p.add_argument("--digest-only", action="store_true", help="print the trace digests and exit (any venv)")
    p.add_argument(
        "--profile-ours",
        action="store_true",
        help="cProfile ours on the workloads (repo venv; the engine imported by cache_manager.py)",
    )
    p.add_argument("--engine-root", help="import cache_manager.py and engine/ from this tree (e.g. a git archive)")
    p.add_argument("--combine", metavar="PREFIX", help="combine round files PREFIX*_{vllm,vllm_pmu16,ours}.json")
    p.add_argument("--out", default="vllm_cache_baseline.json")
    args = p.parse_args()
    if args.profile_ours:
        profile_ours(args.workloads.split(","), args)
        return
    if args.combine:
        combine(args.combine, args.out)
        return
    names = args.workloads.split(",")
    traces = {n: cm.WORKLOADS[n](random.Random(args.seed), args.scale) for n in names}
    digests = {n: trace_digest(w) for n, w in traces.items()}
    for n, dg in digests.items():
        print(f"trace {n}: {len(traces[n].items)} requests, digest {dg}", flush=True)
    if args.digest_only:
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU here: only the config objects need a platform
    import vllm

    results: dict[str, object] = {}
    for n, w in traces.items():
        runs = [run(w, args) for _ in range(args.repeats)]
        r = dict(runs[len(runs) // 2])
        for k in ("us_per_seq_step", "cpu_us_per_seq_step", "cpu_us_per_seq_step_without_prompt_hashing"):
            r[k] = statistics.median(x[k] for x in runs)  # type: ignore[misc]
            r[k + "_runs"] = [x[k] for x in runs]
        r.update(requests=len(w.items), budget_gib=w.budget_gib, digest=digests[n], notes=w.notes)
        results[n] = r
        print(
            f"{n:10s} vllm hit {r['hit_rate']:.4f} cpu us/seq-step {r['cpu_us_per_seq_step']:.2f} "
            f"(without prompt hashing {r['cpu_us_per_seq_step_without_prompt_hashing']:.2f}) "
            f"wall {r['us_per_seq_step']:.2f} "
            f"runs {[round(x, 1) for x in r['cpu_us_per_seq_step_runs']]} steps {r['steps']} "
            f"blocks {r['config']['num_blocks']} block {r['config']['attention_block_size']}",
            flush=True,
        )
    report = {
        "benchmark": "vllm_cache_baseline",
        "vllm": vllm.__version__,
        "args": vars(args),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "loadavg_end": os.getloadavg(),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
