"""Structured output in-process (LLM on the built-in random-weight model: only the grammar makes output valid)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.structured import StructuredOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=1024, kv_cache_memory_bytes=32 * 2**20)


def _gen(llm: LLM, n: int = 3, **structured: object) -> list:  # type: ignore[type-arg]
    params = [SamplingParams(max_tokens=160, temperature=0.0 if i == 0 else 1.0, seed=i,
                             structured_output=dict(structured)) for i in range(n)]
    return llm.generate(["Describe someone."] * n, params)


def test_json_schema_output_validates(llm: LLM) -> None:
    for out in _gen(llm, json=SCHEMA):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_unconstrained_random_model_output_is_not_json(llm: LLM) -> None:
    """The control: without the grammar this model's output is not valid JSON (so the test above can fail)."""
    out = llm.generate(["Describe someone."], SamplingParams(max_tokens=40, temperature=1.0, seed=0))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_regex_choice_json_object_and_grammar(llm: LLM) -> None:
    for out in _gen(llm, regex=r"[a-c]{2}-\d{3}"):
        assert re.fullmatch(r"[a-c]{2}-\d{3}", out.text), out.text
    for out in _gen(llm, choice=["red", "green", "blue"]):
        assert out.text in ("red", "green", "blue")
    out = llm.generate(["x"], SamplingParams(max_tokens=48, temperature=0.0, structured_output={"json_object": 1}))[0]
    assert out.text.startswith("{")  # a random model may not close its first key within max_tokens
    assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict), out.text
    for out in _gen(llm, grammar='root ::= "x" [0-9] [0-9] ("!" | "?")'):
        assert re.fullmatch(r"x\d\d[!?]", out.text), out.text


def test_a_grammar_that_can_only_end_ends_before_min_tokens(llm: LLM) -> None:
    """min_tokens bans EOS; once the grammar allows nothing but EOS, the grammar wins (no token is allowed
    otherwise: the row used to sample token 0, off the grammar). Stop ids are banned the same way."""
    for params in (dict(min_tokens=12), dict(min_tokens=12, stop_token_ids=[0, 1]),
                   dict(min_tokens=12, temperature=1.0, seed=3)):
        out = llm.generate(["Pick one."], SamplingParams(
            max_tokens=16, **{"temperature": 0.0, **params},  # type: ignore[arg-type]
            structured_output={"choice": ["red", "green", "blue"]}))[0]
        assert out.text in ("red", "green", "blue") and out.finish_reason == "stop", (params, out.text)


def test_logprobs_stop_strings_and_batching_with_unconstrained_rows(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=30, temperature=0.0, top_logprobs=3, structured_output={"regex": "ab+c"}),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, stop=["b"], structured_output={"regex": "ab+c"})]
    constrained, free, stopped = llm.generate(["x", "x", "x"], params)
    assert re.fullmatch("ab+c", constrained.text)
    assert len(constrained.logprobs) == len(constrained.token_ids)
    assert all(len(t) == 3 for t in constrained.top_logprobs)
    assert len(free.token_ids) == 8
    reference = llm.generate(["x"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert free.token_ids == reference.token_ids  # masking one row leaves the others alone
    assert stopped.text == "a" and stopped.finish_reason == "stop"


@pytest.mark.parametrize("spec, problem", [
    ({"json": '{"type": 3}'}, "JSON schema"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"choice": []}, "choice"),
])
def test_malformed_spec_is_refused_naming_the_problem(llm: LLM, spec: dict, problem: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidRequestError, match=problem):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_output=spec))
    assert not llm.engine.has_unfinished()


def test_grammar_compiled_once_per_spec(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    _gen(llm, n=2, json=schema)
    compiled = llm.engine.structured.grammars.num_compiled
    _gen(llm, n=2, json=schema)
    assert llm.engine.structured.grammars.num_compiled == compiled


def test_matcher_follows_the_output_after_a_recompute(llm: LLM) -> None:
    """The grammar state is "the output so far": when a request's output changes under its matcher (a recompute
    that restarts it, a replay on another worker), the matcher is rebuilt from the output before the next mask."""
    import torch
    from hybridpd.engine.structured.matchers import StructuredOutputs

    core = llm.engine
    tok = core.tokenizer
    req = SimpleNamespace(request_id="r", output_token_ids=[])
    so = StructuredOutputs(tok, core.vocab_size, core.eos_token_ids, lambda rid: req)
    params = [SamplingParams(structured_output={"regex": "(ab|ac)d"})]

    def allowed() -> set[int]:
        x = torch.zeros(1, core.vocab_size)
        so.apply(x, ["r"], params)
        return set(torch.nonzero(x[0] == 0).view(-1).tolist())

    a, b, c, d = (tok.encode(ch)[0] for ch in "abcd")
    assert allowed() == {a}
    req.output_token_ids = [a]
    assert so.accept(req) and allowed() == {b, c}
    req.output_token_ids = [a, b]
    assert so.accept(req) and allowed() == {d}
    req.output_token_ids = [a]  # the output lost a token: the matcher replays [a]
    assert allowed() == {b, c}
    req.output_token_ids = []  # recomputed from scratch
    assert allowed() == {a}


def test_sampling_params_dict_spelling() -> None:
    assert SamplingParams(structured_output={"json": {"type": "object"}}).structured == StructuredOutput(
        "json", '{"type": "object"}')
    assert SamplingParams(structured_output={"choice": ["a"]}).structured == StructuredOutput("choice", '["a"]')
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_output={"json": {}, "regex": "a"})
    with pytest.raises(InvalidRequestError):
        StructuredOutput("xml", "<a/>")


def test_llm_chat_with_tools_and_a_constraint(llm: LLM) -> None:
    """LLM.chat renders the model's chat template (one conversation or several) and generates."""
    convo = [{"role": "user", "content": "Pick a colour."}]
    outs = llm.chat([convo, convo], SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                                   structured_output={"choice": ["red", "blue"]}))
    assert [o.text in ("red", "blue") for o in outs] == [True, True]
    expected = llm.tokenizer.encode_chat(convo)
    assert outs[0].prompt_token_ids == expected
    with pytest.raises(InvalidRequestError):
        llm.chat([])


def test_choices_beyond_the_basic_plane_and_with_escapes_come_out_as_written(llm: LLM) -> None:
    """A choice holding a character past U+FFFF (an emoji) is produced as its UTF-8 text: the grammar's string
    literal used to hold it as two escaped UTF-16 surrogates, which were read as two 3-byte sequences (CESU-8), so
    the output was six invalid bytes. Quotes, backslashes and control characters stay themselves."""
    for choice in ("x😀é日", 'a"b\\c\n\t'):
        out = llm.generate(["q"], SamplingParams(max_tokens=40, temperature=0.0,
                                                 structured_output={"choice": [choice]}))[0]
        assert (out.text, out.finish_reason) == (choice, "stop")
