"""vLLM's sampling extras in the batched sampler and the engine: `min_p` (after temperature, before top-k / top-p;
greedy rows ignore it) and `allowed_token_ids` (every other token masked, greedy rows included)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.sampler import Sampler

CPU = torch.device("cpu")


def vllm_min_p_keeps(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """vLLM's MinPLogitsProcessor rule, written out: kept = softmax(x / T) >= min_p x its max."""
    probs = torch.softmax(logits / temperature, dim=-1)
    return probs >= min_p * probs.amax(dim=-1, keepdim=True)


def test_min_p_masks_exactly_vllms_set() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    temps, mins = [0.7, 1.0, 1.3, 0.5, 2.0, 1.0], [0.0, 0.05, 0.2, 0.5, 0.9, 1.0]
    scaled = logits / torch.tensor(temps).unsqueeze(1)
    out = Sampler(CPU)._min_p(scaled, mins)
    for i in range(6):
        keeps = vllm_min_p_keeps(logits[i], temps[i], mins[i])
        assert torch.equal(torch.isfinite(out[i]), keeps), i
        assert torch.equal(out[i][keeps], scaled[i][keeps])
    assert int(torch.isfinite(out[5]).sum()) == 1  # min_p 1: the top token only


def test_min_p_applies_before_top_p_and_never_to_greedy_rows() -> None:
    """probs [.4, .3, .2, .1], min_p .3 drops token 3; renormalised, top_p .75 then drops token 2. (top_p first
    would keep tokens 0-2.) A greedy row with min_p 1 still takes the argmax of the raw logits."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().repeat(2000, 1)
    logits[-1] = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    sampled = SamplingParams(temperature=1.0, min_p=0.3, top_p=0.75)
    params = [sampled] * 1999 + [SamplingParams(temperature=0.0, min_p=1.0)]
    tokens, _ = Sampler(CPU, seed=1).sample(logits, [f"r{i}" for i in range(2000)], params)
    assert set(tokens[:-1]) == {0, 1} and tokens[-1] == 3


def test_allowed_token_ids_restrict_greedy_and_random_rows_and_skip_the_fast_path() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 40, generator=g)
    logits[:, 0] = 50.0  # every row's argmax is token 0, which no row with a list allows
    allowed = (5, 9, 17)
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=[5, 9, 17])
    plain = SamplingParams(temperature=0.0)
    rids = [f"r{i}" for i in range(8)]
    tokens, logprobs = Sampler(CPU).sample(logits, rids, [greedy, plain] * 4)  # all greedy: no fast path
    lsm = torch.log_softmax(logits, dim=-1)
    for i in range(0, 8, 2):
        assert tokens[i] == allowed[int(torch.argmax(logits[i, list(allowed)]))]
        assert logprobs[i] == pytest.approx(float(lsm[i, tokens[i]]))  # raw model logprob, as vLLM reports
        assert tokens[i + 1] == 0
    many = torch.randn(3000, 40, generator=g)
    random_rows = [SamplingParams(temperature=1.5, allowed_token_ids=allowed, seed=i % 7) for i in range(3000)]
    drawn, _ = Sampler(CPU).sample(many, [f"s{i}" for i in range(3000)], random_rows)
    assert set(drawn) == set(allowed)


def test_new_fields_validated() -> None:
    cases: list[dict[str, Any]] = [
        dict(min_p=-0.1),
        dict(min_p=1.5),
        dict(min_p="0.1"),
        dict(allowed_token_ids=[]),
        dict(allowed_token_ids=[-1]),
        dict(allowed_token_ids=[1.5]),
        dict(allowed_token_ids="ab"),
    ]
    for bad in cases:
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    assert SamplingParams(allowed_token_ids=[3, 4]).allowed_token_ids == (3, 4)


def test_llm_generate_honours_allowed_token_ids_min_p_and_bad_words(checkpoint_dir):  # type: ignore[no-untyped-def]
    llm = LLM(model=checkpoint_dir("nemotron_attn_mid"), kv_cache_memory_bytes=16 * 2**20, max_model_len=256)
    prompt = [[65, 66, 67]]
    free = llm.generate(
        prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    allowed = [70, 71, 72]
    assert not set(free.token_ids) <= set(allowed)
    for temperature in (0.0, 1.0):
        out = llm.generate(
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(
                max_tokens=6, temperature=temperature, seed=4, ignore_eos=True, allowed_token_ids=allowed
            ),
        )[0]
        assert len(out.token_ids) == 6 and set(out.token_ids) <= set(allowed), temperature
    top = llm.generate(
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True, min_p=1.0),
    )[0]
    assert top.token_ids == free.token_ids  # min_p 1 keeps the top token only: the greedy output
    # bad_words: the engine tokenizes them; the greedy output never holds a banned sequence and differs from `free`
    tok = llm.engine.tokenizer
    assert tok is not None
    word = next(w for w in map(tok.decode, ([i] for i in free.token_ids)) if w.strip() and len(tok.encode(w)) == 1)
    banned = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, bad_words=[word])
    seqs = banned.with_bad_words_token_ids(tok.encode).bad_words_token_ids
    out = llm.generate(prompt_token_ids=prompt, sampling_params=banned)[0].token_ids
    assert out != free.token_ids and len(out) == 6
    for seq in seqs:
        assert all(tuple(out[j : j + len(seq)]) != seq for j in range(len(out))), (seq, out)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids token id"):
        llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(allowed_token_ids=[llm.engine.vocab_size]))


class _History:
    def __init__(self, output: list[int]) -> None:
        self.prompt_token_ids = [1, 2, 3]
        self.output_token_ids = output


def test_bad_words_tokenized_as_vllm_does() -> None:
    """Each word left-stripped; then with a leading space only when that gives another first token and as many
    tokens; a word that tokenizes to nothing is refused."""
    vocab = {
        "foo": [10],
        " foo": [11],
        "bar baz": [1, 2],
        " bar baz": [3, 2],
        "qux": [4, 5],
        " qux": [6],
        "same": [7],
        " same": [7],
    }
    params = SamplingParams(bad_words=["  foo", "bar baz", "qux", "same", "foo"])
    assert params.bad_words == ("  foo", "bar baz", "qux", "same", "foo")
    got = params.with_bad_words_token_ids(lambda text: vocab[text]).bad_words_token_ids
    assert got == ((10,), (11,), (1, 2), (3, 2), (4, 5), (7,), (10,), (11,))
    with pytest.raises(InvalidRequestError, match="tokenizes to no token"):
        SamplingParams(bad_words=["x"]).with_bad_words_token_ids(lambda text: [])
    with pytest.raises(InvalidRequestError, match="too many bad words"):
        SamplingParams(bad_words=[f"w{i}" for i in range(65)]).with_bad_words_token_ids(lambda t: [len(t)])
    for bad in (["ok", ""], [3]):
        with pytest.raises(InvalidRequestError):
            SamplingParams(bad_words=bad)


def test_bad_words_ban_a_words_last_token_after_its_prefix() -> None:
    """vLLM's apply_bad_words: a one-token word always; (7, 8) after an output ending in 7; (1, 2, 3) after one ending
    in 1, 2 (not after 2 alone, nor when the output is shorter than the prefix). Greedy rows too."""
    words = SamplingParams(temperature=0.0, bad_words=["a", "b c", "d e f"]).with_bad_words_token_ids(
        {"a": [5], " a": [15], "b c": [7, 8], " b c": [7, 9], "d e f": [1, 2, 3], " d e f": [1, 2]}.__getitem__
    )
    assert words.bad_words_token_ids == ((5,), (15,), (7, 8), (1, 2, 3))
    outputs = {"r0": [], "r1": [4, 7], "r2": [9, 1, 2], "r3": [2], "r4": [7, 1]}
    sampler = Sampler(CPU)
    sampler.bind(lambda rid: _History(outputs[rid]), eos_token_ids=())
    assert sampler._bad_words_masks(list(outputs), [words] * 5) == (
        [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4],
        [5, 15, 5, 15, 8, 5, 15, 3, 5, 15, 5, 15],
    )
    logits = torch.zeros(5, 20)
    logits[:, [5, 15, 8, 3]] = torch.tensor([9.0, 8.0, 7.0, 6.0])
    tokens, _ = sampler.sample(logits, list(outputs), [words] * 5)  # all greedy: not the fast path
    assert tokens == [8, 3, 8, 8, 8]
