"""Benchmark: the tensor-free cache control plane (Scheduler + HybridCacheManager) on prefix-sharing workloads, with
no model: every scheduled chunk "runs" instantly and sampled tokens are a fixed function of position (`fake_token`),
so every policy sees the same token streams.

Model (the issue's): 4 attention layers (8 KV heads x 128, bf16, block 16: 256 KiB per block) and 12 Mamba-2 layers
(conv 10240 x 3 bf16, SSM 64 x 64 x 128 fp32: ~24 MiB per state, i.e. one state = ~1,550 tokens of KV).

Workloads (`--scale` multiplies request counts). Each budget holds the running working set (64 requests, a state
each) and the content a later request can reuse, but far less than all content the workload creates (unique
suffixes, superseded turns, decode tails), so eviction runs throughout; the GiB are in the table.
  current        the issue's trace: 30 prefixes of 2,000 tokens + unique 500-token suffixes, 100 decode, all queued
  system_prompt  one 1,000-token system prompt + unique questions (20-400 tokens), 50-150 decode
  few_shot       8 few-shot prefixes of 3,000 tokens + unique questions (50-150), 30 decode
  multi_turn     conversations of 6 turns; each turn = the previous prompt + its answer + a new user message
                 (50-300); a turn arrives when the previous one finished (multi_turn_tight: the same at a
                 budget below its working set, where no policy can reach the infinite-cache figure)
  agentic        agent loops: system prompt + one of 4 long shared tool outputs (2,000) + a task; each step appends
                 the answer and a 300-token tool result; the next step arrives when the previous finished
  no_reuse       unique prompts (capacity: how many attention blocks running requests can hold)
  chat_after_shared  workload shift: 1,000 few_shot requests, then multi_turn's chats in the same cache
  prefix_shift   workload shift: current's shape (1,500 requests), then the same with 30 new prefixes
                 (both: `phase` figures count the second part only, ratio to its first-reuse bound)

Policies (all on the engine's plan: one arena whose pages hold attention blocks and checkpoints, k pages each):
  ours           reuse admission (branch points, prompt ends, rolling request ends) + value eviction
  lru            the same admission + LRU eviction (release order across both pools, no block/state consistency)
  fixed          vLLM-style: a checkpoint every 528 tokens (vLLM's hybrid block size for such a model) of every
                 request, prefill and decode, LRU eviction. vLLM itself is not installed: this is its policy,
                 re-implemented here, not vLLM's code or timings.

Reported per workload and policy:
- hit rate = first-admission hits / prompt tokens; theoretical = the same with an infinite cache at 16-token
  granularity: at its admission, request i may hit the longest prefix (in full blocks, capped at N-1) of anything
  computed by then ("every prefix already computed counts"); ratio = hit rate / theoretical;
- first-reuse bound: the theoretical minus hits that no policy can have, because the boundary had never been a
  branch point (two computed sequences diverging) nor an end (of a prompt or a request) before;
- us per scheduled request per step: wall (and CPU) time of schedule() + update_from_output() + finish() over the
  run / (request, step) pairs, median of --repeats runs (the fake model's sampled tokens and the bookkeeping for the
  theoretical are outside the timing; `vllm_cache_baseline.py` times the same scope of vLLM's scheduler);
- no_reuse: attention blocks the running requests can hold / floor((budget - max_num_seqs * state bytes) / block
  bytes), the one-state-per-running-request optimum.

    python benchmarks/cache_manager.py --out docs/results/cache_manager.json
    python benchmarks/cache_manager.py --scale 0.2 --repeats 1 --workloads current   # a quick look
    python benchmarks/cache_manager.py --policies ours --repeats 1 --workloads current --scale 0.3 --budget-gib 4 \
        --max-num-seqs 32 --max-num-batched-tokens 4096   # a small arena
    python benchmarks/cache_manager.py --policies ours --repeats 1 --digest   # + `decision_digest` per workload:
        # sha256 over every step's scheduler output; equal digests = identical decisions (compare two commits)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridpd.engine.cache.admission import Admission, CachePolicy  # noqa: E402
from hybridpd.engine.cache.coordinator import HybridCacheManager  # noqa: E402
from hybridpd.engine.cache.hashing import append_block_hashes  # noqa: E402
from hybridpd.engine.cache.planner import plan_capacity  # noqa: E402
from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec  # noqa: E402
from hybridpd.engine.cache.tree import CacheTree  # noqa: E402
from hybridpd.engine.config import SchedulerConfig  # noqa: E402
from hybridpd.engine.request import Request  # noqa: E402
from hybridpd.engine.sampling_params import SamplingParams  # noqa: E402
from hybridpd.engine.scheduler import Scheduler  # noqa: E402

from benchmarks.cache_policies import LruTree, fixed_interval  # noqa: E402

VOCAB = 150_000
BS = 16
GiB = 2**30
GROUPS = [
    CacheGroup(0, FullAttentionSpec(BS, 8, 128, "bfloat16"), (3, 7, 11, 15)),
    CacheGroup(
        1,
        RecurrentStateSpec("mamba2", (10240, 3), "bfloat16", (64, 64, 128), "float32"),
        tuple(i for i in range(16) if i % 4 != 3),
    ),
]
BLOCK_BYTES = GROUPS[0].page_bytes_all_layers
STATE_BYTES = GROUPS[1].page_bytes_all_layers
POLICIES = ("ours", "lru", "fixed")


def model_bytes(groups: list[CacheGroup]) -> tuple[int, int, int]:
    """(block size, bytes of one block in every attention group, bytes of one state in every recurrent group)."""
    attn = [g for g in groups if g.is_attention]
    rec = sum(g.page_bytes_all_layers for g in groups if not g.is_attention)
    return attn[0].spec.block_size, sum(g.page_bytes_all_layers for g in attn), rec  # type: ignore[union-attr]


@dataclass
class Item:
    """One request of a workload: its prompt, output length, and (closed loop) the request it waits for."""

    prompt: list[int]
    max_tokens: int
    after: int | None = None
    """Index of the request whose finish makes this one arrive (None: queued at the start)."""


@dataclass
class Workload:
    name: str
    items: list[Item]
    budget_gib: float
    notes: str = ""
    measured_from: int = 0
    """Index of the first request the phase figures (`phase_ratio`) count (0: the whole workload)."""
    measured: list[int] | None = None
    """Indices of the requests the phase figures count, when they are not one tail (`measured_from`)."""
    groups: list[CacheGroup] = field(default_factory=lambda: GROUPS)
    """The model's cache groups (attention first; its block size is the hashing block)."""
    max_num_seqs: int | None = None
    """This workload's max_num_seqs (None: --max-num-seqs)."""


# -- token streams -------------------------------------------------------------------------------------------------
def fake_token(num_tokens: int, request_index: int) -> int:
    """The token sampled when a request holds `num_tokens` tokens (a fixed function: policies see equal streams)."""
    return (num_tokens * 2_654_435_761 + request_index * 40_503) % VOCAB


def answer(prompt_len: int, request_index: int, n: int) -> list[int]:
    return [fake_token(prompt_len + k, request_index) for k in range(n)]


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# -- workloads -----------------------------------------------------------------------------------------------------
def current(rng: random.Random, scale: float) -> Workload:
    prefixes = [toks(rng, 2000) for _ in range(30)]
    n = int(3000 * scale)
    items = [Item(prefixes[i % 30] + toks(rng, 500), 100) for i in range(n)]
    rng.shuffle(items)
    return Workload("current", items, 10.0, "30 x 2,000-token prefixes + unique 500, 100 decode, all queued")


def system_prompt(rng: random.Random, scale: float) -> Workload:
    system = toks(rng, 1000)
    items = [Item(system + toks(rng, rng.randint(20, 400)), rng.randint(50, 150)) for _ in range(int(2000 * scale))]
    return Workload("system_prompt", items, 4.0, "1,000-token system prompt + unique 20-400, 50-150 decode")


def few_shot(rng: random.Random, scale: float) -> Workload:
    shots = [toks(rng, 3000) for _ in range(8)]
    items = [Item(rng.choice(shots) + toks(rng, rng.randint(50, 150)), 30) for _ in range(int(2000 * scale))]
    return Workload("few_shot", items, 6.0, "8 x 3,000-token few-shot prefixes + unique 50-150, 30 decode")


def chains(
    rng: random.Random,
    starts: list[list[int]],
    steps: int,
    extra: object,
    out_len: tuple[int, int],
    first_index: int = 0,
) -> list[Item]:
    """Closed-loop sessions: step t+1's prompt = step t's prompt + its answer + extra(rng); it arrives when step t
    finished. Sessions interleave (indices are assigned in a shuffled start order). `first_index`: the workload
    index of the first item (answers are a function of it; `after` holds workload indices)."""
    items: list[Item] = []
    for start in starts:
        prompt, prev = start, None
        for _ in range(steps):
            i = first_index + len(items)
            n_out = rng.randint(*out_len)
            items.append(Item(prompt, n_out, prev))
            prompt = prompt + answer(len(prompt), i, n_out) + extra(rng)  # type: ignore[operator]
            prev = i
    return items


def multi_turn(rng: random.Random, scale: float) -> Workload:
    starts = [toks(rng, rng.randint(100, 600)) for _ in range(int(160 * scale))]
    items = chains(rng, starts, 6, lambda r: toks(r, r.randint(50, 300)), (50, 250))
    return Workload("multi_turn", items, 18.0, "6-turn chats: previous prompt + answer + user 50-300; answers 50-250")


def multi_turn_tight(rng: random.Random, scale: float) -> Workload:
    w = multi_turn(rng, scale)
    return Workload("multi_turn_tight", w.items, 12.0, "multi_turn at 12 GiB: less than its working set (stress)")


def agentic(rng: random.Random, scale: float) -> Workload:
    system, docs = toks(rng, 800), [toks(rng, 2000) for _ in range(4)]
    starts = [system + rng.choice(docs) + toks(rng, 100) for _ in range(int(100 * scale))]
    items = chains(rng, starts, 5, lambda r: toks(r, 300), (30, 100))
    return Workload(
        "agentic",
        items,
        14.0,
        "system 800 + 1 of 4 shared 2,000-token tool outputs + task; "
        "5 steps each appending answer + 300-token tool result",
    )


def no_reuse(rng: random.Random, scale: float) -> Workload:
    items = [Item(toks(rng, rng.randint(500, 3000)), 50) for _ in range(int(800 * scale))]
    return Workload("no_reuse", items, 20.0, "unique 500-3,000-token prompts, 50 decode (the issue's 20 GiB)")


def chat_after_shared(rng: random.Random, scale: float) -> Workload:
    """A workload shift: a shared-prefix phase (few-shot prefixes, hits on their checkpoints) and then, in the same
    cache, multi-turn chats; the phase figures count the chats only (alone, multi_turn reaches 1.00)."""
    shots = [toks(rng, 3000) for _ in range(8)]
    first = [Item(rng.choice(shots) + toks(rng, rng.randint(50, 150)), 30) for _ in range(int(1000 * scale))]
    starts = [toks(rng, rng.randint(100, 600)) for _ in range(int(160 * scale))]
    n = len(first)
    chats = chains(rng, starts, 6, lambda r: toks(r, r.randint(50, 300)), (50, 250), first_index=n)
    tail = list(range(max(0, n - 64), n))  # a chat starts when one of the phase's last requests finished
    for it in chats:
        if it.after is None:
            it.after = tail[rng.randrange(len(tail))]
    return Workload(
        "chat_after_shared",
        first + chats,
        18.0,
        "1,000 few_shot requests, then multi_turn's 160 chats in the same cache (phase figures: the chats)",
        measured_from=n,
    )


def prefix_shift(rng: random.Random, scale: float) -> Workload:
    """A workload shift: `current`'s shape with 30 prefixes, then the same with 30 new ones in the same cache (the
    phase figures count the second half): the first prefixes' popularity must age out."""
    old, new = ([toks(rng, 2000) for _ in range(30)] for _ in range(2))
    n = int(1500 * scale)
    first = [Item(old[i % 30] + toks(rng, 500), 100) for i in range(n)]
    second = [Item(new[i % 30] + toks(rng, 500), 100) for i in range(n)]
    rng.shuffle(first)
    rng.shuffle(second)
    for it in second:
        it.after = n - 1 - rng.randrange(min(64, n))
    return Workload(
        "prefix_shift",
        first + second,
        10.0,
        "current's shape, then 30 new prefixes in the same cache (phase figures: the second half)",
        measured_from=n,
    )


WORKLOADS = {
    f.__name__: f
    for f in (
        current,
        system_prompt,
        few_shot,
        multi_turn,
        multi_turn_tight,
        agentic,
        no_reuse,
        chat_after_shared,
        prefix_shift,
    )
}


# -- the run -------------------------------------------------------------------------------------------------------
@dataclass
class Theoretical:
    """Infinite-cache bookkeeping over computed content (block hashes), outside the timed region."""

    computed: set[bytes] = field(default_factory=set)
    kids: dict[bytes, int] = field(default_factory=dict)
    ends: set[bytes] = field(default_factory=set)
    hits: int = 0
    reachable: int = 0
    per_request: dict[str, tuple[int, int]] = field(default_factory=dict)
    """request id -> (theoretical hit tokens, first-reuse bound tokens)."""
    bs: int = BS

    def admit(self, req: Request) -> None:
        BS = self.bs
        cap = (req.num_prompt_tokens - 1) // BS
        hashes, n, best = req.block_hashes, 0, 0
        while n < min(cap, len(hashes)) and hashes[n] in self.computed:
            n += 1
            if hashes[n - 1] in self.ends or self.kids.get(hashes[n - 1], 0) >= 2:
                best = n
        self.hits += n * BS
        self.reachable += best * BS
        self.per_request[req.request_id] = (n * BS, best * BS)

    def computed_upto(self, req: Request) -> None:
        BS = self.bs
        hashes = req.block_hashes[: req.num_computed_tokens // BS]
        parent = None
        for h in hashes:
            if h not in self.computed:
                self.computed.add(h)
                if parent is not None:
                    self.kids[parent] = self.kids.get(parent, 0) + 1
            parent = h
        if req.num_computed_tokens >= req.num_prompt_tokens:
            for b in (req.num_prompt_tokens // BS, (req.num_prompt_tokens - 1) // BS):
                if b:
                    self.ends.add(req.block_hashes[b - 1])

    def finished(self, req: Request) -> None:
        b = req.num_computed_tokens // self.bs
        if b:
            self.ends.add(req.block_hashes[b - 1])


def make_cache(policy: str, budget: int, max_num_seqs: int, groups: list[CacheGroup] = GROUPS) -> HybridCacheManager:
    """The engine's plan (one arena: blocks and checkpoints share its pages, planner.py) under `policy`."""
    BS = model_bytes(groups)[0]  # noqa: N806
    tree = CacheTree if policy == "ours" else LruTree
    cp, adm = fixed_interval(528) if policy == "fixed" else (CachePolicy(), Admission)
    plan = plan_capacity(groups, budget, max_num_seqs, None, 1 << 16, cp.interval or BS, policy=cp)
    return HybridCacheManager(groups, plan.layout(), tree_cls=tree, admission_cls=adm)


def run(w: Workload, policy: str, args: argparse.Namespace) -> dict[str, object]:
    budget = int(w.budget_gib * GiB)
    seqs = w.max_num_seqs or args.max_num_seqs
    cache = make_cache(policy, budget, seqs, w.groups)
    sched = Scheduler(SchedulerConfig(seqs, args.max_num_batched_tokens), cache)
    reqs = [
        Request(f"r{i}", list(it.prompt), SamplingParams(max_tokens=it.max_tokens), arrival_index=i)
        for i, it in enumerate(w.items)
    ]
    index = {r.request_id: i for i, r in enumerate(reqs)}
    waiters: dict[int, list[int]] = {}
    for i, it in enumerate(w.items):
        if it.after is None:
            sched.add_request(reqs[i])
        else:
            waiters.setdefault(it.after, []).append(i)
    theo, admitted = Theoretical(bs=model_bytes(w.groups)[0]), set()
    digest = hashlib.sha256() if getattr(args, "digest", False) else None
    steps = scheduled = 0
    timed = cpu = 0.0
    while sched.num_unfinished:
        t0, c0 = time.perf_counter(), time.process_time()
        out = sched.schedule()
        timed -= t0 - time.perf_counter()
        cpu -= c0 - time.process_time()
        sampled = {
            s.request_id: (
                fake_token(
                    sched.requests[s.request_id].num_tokens,  # the fake model: untimed
                    index[s.request_id],
                ),
                0.0,
            )
            for s in out.seqs
            if s.sample
        }
        t0, c0 = time.perf_counter(), time.process_time()
        advanced = sched.update_from_output(out, sampled)
        done = [r for r in advanced if len(r.output_token_ids) >= r.sampling_params.max_tokens]
        for r in done:
            sched.finish(r, "length")
        timed += time.perf_counter() - t0
        cpu += time.process_time() - c0
        cache.events.drain_from()  # what a subscribed worker's event stream does, off the step thread: untimed
        if digest is not None:  # every decision: block tables, slots, checkpoints, restores, fresh blocks, hits
            digest.update(repr(out).encode())
        for s in out.seqs:  # bookkeeping for the theoretical, untimed
            if s.request_id not in admitted:
                admitted.add(s.request_id)
                theo.admit(reqs[index[s.request_id]])
        for r in advanced:
            theo.computed_upto(r)
        for r in done:
            theo.finished(r)
            for j in waiters.pop(index[r.request_id], []):
                sched.add_request(reqs[j])
        steps += 1
        scheduled += len(out.seqs)
    cache.check_integrity()
    prompt_tokens = sum(r.num_prompt_tokens for r in reqs)
    hit_tokens = sum(max(r.num_cached_tokens, 0) for r in reqs)
    out_ = {
        "policy": policy,
        "budget_bytes": budget,
        "steps": steps,
        "scheduled_seqs": scheduled,
        "us_per_seq_step": timed / max(scheduled, 1) * 1e6,
        "cpu_us_per_seq_step": cpu / max(scheduled, 1) * 1e6,
        "prompt_tokens": prompt_tokens,
        "hit_rate": hit_tokens / prompt_tokens,
        "theoretical": theo.hits / prompt_tokens,
        "first_reuse_bound": theo.reachable / prompt_tokens,
        "preemptions": sched.num_preemptions,
        "evictions": {f"group{g.group_id}:{g.kind}": cache.tree.num_evictions[not g.is_attention]
                      for g in cache.groups},
        "checkpoints_admitted": cache.num_admitted,
    }
    out_["ratio"] = out_["hit_rate"] / out_["theoretical"] if out_["theoretical"] else 1.0  # type: ignore[operator]
    bound = out_["first_reuse_bound"]
    out_["ratio_to_bound"] = out_["hit_rate"] / bound if bound else 1.0  # type: ignore[operator]
    if w.measured is not None:
        out_["phase"] = phase_figures([reqs[i] for i in w.measured], theo)
    elif w.measured_from:
        out_["phase"] = phase_figures(reqs[w.measured_from :], theo)
    if digest is not None:
        out_["decision_digest"] = digest.hexdigest()
    return out_


def phase_figures(reqs: list[Request], theo: Theoretical) -> dict[str, float]:
    """Hit rate, theoretical and first-reuse bound of `reqs` alone, and ratio = hit rate / first-reuse bound."""
    prompt = sum(r.num_prompt_tokens for r in reqs)
    hits = sum(max(r.num_cached_tokens, 0) for r in reqs)
    bound = sum(theo.per_request[r.request_id][1] for r in reqs)
    theoretical = sum(theo.per_request[r.request_id][0] for r in reqs)
    return {
        "hit_rate": hits / prompt,
        "theoretical": theoretical / prompt,
        "first_reuse_bound": bound / prompt,
        "ratio_to_bound": hits / bound if bound else 1.0,
    }


def capacity(policy: str, budget: int, max_num_seqs: int, junk: Workload, args: argparse.Namespace) -> dict[str, float]:
    """Attention blocks that max_num_seqs running requests can hold after a no-reuse run left the cache full of
    whatever its policy keeps: one long request grows until allocation fails, the others hold one block each."""
    cache = make_cache(policy, budget, max_num_seqs, junk.groups)
    sched = Scheduler(SchedulerConfig(max_num_seqs, args.max_num_batched_tokens), cache)
    BS, BLOCK_BYTES, STATE_BYTES = model_bytes(junk.groups)  # noqa: N806
    for i, it in enumerate(junk.items):
        sched.add_request(Request(f"j{i}", list(it.prompt), SamplingParams(max_tokens=it.max_tokens)))
    while sched.num_unfinished:
        out = sched.schedule()
        sampled = {s.request_id: (7, 0.0) for s in out.seqs if s.sample}
        for r in sched.update_from_output(out, sampled):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                sched.finish(r, "length")
    small = [Request(f"s{i}", [i + 1], SamplingParams(max_tokens=1)) for i in range(max_num_seqs - 1)]
    for r in small:
        assert cache.allocate(r, 1)
    big = Request("big", [1], SamplingParams(max_tokens=1))
    n = 0
    step = 1 << 20
    while step >= BS:  # largest token count the big request can hold
        if cache.allocate(big, n + step):
            n += step
        else:
            step //= 2
    held = sum(len(cache.seq_tables(r.request_id)[0][0][1]) for r in [*small, big])
    optimum = (budget - max_num_seqs * STATE_BYTES) // BLOCK_BYTES
    cache.check_integrity()
    return {"blocks_held": held, "optimum_blocks": optimum, "ratio": held / optimum}


def time_hashing(token_lists: list[list[int]], repeats: int = 3) -> float:
    n = sum(len(t) for t in token_lists)
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        for t in token_lists:
            append_block_hashes([], t[: len(t) // BS * BS], BS)
        best = min(best, time.process_time() - c0)
    return best / n * 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=None, help="comma-separated (default: all of the chosen set)")
    p.add_argument("--heldout", action="store_true", help="the held-out set (cache_heldout.py) instead")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-gib", type=float, default=None, help="every workload's budget (default: its own)")
    p.add_argument("--out", default="cache_manager.json")
    p.add_argument("--digest", action="store_true", help="sha256 over every step's scheduler output (untimed)")
    args = p.parse_args()
    workloads: dict[str, Callable[[random.Random, float], Workload]] = dict(WORKLOADS)
    if args.heldout:
        from benchmarks.cache_heldout import HELDOUT

        workloads = HELDOUT
    args.workloads = args.workloads or ",".join(workloads)
    policies = args.policies.split(",")
    results: dict[str, dict[str, object]] = {}
    print(
        f"block {BLOCK_BYTES / 2**10:.0f} KiB, state {STATE_BYTES / 2**20:.1f} MiB "
        f"(= {STATE_BYTES / BLOCK_BYTES * BS:.0f} tokens of KV)",
        flush=True,
    )
    for name in args.workloads.split(","):
        w = workloads[name](random.Random(args.seed), args.scale)
        if args.budget_gib is not None:
            w.budget_gib = args.budget_gib
        results[name] = {
            "notes": w.notes,
            "requests": len(w.items),
            "budget_gib": w.budget_gib,
            "model": [(g.kind, g.page_bytes_all_layers) for g in w.groups],
            "max_num_seqs": w.max_num_seqs or args.max_num_seqs,
        }
        for pol in policies:
            try:
                runs = [run(w, pol, args) for _ in range(args.repeats)]
            except ValueError as e:  # a budget too small for the running states
                results[name][pol] = {"policy": pol, "error": str(e)}
                print(f"{name:14s} {pol:6s} cannot start: {e}", flush=True)
                continue
            r = dict(runs[len(runs) // 2])
            r["us_per_seq_step"] = statistics.median(x["us_per_seq_step"] for x in runs)  # type: ignore[misc, type-var]
            r["us_per_seq_step_runs"] = [x["us_per_seq_step"] for x in runs]
            r["cpu_us_per_seq_step"] = statistics.median(x["cpu_us_per_seq_step"] for x in runs)  # type: ignore[misc, type-var]
            results[name][pol] = r
            print(
                f"{name:14s} {pol:6s} hit {r['hit_rate']:.4f} theo {r['theoretical']:.4f} "
                f"ratio {r['ratio']:.4f} bound {r['first_reuse_bound']:.4f} /bound {r['ratio_to_bound']:.4f} "
                f"us/seq-step {r['us_per_seq_step']:.2f} "
                f"evict {r['evictions']} ckpts {r['checkpoints_admitted']}",
                flush=True,
            )
            if "phase" in r:
                ph = r["phase"]
                print(
                    f"{'':14s} {pol:6s} phase: hit {ph['hit_rate']:.4f} bound {ph['first_reuse_bound']:.4f} "  # type: ignore[index]
                    f"ratio to bound {ph['ratio_to_bound']:.4f}",  # type: ignore[index]
                    flush=True,
                )
        if name.startswith("no_reuse"):
            for pol in policies:
                if "error" in results[name][pol]:  # type: ignore[operator]
                    continue
                c = capacity(pol, int(w.budget_gib * GiB), args.max_num_seqs, w, args)
                results[name][pol]["capacity"] = c  # type: ignore[index]
                print(
                    f"{name:14s} {pol:6s} capacity {c['blocks_held']}/{c['optimum_blocks']} = {c['ratio']:.4f}",
                    flush=True,
                )
    lists = [it.prompt for it in WORKLOADS["current"](random.Random(args.seed), min(args.scale, 0.3)).items]
    report = {
        "benchmark": "cache_manager",
        "args": vars(args),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "block_bytes": BLOCK_BYTES,
        "state_bytes": STATE_BYTES,
        "cpu_ns_per_hashed_token": time_hashing(lists),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"hashing {report['cpu_ns_per_hashed_token']:.1f} ns/token (cpu); wrote {args.out}")


if __name__ == "__main__":
    main()
