"""Held-out workloads for `cache_manager.py --heldout`: shapes the nine tuning workloads do not have, to check that
the eviction and admission policy holds off them (bar: hit rate >= 0.95 of the first-reuse bound, on the whole
workload and on its measured phase).

  chat_shared_chat     chats, then a few-shot shared-prefix phase, then new chats (phase: the last chats)
  agentic_after_shots  a few-shot phase, then agent loops (phase: the loops)
  flood_chat           long multi-turn chats; between two turns of a chat a run of short unrelated prompts, and
                       background streams of them throughout (phase: the chat turns)
  hot_prefix_rotation  one hot prefix (70 % of traffic) + 10 cold ones; then the hot one stops and a new hot one
                       takes over, twice (phase: the second and third periods)
  doc_qa_bursts        bursts of questions over one of 6 long documents (6-12k tokens); documents come back
  tenants              5 tenants with their own system prompts (Zipf traffic), 3-turn sessions, interleaved
  returning_prefix     a hot prefix, then another, then the first again (phase: the second and third periods)
  many_tenants         40 system prompts (Zipf traffic) + unique questions
  *_small / *_large    the same at a small budget and 32 sequences / at a large budget
  *_b64                attention block (hashing block) 64 tokens
  *_2rec               two recurrent groups (Mamba-2 and Gated-DeltaNet layers) besides attention
  no_reuse_*           capacity with no reuse on those models (bar: >= 0.99 of the optimum)

    python benchmarks/cache_manager.py --heldout --policies ours --repeats 1 --out docs/results/cache_heldout.json
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec

from benchmarks.cache_manager import GROUPS, Item, Workload, answer, chains, few_shot, no_reuse, toks

MAMBA = RecurrentStateSpec("mamba2", (10240, 3), "bfloat16", (64, 64, 128), "float32")
GDN = RecurrentStateSpec("gated_deltanet", (8192, 3), "bfloat16", (32, 128, 128), "float32")


def attention(block_size: int) -> CacheGroup:
    return CacheGroup(0, FullAttentionSpec(block_size, 8, 128, "bfloat16"), (3, 7, 11, 15))


MODELS: dict[str, list[CacheGroup]] = {
    "b16": GROUPS,
    "b64": [attention(64), CacheGroup(1, MAMBA, GROUPS[1].layer_ids)],
    "2rec": [attention(16), CacheGroup(1, MAMBA, (0, 2, 4, 8, 10, 12)), CacheGroup(2, GDN, (1, 5, 6, 9, 13, 14))],
    "2rec_b64": [attention(64), CacheGroup(1, MAMBA, (0, 2, 4, 8, 10, 12)), CacheGroup(2, GDN, (1, 5, 6, 9, 13, 14))],
}


def _after_phase(items: list[Item], first: int, end: int, rng: random.Random) -> None:
    """Requests of a new phase that wait for nothing start when one of the previous phase's last 64 finished."""
    for it in items:
        if it.after is None:
            it.after = rng.randrange(max(first, end - 64), end)


def _chats(rng: random.Random, n: int, first_index: int, turns: int = 6) -> list[Item]:
    starts = [toks(rng, rng.randint(100, 600)) for _ in range(n)]
    return chains(rng, starts, turns, lambda r: toks(r, r.randint(50, 300)), (50, 250), first_index)


def chat_shared_chat(rng: random.Random, scale: float) -> Workload:
    first = _chats(rng, int(80 * scale), 0)
    shots = few_shot(rng, scale * 0.4).items
    _after_phase(shots, 0, len(first), rng)
    n = len(first) + len(shots)
    last = _chats(rng, int(80 * scale), n)
    _after_phase(last, len(first), n, rng)
    return Workload("chat_shared_chat", first + shots + last, 18.0, "chats, few-shot, chats", measured_from=n)


def agentic_after_shots(rng: random.Random, scale: float) -> Workload:
    shots = few_shot(rng, scale * 0.5).items
    n = len(shots)
    system, docs = toks(rng, 800), [toks(rng, 2000) for _ in range(4)]
    starts = [system + rng.choice(docs) + toks(rng, 100) for _ in range(int(100 * scale))]
    loops = chains(rng, starts, 5, lambda r: toks(r, 300), (30, 100), n)
    _after_phase(loops, 0, n, rng)
    return Workload("agentic_after_shots", shots + loops, 14.0, "few-shot, then agent loops", measured_from=n)


def flood_chat(rng: random.Random, scale: float) -> Workload:
    """Each chat turn is followed by a run of 4 short unrelated prompts before the chat's next turn; 40 streams
    of such prompts run throughout."""
    items: list[Item] = []
    measured: list[int] = []

    def flood(after: int | None, n: int) -> int | None:
        for _ in range(n):
            items.append(Item(toks(rng, rng.randint(100, 600)), rng.randint(10, 50), after))
            after = len(items) - 1
        return after

    for _ in range(40):
        flood(None, int(25 * scale))
    for _ in range(int(24 * scale)):
        prompt, prev = toks(rng, rng.randint(2000, 4000)), None
        for _ in range(8):
            i, n_out = len(items), rng.randint(100, 300)
            items.append(Item(prompt, n_out, prev))
            measured.append(i)
            prompt = prompt + answer(len(prompt), i, n_out) + toks(rng, rng.randint(100, 400))
            prev = flood(i, 4)
    return Workload(
        "flood_chat", items, 8.0, "long chats with short unrelated prompts between turns", measured=measured
    )


def hot_prefix_rotation(rng: random.Random, scale: float) -> Workload:
    items: list[Item] = []
    n = int(800 * scale)
    for period in range(3):
        hot, cold = toks(rng, 3000), [toks(rng, 1500) for _ in range(10)]
        batch = [
            Item((hot if rng.random() < 0.7 else rng.choice(cold)) + toks(rng, rng.randint(200, 500)), 50)
            for _ in range(n)
        ]
        if period:
            _after_phase(batch, len(items) - n, len(items), rng)
        items += batch
    return Workload("hot_prefix_rotation", items, 6.0, "a hot prefix that stops, twice", measured_from=n)


def doc_qa_bursts(rng: random.Random, scale: float) -> Workload:
    docs = [toks(rng, rng.randint(6000, 12000)) for _ in range(6)]
    order = [0, 1, 2, 0, 3, 4, 1, 5, 2, 0, 3, 5]
    items: list[Item] = []
    per = int(60 * scale)
    for b, d in enumerate(order):
        burst = [Item(docs[d] + toks(rng, rng.randint(30, 120)), rng.randint(50, 200)) for _ in range(per)]
        if b:
            _after_phase(burst, len(items) - per, len(items), rng)
        items += burst
    return Workload("doc_qa_bursts", items, 4.0, "bursts of questions over 6 long documents that come back")


def tenants(rng: random.Random, scale: float) -> Workload:
    systems = [toks(rng, rng.randint(800, 4000)) for _ in range(5)]
    weights = [1 / (t + 1) for t in range(5)]
    starts = [rng.choices(systems, weights)[0] + toks(rng, rng.randint(50, 400)) for _ in range(int(150 * scale))]
    items = chains(rng, starts, 3, lambda r: toks(r, r.randint(50, 300)), (50, 250))  # tenants interleave
    return Workload("tenants", items, 10.0, "5 tenants' system prompts, 3-turn sessions")


def returning_prefix(rng: random.Random, scale: float) -> Workload:
    """Three periods of one hot prefix each (70 % of traffic) + cold ones: A, then B, then A again."""
    hot = [toks(rng, 3000), toks(rng, 3000)]
    cold = [toks(rng, 1500) for _ in range(10)]
    items: list[Item] = []
    n = int(800 * scale)
    for period, h in enumerate((0, 1, 0)):
        batch = [
            Item((hot[h] if rng.random() < 0.7 else rng.choice(cold)) + toks(rng, rng.randint(200, 500)), 50)
            for _ in range(n)
        ]
        if period:
            _after_phase(batch, len(items) - n, len(items), rng)
        items += batch
    return Workload("returning_prefix", items, 6.0, "a hot prefix, another, then the first again", measured_from=n)


def many_tenants(rng: random.Random, scale: float) -> Workload:
    systems = [toks(rng, rng.randint(500, 2000)) for _ in range(40)]
    weights = [1 / (t + 1) for t in range(40)]
    items = [
        Item(rng.choices(systems, weights)[0] + toks(rng, rng.randint(20, 300)), rng.randint(20, 150))
        for _ in range(int(2000 * scale))
    ]
    return Workload("many_tenants", items, 8.0, "40 system prompts (Zipf) + unique questions")


def variant(
    make: Callable[[random.Random, float], Workload],
    suffix: str,
    budget_gib: float | None = None,
    model: str = "b16",
    max_num_seqs: int | None = None,
) -> Callable[[random.Random, float], Workload]:
    def build(rng: random.Random, scale: float) -> Workload:
        w = make(rng, scale)
        w.name = f"{w.name}_{suffix}"
        w.groups = MODELS[model]
        w.budget_gib = budget_gib or w.budget_gib
        w.max_num_seqs = max_num_seqs
        return w

    build.__name__ = f"{make.__name__}_{suffix}"
    return build


SMALL = {  # budgets (32 sequences) near the least at which some layout tried reached >= 0.95
    "chat_shared_chat": 9.0,
    "agentic_after_shots": 7.0,
    "flood_chat": 6.0,
    "hot_prefix_rotation": 5.0,
    "doc_qa_bursts": 2.0,
    "tenants": 7.0,
    "returning_prefix": 5.0,
    "many_tenants": 6.0,
}
BASE = [
    chat_shared_chat,
    agentic_after_shots,
    flood_chat,
    hot_prefix_rotation,
    doc_qa_bursts,
    tenants,
    returning_prefix,
    many_tenants,
]
HELDOUT: dict[str, Callable[[random.Random, float], Workload]] = {f.__name__: f for f in BASE}
for _f in BASE:
    for _v in (
        variant(_f, "small", SMALL[_f.__name__], max_num_seqs=32),
        variant(_f, "large", 40.0),
        variant(_f, "b64", model="b64"),
        variant(_f, "2rec", model="2rec"),
        variant(_f, "2rec_b64", model="2rec_b64"),
    ):
        HELDOUT[_v.__name__] = _v
for _m in ("b64", "2rec", "2rec_b64"):  # capacity with no reuse (the figure is blocks held / the optimum)
    HELDOUT[f"no_reuse_{_m}"] = variant(no_reuse, _m, model=_m)
