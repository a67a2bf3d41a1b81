"""vLLM's flag spellings on `generate`, `worker` and `serve` (deploy/vllm_flags.py): honoured where they mean the
same here, refused with a message naming the flag otherwise, never silently ignored."""

from __future__ import annotations

import pytest
from hybridpd.deploy.cli import build_parser
from hybridpd.deploy.engine_flags import engine_config_from_args
from hybridpd.deploy.vllm_flags import UnsupportedFlagError


def _config(*argv: str):  # type: ignore[no-untyped-def]
    return engine_config_from_args(build_parser().parse_args(["generate", *argv]))


@pytest.mark.parametrize("command", ["generate", "serve", "worker"])
def test_prefix_caching_in_vllm_spelling(command: str) -> None:
    parse = build_parser().parse_args
    extra = ["--role", "decode"] if command == "worker" else []
    assert parse([command, *extra, "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse([command, *extra, "--enable-prefix-caching"]).enable_prefix_caching is True
    assert parse([command, *extra, "--no-prefix-caching"]).enable_prefix_caching is False
    assert _config("--no-enable-prefix-caching").cache.enable_prefix_caching is False


def test_flags_that_mean_the_same_here_are_accepted() -> None:
    cfg = _config("--disable-log-requests", "--disable-log-stats", "--enable-chunked-prefill", "--kv-cache-dtype",
                  "auto", "-pp", "1", "--data-parallel-size", "1", "--enable-auto-tool-choice", "--tool-call-parser",
                  "qwen3_coder")
    assert cfg == _config()


@pytest.mark.parametrize(("argv", "names"), [
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
    (["--quantization", "awq"], "--quantization"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
    (["-dp", "2"], "--data-parallel-size 2"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser hermes"),
    (["--reasoning-parser", "deepseek_r1"], "--reasoning-parser"),
    (["--enable-lora"], "--enable-lora"),
    (["--speculative-config", "{}"], "--speculative-config"),
])
def test_flags_naming_what_is_not_done_are_refused(argv: list[str], names: str) -> None:
    with pytest.raises(UnsupportedFlagError, match=names):
        _config(*argv)


def test_revision_and_download_dir_reach_the_model_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import hybridpd.engine.model_source as source

    seen = []
    real = _config().model.path

    def resolve(name, revision=None, allow_download=True, cache_dir=None):  # type: ignore[no-untyped-def]
        seen.append((name, revision, cache_dir))
        return real

    monkeypatch.setattr(source, "resolve_model", resolve)
    cfg = _config("--model", "org/model", "--revision", "v2", "--tokenizer", "org/tok", "--tokenizer-revision",
                  "abc123", "--download-dir", str(tmp_path))
    assert cfg.model.path == real
    assert seen == [("org/model", "v2", str(tmp_path)), ("org/tok", "abc123", str(tmp_path))]
