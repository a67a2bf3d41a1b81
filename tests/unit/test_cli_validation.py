"""Bad serving flags end in one line on stderr and exit code 2 before anything starts: no traceback, no Ray."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hybridpd.deploy.cli import main

PROXY = ["proxy", "--decode", "127.0.0.1:1", "--port", "0"]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> None:
    t0 = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybridpd {argv[0]}: error: "), err
    assert all(w in err[0] for w in words), err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--max-model-len", "-5"], ("max_model_len", "-5")),
        (["--request-timeout", "0"], ("request_timeout",)),
        (["--inter-token-timeout", "-1"], ("--inter-token-timeout", "-1")),
        (["--generation-config", "/nonexistent"], ("--generation-config", "/nonexistent")),
    ],
)
def test_proxy_config_errors(capsys: pytest.CaptureFixture[str], extra: list[str], words: tuple[str, ...]) -> None:
    _one_line_error(capsys, [*PROXY, *extra], *words)


@pytest.mark.parametrize("command", [["proxy", "--decode", "127.0.0.1:1"], ["serve"]])
def test_port_out_of_range(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    _one_line_error(capsys, [*command, "--port", "70000"], "70000")


@pytest.mark.parametrize(
    ("flag", "value", "word"),
    [
        ("--block-size", "0", "block_size"),
        ("--gpu-memory-utilization", "1.5", "gpu_memory_utilization"),
        ("--checkpoint-interval", "5", "checkpoint_interval"),
    ],
)
def test_serve_checks_engine_flags_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, word: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nemotron_h", "max_position_embeddings": 256}))
    _one_line_error(capsys, ["serve", "--model", str(tmp_path), "--port", "0", flag, value], word)
