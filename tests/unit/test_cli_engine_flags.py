"""Every engine flag reaches the engine through every command that runs one: `generate` (LLM in process), `worker`
(run_worker), and `serve` (the worker command line it hands each Ray actor, parsed back by `worker`). Before,
`generate` built an EngineConfig and dropped it, silently ignoring --checkpoint-interval, --zero-fresh-blocks and
--gpu-memory-utilization. No engine is built here: the entry points are intercepted with the config they got."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from deploy import cli, commands
from engine.config import EngineConfig

# every engine flag, each at a non-default value
FLAGS = ["--dtype", "bfloat16", "--device", "cpu", "--block-size", "32", "--max-model-len", "1024",
         "--max-num-seqs", "7", "--max-num-batched-tokens", "333", "--kv-cache-memory-bytes", "12345678",
         "--gpu-memory-utilization", "0.5", "--checkpoint-interval", "64", "--zero-fresh-blocks", "off",
         "--seed", "9", "--no-prefix-caching"]
WANT = {("model", "dtype"): "bfloat16", ("model", "device"): "cpu", ("model", "max_model_len"): 1024,
        ("model", "seed"): 9, ("cache", "block_size"): 32, ("cache", "kv_cache_memory_bytes"): 12345678,
        ("cache", "gpu_memory_utilization"): 0.5, ("cache", "checkpoint_interval"): 64,
        ("cache", "zero_fresh_blocks"): "off", ("cache", "enable_prefix_caching"): False,
        ("scheduler", "max_num_seqs"): 7, ("scheduler", "max_num_batched_tokens"): 333}


def _check(cfg: EngineConfig, model: str) -> None:
    assert cfg.model.path == model
    got = {(section, name): getattr(getattr(cfg, section), name) for section, name in WANT}
    assert got == WANT


def test_the_table_covers_every_engine_flag() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    engine_dests = {a.dest for a in sub.choices["generate"]._actions} & {a.dest for a in sub.choices["worker"]._actions}
    engine_dests -= {"help", "model", "version", "enforce_eager"}  # enforce_eager travels as an env var
    flagged = {f[2:].replace("-", "_") for f in FLAGS if f.startswith("--")} - {"no_prefix_caching"}
    assert engine_dests - {"no_prefix_caching"} <= flagged | {"prompt", "max_tokens", "temperature", "top_p",
                                                              "top_k", "sample_seed", "stop"}
    assert set(commands.ENGINE_FLAGS) <= flagged


def test_generate_passes_every_flag(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    seen: list[EngineConfig] = []

    class Stop(Exception):
        pass

    class FakeLLM:
        def __init__(self, config: EngineConfig | None = None, **kwargs: object) -> None:
            assert not kwargs and config is not None
            seen.append(config)
            raise Stop

    monkeypatch.setattr("engine.llm.LLM", FakeLLM)
    with pytest.raises(Stop):
        cli.main(["generate", "--model", str(tmp_path), "--prompt", "x", *FLAGS])
    _check(seen[0], str(tmp_path))


def test_worker_and_serve_pass_every_flag(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    seen: list[EngineConfig] = []
    monkeypatch.setattr("worker.bootstrap.run_worker", lambda cfg, opts: seen.append(cfg) or 0)
    assert cli.main(["worker", "--role", "decode", "--model", str(tmp_path), *FLAGS]) == 0
    _check(seen[0], str(tmp_path))

    # serve: the worker command line it gives each actor carries the same flags
    args = cli.build_parser().parse_args(["serve", "--model", str(tmp_path), *FLAGS])
    argv = commands.engine_argv(args, str(tmp_path))
    assert cli.main(["worker", "--role", "prefill", *argv]) == 0
    _check(seen[1], str(tmp_path))
    assert dataclasses.asdict(seen[0]) == dataclasses.asdict(seen[1])
