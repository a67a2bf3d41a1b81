"""Stop conditions in the engine: stop strings cut the text before the match; stop token ids end generation with
the token kept; max_tokens gives "length"."""

from __future__ import annotations

from hybridpd.engine import LLM, SamplingParams


def test_stop_string_and_stop_token(checkpoint_dir):  # type: ignore[no-untyped-def]
    llm = LLM(model=checkpoint_dir("nemotron_attn_mid"), kv_cache_memory_bytes=16 * 2**20, max_model_len=256)
    prompt = [[65, 66, 67]]
    full = llm.generate(prompt_token_ids=prompt,
                        sampling_params=SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop = full.text[3:5]
    assert len(stop) == 2
    cut = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 20
    tok = full.token_ids[4]
    by_id = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]


def test_stop_string_seen_before_min_tokens_does_not_cut(checkpoint_dir):  # type: ignore[no-untyped-def]
    """Stop strings wait for min_tokens: an earlier occurrence is kept, the text ends where the match was found
    (as vLLM cuts it), not at the first occurrence anywhere in the output."""
    llm = LLM(model=checkpoint_dir("nemotron_attn_mid"), kv_cache_memory_bytes=16 * 2**20, max_model_len=256)
    forced = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias={70: 100.0})
    full = llm.generate(prompt_token_ids=[[65, 66, 67]], sampling_params=forced)[0]
    assert full.token_ids == [70] * 8
    one = full.text[: len(full.text) // 8]
    assert one and full.text == one * 8
    for stop, include, want in ((one, False, 3), (one, True, 4), (one * 2, False, 2), (one * 2, True, 4)):
        out = llm.generate(prompt_token_ids=[[65, 66, 67]], sampling_params=SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, logit_bias={70: 100.0}, min_tokens=4, stop=[stop],
            include_stop_str_in_output=include))[0]
        assert out.finish_reason == "stop" and len(out.token_ids) == 4, (stop, include)
        assert out.text == one * want, (stop, include, out.text)


def test_stop_match_names_the_stop_string_or_stop_token(checkpoint_dir):  # type: ignore[no-untyped-def]
    """vLLM's stop_reason: the stop string or stop token id that ended a request; None for EOS (checked first, as
    vLLM does), max_tokens and anything else."""
    llm = LLM(model=checkpoint_dir("nemotron_attn_mid"), kv_cache_memory_bytes=16 * 2**20, max_model_len=256)
    core = llm.engine
    eos = core.eos_token_ids[0]
    ended = []

    def run(bias: int, **kw: object) -> tuple[str | None, str | int | None]:
        req = core.add_request(f"r{len(ended)}", [65, 66, 67], SamplingParams(
            max_tokens=6, temperature=0, logit_bias={bias: 100.0}, **kw))  # type: ignore[arg-type]
        while not req.is_finished:
            core.step()
        ended.append(req)
        return req.finish_reason, core.stop_match(req)

    assert run(70, ignore_eos=True, stop_token_ids=[70]) == ("stop", 70)
    assert run(70, ignore_eos=True, stop=["xyz", "FF"]) == ("stop", "FF")  # token 70 is the byte "F"
    assert run(70, ignore_eos=True) == ("length", None)
    assert run(eos) == ("stop", None)
    assert run(eos, stop_token_ids=[eos]) == ("stop", None)
    assert run(eos, ignore_eos=True, stop_token_ids=[eos]) == ("stop", eos)


def test_skip_special_tokens_false_keeps_them_in_the_text(checkpoint_dir):  # type: ignore[no-untyped-def]
    """vLLM's `skip_special_tokens` (default true): false keeps special tokens in the text, and stop strings see
    them."""
    llm = LLM(model=checkpoint_dir("nemotron_attn_mid"), kv_cache_memory_bytes=16 * 2**20, max_model_len=256)
    start = llm.engine.tokenizer.token_to_id("<|im_start|>")
    forced = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {start: 100.0}}
    default, kept, cut = llm.generate(prompt_token_ids=[[65, 66]] * 3, sampling_params=[
        SamplingParams(**forced), SamplingParams(**forced, skip_special_tokens=False),  # type: ignore[arg-type]
        SamplingParams(**forced, skip_special_tokens=False, stop=["t|><|im"])])  # type: ignore[arg-type]
    assert default.token_ids == kept.token_ids == [start] * 3 and default.text == ""
    assert kept.text == "<|im_start|>" * 3
    assert (cut.text, cut.finish_reason, len(cut.token_ids)) == ("<|im_star", "stop", 2)
