"""Bad input gets a clear error naming the problem (engine and CLI), never a traceback from deep inside torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.errors import InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def llm(checkpoint_dir):  # type: ignore[no-untyped-def]
    return LLM(model=checkpoint_dir("nemotron_attn_mid"), max_model_len=64, kv_cache_memory_bytes=16 * 2**20)


def test_missing_checkpoint_dir(tmp_path):  # type: ignore[no-untyped-def]
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))


def test_malformed_config(tmp_path):  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(tmp_path))


def test_unsupported_architecture(tmp_path, checkpoint_dir):  # type: ignore[no-untyped-def]
    cfg = json.loads(open(os.path.join(checkpoint_dir("nemotron_attn_mid"), "config.json")).read())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM") as e:
        LLM(model=str(tmp_path))
    assert "NemotronHForCausalLM" in str(e.value)  # names what is supported


def test_missing_weights(tmp_path, checkpoint_dir):  # type: ignore[no-untyped-def]
    src = checkpoint_dir("nemotron_attn_mid")
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(model=str(tmp_path))


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_params(kwargs, match):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_empty_prompt(llm):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate(prompt_token_ids=[[]])


def test_prompt_longer_than_max_model_len(llm):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[5] * 64])
    # nothing was half-added: the engine still serves
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].token_ids) == 2


def test_token_outside_vocab(llm):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate(prompt_token_ids=[[10**9]])


def test_generation_stops_at_max_model_len(llm):  # type: ignore[no-untyped-def]
    out = llm.generate(prompt_token_ids=[[5] * 60], sampling_params=SamplingParams(max_tokens=50, temperature=0,
                                                                                  ignore_eos=True))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 4


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybridpd.deploy.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_cli_clear_errors(tmp_path):  # type: ignore[no-untyped-def]
    r = _cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr
    r = _cli("init-model", "--family", "llama", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_cli_init_model_then_generate(tmp_path):  # type: ignore[no-untyped-def]
    out = tmp_path / "tiny"
    r = _cli("init-model", "--family", "qwen3_5", "--out", str(out))
    assert r.returncode == 0, r.stderr
    r = _cli("generate", "--model", str(out), "--prompt", "Hello", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(line["token_ids"]) >= 1 and line["finish_reason"] in ("length", "stop")
