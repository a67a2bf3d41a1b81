"""Every engine flag reaches the engine through every command that runs one: `generate` (LLM in process), `worker`
(run_worker), and `serve` (the worker command line it hands each Ray actor, parsed back by `worker`). Before,
`generate` built an EngineConfig and dropped it, silently ignoring --checkpoint-interval, --zero-fresh-blocks and
--gpu-memory-utilization. No engine is built here: the entry points are intercepted with the config they got.

The flags are generated from engine/config.py's sections (deploy.engine_flags): the tests iterate over the
dataclass fields, so a field added there is checked to get a flag with help text that reaches the engine."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hybridpd.deploy import cli, commands, engine_flags
from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig, config_sections, field_docs

# the flag spellings documented before the flags were generated (a contract), each at a non-default value
FLAGS = ["--dtype", "bfloat16", "--device", "cpu", "--block-size", "32", "--max-model-len", "1024",
         "--max-num-seqs", "7", "--max-num-batched-tokens", "333", "--kv-cache-memory-bytes", "12345678",
         "--gpu-memory-utilization", "0.5", "--checkpoint-interval", "64", "--zero-fresh-blocks", "off",
         "--seed", "9", "--no-prefix-caching"]
WANT = {("model", "dtype"): "bfloat16", ("model", "device"): "cpu", ("model", "max_model_len"): 1024,
        ("model", "seed"): 9, ("cache", "block_size"): 32, ("cache", "kv_cache_memory_bytes"): 12345678,
        ("cache", "gpu_memory_utilization"): 0.5, ("cache", "checkpoint_interval"): 64,
        ("cache", "zero_fresh_blocks"): "off", ("cache", "enable_prefix_caching"): False,
        ("scheduler", "max_num_seqs"): 7, ("scheduler", "max_num_batched_tokens"): 333}
ENGINE_COMMANDS = ("generate", "worker", "serve")


def _check(cfg: EngineConfig, model: str, want: dict[tuple[str, str], Any] = WANT) -> None:
    assert cfg.model.path == model
    got = {(section, name): getattr(getattr(cfg, section), name) for section, name in want}
    assert got == want


def _fields() -> list[tuple[str, dataclasses.Field]]:
    return [(s, f) for s, cls in config_sections().items() for f in dataclasses.fields(cls) if f.name != "path"]


def _other_value(section: str, f: dataclasses.Field) -> Any:
    """A value of the field's type other than its default (choices: another choice)."""
    hint = typing.get_type_hints(config_sections()[section])[f.name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if union else hint
    if typing.get_origin(base) is typing.Literal:
        return next(c for c in typing.get_args(base) if c != f.default)
    if base is bool:
        return not f.default
    if base is int:
        return (f.default or 0) + 7
    if base is float:
        return (f.default or 0.0) / 4 + 0.125
    assert base is str, f"{section}.{f.name}: add a test value for {hint}"
    return "cuda:1" if f.name == "device" else f"x-{f.name}"


def _all_other() -> dict[tuple[str, str], Any]:
    return {(s, f.name): _other_value(s, f) for s, f in _fields()}


def _config(model: str, values: dict[tuple[str, str], Any]) -> EngineConfig:
    return EngineConfig.from_settings(model, **{name: v for (_, name), v in values.items()})


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


# ---- the generated flags -----------------------------------------------------------------------------------------


def test_every_field_has_one_flag_with_its_doc_as_help() -> None:
    flags = {(f.section, f.name): f for f in engine_flags.engine_flags()}
    assert set(flags) == {(s, f.name) for s, f in _fields()} | {("model", "path")}
    for (section, name), flag in flags.items():
        doc = field_docs(config_sections()[section]).get(name)
        assert doc, f"{section}.{name} has no docstring (it is the flag's help text)"
        assert flag.help == doc
    names = [f.name for f in flags.values()]
    assert len(names) == len(set(names)), "field names must be unique across sections (one flag each)"


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_command_has_every_flag_with_help_and_default(command: str) -> None:
    actions = {a.dest: a for a in _subparsers()[command]._actions}
    for flag in engine_flags.engine_flags():
        action = actions[flag.dest]
        assert flag.option in action.option_strings
        assert action.help and flag.help.replace("%", "%%") in action.help
        if flag.name != "path":
            assert action.default == flag.default
    assert set(actions["dtype"].choices) == {"auto", "float32", "bfloat16", "float16", "half", "float"}  # + vLLM's
    assert set(actions["zero_fresh_blocks"].choices) == {"auto", "on", "off"}
    assert "eviction" not in actions  # one eviction policy (engine/cache/tree.py)


def test_documented_spellings_still_parse() -> None:
    sub = _subparsers()
    for command in ENGINE_COMMANDS:
        args = sub[command].parse_args(["--role", "decode", *FLAGS] if command == "worker" else FLAGS)
        _check(engine_flags.engine_config_from_args(args), args.model or engine_flags.default_model(), WANT)
    for spelling in (["--prefix-caching"], ["--no-prefix-caching"], ["--enforce-eager"]):
        sub["generate"].parse_args(spelling)


def test_no_flags_is_the_config_defaults() -> None:
    args = _subparsers()["worker"].parse_args(["--role", "decode", "--model", "m"])
    assert engine_flags.engine_config_from_args(args) == EngineConfig(model=ModelConfig(path="m"))


@dataclasses.dataclass(frozen=True)
class _Extra:
    new_knob: int = 3
    """A knob added later."""
    new_switch: bool = False
    """A switch added later."""


@dataclasses.dataclass(frozen=True)
class _Root:
    model: ModelConfig
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    extra: _Extra = dataclasses.field(default_factory=_Extra)


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    knob: int = 3


@dataclasses.dataclass(frozen=True)
class _RootWithUndocumented:
    model: ModelConfig
    extra: _Undocumented = dataclasses.field(default_factory=_Undocumented)


def test_a_new_field_gets_a_flag() -> None:
    flags = engine_flags.engine_flags(_Root)
    parser = argparse.ArgumentParser()
    engine_flags.add_engine_args(parser, flags)
    args = parser.parse_args(["--model", "m", "--new-knob", "5", "--new-switch"])
    cfg = engine_flags.engine_config_from_args(args, _Root, flags)
    assert cfg.extra == _Extra(new_knob=5, new_switch=True) and cfg.model == ModelConfig(path="m")
    assert "A knob added later." in parser.format_help()
    with pytest.raises(TypeError, match="knob"):
        engine_flags.engine_flags(_RootWithUndocumented)


# ---- every flag reaches the engine through every command ---------------------------------------------------------


def _generated_argv(values: dict[tuple[str, str], Any]) -> list[str]:
    """The command line for `values`, written from the flag table (not by engine_argv, which is under test)."""
    by_field = {(f.section, f.name): f for f in engine_flags.engine_flags()}
    argv: list[str] = []
    for key, value in values.items():
        option = by_field[key].option
        if isinstance(value, bool):
            argv.append(option if value else "--no-" + option[2:])
        else:
            argv += [option, str(value)]
    return argv


@pytest.mark.parametrize("table", ["documented", "every_field"])
def test_generate_passes_every_flag(monkeypatch: pytest.MonkeyPatch, tmp_path, table: str) -> None:  # type: ignore[no-untyped-def]
    flags, want = (FLAGS, WANT) if table == "documented" else (_generated_argv(_all_other()), _all_other())
    seen: list[EngineConfig] = []

    class Stop(Exception):
        pass

    class FakeLLM:
        def __init__(self, config: EngineConfig | None = None, **kwargs: object) -> None:
            assert not kwargs and config is not None
            seen.append(config)
            raise Stop

    monkeypatch.setattr("hybridpd.engine.llm.LLM", FakeLLM)
    with pytest.raises(Stop):
        cli.main(["generate", "--model", str(tmp_path), "--prompt", "x", *flags])
    _check(seen[0], str(tmp_path), want)


@pytest.mark.parametrize("table", ["documented", "every_field"])
def test_worker_and_serve_pass_every_flag(monkeypatch: pytest.MonkeyPatch, tmp_path, table: str) -> None:  # type: ignore[no-untyped-def]
    flags, want = (FLAGS, WANT) if table == "documented" else (_generated_argv(_all_other()), _all_other())
    seen: list[EngineConfig] = []
    monkeypatch.setattr("hybridpd.worker.bootstrap.run_worker", lambda cfg, opts: seen.append(cfg) or 0)
    # every field at a non-default value need not be a valid config (checkpoint_interval 7, block_size 23): worker
    # and serve would refuse it up front; this test is about the flags reaching the workers
    monkeypatch.setattr(EngineConfig, "validate", lambda self: None)
    assert cli.main(["worker", "--role", "decode", "--model", str(tmp_path), *flags]) == 0
    _check(seen[0], str(tmp_path), want)

    # serve: the worker command line it gives each actor carries the same flags
    served: list[list[str]] = []
    fake = lambda args, argv, model, max_len: served.append(argv) or 0  # noqa: E731
    monkeypatch.setattr("hybridpd.deploy.ray_launcher.serve", fake)
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["serve", "--model", str(tmp_path), "--port", "0", *flags]) == 0
    assert cli.main(["worker", "--role", "prefill", *served[0]]) == 0
    _check(seen[1], str(tmp_path), want)


def test_worker_command_line_round_trips_any_config() -> None:
    sub = _subparsers()
    for values in ({}, _all_other(), {("cache", "enable_prefix_caching"): False}):
        cfg = _config("/m", values)
        argv = commands.engine_argv(cfg)
        assert argv[:2] == ["--model", "/m"]
        args = sub["worker"].parse_args(["--role", "decode", *argv])
        assert engine_flags.engine_config_from_args(args) == cfg
    assert commands.engine_argv(_config("/m", {})) == ["--model", "/m"]  # defaults are left to the worker


def test_llm_takes_every_field_by_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridpd.engine import llm

    seen: list[EngineConfig] = []
    monkeypatch.setattr(llm, "EngineCore", lambda cfg: seen.append(cfg))
    values = _all_other()
    llm.LLM(model="/m", **{name: v for (_, name), v in values.items()})
    _check(seen[0], "/m", values)
    llm.LLM(model="/m", block_size=32, enable_prefix_caching=False)
    _check(seen[1], "/m", {("cache", "block_size"): 32, ("cache", "enable_prefix_caching"): False})
    with pytest.raises(TypeError, match="no_such_setting"):
        llm.LLM(model="/m", no_such_setting=1)


# ---- the documented command lines still parse --------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
DOCUMENTED = ("README.md", "docs/DEPLOY.md", "docs/ARCHITECTURE.md", "deploy/helm/hybridpd/values.yaml")


COMMAND_LINE = re.compile(r"^\s*'?(?:exec\s+)?(?:\w+=\S+\s+)*(?:\.venv/bin/)?hybridpd "
                          r"((?:generate|worker|serve|proxy|init-model)\b[^\n`'&#|;\\]*)")


def _documented_commands() -> list[tuple[str, str]]:
    """Every line that runs `hybridpd <command> ...` in the docs and the Helm chart (up to a shell operator or
    comment); `{{ template }}` values become 1, the chart's extra engine flags (empty by default) nothing."""
    found = []
    for name in DOCUMENTED:
        text = re.sub(r"\{\{\s*\.Values\.workers\.engineArgs\s*\}\}", "", (REPO / name).read_text())
        for line in re.sub(r"\{\{[^}]*\}\}", "1", text).splitlines():
            if m := COMMAND_LINE.match(line):
                found.append((name, m.group(1).strip()))
    return found


def test_documented_command_lines_parse() -> None:
    commands_found = _documented_commands()
    assert {"README.md", "docs/DEPLOY.md", "deploy/helm/hybridpd/values.yaml"} <= {n for n, _ in commands_found}
    parser = cli.build_parser()
    for name, line in commands_found:
        try:
            parser.parse_args(shlex.split(line))
        except SystemExit:
            pytest.fail(f"{name}: `hybridpd {line}` no longer parses")
