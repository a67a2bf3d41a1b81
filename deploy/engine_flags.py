"""Engine flags, generated from engine/config.py's frozen sections: one flag per field, its help text the field's
docstring, its type, default and choices those of the field. Every command that runs an engine (`generate`,
`worker`, `serve`) takes them through `add_engine_args`, builds the config with `engine_config_from_args`, and
`serve` hands its config to each worker as `engine_argv(config)`. A field added to the config is a new flag of
every one of them.

    field               flag                      type / choices
    cache.block_size    --block-size N            int (Optional[int]: default None)
    model.dtype         --dtype {float32,...}     Literal[...] -> choices
    cache.enable_..     --prefix-caching / --no-prefix-caching   bool (names below keep documented spellings)
    model.path          --model DIR               default: the built-in tiny model

The spellings are a contract (README, docs/DEPLOY.md, the Helm chart's worker args): `FLAG_NAMES` keeps the two
that differ from the field name.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any

from hybridpd.deploy.vllm_flags import (
    PREFIX_CACHING_ALIAS,
    add_vllm_args,
    check_vllm_args,
    human_readable_int,
    human_readable_int_or_auto,
)
from hybridpd.engine.config import EngineConfig, config_sections, field_docs

FLAG_NAMES = {("model", "path"): "model", ("cache", "enable_prefix_caching"): "prefix-caching"}
"""Flags not spelled like their field (`--model`, `--prefix-caching` / `--no-prefix-caching`)."""

FLAG_PARSERS = {
    ("model", "max_model_len"): human_readable_int_or_auto,
    ("cache", "kv_cache_memory_bytes"): human_readable_int,
    ("scheduler", "max_num_batched_tokens"): human_readable_int,
}
"""Flags whose values vLLM reads as human-readable integers (32k, 4G; --max-model-len also auto)."""


@dataclass(frozen=True)
class EngineFlag:
    """One config field as a command-line flag."""

    section: str  # the root's field holding the section: "model", "cache", "scheduler"
    name: str  # the section's field
    option: str  # "--block-size"
    kind: type  # int | float | str | bool
    default: Any
    choices: tuple[Any, ...] | None
    help: str

    @property
    def dest(self) -> str:
        return self.option[2:].replace("-", "_") if self.kind is not bool else self.name


def _kind(hint: Any, where: str) -> tuple[type, tuple[Any, ...] | None]:
    """(argparse type, choices) of a field annotation: int, float, str, bool, a one-type Literal, or Optional of one."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if len(args) != 1:
            raise TypeError(f"{where}: a flag needs one type, got {hint}")
        hint = args[0]
    if typing.get_origin(hint) is typing.Literal:
        kinds = {type(v) for v in typing.get_args(hint)}
        if len(kinds) != 1:
            raise TypeError(f"{where}: a flag's choices need one type, got {hint}")
        return kinds.pop(), tuple(typing.get_args(hint))
    if hint in (int, float, str, bool):
        return hint, None
    raise TypeError(f"{where}: no flag type for {hint} (int, float, str, bool, Literal or Optional of one)")


def engine_flags(root: type = EngineConfig) -> tuple[EngineFlag, ...]:
    """One flag per field of each section of `root`. A field without a docstring is a TypeError: every flag has
    help text."""
    out = []
    for section, cls in config_sections(root).items():
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in fields(cls):
            where = f"{cls.__name__}.{f.name}"
            if not docs.get(f.name):
                raise TypeError(f"{where} has no docstring: it is the help text of its command-line flag")
            kind, choices = _kind(hints[f.name], where)
            default = f.default_factory() if f.default_factory is not MISSING else \
                None if f.default is MISSING else f.default
            name = FLAG_NAMES.get((section, f.name), f.name.replace("_", "-"))
            out.append(EngineFlag(section, f.name, f"--{name}", kind, default, choices, docs[f.name]))
    return tuple(out)


def add_engine_args(parser: argparse.ArgumentParser, flags: tuple[EngineFlag, ...] | None = None) -> None:
    """The engine flags, plus --enforce-eager (not a config field: an environment variable the runner reads) and
    vLLM's spellings (deploy/vllm_flags.py)."""
    for flag in flags if flags is not None else engine_flags():
        text = flag.help.replace("%", "%%")
        if flag.kind is bool:
            alias = (PREFIX_CACHING_ALIAS,) if flag.name == "enable_prefix_caching" else ()  # vLLM's spelling
            parser.add_argument(flag.option, *alias, dest=flag.dest, action=argparse.BooleanOptionalAction,
                                default=flag.default, help=text)
        else:
            parser.add_argument(flag.option, dest=flag.dest, default=flag.default, choices=flag.choices, help=text,
                                type=FLAG_PARSERS.get((flag.section, flag.name), flag.kind))
    parser.add_argument("--enforce-eager", action="store_true",
                        help="GPU: no CUDA graphs for decode steps (sets HYBRIDPD_ENFORCE_EAGER=1 for this process and "
                             "the workers it starts)")
    add_vllm_args(parser)


def default_model() -> str:
    from hybridpd.engine.default_model import default_model_path

    return default_model_path()


def engine_config_from_args(args: argparse.Namespace, root: type = EngineConfig,
                            flags: tuple[EngineFlag, ...] | None = None) -> Any:
    """The config the parsed engine flags describe (no --model: the built-in tiny model)."""
    check_vllm_args(args)
    revisions = {"path": getattr(args, "revision", None), "tokenizer": getattr(args, "tokenizer_revision", None)}
    values: dict[str, dict[str, Any]] = {section: {} for section in config_sections(root)}
    for flag in flags if flags is not None else engine_flags(root):
        values[flag.section][flag.name] = getattr(args, flag.dest)
    sections = {}
    for section, cls in config_sections(root).items():
        if values[section].get("path", "") is None:
            values[section]["path"] = default_model()
        for key in ("path", "tokenizer"):  # a Hugging Face model id: its snapshot in the local cache
            if values[section].get(key):
                from hybridpd.engine.model_source import resolve_model

                values[section][key] = resolve_model(values[section][key], revisions[key],
                                                     cache_dir=getattr(args, "download_dir", None))
        sections[section] = cls(**values[section])
    return root(**sections)


def engine_argv(config: EngineConfig) -> list[str]:
    """`config` as engine flags (`--model` first; fields at their default are left out), for a worker command line:
    parsed back by engine_config_from_args it is `config` again."""
    argv = ["--model", config.model.path]
    for flag in engine_flags():
        value = getattr(getattr(config, flag.section), flag.name)
        if flag.name == "path" or value == flag.default:
            continue
        if flag.kind is bool:
            argv.append(flag.option if value else f"--no-{flag.option[2:]}")
        elif value is None:
            raise ValueError(f"{flag.option}: None cannot be written as a flag (its default is {flag.default!r})")
        else:
            argv += [flag.option, str(value)]
    return argv
