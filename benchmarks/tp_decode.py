"""Tensor parallelism on GPUs: the decode step at TP 2 against TP 1, prefill at TP 2 against torch.mm, and TP 2 ==
TP 1 greedy tokens in fp32 through the whole engine (fast path, CUDA graphs, NCCL).

Jobs `PRESET:TP` (default: the 8B preset at TP 1 and 2, Nemotron-3-Nano-30B-A3B at TP 2). Each job runs as TP plain
processes (one per GPU, NCCL; no Ray), with random weights drawn on the GPU for the rank's slice only (the model is
built on the meta device and cut by engine.parallel.shard before it is materialised: the 30B model never exists
whole on one GPU). Every rank executes the same synthetic decode step (`ModelRunner.execute` of a scheduler output:
every sequence has `context - 1` tokens cached and computes one), in lockstep; rank 0 times it (median of --steps
after --warmup, wall clock, sampler included).

    per-rank roofline = (rank's weights + its KV slice + its state slice, bytes read/written) / copy bandwidth
    all-reduce cost    = one NCCL all-reduce of [batch, hidden] inside a CUDA graph (median) x those of one step
    bar                = TP 2 step <= 0.6 x TP 1 step at batch 64 (8B preset)

The identity checks (--identity) build two small models (NemotronH with Mamba-2, attention with 2 KV heads, MoE;
Qwen3.5 with GDN), random dummy weights (identical on every GPU: same seed), and compare greedy tokens of
`LLM(tensor_parallel_size=2, device="cuda", dtype="float32")` against TP 1, then P TP 1 -> D TP 2 and P TP 2 -> D
TP 1 handoffs (engine export/import, the planned pieces moved through the ranks' control channel:
engine.parallel.handoff, not NIXL) against the colocated TP 1 engine.

    NCCL_NVLS_ENABLE=0 python benchmarks/tp_decode.py --identity --out out/tp_decode.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.roofline import (  # noqa: E402
    BLOCK,
    copy_bandwidth,
    decode_output,
    describe,
    mm_flops,
    prefill_output,
    timed,
)


def sharded_random_model(name: str, dtype: str, device: str, tp: Any, expert_parallel: bool = False) -> Any:
    """A preset's engine model cut to `tp`'s rank (None: whole), random weights drawn on `device` for its slice
    (`expert_parallel`: MoE blocks keep whole experts per rank)."""
    from hybridpd.engine.models.checkpoint import fill_random_weights, hf_config, preset
    from hybridpd.engine.models.registry import ARCHITECTURES
    from hybridpd.engine.parallel.shard import shard_model

    family, overrides = preset(name)
    config = hf_config(family, **overrides)
    cls = ARCHITECTURES["NemotronHForCausalLM" if family == "nemotron_h" else "Qwen3_5ForCausalLM"]
    with torch.device("meta"):
        model = cls(config.to_dict(), dtype)
    if tp is not None:
        shard_model(model, tp, expert_parallel)
    fill_random_weights(model, cls, family, config, dtype, device, seed=0)
    model.requires_grad_(False)
    return model.eval()


def _runner(model: Any, device: str, batch: int, ctx: int) -> tuple[Any, int, Any]:
    from hybridpd.engine.cache.planner import plan_capacity
    from hybridpd.engine.cache.specs import group_layers
    from hybridpd.engine.runner import ModelRunner

    groups = group_layers(model.cache_specs(BLOCK))
    blocks_per_seq = -(-ctx // BLOCK)
    probe = plan_capacity(groups, 1 << 40, batch, 0, ctx, 256)
    budget = (batch + 1) * probe.bytes_per_state + (batch * blocks_per_seq + 2) * probe.bytes_per_block
    plan = plan_capacity(groups, budget, batch, 0, ctx, 256)
    runner = ModelRunner(
        model, groups, plan, len(model.args.layer_types), torch.device(device), zero_fresh_blocks=False, fast_path=True
    )
    return runner, blocks_per_seq, groups


def rank_matmul_params(model: Any) -> float:
    """Matmul parameters one token meets on this rank: every 2-D weight of the rank's slice except the input
    embedding, routed experts as top-k of E (roofline.describe assumes whole experts)."""
    a = model.args
    share = a.num_experts_per_tok / a.n_routed_experts if "moe" in a.layer_types else 1.0
    total = 0.0
    for n, p in model.named_parameters():
        if p.dim() != 2 or n.endswith(("embeddings.weight", "embed_tokens.weight")):
            continue
        total += p.numel() * (share if ".experts." in n else 1.0)
    return total


def _all_reduce_ms(tp: Any, batch: int, hidden: int, dtype: torch.dtype, reps: int = 50) -> float:
    """One all-reduce of [batch, hidden] as the decode step runs it: `reps` of them captured in one CUDA graph,
    the graph's median replay time / reps (launch cost excluded, as in the step's graph)."""
    x = torch.randn(batch, hidden, dtype=dtype, device="cuda") * 1e-3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            tp.all_reduce(x.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    y = x.clone()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            y = tp.all_reduce(y) * 0.5
    times = timed(graph.replay, 3, 20)
    return statistics.median(times) * 1e3 / reps


def rank_main(rank: int, job: dict[str, Any], init: str, queue: Any) -> None:
    """One rank of one job: build, time decode (graph and eager) and prefill, rank 0 reports rows on `queue`."""
    from hybridpd.engine.parallel.group import init_tp
    from hybridpd.engine.sampling_params import SamplingParams

    world, device = job["tp"], f"cuda:{rank}"
    torch.cuda.set_device(device)
    tp = init_tp(rank, world, init, device) if world > 1 else None
    rows: list[dict[str, Any]] = []
    try:
        bw, mm = (copy_bandwidth(), mm_flops()) if rank == 0 else (0.0, 0.0)
        model = sharded_random_model(job["preset"], job["dtype"], device, tp, job["ep"])
        runner, blocks_per_seq, groups = _runner(model, device, job["batch"], max(job["context"], job["prefill"]))
        shape = describe(model, groups)
        n_reduce = len(model.args.layer_types) + 1  # one per block + the embedding (the logits gather aside)
        ar_ms = _all_reduce_ms(tp, job["batch"], model.hidden_size, next(model.parameters()).dtype) if tp else 0.0
        params = {f"r{i}": SamplingParams(max_tokens=1, temperature=0) for i in range(job["batch"])}
        params["p0"] = SamplingParams(max_tokens=1, temperature=0)
        graphs = runner.graphs
        b, ctx = job["batch"], job["context"]
        for mode in job["modes"]:
            runner.graphs = graphs if mode == "graph" else None
            step = functools.partial(runner.execute, decode_output(b, ctx, blocks_per_seq), params)
            try:
                times = timed(step, job["warmup"], job["steps"])
            except Exception as e:  # noqa: BLE001 - report (e.g. a collective that cannot be captured), go on
                rows.append({**_key(job), "mode": mode, "error": f"{type(e).__name__}: {e}"})
                continue
            med = statistics.median(times)
            nbytes = shape.weights_read(b) + b * ctx * shape.kv_bytes_per_token + 2 * b * shape.state_bytes
            roof = nbytes / bw * 1e3 if bw else 0.0
            rows.append(
                {
                    **_key(job),
                    "mode": mode,
                    "batch": b,
                    "context": ctx,
                    "step_ms": med * 1e3,
                    "rank_roofline_ms": roof,
                    "all_reduce_ms": ar_ms,
                    "all_reduces": n_reduce,
                    "roofline_plus_comm_ms": roof + n_reduce * ar_ms,
                    "tok_per_s": b / med,
                }
            )
        runner.graphs = graphs
        if job["profile"]:
            rows += _profile_rows(runner, graphs, job, decode_output(b, ctx, blocks_per_seq), params)
        if job["prefill"]:
            T = job["prefill"]
            times = timed(functools.partial(runner.execute, prefill_output(T), params), 1, job["prefill_steps"])
            med = statistics.median(times)
            flops = 2 * rank_matmul_params(model) * T + 2 * shape.attn_layers * T * T * shape.attn_width
            rows.append(
                {
                    **_key(job),
                    "prefill_tokens": T,
                    "prefill_ms": med * 1e3,
                    "rank_tflops": flops / med / 1e12,
                    "mm_tflops": mm / 1e12,
                    "fraction_of_mm": flops / med / mm if mm else 0.0,
                }
            )
    except Exception as e:  # noqa: BLE001
        rows.append({**_key(job), "error": f"{type(e).__name__}: {e}"})
    if rank == 0:
        queue.put(rows)
    if tp is not None:
        torch.distributed.destroy_process_group()


def _profile_rows(runner: Any, graphs: Any, job: dict[str, Any], out: Any, params: Any) -> list[dict[str, Any]]:
    """Per-kernel totals of one decode step (torch.profiler) with and without CUDA graphs, on every rank at once
    (the collectives need all of them); rank 0's rows are the ones reported."""
    from benchmarks.profile_decode import kernel_table

    rows = []
    for mode in job["modes"]:
        runner.graphs = graphs if mode == "graph" else None
        total_us, table = kernel_table(functools.partial(runner.execute, out, params))
        rows.append(
            {
                **_key(job),
                "profile": mode,
                "kernel_sum_ms": total_us / 1e3,
                "kernels": sum(r[1] for r in table),
                "top": [{"kernel": k, "count": c, "us": round(t, 1)} for k, c, t in table[: job["profile"]]],
            }
        )
    runner.graphs = graphs
    return rows


def _key(job: dict[str, Any]) -> dict[str, Any]:
    return {"preset": job["preset"], "tp": job["tp"], "dtype": job["dtype"], "experts": "EP" if job["ep"] else "TP"}


def run_job(job: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp
    from hybridpd.engine.parallel.group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, job, init, queue)) for r in range(job["tp"])]
    for p in procs:
        p.start()
    try:
        rows: list[dict[str, Any]] = queue.get(timeout=timeout_s)
    except Exception:  # noqa: BLE001
        rows = [{**_key(job), "error": f"no result in {timeout_s:.0f} s"}]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def _identity_models() -> dict[str, str]:
    """Two small dummy-weight checkpoint directories (config + tokenizer; weights drawn at load, same seed)."""
    from hybridpd.engine.models.checkpoint import nemotron_h_config, qwen3_5_config
    from hybridpd.engine.tokenizer import write_tokenizer_files

    models = {
        "nemotron_h": (
            "NemotronHForCausalLM",
            nemotron_h_config(hidden_size=256, pattern="M*EM-M*E", n_groups=2, num_key_value_heads=2),
        ),
        "qwen3_5": ("Qwen3_5ForCausalLM", qwen3_5_config(hidden_size=256, num_hidden_layers=8)),
    }
    paths = {}
    for family, (arch, cfg) in models.items():
        path = paths[family] = tempfile.mkdtemp(prefix=f"tp-identity-{family}-")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**cfg, "architectures": [arch], "model_type": family}, f)
        write_tokenizer_files(path, cfg["vocab_size"], cfg["max_position_embeddings"])
    return paths


PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 37, 150, 600))]


def identity_check(tp: int, device: str = "cuda") -> list[dict[str, Any]]:
    """Greedy tokens of LLM at TP `tp` vs TP 1, fp32 on CUDA (fast path, CUDA graphs), two families."""
    from hybridpd.engine import LLM, SamplingParams

    prompts = PROMPTS
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    rows = []
    for family, path in _identity_models().items():
        tokens = {}
        for size in (1, tp):
            llm = LLM(
                path,
                device=device,
                dtype="float32",
                load_format="dummy",
                tensor_parallel_size=size,
                kv_cache_memory_bytes=1 << 30,
                max_model_len=1024,
            )
            graphs = llm.engine.runner.graphs is not None
            tokens[size] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        same = sum(a == b for a, b in zip(tokens[1], tokens[tp], strict=True))
        row = {
            "identity": family,
            "tp": tp,
            "dtype": "float32",
            "cuda_graphs": graphs,
            "prompts_identical": same,
            "prompts": len(prompts),
            "ok": same == len(prompts),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def hetero_check(pairs: list[tuple[int, int]], device: str = "cuda") -> list[dict[str, Any]]:
    """P TP a -> D TP b handoffs (engine export/import, pieces planned by kvtransfer.tp_slices, moved through the
    ranks' control channel: engine.parallel.handoff) against the colocated TP 1 engine, fp32 on CUDA."""
    from hybridpd.engine import LLM, SamplingParams
    from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from hybridpd.engine.core import EngineCore
    from hybridpd.engine.parallel.handoff import copy_import
    from hybridpd.engine.transfer import ImportSource, begin_import, complete_import, export_prefilled, release_export

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    rows = []
    for family, path in _identity_models().items():
        llm = LLM(
            path, device=device, dtype="float32", load_format="dummy", kv_cache_memory_bytes=1 << 30, max_model_len=1024
        )
        want = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy)]
        del llm
        gc.collect()

        def core(size: int, path: str = path) -> EngineCore:
            return EngineCore(
                EngineConfig(
                    model=ModelConfig(
                        path=path, device=device, dtype="float32", load_format="dummy", max_model_len=1024
                    ),
                    cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
                    parallel=ParallelConfig(tensor_parallel_size=size),
                )
            )

        for tp_p, tp_d in pairs:
            p, d = core(tp_p), core(tp_d)
            same = 0
            try:
                for i, prompt in enumerate(PROMPTS):
                    preq = p.add_request(f"r{i}", prompt, greedy, compute_target=len(prompt) - 1)
                    while p.has_unfinished():
                        p.step()
                    exp = export_prefilled(p, preq)
                    dreq = d.new_request(f"r{i}", prompt, greedy)
                    imp = begin_import(
                        d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint)
                    )
                    assert imp is not None
                    copy_import(p, d, imp)
                    complete_import(d, dreq, imp)
                    release_export(p, preq, exp)
                    while d.has_unfinished():
                        d.step()
                    same += dreq.output_token_ids == want[i]
                row = {
                    "hetero": family,
                    "p_tp": tp_p,
                    "d_tp": tp_d,
                    "dtype": "float32",
                    "prompts_identical": same,
                    "prompts": len(PROMPTS),
                    "ok": same == len(PROMPTS),
                }
            except Exception as e:  # noqa: BLE001
                row = {"hetero": family, "p_tp": tp_p, "d_tp": tp_d, "error": f"{type(e).__name__}: {e}"}
            finally:
                p.shutdown()
                d.shutdown()
                del p, d
                gc.collect()
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'preset':26} {'tp':>2} {'mode':10} {'batch':>5} {'ctx':>5} {'step ms':>8} {'roofline':>8} "
        f"{'+comm':>7} {'AR ms':>6} {'tok/s':>8}"
    )
    base = {(r["preset"], r["mode"]): r["step_ms"] for r in rows if r.get("tp") == 1 and "step_ms" in r}
    print("(AR ms: one [batch, hidden] all-reduce inside a CUDA graph)")
    for r in rows:
        if "error" in r:
            what = r.get("preset", r.get("identity", r.get("hetero", "?")))
            print(f"{what:26} {r.get('tp', ''):>2} FAILED {r['error'][:100]}")
        elif "step_ms" in r:
            vs = base.get((r["preset"], r["mode"]))
            ratio = f"  = {r['step_ms'] / vs:.2f} x TP 1" if vs and r["tp"] > 1 else ""
            mode = r["mode"] + ("/EP" if r.get("experts") == "EP" else "")
            print(
                f"{r['preset']:26} {r['tp']:2d} {mode:10} {r['batch']:5d} "
                f"{r['context']:5d} {r['step_ms']:8.2f} "
                f"{r['rank_roofline_ms']:8.2f} {r['roofline_plus_comm_ms']:7.2f} {r['all_reduce_ms']:6.3f} "
                f"{r['tok_per_s']:8.0f}{ratio}"
            )
        elif "profile" in r:
            print(
                f"\n{r['preset']} TP {r['tp']} {r['profile']} step: "
                f"{r['kernel_sum_ms']:.2f} ms of kernels in {r['kernels']}"
            )
            for k in r["top"]:
                print(f"  {k['us'] / 1e3:7.3f} ms {k['count']:5d}x {k['us'] / k['count']:8.1f} us  {k['kernel']}")
        elif "prefill_ms" in r:
            print(
                f"{r['preset']:26} {r['tp']:2d} prefill {r['prefill_tokens']} tokens: {r['prefill_ms']:.1f} ms, "
                f"{r['rank_tflops']:.0f} TFLOP/s per GPU = {r['fraction_of_mm']:.2f} of torch.mm "
                f"({r['mm_tflops']:.0f})"
            )
        elif "hetero" in r:
            print(
                f"hetero   {r['hetero']:10} P TP {r['p_tp']} -> D TP {r['d_tp']} fp32 vs colocated: "
                f"{r['prompts_identical']}/{r['prompts']} prompts token-identical"
            )
        elif "identity" in r:
            print(
                f"identity {r['identity']:10} TP {r['tp']} vs 1 fp32 (graphs {r['cuda_graphs']}): "
                f"{r['prompts_identical']}/{r['prompts']} prompts token-identical"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--jobs",
        default="nemotron-h-8b:1,nemotron-h-8b:2,nemotron-3-nano-30b-a3b:2",
        help="PRESET:TP[:ep] jobs, comma-separated (ep: expert parallelism for MoE blocks)",
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="graph,eager")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--prefill-steps", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, help="also per-kernel totals of one step: the top N kernels")
    p.add_argument("--identity", action="store_true", help="also the fp32 TP 2 == TP 1 token check")
    p.add_argument("--identity-device", default="cuda", help="cpu: the identity checks on gloo ranks (a smoke test)")
    p.add_argument("--job-timeout", type=float, default=240.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for spec in filter(None, args.jobs.split(",")):
        name, size, *how = spec.split(":")
        job = {
            "preset": name,
            "tp": int(size),
            "ep": how == ["ep"],
            "dtype": args.dtype,
            "batch": args.batch,
            "context": args.context,
            "modes": args.modes.split(","),
            "warmup": args.warmup,
            "steps": args.steps,
            "prefill": args.prefill_tokens,
            "prefill_steps": args.prefill_steps,
            "profile": args.profile,
        }
        rows += run_job(job, args.job_timeout)
    if args.identity:
        rows += identity_check(2, args.identity_device)
        rows += hetero_check([(1, 2), (2, 1)], args.identity_device)
    print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    "date": time.strftime("%Y-%m-%d"),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
