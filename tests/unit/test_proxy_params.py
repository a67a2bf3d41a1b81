"""vLLM/OpenAI parameters through the proxy against FAKE workers (tests/support/fake_workers.py: D answers the prompt's
ids reversed; the fake tokenizer is byte-level): n, a list of prompts, echo, stream with several choices, sampling
params on the wire, continuous usage stats."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.support.fake_workers import write_fake_tokenizer
from tests.support.live_stack import LiveStack

MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path_factory.mktemp("tok")))
    with LiveStack(tokenizer=tok, model_name=MODEL, max_model_len=64) as s:
        yield s


def events(text: str) -> list[dict]:
    blocks = [b[len("data: "):] for b in text.split("\n\n") if b.strip()]
    assert blocks[-1] == "[DONE]"
    return [json.loads(b) for b in blocks[:-1]]


def test_n_and_list_of_prompts_in_choice_order(stack: LiveStack) -> None:
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "xyz"], "n": 2, "max_tokens": 8,
                                                 "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "ba"), (1, "ba"), (2, "zyx"), (3, "zyx")]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 10  # prompts once each
    seeds = [g.sampling_params.seed for g in stack.decode[0].generates[-4:]]
    assert sorted(seeds) == [5, 5, 6, 6]  # sample j of a prompt uses seed + j: n samples differ
    assert len({g.request_id for g in stack.decode[0].generates[-4:]}) == 4


def test_echo_prepends_the_prompt(stack: LiveStack) -> None:
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "echo": True, "max_tokens": 3})
    assert r.json()["choices"][0]["text"] == "abccba"
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": [104, 105], "echo": True, "max_tokens": 1,
                                                 "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events(r.text)) == "hii"


def test_chat_stream_with_n_choices(stack: LiveStack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = stack.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    evs = events(r.text)
    roles = [e["choices"][0]["index"] for e in evs if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1, 2]
    finished = sorted(e["choices"][0]["index"] for e in evs if e["choices"] and e["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2]
    assert all(e["usage"] is not None for e in evs if e["choices"] and "role" not in e["choices"][0]["delta"])
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 6


def test_sampling_params_on_the_wire(stack: LiveStack) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2, "min_tokens": 2, "logit_bias": {"104": -100, "7": 2.5}, "logprobs": 5,
            "stop": ["q"], "include_stop_str_in_output": True, "user": "someone"}
    r = stack.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    sp = stack.decode[0].generates[-1].sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, pytest.approx(1.2))
    assert sp.min_tokens == 2 and dict(sp.logit_bias) == {104: -100.0, 7: 2.5}
    assert sp.logprobs and sp.top_logprobs == 5 and sp.include_stop_str_in_output
    assert stack.prefill[0].prefills[-1].sampling_params.top_logprobs == 5
    default = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert default.status_code == 200
    sp = stack.decode[0].generates[-1].sampling_params
    assert not sp.HasField("repetition_penalty") and not sp.logit_bias and sp.top_logprobs == 0


def test_text_offsets_skip_special_tokens(stack: LiveStack) -> None:
    # fake D reverses the prompt: token 256 (<|endoftext|>, special) first, then "@"
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": [64, 256], "max_tokens": 2, "logprobs": 0})
    choice = r.json()["choices"][0]
    assert choice["logprobs"]["tokens"] == ["<|endoftext|>", "@"]
    assert choice["logprobs"]["text_offset"] == [0, 0]


def test_top_logprobs_from_the_worker(stack: LiveStack) -> None:
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2, "logprobs": 3})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["b", "a"]
    assert lp["top_logprobs"][0] == {"b": pytest.approx(-0.1), "c": pytest.approx(-1.1), "d": pytest.approx(-2.1)}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True,
            "top_logprobs": 2}
    content = stack.http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    alts = content[0]["top_logprobs"]
    assert [a["logprob"] for a in alts] == pytest.approx([-0.1, -1.1]) and alts[0]["token"] == content[0]["token"]


def test_one_failing_choice_ends_the_stream_and_aborts_the_others() -> None:
    import grpc

    from tests.polling import wait_for
    from tests.support.fake_workers import Failure

    with LiveStack(n_decode=2, token_delay_s=0.05) as s:
        s.decode[1].failure = Failure(grpc.StatusCode.INTERNAL, "decode exploded", after_tokens=2)
        body = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True, "n": 2, "stream": True}
        r = s.http.post("/v1/completions", json=body)
        blocks = [b for b in r.text.split("\n\n") if b]
        assert blocks[-1] == "data: [DONE]" and "decode exploded" in blocks[-2]
        wait_for("the healthy choice aborted", lambda: len(s.decode[0].aborts) == 1, timeout=5, interval=0.05)
        assert s.http.get("/v1/cluster").json()["workers"][1]["in_flight"] == 0


def test_later_samples_of_a_prompt_start_after_the_first_has_its_first_token() -> None:
    """So they find the prompt in the prefix cache instead of computing it n times."""
    import asyncio
    from types import SimpleNamespace

    from hybridpd.proxy.choices import Choices
    from hybridpd.proxy.deltas import Delta

    events: list[str] = []

    class Stub:
        def __init__(self, name: str, leader: bool) -> None:
            self.name, self.req = name, SimpleNamespace(counts_prompt=leader)

        async def start(self) -> Delta:
            events.append(f"start {self.name}")
            await asyncio.sleep(0.05)
            events.append(f"first token {self.name}")
            return Delta((1,), "x", (), "length")

    gens = [Stub("a0", True), Stub("a1", False), Stub("b0", True), Stub("b1", False)]
    asyncio.run(Choices(gens).start())  # type: ignore[arg-type]
    assert events.index("start a1") > events.index("first token a0")
    assert events.index("start b1") > events.index("first token b0")
    assert events.index("start b0") < events.index("first token a0")  # different prompts run concurrently


def test_return_tokens_as_token_ids(stack: LiveStack) -> None:
    """vLLM's `return_tokens_as_token_ids`: every logprob token is written "token_id:<id>" (a token that is not
    valid UTF-8 on its own stays tellable from the others)."""
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 2, "logprobs": 2, "return_tokens_as_token_ids": True}
    choice = stack.http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "ba"
    assert choice["logprobs"]["tokens"] == ["token_id:98", "token_id:97"]
    assert set(choice["logprobs"]["top_logprobs"][0]) == {"token_id:98", "token_id:99"}
    assert choice["logprobs"]["text_offset"] == [0, 1]  # offsets stay those of the text
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True,
            "top_logprobs": 2, "return_tokens_as_token_ids": True}
    entry = stack.http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"][0]
    assert entry["token"].startswith("token_id:") and entry["token"] == entry["top_logprobs"][0]["token"]
    assert all(a["token"].startswith("token_id:") for a in entry["top_logprobs"])


def test_return_token_ids(stack: LiveStack) -> None:
    """vLLM's `return_token_ids`: completions give each choice its prompt's ids; chat gives the prompt's ids on the
    response (a stream: on its first chunk) and each choice's output ids (a stream: each chunk's)."""
    body = {"model": MODEL, "prompt": ["ab", "c"], "max_tokens": 2, "return_token_ids": True}
    choices = stack.http.post("/v1/completions", json=body).json()["choices"]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in choices] == [([97, 98], [98, 97]), ([99], [99])]
    chunks = events(stack.http.post("/v1/completions", json={**body, "stream": True}).text)
    assert sorted(c["choices"][0]["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c["choices"][0]) == [
        [97, 98], [99]]
    plain = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2}).json()
    assert "prompt_token_ids" not in plain["choices"][0]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_token_ids": True}
    full = stack.http.post("/v1/chat/completions", json=chat).json()
    prompt = full["prompt_token_ids"]
    assert prompt and full["choices"][0]["token_ids"] == list(reversed(prompt))[:3]
    chunks = events(stack.http.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == full["choices"][0]["token_ids"]
    plain = stack.http.post("/v1/chat/completions", json={**chat, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_add_special_tokens(tmp_path: Path) -> None:
    """A completion prompt gets the tokenizer's special tokens (here a BOS post-processor) unless
    `add_special_tokens` is false; a chat prompt gets them only when it asks (vLLM's defaults)."""
    from tokenizers import Tokenizer, processors

    root = write_fake_tokenizer(tmp_path, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[
        ("<|endoftext|>", 256)])
    tok.save(str(root / "tokenizer.json"))
    with LiveStack(tokenizer=PromptTokenizer.from_dir(root), model_name=MODEL, max_model_len=64) as s:

        def prompt_ids(path: str, **body: object) -> list[int]:
            r = s.http.post(path, json={"model": MODEL, "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            return list(s.prefill[0].prefills[-1].prompt_token_ids)

        assert prompt_ids("/v1/completions", prompt="ab") == [256, 97, 98]
        assert prompt_ids("/v1/completions", prompt="ab", add_special_tokens=False) == [97, 98]
        msgs = [{"role": "user", "content": "ab"}]
        assert prompt_ids("/v1/chat/completions", messages=msgs) == [97, 98]
        assert prompt_ids("/v1/chat/completions", messages=msgs, add_special_tokens=True) == [256, 97, 98]


def test_continuous_usage_stats_needs_include_usage(stack: LiveStack) -> None:
    """vLLM: `continuous_usage_stats` alone adds nothing (it refines `include_usage`)."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    chunks = events(stack.http.post("/v1/completions", json=body).text)
    assert chunks and all("usage" not in c and c["choices"] for c in chunks)


def test_skip_special_tokens_false_reaches_the_workers(stack: LiveStack) -> None:
    """vLLM's `skip_special_tokens` (default true) goes to both workers only when false (the workers then keep
    special tokens in the text). `spaces_between_special_tokens` is accepted (a no-op with fast tokenizers, as in
    vLLM)."""
    from hybridpd.worker.convert import sampling_params_from_proto

    body = {"model": MODEL, "prompt": [64, 256], "max_tokens": 2, "logprobs": 0, "skip_special_tokens": False,
            "spaces_between_special_tokens": False}
    r = stack.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for sent in (stack.prefill[0].prefills[-1].sampling_params, stack.decode[0].generates[-1].sampling_params):
        assert sent.HasField("skip_special_tokens") and not sampling_params_from_proto(sent).skip_special_tokens
    r = stack.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 2, "skip_special_tokens": True})
    assert r.status_code == 200 and not stack.prefill[0].prefills[-1].sampling_params.HasField("skip_special_tokens")
    assert sampling_params_from_proto(stack.prefill[0].prefills[-1].sampling_params).skip_special_tokens


def test_stop_reason(stack: LiveStack) -> None:
    """vLLM's `stop_reason` on every choice: the stop string or stop token id that ended it, else null; in a stream,
    on the last chunk of a choice. (Fake D: the prompt reversed; P's first token can end the request too.)"""

    def reasons(path: str, body: dict) -> list[tuple[str | None, str | int | None]]:
        r = stack.http.post(path, json={"model": MODEL, "max_tokens": 8, **body})
        assert r.status_code == 200, r.text
        full = [(c["finish_reason"], c["stop_reason"]) for c in r.json()["choices"]]
        chunks = events(stack.http.post(path, json={"model": MODEL, "max_tokens": 8, "stream": True, **body}).text)
        ends = [(c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) for c in chunks if c["choices"]]
        assert all(e == (None, None) for e in ends[:-1]) and ends[-1] == full[0], (ends, full)
        return full

    assert reasons("/v1/completions", {"prompt": "abcd", "stop": ["b"]}) == [("stop", "b")]
    assert reasons("/v1/completions", {"prompt": "abcd", "stop_token_ids": [98]}) == [("stop", 98)]
    assert reasons("/v1/completions", {"prompt": "abcd", "stop": ["d"]}) == [("stop", "d")]  # P's first token
    assert reasons("/v1/completions", {"prompt": "abcd", "max_tokens": 2}) == [("length", None)]
    assert reasons("/v1/completions", {"prompt": "ab"}) == [("stop", None)]  # the fake's end of output
    chat = {"messages": [{"role": "user", "content": "xy"}], "stop": [">"]}  # the prompt ends "<|assistant|>\n"
    assert reasons("/v1/chat/completions", chat) == [("stop", ">")]
