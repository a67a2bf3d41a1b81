"""load_format="dummy": a config-only model directory (`hybridpd init-model --no-weights`) loads with random
weights drawn on the device, with exactly the parameters a real checkpoint gives."""

from __future__ import annotations

import pytest
from hybridpd.engine.errors import InvalidRequestError, ModelLoadError
from hybridpd.engine.models.checkpoint import write_random_checkpoint
from hybridpd.engine.models.registry import load_model


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_dummy_matches_real_parameters(tmp_path, family):
    real = load_model(write_random_checkpoint(tmp_path / "real", family, seed=0), "bfloat16")
    bare = write_random_checkpoint(tmp_path / "bare", family, seed=0, weights=False)
    assert not list((tmp_path / "bare").glob("*.safetensors"))
    with pytest.raises(ModelLoadError):
        load_model(bare, "float32")  # no weights: the default format refuses, it never invents them
    dummy = load_model(bare, "bfloat16", load_format="dummy")
    want = {n: (tuple(t.shape), t.dtype) for n, t in real.state_dict().items()}
    got = {n: (tuple(t.shape), t.dtype) for n, t in dummy.state_dict().items()}
    assert set(got) == set(want)
    assert got == want  # same names, shapes and dtypes (fp32 where the model keeps fp32)
    for n, t in dummy.state_dict().items():
        assert t.device.type == "cpu" and bool(t.float().isfinite().all()), n
        if t.numel() > 16:
            assert float(t.float().std()) > 0, f"{n} was left constant"


def test_dummy_engine_generates(tmp_path):
    from hybridpd.engine import LLM, SamplingParams

    path = write_random_checkpoint(tmp_path / "m", "nemotron_h", weights=False)
    llm = LLM(model=path, load_format="dummy")
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].token_ids) == 4


def test_bad_load_format_is_refused(tmp_path):
    from hybridpd.engine import LLM

    with pytest.raises(InvalidRequestError, match="load_format"):
        LLM(model=write_random_checkpoint(tmp_path / "m", "nemotron_h", weights=False), load_format="safetensor")
