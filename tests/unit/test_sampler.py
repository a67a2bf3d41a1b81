"""The batched sampler against a per-row reference written the obvious way (vLLM semantics), plus the engine-level
parameters: min_tokens, include_stop_str_in_output, top_logprobs, logit_bias, penalties through `LLM.generate`."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.sampler import Sampler

V = 50


@dataclass
class Hist:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def reference_processed(logits: torch.Tensor, h: Hist, p: SamplingParams, eos: tuple[int, ...]) -> torch.Tensor:
    """One row, one token at a time: what vLLM does to the logits before sampling."""
    x = logits.clone()
    counts = [0] * V
    for t in h.output_token_ids:
        counts[t] += 1
    for t in range(V):
        if p.repetition_penalty != 1.0 and (counts[t] or t in h.prompt_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    for t, b in p.logit_bias or ():
        x[t] += b
    if len(h.output_token_ids) < p.min_tokens:
        for t in (*eos, *p.stop_token_ids):
            x[t] = float("-inf")
    return x


def make(rows: list[tuple[Hist, SamplingParams]], eos: tuple[int, ...] = (3,)) -> tuple[Sampler, list[str]]:
    hist = {f"r{i}": h for i, (h, _) in enumerate(rows)}
    s = Sampler(torch.device("cpu"), seed=0)
    s.bind(hist.get, eos)
    return s, list(hist)


def test_greedy_with_penalties_bias_and_min_tokens_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g) * 3
    rows = [
        (Hist([1, 2, 3]), SamplingParams(temperature=0)),
        (Hist([5, 6], [7, 7, 8]), SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.7)),
        (Hist([9, 10], [10, 11]), SamplingParams(temperature=0, repetition_penalty=1.8)),
        (Hist([4], [12]), SamplingParams(temperature=0, repetition_penalty=0.5, presence_penalty=-2.0)),
        (Hist([4], []), SamplingParams(temperature=0, logit_bias={17: 100.0, 2: -5.0})),
        (Hist([4], [1]), SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(int(logits[5].argmax()),))),
    ]
    s, rids = make(rows)
    tokens, lps = s.sample(logits, rids, [p for _, p in rows])
    want = [int(reference_processed(logits[i], h, p, (3,)).argmax()) for i, (h, p) in enumerate(rows)]
    assert tokens == want
    assert tokens[4] == 17 and tokens[5] != int(logits[5].argmax())
    raw = torch.log_softmax(logits, -1)
    # raw-distribution logprobs (x[t] - logsumexp(x): equal to log_softmax up to fp32 rounding order)
    assert lps == pytest.approx([float(raw[i, t]) for i, t in enumerate(tokens)], rel=1e-6, abs=1e-6)


def test_top_k_one_and_tiny_top_p_are_greedy_and_seeds_are_per_request() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    rows = [(Hist([1]), SamplingParams(temperature=0.8, top_k=1)),
            (Hist([1]), SamplingParams(temperature=1.3, top_p=1e-6)),
            (Hist([1]), SamplingParams(temperature=1.0, seed=7)),
            (Hist([1]), SamplingParams(temperature=1.0, seed=7, top_k=5, top_p=0.9))]
    s, rids = make(rows)
    tokens, _ = s.sample(logits, rids, [p for _, p in rows])
    assert tokens[:2] == [int(logits[0].argmax()), int(logits[1].argmax())]
    assert tokens[3] in torch.topk(logits[3], 5).indices.tolist()
    # A seeded row draws the same token whatever else is in the batch.
    s2, _ = make([rows[2]])
    alone, _ = s2.sample(logits[2:3], ["r0"], [rows[2][1]])
    assert alone[0] == tokens[2]


def test_sampling_distribution_follows_temperature_and_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)]).repeat(4000, 1)
    rows = [(Hist([1]), SamplingParams(temperature=0.5, top_k=3))] * 4000
    s = Sampler(torch.device("cpu"), seed=3)
    s.bind(lambda rid: None, ())
    tokens, _ = s.sample(logits, [f"r{i}" for i in range(4000)], [p for _, p in rows])
    freq = torch.bincount(torch.tensor(tokens), minlength=V)[:4].float() / 4000
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 0.5, -1)
    assert freq[3] == 0 and torch.allclose(freq[:3], want, atol=0.03)


def test_top_logprobs_are_the_raw_distribution_best_first() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    rows = [(Hist([1]), SamplingParams(temperature=0, top_logprobs=5)), (Hist([1]), SamplingParams(temperature=0)),
            (Hist([1]), SamplingParams(temperature=0, top_logprobs=20, presence_penalty=1.0))]
    s, rids = make(rows)
    s.sample(logits, rids, [p for _, p in rows])
    top = s.take_top_logprobs()
    raw = torch.log_softmax(logits, -1)
    assert set(top) == {"r0", "r2"} and len(top["r0"]) == 5 and len(top["r2"]) == 20
    v, i = torch.topk(raw[0], 5)
    assert [t for t, _ in top["r0"]] == i.tolist() and [lp for _, lp in top["r0"]] == pytest.approx(v.tolist())
    assert s.take_top_logprobs() == {}


@pytest.fixture(scope="module")
def llm(checkpoint_dir):  # type: ignore[no-untyped-def]
    return LLM(model=checkpoint_dir("nemotron_attn_mid"), kv_cache_memory_bytes=16 * 2**20, max_model_len=128)


def test_engine_min_tokens_stop_string_kept_and_top_logprobs(llm) -> None:  # type: ignore[no-untyped-def]
    prompt = [[65, 66, 67]]
    full = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, top_logprobs=3))[0]
    assert len(full.top_logprobs) == 12 and all(len(t) == 3 for t in full.top_logprobs)
    assert [t[0][0] for t in full.top_logprobs] == full.token_ids  # greedy: the best alternative is the choice
    assert [t[0][1] for t in full.top_logprobs] == pytest.approx(full.logprobs, abs=1e-5)
    stop = full.text[3:5]
    kept = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop" and kept.text == full.text[: full.text.find(stop) + len(stop)]
    first = full.token_ids[0]
    held = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, min_tokens=3, stop_token_ids=[first]))[0]
    assert held.token_ids[0] != first and len(held.token_ids) >= 3
    biased = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logit_bias={70: 100.0}))[0]
    assert biased.token_ids == [70, 70, 70, 70]
    rep = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logit_bias={70: 8.0}, frequency_penalty=2.0,
        presence_penalty=2.0))[0]
    assert rep.token_ids[0] == 70 and rep.token_ids.count(70) < 4  # the penalties push the biased token down
