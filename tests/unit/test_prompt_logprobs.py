"""Prompt logprobs (vLLM's `prompt_logprobs`): the engine against transformers (fp32, both families, a prefill cut
into 16-token chunks, prompts already in the prefix cache), the host bookkeeping, and the OpenAI surface against
FAKE workers (tests/support/fake_workers.py: the first output chunk scores prompt token i -0.01 * i, rank i, with
ids +1.. +k as alternatives): response shapes, echo with logprobs, chat echo, PD and colocated alike.
The same over real workers, PD against colocated: tests/unit/test_pd_differential.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.prompt_logprobs import PromptLogprobs, ScoredRows
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.oracle import hf_model, random_prompts
from tests.support.fake_workers import write_fake_tokenizer
from tests.support.live_stack import LiveStack

LENGTHS = [1, 2, 17, 45]
K = 3


@pytest.mark.parametrize(("name", "async_scheduling"), [("nemotron_attn_mid", False), ("qwen_attn_first", True)])
def test_engine_prompt_logprobs_match_transformers(name: str, async_scheduling: bool, checkpoint_dir: Any) -> None:
    """Chunks of 16 tokens (so a prompt is scored across chunks), the prompts cached by a first plain run: the
    scored run reads no prefix cache (a cached prefix has no logits) and every score is transformers' within 1e-4,
    ranks and top k in its order; the cache it leaves serves the next plain run. One family with asynchronous
    scheduling (the scores travel with the launched step)."""
    path = checkpoint_dir(name)
    llm = LLM(
        model=path,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        checkpoint_interval=16,
        max_model_len=128,
        kv_cache_memory_bytes=16 * 2**20,
        async_scheduling=async_scheduling,
    )
    prompts = random_prompts(LENGTHS, llm.engine.vocab_size, seed=11)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate(prompt_token_ids=prompts, sampling_params=plain)
    outs = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)
    )
    model = hf_model(path)
    for ids, out in zip(prompts, outs, strict=True):
        assert out.num_cached_tokens == 0, "a request scoring its prompt read the prefix cache"
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)
        for i in range(1, len(ids)):
            row, want, tid = out.prompt_logprobs[i], ref[i - 1], ids[i]
            assert row is not None and next(iter(row)) == tid
            assert abs(row[tid].logprob - want[tid].item()) < 1e-4
            assert row[tid].rank == int((want >= want[tid]).sum())
            top = want.topk(K)
            assert sorted((t for t in row if row[t].rank <= K), key=lambda t: row[t].rank) == top.indices.tolist()
            assert all(
                abs(row[t].logprob - v) < 1e-4 for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
            )
    again = llm.generate(prompt_token_ids=prompts, sampling_params=plain)
    assert again[-1].num_cached_tokens > 0  # the scored run still published its blocks
    llm.engine.cache.check_integrity()


def test_sampling_params_prompt_logprobs_range() -> None:
    for bad in (-2, -1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0


def test_scores_are_kept_once_per_position() -> None:
    """A chunk recomputed after a preemption adds nothing; a gap is refused."""

    def rows(start: int, n: int) -> ScoredRows:
        r = range(start, start + n)
        return ScoredRows(start, list(r), [-float(i) for i in r], [1] * n, [[i] for i in r], [[-float(i)] for i in r])

    scores = PromptLogprobs(k=1)
    scores.extend(rows(0, 3))
    scores.extend(rows(0, 5))  # recomputed from the start: positions 3, 4 are new
    assert scores.token_ids == [0, 1, 2, 3, 4] and scores.logprobs == [0.0, -1.0, -2.0, -3.0, -4.0]
    with pytest.raises(ValueError):
        scores.extend(rows(7, 1))
    dicts = scores.as_dicts(str)
    assert dicts[0] is None and len(dicts) == 6 and dicts[2] == {1: (-1.0, 1, "1")}


# -- the OpenAI surface, against fake workers ------------------------------------------------------------------------

MODEL = "tiny"


@pytest.fixture(scope="module", params=["pd", "colocated"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path_factory.mktemp("tok")))
    with LiveStack(n_prefill=1 if request.param == "pd" else 0, tokenizer=tok, model_name=MODEL, max_model_len=64) as s:
        yield s


def _events(text: str) -> list[dict[str, Any]]:
    blocks = [b[len("data: ") :] for b in text.split("\n\n") if b.strip()]
    assert blocks[-1] == "[DONE]"
    return [json.loads(b) for b in blocks[:-1]]


def test_completion_prompt_logprobs_field(stack: LiveStack) -> None:
    r = stack.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": [104, 105, 106], "max_tokens": 2, "prompt_logprobs": 2}
    )
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got == [None] + [
        {
            str(t): {"logprob": pytest.approx(-0.01 * i), "rank": i, "decoded_token": chr(t)},
            str(t + 1): {"logprob": -0.5, "rank": 1, "decoded_token": chr(t + 1)},
            str(t + 2): {"logprob": -1.5, "rank": 2, "decoded_token": chr(t + 2)},
        }
        for i, t in ((1, 105), (2, 106))
    ]
    plain = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 1})
    assert "prompt_logprobs" not in plain.json()["choices"][0]


def test_echo_with_logprobs_scores_the_prompt_tokens(stack: LiveStack) -> None:
    """vLLM: echo with logprobs asks for prompt logprobs (that many alternatives); the prompt's tokens lead the
    logprobs, the first with null, each other with the prompt token then its alternatives (logprobs + 1 in all);
    streamed, the first chunk of every choice carries them; n > 1 gives every choice its own."""
    body = {"model": MODEL, "prompt": "hij", "max_tokens": 2, "echo": True, "logprobs": 1, "n": 2}
    r = stack.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    sent = (
        stack.decode[0].generates[-1].sampling_params
        if not stack.prefill
        else stack.prefill[0].prefills[-1].sampling_params
    )
    assert sent.HasField("prompt_logprobs") and sent.prompt_logprobs == 1
    for c in r.json()["choices"]:
        lp = c["logprobs"]
        assert c["text"] == "hijji" and lp["tokens"][:3] == ["h", "i", "j"]
        assert lp["token_logprobs"][:3] == [None, pytest.approx(-0.01), pytest.approx(-0.02)]
        assert lp["top_logprobs"][:3] == [
            None,
            {"i": pytest.approx(-0.01), "j": -0.5},
            {"j": pytest.approx(-0.02), "k": -0.5},
        ]
        assert lp["text_offset"] == [0, 1, 2, 3, 4] and len(lp["tokens"]) == 5
    split = stack.http.post("/v1/completions", json={**body, "prompt": "\u00e9!", "n": 1}).json()["choices"][0]
    assert split["logprobs"]["text_offset"][:3] == [0, 0, 1]  # a character split over tokens starts at its first
    stream = stack.http.post("/v1/completions", json={**body, "stream": True})
    firsts: dict[int, dict[str, Any]] = {}
    for e in _events(stream.text):
        firsts.setdefault(e["choices"][0]["index"], e["choices"][0])
    assert sorted(firsts) == [0, 1]
    for c in firsts.values():
        assert c["text"].startswith("hij") and c["logprobs"]["token_logprobs"][:2] == [None, pytest.approx(-0.01)]


def test_echo_with_max_tokens_0_answers_the_scored_prompt_alone(stack: LiveStack) -> None:
    """vLLM's scoring request (what evaluation harnesses send): echo, max_tokens 0, logprobs: the prompt and its
    logprobs, no output; max_tokens 0 without echo is a 400."""
    body = {"model": MODEL, "prompt": "hij", "max_tokens": 0, "echo": True, "logprobs": 0}
    for stream in (False, True):
        r = stack.http.post("/v1/completions", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        c = _events(r.text)[0]["choices"][0] if stream else r.json()["choices"][0]
        assert c["text"] == "hij" and c["token_ids"] == [] and c["finish_reason"] == "length"
        assert c["logprobs"]["tokens"] == ["h", "i", "j"]
        assert c["logprobs"]["token_logprobs"] == [None, pytest.approx(-0.01), pytest.approx(-0.02)]
    r = stack.http.post("/v1/completions", json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_prompt_logprobs_and_echo(stack: LiveStack) -> None:
    """Chat: the response's prompt_logprobs; echo (vLLM) prefixes a continued assistant message, and asks for
    prompt logprobs with top_logprobs (0 by default)."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    r = stack.http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": msgs[:1], "max_tokens": 2, "prompt_logprobs": 0}
    )
    body = r.json()
    assert r.status_code == 200 and body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(row) == 1 for row in body["prompt_logprobs"][1:])  # the prompt token alone (k = 0)
    cont = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 2,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    r = stack.http.post("/v1/chat/completions", json=cont)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].startswith("Sure: ") and "prompt_logprobs" in body
    r = stack.http.post("/v1/chat/completions", json={**cont, "stream": True})
    contents = [e["choices"][0]["delta"].get("content") for e in _events(r.text) if e["choices"]]
    assert contents[:2] == ["", "Sure: "]  # the role chunk, then the echo
    r = stack.http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": msgs[:1], "max_tokens": 1, "echo": True}
    )
    assert not r.json()["choices"][0]["message"]["content"].startswith("hi")  # a user message is not echoed


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"prompt_logprobs": -2}, "positive value or -1"),
        ({"prompt_logprobs": -1}, "greater than max allowed: 20"),
        ({"prompt_logprobs": 21}, "greater than max allowed: 20"),
        ({"prompt_logprobs": "2"}, "integer"),
        ({"prompt_logprobs": 1, "stream": True}, "not available when 'stream'"),
    ],
)
def test_bad_prompt_logprobs_are_400(stack: LiveStack, body: dict[str, Any], why: str) -> None:
    for path, base in (
        ("/v1/completions", {"prompt": "ab"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        r = stack.http.post(path, json={"model": MODEL, **base, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt_logprobs" and why in err["message"] and err["type"] == "invalid_request_error"


def test_echo_with_return_token_ids_leaves_the_prompt_text_out(stack: LiveStack) -> None:
    """vLLM: echo with return_token_ids returns the prompt as prompt_token_ids, not as text; the logprobs still
    lead with the prompt's tokens (offsets as if its text were there), streamed or not."""
    body = {"model": MODEL, "prompt": "hij", "max_tokens": 2, "echo": True, "logprobs": 1, "return_token_ids": True}
    c = stack.http.post("/v1/completions", json=body).json()["choices"][0]
    assert (c["text"], c["prompt_token_ids"], c["token_ids"]) == ("ji", [104, 105, 106], [106, 105])
    assert c["logprobs"]["tokens"] == ["h", "i", "j", "j", "i"] and c["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]
    assert c["logprobs"]["token_logprobs"][:3] == [None, pytest.approx(-0.01), pytest.approx(-0.02)]
    events = _events(stack.http.post("/v1/completions", json={**body, "stream": True}).text)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(ch["text"] for ch in chunks) == "ji"
    assert chunks[0]["logprobs"]["tokens"][:3] == ["h", "i", "j"]
    plain = stack.http.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["text"] == "hijji"


def test_prompt_logprobs_decoded_tokens_stay_text_with_tokens_as_ids(stack: LiveStack) -> None:
    """vLLM: return_tokens_as_token_ids writes 'token_id:N' in the logprobs' tokens, never in prompt_logprobs'
    decoded_token (the engine's text of the token), completions and chat alike."""
    base = {"model": MODEL, "max_tokens": 1, "prompt_logprobs": 1, "return_tokens_as_token_ids": True}
    c = stack.http.post("/v1/completions", json={**base, "prompt": "hij", "logprobs": 0}).json()["choices"][0]
    assert c["prompt_logprobs"][1]["105"]["decoded_token"] == "i" and c["logprobs"]["tokens"][0].startswith("token_id:")
    chat = {**base, "messages": [{"role": "user", "content": "hi"}]}
    rows = stack.http.post("/v1/chat/completions", json=chat).json()["prompt_logprobs"][1:]
    assert all(not v["decoded_token"].startswith("token_id:") for row in rows for v in row.values())
