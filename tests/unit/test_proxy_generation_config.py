"""The model's generation_config.json gives the sampling defaults of requests that set none (vLLM's
`--generation-config auto`): temperature, top_p, top_k, min_p, the penalties, max_new_tokens; a request's own values
win; `generation_config="vllm"` turns it off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridpd.proxy.sampling_defaults import load_sampling_defaults
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.support.fake_workers import write_fake_tokenizer
from tests.support.live_stack import LiveStack

MODEL = "tiny"
GEN = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 7,
    "do_sample": True,
    "eos_token_id": 256,
}


def test_load_sampling_defaults(tmp_path: Path) -> None:
    assert load_sampling_defaults("auto", str(tmp_path)) == {}  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps(GEN))
    assert load_sampling_defaults("auto", str(tmp_path)) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 7,
    }
    assert load_sampling_defaults("vllm", str(tmp_path)) == {}
    assert load_sampling_defaults(str(tmp_path), None) == load_sampling_defaults("auto", str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{not json")
    assert load_sampling_defaults("auto", str(tmp_path)) == {}
    with pytest.raises(ValueError, match="generation_config"):
        load_sampling_defaults(str(tmp_path / "nowhere"), None)


def test_defaults_fill_only_what_a_request_leaves_out(tmp_path: Path) -> None:
    root = write_fake_tokenizer(tmp_path)
    (root / "generation_config.json").write_text(json.dumps(GEN))
    with LiveStack(
        tokenizer=PromptTokenizer.from_dir(root), model_name=MODEL, max_model_len=64, tokenizer_path=str(root)
    ) as s:

        def sent(path: str, **body: object):  # type: ignore[no-untyped-def]
            r = s.http.post(path, json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            return s.prefill[0].prefills[-1].sampling_params

        sp = sent("/v1/completions", prompt="hello")
        assert (sp.temperature, sp.top_p, sp.top_k) == (pytest.approx(0.6), pytest.approx(0.95), 20)
        assert sp.repetition_penalty == pytest.approx(1.05) and sp.max_tokens == 16  # completions: 16 unless null
        sp = sent("/v1/completions", prompt="hello", temperature=0, top_k=-1, repetition_penalty=1.0, max_tokens=None)
        assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.0, -1, 7)
        assert not sp.HasField("repetition_penalty")  # the request's 1.0: off
        sp = sent("/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
        assert sp.max_tokens == 7 and sp.temperature == pytest.approx(0.6)
