"""Zeroing fresh KV blocks, end to end through the engine.

The real torch attention (`paged_attention`) gathers only valid positions, so garbage in the unused positions of a
block cannot reach it (test_poison.py proves that). The failure zeroing guards against needs a kernel that reads whole
blocks and masks by multiplying with zero, as FlashAttention-style kernels do: P = softmax(S masked to -inf) is 0
past the context, and P @ V computes 0 * V there, which is NaN when V is NaN. `whole_block_attention` below is
such a kernel, installed in place of `paged_attention` for these tests only. With NaN in every free attention block
before every step:
- zeroing on: outputs identical to transformers (fresh blocks are zeroed before first use);
- zeroing off: outputs are NaN (the test can fail, and does, without the zeroing);
- prefix hits are not zeroed (their contents survive: identical outputs, and the zeroer never sees their ids);
- the number of zeroed blocks equals the number of fresh (non-hit) blocks, computed from the prompt lengths;
- with zeroing off the fresh-id list is still drained every step (100,000 steps, the fresh-id leak).
One launch per step on the Triton path is covered by test_zero_blocks.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.models import nemotron_h, qwen3_5
from hybridpd.engine.models.reference import StepMetadata

from tests.oracle import random_prompts, reference_set
from tests.support.pool_views import free_pages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]
NEW_TOKENS = 16
FAMILIES = ["nemotron_attn_mid", "qwen_attn_first"]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK = 16

def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty



def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------------------------
# a FlashAttention-style kernel: whole blocks in, masking by multiplication


def whole_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: StepMetadata, scale: float
) -> torch.Tensor:
    """Same contract as `paged_attention`, but every position of every block in a sequence's table is loaded."""
    if meta.write_rows.numel() > 0:
        rows = meta.write_rows
        kv_cache[meta.write_blocks, 0, meta.write_offsets] = k[rows].to(kv_cache.dtype)
        kv_cache[meta.write_blocks, 1, meta.write_offsets] = v[rows].to(kv_cache.dtype)
    bs = kv_cache.shape[2]
    out = torch.zeros_like(q)
    for s in meta.attn_seqs:  # ctx_blocks[p] = block of position p, so every bs-th entry is the block table
        rows_ = slice(s.q_start, s.q_start + s.q_len)
        out[rows_] = _attend_whole_blocks(q[rows_], kv_cache, s.ctx_blocks[::bs], s.num_computed, scale)
    d = meta.attn_decode
    if d is not None:
        for i, tok in enumerate(d.tokens.tolist()):
            ctx = int(d.valid[i].sum())
            out[tok : tok + 1] = _attend_whole_blocks(q[tok : tok + 1], kv_cache, d.blocks[i, :ctx:bs], ctx - 1, scale)
    return out


def _attend_whole_blocks(
    q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, num_computed: int, scale: float
) -> torch.Tensor:
    n, heads, dim = q.shape
    key = kv_cache[table, 0].flatten(0, 1).float()  # [num_blocks * bs, KVH, D]: unused positions included
    val = kv_cache[table, 1].flatten(0, 1).float()
    kvh = key.shape[1]
    qg = q.float().view(n, kvh, heads // kvh, dim)
    scores = torch.einsum("nkgd,ckd->kgnc", qg, key) * scale
    kpos = torch.arange(key.shape[0], device=q.device)
    qpos = num_computed + torch.arange(n, device=q.device)
    probs = torch.softmax(scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf")), dim=-1)
    return torch.einsum("kgnc,ckd->nkgd", probs, val).reshape(n, heads, dim).to(q.dtype)  # 0 * V past the context


@pytest.fixture
def whole_blocks(monkeypatch):  # type: ignore[no-untyped-def]
    """Install `whole_block_attention` where the model families call `paged_attention`; counts calls."""
    calls = [0]

    def counted(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return whole_block_attention(*args)

    for family in (nemotron_h, qwen3_5):  # each family's reference attention calls the name it imported
        monkeypatch.setattr(family, "paged_attention", counted)
    return calls


# ----------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def reference(checkpoint_dir):  # type: ignore[no-untyped-def]
    return lambda name: reference_set(checkpoint_dir(name), tuple(LENGTHS), NEW_TOKENS)


def poison_free_blocks_every_step(engine) -> None:  # type: ignore[no-untyped-def]
    """Before every step: NaN into every free attention block without a hash (cached blocks are prefix content)."""
    step, cache = engine.step, engine.cache

    def poisoned_step():  # type: ignore[no-untyped-def]
        ids = sorted(free_pages(cache))
        for kv in engine.runner.attention_tensors:
            kv[torch.tensor(ids, dtype=torch.int64)] = float("nan")
        return step()

    engine.step = poisoned_step


def record_zeroed(runner) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Spy on `runner.zero_blocks`: one list of ids per call."""
    calls: list[list[int]] = []
    zero = runner.zero_blocks

    def spy(block_ids, group_id):  # type: ignore[no-untyped-def]
        calls.append(list(block_ids))
        return zero(block_ids, group_id)

    runner.zero_blocks = spy
    return calls


def matches(outputs, expected) -> bool:  # type: ignore[no-untyped-def]
    for out, (toks, lps) in zip(outputs, expected, strict=True):
        if out.token_ids != toks or any(not abs(a - b) < 1e-4 for a, b in zip(out.logprobs, lps, strict=True)):
            return False
    return True


def engine_llm(path: str, zeroing: str, prefix_caching: bool = False) -> LLM:
    return LLM(model=path, max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=prefix_caching,
               checkpoint_interval=32, num_checkpoint_slots=64, kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
               zero_fresh_blocks=zeroing)


# ----------------------------------------------------------------------------------------------------------------
# (a) + (d): multiply-masking kernel with NaN-poisoned free blocks


@pytest.mark.parametrize("name", FAMILIES)
def test_zeroing_auto_keeps_multiply_masking_exact(name, checkpoint_dir, reference, whole_blocks):  # type: ignore[no-untyped-def]
    """zero_fresh_blocks=auto is on for hybrid models; with it, outputs are exact, and exactly the fresh blocks
    (ceil((prompt + generated - 1) / 16) per request: the last sampled token is never computed) are zeroed."""
    prompts, expected = reference(name)
    llm = engine_llm(checkpoint_dir(name), "auto")
    assert llm.engine.runner.zero_fresh_blocks, "auto must turn zeroing on for a model with recurrent layers"
    poison_free_blocks_every_step(llm.engine)
    zeroed = record_zeroed(llm.engine.runner)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert whole_blocks[0] > 0, "the whole-block kernel was not called"
    assert matches(outs, expected), "zeroing on: outputs differ from transformers"
    fresh = sum(cdiv(len(p) + NEW_TOKENS - 1, BLOCK) for p in prompts)
    assert llm.engine.runner.num_zeroed_blocks == sum(len(c) for c in zeroed) == fresh
    assert all(len(set(c)) == len(c) for c in zeroed), "a block was listed twice in one step"


@pytest.mark.parametrize("name", FAMILIES)
def test_zeroing_off_leaks_nan_through_multiply_masking(name, checkpoint_dir, reference, whole_blocks):  # type: ignore[no-untyped-def]
    """The same run with zeroing off must fail: this is what makes the test above meaningful."""
    prompts, expected = reference(name)
    llm = engine_llm(checkpoint_dir(name), "off")
    poison_free_blocks_every_step(llm.engine)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert llm.engine.runner.num_zeroed_blocks == 0
    assert not matches(outs, expected), "zeroing off and NaN in fresh blocks, yet outputs match: nothing was tested"
    assert any(math.isnan(lp) for o in outs for lp in o.logprobs), "expected NaN logprobs from the poisoned blocks"


# ----------------------------------------------------------------------------------------------------------------
# (b) + (d): prefix hits are not zeroed


@pytest.mark.parametrize("name", FAMILIES)
def test_prefix_hits_are_not_zeroed(name, checkpoint_dir, reference, whole_blocks):  # type: ignore[no-untyped-def]
    """Second pass over the same prompts: hit blocks keep their contents (exact outputs with the whole-block
    kernel, which would read zeros if they were zeroed), the zeroer never sees a hit block's id, and the
    zeroed count is exactly the non-hit blocks."""
    prompts, expected = reference(name)
    llm = engine_llm(checkpoint_dir(name), "auto", prefix_caching=True)
    poison_free_blocks_every_step(llm.engine)
    assert matches(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY), expected)

    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    zeroed = record_zeroed(runner)
    hit_blocks: set[int] = set()
    schedule = scheduler.schedule

    def spy_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        for s in out.seqs:
            req = scheduler.requests[s.request_id]
            if s.num_computed_tokens == req.num_cached_tokens > 0:  # the step that admitted it with its hit
                hit_blocks.update(lead(s.group_block_ids)[: s.num_computed_tokens // BLOCK])
        return out

    scheduler.schedule = spy_schedule
    before = runner.num_zeroed_blocks
    second = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert matches(second, expected), "prefix hits did not keep their contents"
    hits = [o.num_cached_tokens for o in second]
    assert hits == [((len(p) - 1) // 16) * 16 for p in prompts]  # prompt-end checkpoints
    assert len(hit_blocks) == sum(hits) // BLOCK
    assert hit_blocks.isdisjoint(b for c in zeroed for b in c), "a prefix-hit block was zeroed"
    assert llm.engine.cache.tree.num_evictions[0] == 0  # so no hit block was reallocated (and zeroed)
    fresh = sum(cdiv(len(p) + NEW_TOKENS - 1, BLOCK) - h // BLOCK for p, h in zip(prompts, hits, strict=True))
    assert runner.num_zeroed_blocks - before == sum(len(c) for c in zeroed) == fresh


# ----------------------------------------------------------------------------------------------------------------
# (c): the fresh-id list is drained every step, zeroing off


STEPS = 100_000


def test_fresh_ids_drained_every_step_with_zeroing_off(checkpoint_dir):  # type: ignore[no-untyped-def]
    """100,000 engine steps with a fake model (the runner's execute returns made-up tokens but still calls the
    real, gated `zero_blocks`): requests keep arriving (shared prefixes: hits), finishing, being aborted and
    preempted in an 8-block pool. After every schedule the manager's pending list is empty and the step's fresh
    ids are bounded by what one step can allocate."""
    path = checkpoint_dir("nemotron_attn_mid")
    info = LLM(model=path, kv_cache_memory_bytes=64 * 2**20, max_model_len=128).kv_cache_info()
    max_seqs, budget = 3, 32
    # one arena: only the null, running and staging slots are reserved, k whole pages each
    state = (1 + max_seqs + STAGING_SLOTS) * info["blocks_per_checkpoint"] * info["bytes_per_block"]
    llm = LLM(model=path, kv_cache_memory_bytes=state + 9 * info["bytes_per_block"], max_num_seqs=max_seqs,
              max_num_batched_tokens=budget, checkpoint_interval=32, max_model_len=64, zero_fresh_blocks="off")
    engine = llm.engine
    cache, runner = engine.cache, engine.runner
    assert cache.pages.capacity == 8 and not runner.zero_fresh_blocks
    bound = budget // BLOCK + max_seqs  # a chunk of n new tokens needs at most n // 16 + 1 new blocks
    rng = random.Random(0)
    seen = [0, 0]  # total fresh ids, largest per step

    def fake_execute(out, params):  # type: ignore[no-untyped-def]
        assert not cache.fresh, "fresh block ids were not drained by the schedule"
        assert len(lead(out.group_fresh_blocks)) <= bound
        seen[0] += len(lead(out.group_fresh_blocks))
        seen[1] = max(seen[1], len(lead(out.group_fresh_blocks)))
        for gid, fresh in out.group_fresh_blocks:
            runner.zero_blocks(fresh, gid)  # the real gate: a no-op with zeroing off
        return {s.request_id: (3 + len(s.token_ids) % 200, -1.0) for s in out.seqs if s.sample}

    runner.execute = fake_execute
    prefixes = random_prompts([40, 24, 33], vocab=256, seed=2)
    for i in range(STEPS):
        while engine.scheduler.num_unfinished < max_seqs + 1:
            prompt = rng.choice(prefixes)[: rng.randint(1, 40)] + [rng.randrange(3, 256)]
            engine.add_request(f"r{i}-{engine.scheduler.num_unfinished}", prompt,
                               SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0, ignore_eos=True))
        if i % 97 == 0 and engine.scheduler.running:
            engine.abort(rng.choice(engine.scheduler.running).request_id)
        engine.step()
    assert engine.stats.num_steps == STEPS and runner.num_zeroed_blocks == 0
    assert not cache.fresh
    assert seen[0] > STEPS // 10 and seen[1] > 1, "too little allocation churn to mean anything"
    assert engine.scheduler.num_preemptions > 0 and cache.counters["attention"].hits > 0
    cache.check_integrity()


# ----------------------------------------------------------------------------------------------------------------
# (d): auto follows the model


def test_auto_is_off_without_recurrent_layers(tmp_path):  # type: ignore[no-untyped-def]
    """A pure-attention NemotronH ("*-*-"): auto leaves zeroing off (nothing zeroed), ids are still drained."""
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    path = write_random_checkpoint(str(tmp_path), "nemotron_h", seed=0, hybrid_override_pattern="*-*-")
    llm = LLM(model=path, kv_cache_memory_bytes=2**20, max_model_len=128, max_num_batched_tokens=16)
    assert not llm.engine.has_recurrent and not llm.engine.runner.zero_fresh_blocks
    llm.generate(prompt_token_ids=random_prompts([20, 50], vocab=256), sampling_params=GREEDY)
    assert llm.engine.runner.num_zeroed_blocks == 0 and not llm.engine.cache.fresh
