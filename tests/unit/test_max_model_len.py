"""max_model_len past the checkpoint's max_position_embeddings is refused (as vLLM refuses it) by the config
resolution, LLM() and the CLI, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; a config without the field accepts any."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridpd.deploy.cli import main
from hybridpd.engine.config import ALLOW_LONG_MAX_MODEL_LEN_ENV, resolve_max_model_len
from hybridpd.engine.errors import InvalidRequestError

ENV = ALLOW_LONG_MAX_MODEL_LEN_ENV


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def test_too_long_is_refused_naming_both_values_and_the_override() -> None:
    with pytest.raises(
        InvalidRequestError, match=rf"max_model_len \(4097\).*max_position_embeddings \(4096\).*{ENV}=1"
    ):
        resolve_max_model_len(4097, {"max_position_embeddings": 4096})


def test_up_to_the_limit_and_default() -> None:
    cfg = {"max_position_embeddings": 4096}
    assert resolve_max_model_len(4096, cfg) == 4096
    assert resolve_max_model_len(128, cfg) == 128
    assert resolve_max_model_len(None, cfg) == 4096 and resolve_max_model_len(0, cfg) == 4096
    assert resolve_max_model_len(None, {"text_config": {"max_position_embeddings": 512}}) == 512
    with pytest.raises(InvalidRequestError, match="-5"):
        resolve_max_model_len(-5, cfg)


def test_text_config_limit_and_model_max_length_count() -> None:
    with pytest.raises(InvalidRequestError, match=r"\(513\).*\(512\)"):
        resolve_max_model_len(513, {"text_config": {"max_position_embeddings": 512}})
    assert resolve_max_model_len(8192, {"max_position_embeddings": 4096, "model_max_length": 8192}) == 8192


@pytest.mark.parametrize("value", ["1", "true", " TRUE "])
def test_env_override_allows_it(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV, value)
    assert resolve_max_model_len(100_000, {"max_position_embeddings": 4096}) == 100_000


def test_env_other_values_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(InvalidRequestError):
        resolve_max_model_len(4097, {"max_position_embeddings": 4096})


def test_config_without_the_field_keeps_accepting_any() -> None:
    assert resolve_max_model_len(None, {}) == 4096
    assert resolve_max_model_len(1_000_000, {"model_type": "nemotron_h"}) == 1_000_000


def _config_dir(tmp_path: Path, max_pos: int) -> str:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "max_position_embeddings": max_pos}
        )
    )
    return str(tmp_path)


def test_llm_raises_value_error_before_loading(tmp_path: Path) -> None:
    from hybridpd.engine.llm import LLM

    with pytest.raises(ValueError, match=r"max_model_len \(300\).*\(256\)"):  # config.json only: no weights read
        LLM(model=_config_dir(tmp_path, 256), max_model_len=300, device="cpu")


@pytest.mark.parametrize("command", [["proxy", "--decode", "127.0.0.1:1"], ["serve"]])
def test_cli_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    argv = [*command, "--model", _config_dir(tmp_path, 256), "--max-model-len", "300", "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_model_len (300)" in err[0] and "(256)" in err[0] and ENV in err[0]
