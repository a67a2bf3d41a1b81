"""Decode step time against the HBM roofline, prefill against torch.mm, kernels per step, on full-size presets.

Per preset (random weights built on the GPU, `engine.models.checkpoint.random_engine_model`), per batch and context:
one decode step = `ModelRunner.execute` of a synthetic scheduler output (every sequence has `context - 1` tokens
cached and computes one; block tables and state slots distinct), input preparation, forward, logits and sampling
included, timed on the wall clock (the sampler reads the tokens back, so the step is complete). Median of --steps
after --warmup.

    roofline = (weights read + KV read + recurrent state read and written, bytes) / copy bandwidth
    copy bandwidth = 2 * bytes / time of a 2 GiB device-to-device copy measured in the same run (median of 10)

Weights count every parameter except the input embedding table (a decode step reads B rows of it); routed MoE
experts count as far as B tokens touch them (expected distinct experts under uniform routing). Prefill: one
step of a single --prefill-tokens prompt; achieved FLOP/s (2 x matmul parameters x tokens + causal attention) as a
fraction of a same-run bf16 torch.mm (8192^3, median of 10). Kernels per step from torch.profiler (one step).

    python benchmarks/roofline.py --presets nemotron-h-8b,qwen3.5-9b --batches 1,16,64,256 --contexts 1024,8192
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
from dataclasses import dataclass

import torch
from hybridpd.engine.cache.planner import plan_capacity
from hybridpd.engine.cache.specs import FullAttentionSpec, group_layers
from hybridpd.engine.models.checkpoint import preset, random_engine_model
from hybridpd.engine.runner import ModelRunner
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import ScheduledSeq, SchedulerOutput

BLOCK = 16


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del a, b
    return 2 * nbytes / statistics.median(times[2:])


def mm_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(12):
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times[2:])


@dataclass
class Shape:
    weight_bytes: int
    matmul_params: int
    kv_bytes_per_token: int  # all attention layers
    state_bytes: int  # conv + ssm of all recurrent layers, one sequence
    attn_layers: int
    attn_width: int  # heads * head_dim
    expert_bytes: int = 0  # routed experts of all MoE layers (included in weight_bytes)
    experts: int = 0
    top_k: int = 0

    def weights_read(self, batch: int) -> float:
        """Weight bytes one decode step reads: routed experts only as far as `batch` tokens touch them (expected
        number of distinct experts under uniform routing: E (1 - (1 - k/E)^B))."""
        if not self.experts:
            return self.weight_bytes
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** batch)
        return self.weight_bytes - self.expert_bytes + self.expert_bytes * touched / self.experts


def describe(model, groups) -> Shape:  # type: ignore[no-untyped-def]
    emb = model.backbone.embeddings.weight if hasattr(model, "backbone") else model.model.embed_tokens.weight
    params = [(n, p) for n, p in model.named_parameters() if p.data_ptr() != emb.data_ptr() or "lm_head" in n]
    weight_bytes = sum(p.numel() * p.element_size() for _, p in params)
    matmul = sum(p.numel() for _, p in params if p.dim() == 2)
    if getattr(model.args, "n_routed_experts", 0) and "moe" in model.args.layer_types:
        a = model.args  # only top-k of the routed experts run per token
        per_expert = 2 * (a.moe_latent_size or a.hidden_size) * a.moe_intermediate_size
        matmul -= a.layer_types.count("moe") * (a.n_routed_experts - a.num_experts_per_tok) * per_expert
    experts = top_k = expert_bytes = 0
    if "moe" in model.args.layer_types:
        experts, top_k = model.args.n_routed_experts, model.args.num_experts_per_tok
        expert_bytes = sum(p.numel() * p.element_size() for n, p in params if ".experts." in n)
    kv = st = layers = width = 0
    for g in groups:
        n = len(g.layer_ids)
        if isinstance(g.spec, FullAttentionSpec):
            kv += g.page_bytes_all_layers // g.spec.block_size
            layers += n
            width = model.args.num_attention_heads * model.args.head_dim
        else:
            st += g.page_bytes_all_layers
    return Shape(weight_bytes, matmul, kv, st, layers, width, expert_bytes, experts, top_k)


def decode_output(batch: int, ctx: int, blocks_per_seq: int) -> SchedulerOutput:
    seqs = []
    for i in range(batch):
        nb = -(-ctx // BLOCK)
        first = 1 + i * blocks_per_seq
        seqs.append(ScheduledSeq(request_id=f"r{i}", num_computed_tokens=ctx - 1, token_ids=(7 + i % 200,),
                                 sample=True, group_block_ids=((0, tuple(range(first, first + nb))),),
                                 group_state_slots=((1, 1 + i),), group_checkpoints=((1, ()),)))
    return SchedulerOutput(seqs=tuple(seqs), preempted=())


def prefill_output(tokens: int) -> SchedulerOutput:
    nb = -(-tokens // BLOCK)
    seq = ScheduledSeq(request_id="p0", num_computed_tokens=0, token_ids=tuple(i % 250 for i in range(tokens)),
                       sample=True, group_block_ids=((0, tuple(range(1, 1 + nb))),), group_state_slots=((1, 1),),
                       group_checkpoints=((1, ()),))
    return SchedulerOutput(seqs=(seq,), preempted=())


def timed(fn, warmup: int, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def count_kernels(fn) -> dict[str, int]:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = graphs = launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += 1
        elif e.name == "cudaGraphLaunch":
            graphs += 1
    return {"gpu_kernels": kernels, "kernel_launches": launches, "graph_launches": graphs}


def build_runner(name: str, dtype: str, max_batch: int, max_ctx: int, fast_path: bool = True,
                 reserve: int = 6 << 30):  # type: ignore[no-untyped-def]
    """(model, runner, shape, plan) for a preset with random weights on the GPU, its caches sized for `max_batch`
    sequences of `max_ctx` tokens with distinct blocks and slots, or for what the GPU holds after the weights
    (`fits` tells which batches then run)."""
    family, overrides = preset(name)
    torch.manual_seed(0)
    model = random_engine_model(family, dtype, "cuda", seed=0, **overrides)
    groups = group_layers(model.cache_specs(BLOCK))
    blocks_per_seq = -(-max_ctx // BLOCK)
    probe = plan_capacity(groups, 1 << 40, max_batch, 0, max_ctx, 256)
    budget, slots = fit_cache(probe.bytes_per_state, probe.bytes_per_block, max_batch, blocks_per_seq, reserve,
                              name)
    plan = plan_capacity(groups, budget, slots, 0, max_ctx, 256)
    print(json.dumps({"preset": name, "weights_gib": torch.cuda.memory_allocated() / 2**30,
                      "cache_gib": budget / 2**30, "state_slots": slots, "attention_blocks": plan.attention_blocks,
                      "max_concurrency": {c: fits(plan, 10**9, c) for c in (1024, 8192, max_ctx)}}), flush=True)
    runner = ModelRunner(model, groups, plan, len(model.args.layer_types), torch.device("cuda"),
                         zero_fresh_blocks=False, fast_path=fast_path)
    return model, runner, describe(model, groups), plan


def fit_cache(bytes_per_state: int, bytes_per_block: int, max_batch: int, blocks_per_seq: int, reserve: int,
              name: str) -> tuple[int, int]:
    """(cache bytes, state slots): enough for `max_batch` sequences of `blocks_per_seq` blocks, or what the GPU has
    left after the weights (less `reserve` for activations) when that is less. Raises when not even one sequence
    of the longest context fits, with the numbers."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    room = free - reserve
    one = 2 * bytes_per_state + (blocks_per_seq + 2) * bytes_per_block
    if room < one:
        raise RuntimeError(f"{name} does not fit: weights take {torch.cuda.memory_allocated() / 2**30:.1f} GiB, "
                           f"{free / 2**30:.1f} GiB are free, {reserve / 2**30:.1f} GiB are kept for activations and "
                           f"one sequence of {blocks_per_seq * BLOCK} tokens needs {one / 2**30:.2f} GiB of cache")
    want = (max_batch + 1) * bytes_per_state + (max_batch * blocks_per_seq + 2) * bytes_per_block
    if want <= room:
        return want, max_batch
    slots = max(1, min(max_batch, (room - (blocks_per_seq + 2) * bytes_per_block) // max(bytes_per_state, 1) - 1))
    return room, int(slots)


def fits(plan, batch: int, ctx: int) -> int:  # type: ignore[no-untyped-def]
    """How many of `batch` sequences of `ctx` tokens the runner's caches hold (distinct blocks and slots)."""
    return min(batch, plan.state_slots_running or batch, (plan.attention_blocks - 1) // -(-ctx // BLOCK))


def run_preset(name: str, args: argparse.Namespace, bw: float, mm: float) -> list[dict]:  # type: ignore[type-arg]
    max_b, max_ctx = max(args.batches), max(args.contexts + [args.prefill_tokens])
    model, runner, shape, plan = build_runner(name, args.dtype, max_b, max_ctx, not args.reference,
                                              int(args.reserve_gib * 2**30))
    params = {f"r{i}": SamplingParams(max_tokens=1, temperature=0) for i in range(max_b)}
    params["p0"] = SamplingParams(max_tokens=1, temperature=0)
    rows = []
    graphs = runner.graphs
    for ctx, b, mode in [(c, b, m) for c in args.contexts for b in args.batches for m in args.modes]:
        if fits(plan, b, ctx) < b:
            rows.append({"preset": name, "mode": mode, "batch": b, "context": ctx,
                         "skipped": f"does not fit: the cache left after weights holds {fits(plan, b, ctx)}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        runner.graphs = graphs if mode == "graph" else None
        out = decode_output(b, ctx, -(-ctx // BLOCK))
        step = functools.partial(runner.execute, out, params)
        times = timed(step, args.warmup, args.steps)
        med = statistics.median(times)
        nbytes = shape.weights_read(b) + b * ctx * shape.kv_bytes_per_token + 2 * b * shape.state_bytes
        row = {"preset": name, "mode": mode, "batch": b, "context": ctx, "step_ms": med * 1e3,
               "step_ms_min": min(times) * 1e3, "roofline_ms": nbytes / bw * 1e3, "ratio": med * bw / nbytes,
               "bytes": nbytes, "tok_per_s": b / med}
        if args.kernels and ctx == args.contexts[0] and b in (1, 64):
            row.update(count_kernels(step))
        rows.append(row)
        print(json.dumps(row), flush=True)
    runner.graphs = graphs
    if args.prefill_tokens and fits(plan, 1, args.prefill_tokens):
        out = prefill_output(args.prefill_tokens)
        times = timed(functools.partial(runner.execute, out, params), 1, args.prefill_steps)
        med = statistics.median(times)
        T = args.prefill_tokens
        flops = 2 * shape.matmul_params * T + 2 * shape.attn_layers * T * T * shape.attn_width  # causal QK + PV
        row = {"preset": name, "prefill_tokens": T, "prefill_ms": med * 1e3, "prefill_tok_per_s": T / med,
               "model_flops": flops, "achieved_tflops": flops / med / 1e12, "mm_tflops": mm / 1e12,
               "fraction_of_mm": flops / med / mm}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del runner, model  # free the GPU memory before the next preset
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="nemotron-h-8b,qwen3.5-9b")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--prefill-steps", type=int, default=3)
    p.add_argument("--kernels", action="store_true", help="count kernels of one step (batch 1 and 64)")
    p.add_argument("--reference", action="store_true", help="run the reference path instead of the fast path")
    p.add_argument("--modes", default="graph,eager", help="decode with CUDA graphs (graph) and/or without (eager)")
    p.add_argument("--reserve-gib", type=float, default=6.0,
                   help="GPU memory kept for activations when the cache is sized from what the weights leave")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.modes = args.modes.split(",")
    bw, mm = copy_bandwidth(), mm_flops()
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "mm_tflops": mm / 1e12}))
    rows: list[dict] = []  # type: ignore[type-arg]
    for name in args.presets.split(","):
        try:
            rows += run_preset(name, args, bw, mm)
        except Exception as e:  # noqa: BLE001 - report and go on with the next preset
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            rows.append({"preset": name, "error": f"{type(e).__name__}: {e}"})
            torch.cuda.empty_cache()
    print(f"\n{'preset':26} {'mode':5} {'batch':>5} {'ctx':>5} {'step ms':>8} {'roofline':>8} {'ratio':>6} "
          f"{'tok/s':>8} kernels")
    for r in rows:
        if "error" in r:
            print(f"{r['preset']:26} FAILED {r['error'][:90]}")
        elif "skipped" in r:
            print(f"{r['preset']:26} {r['mode']:5} {r['batch']:5d} {r['context']:5d} skipped: {r['skipped']}")
        elif "batch" in r:
            k = f"{r['gpu_kernels']} ({r['kernel_launches']} launches, {r['graph_launches']} graphs)" \
                if "gpu_kernels" in r else ""
            print(f"{r['preset']:26} {r['mode']:5} {r['batch']:5d} {r['context']:5d} {r['step_ms']:8.2f} "
                  f"{r['roofline_ms']:8.2f} {r['ratio']:6.2f} {r['tok_per_s']:8.0f} {k}")
        else:
            print(f"{r['preset']:26} prefill {r['prefill_tokens']} tokens: {r['prefill_ms']:.1f} ms, "
                  f"{r['prefill_tok_per_s']:.0f} tok/s, {r['achieved_tflops']:.0f} TFLOP/s = "
                  f"{r['fraction_of_mm']:.2f} of torch.mm ({r['mm_tflops']:.0f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "mm_tflops": mm / 1e12,
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
