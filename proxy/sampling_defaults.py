"""Sampling defaults of requests that set none, from the model's `generation_config.json`, as vLLM's
`--generation-config` (default "auto") gives them: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`,
`presence_penalty`, `frequency_penalty` fill the fields a request leaves out, and `max_new_tokens` is the max_tokens
of a request with no limit of its own (chat without max_tokens, a completion with `"max_tokens": null`; a
completion without the field keeps its 16). A request's own values always win. The source: "auto" (the model
directory's file; none there: no defaults), "vllm" (none: vLLM's neutral defaults), or a directory holding one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path

from hybridpd.proxy.openai_schema import SamplingOptions

log = logging.getLogger(__name__)

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
"""The generation-config fields vLLM takes as sampling defaults (besides max_new_tokens)."""


def load_sampling_defaults(source: str, model_dir: str | None) -> dict[str, float | int]:
    """{field: value} (`max_tokens` for max_new_tokens). A file that cannot be read gives none (logged); a
    `source` directory without the file is a ValueError (a configuration mistake)."""
    if source == "vllm":
        return {}
    if source == "auto":
        if model_dir is None or not (Path(model_dir) / "generation_config.json").is_file():
            return {}
        path = Path(model_dir) / "generation_config.json"
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config {source!r}: no generation_config.json there")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("not using %s for sampling defaults: %s", path, e)
        return {}
    if not isinstance(config, dict):
        return {}
    out: dict[str, float | int] = {}
    for name in FIELDS:
        value = config.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    max_new = config.get("max_new_tokens")
    if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new > 0:
        out["max_tokens"] = max_new
    if out:
        log.info("sampling defaults from %s (requests' own values win): %s", path, out)
    return out


def apply_sampling_defaults(sampling: SamplingOptions, defaults: Mapping[str, float | int]) -> SamplingOptions:
    """`sampling` with the defaults in the fields the request left out (None)."""
    fill = {k: v for k, v in defaults.items() if k in FIELDS and getattr(sampling, k) is None}
    return dataclasses.replace(sampling, **fill) if fill else sampling


__all__ = ["FIELDS", "apply_sampling_defaults", "load_sampling_defaults"]
