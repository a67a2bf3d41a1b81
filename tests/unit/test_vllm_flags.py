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


@pytest.mark.parametrize("command", ["generate", "serve", "worker", "proxy"])
def test_lengths_and_sizes_read_as_vllm_reads_them(command: str) -> None:
    parse = build_parser().parse_args
    extra = ["--role", "decode"] if command == "worker" else []
    for text, want in (("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("4096", 4096), ("auto", -1), ("-1", -1)):
        assert parse([command, *extra, "--max-model-len", text]).max_model_len == want
    if command != "proxy":
        args = parse([command, *extra, "--kv-cache-memory-bytes", "4G", "--max-num-batched-tokens", "8k"])
        assert (args.kv_cache_memory_bytes, args.max_num_batched_tokens) == (4 * 2**30, 8000)


@pytest.mark.parametrize(
    ("text", "says"), [("2.5K", "decimals only with k, m, g, t: 2.5k?"), ("lots", "not an integer")]
)
def test_bad_lengths_name_the_flag(capsys: pytest.CaptureFixture[str], text: str, says: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-model-len", text])
    err = capsys.readouterr().err
    assert "argument --max-model-len" in err and says in err


def test_vllm_dtype_names_half_and_float() -> None:
    from hybridpd.engine.device import resolve_dtype

    assert _config("--dtype", "half").model.dtype == "half" and resolve_dtype("half", "cpu") == "float16"
    assert resolve_dtype("float", "cuda") == "float32"
    _config("--dtype", "float").validate()


def test_max_model_len_auto_fits_what_the_cache_holds(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's --max-model-len auto (-1): the checkpoint's length when it fits, else the longest one request of which
    the cache budget holds, logged; the same budget with an explicit length that does not fit is an error."""
    from hybridpd.engine import LLM
    from hybridpd.engine.errors import InvalidRequestError

    roomy = LLM(max_model_len=-1, kv_cache_memory_bytes=8 * 2**20)
    assert roomy.engine.max_model_len == 4096  # the tiny checkpoint's max_position_embeddings fits
    # 4 state slots (null, 1 running, 2 staging) of k = 6 pages take 98,304 B; the rest is 12 pages of 16 tokens
    with caplog.at_level("INFO", logger="hybridpd.engine"):
        small = LLM(max_model_len=-1, kv_cache_memory_bytes=150_000)
    fitted = small.engine.max_model_len
    assert 1 < fitted < 4096 and small.engine.plan.max_model_len == fitted
    assert f"auto-fit max_model_len: reduced from 4096 to {fitted}" in caplog.text
    with pytest.raises(InvalidRequestError, match=f"the largest max_model_len it holds is {fitted} tokens"):
        LLM(max_model_len=fitted + 1, kv_cache_memory_bytes=150_000)
    out = small.generate(prompt_token_ids=[[5] * (fitted - 3)])[0]  # a prompt near the fitted length runs
    assert out.finish_reason == "length" and fitted - 3 + len(out.token_ids) == fitted  # stopped by max_model_len


@pytest.mark.parametrize("text", ["infk", "1e400k", "-2k", "1e3k", "nanK"])
def test_lengths_outside_vllms_grammar_are_refused_cleanly(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """A digit string (with a decimal part only before k/m/g/t) and a suffix, as vLLM's regex: no OverflowError
    traceback for an infinite number, no negative or exponent spelling vLLM refuses."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", f"--max-model-len={text}"])
    err = capsys.readouterr().err
    assert "argument --max-model-len" in err and "not an integer" in err


@pytest.mark.parametrize("size", ["0", "-1", "-5"])
def test_kv_cache_memory_bytes_below_one_is_refused_before_start(size: str) -> None:
    """0 or a negative cache budget is a flag error (before Ray, workers or the model), not a 'model does not fit'
    error from every worker after the weights are loaded."""
    from hybridpd.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_cache_memory_bytes must be >= 1"):
        _config(f"--kv-cache-memory-bytes={size}").validate()
