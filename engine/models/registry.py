"""Model loading: a Hugging Face-format directory -> a `CausalLM` on a device.

The family is picked by `architectures` in config.json (falling back to `model_type`). The model is built on the
meta device, then every tensor of the checkpoint (one `*.safetensors` file, several, or shards listed in
`model.safetensors.index.json`) is renamed by the family, checked against the expected name and shape, converted
to the requested dtype/device, and assigned. Anything wrong raises `ModelLoadError` with the reason.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from hybridpd.engine.errors import ModelLoadError
from hybridpd.engine.models.base import CausalLM
from hybridpd.engine.models.layers import torch_dtype
from hybridpd.engine.models.nemotron_h import NemotronHForCausalLM
from hybridpd.engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from safetensors import safe_open

logger = logging.getLogger(__name__)

ModelClass = type[NemotronHForCausalLM] | type[Qwen3_5ForCausalLM]

ARCHITECTURES: dict[str, ModelClass] = {
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,  # text part only
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,  # text part only
}
SERVABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Checkpoint tensor dtypes the loader converts; any other (fp8, int8, packed uint8) is refused."""
MODEL_TYPES = {
    "nemotron_h": "NemotronHForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def read_model_config(path: str | Path) -> dict[str, Any]:
    """config.json of a model directory as a dict (ModelLoadError if the directory or a valid file is missing)."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist or is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path} must hold a JSON object, not {type(cfg).__name__}")
    return cfg


def resolve_architecture(cfg: dict[str, Any]) -> str:
    """The supported architecture named by the config (first match of `architectures`, else by `model_type`)."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    if not archs and cfg.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[cfg["model_type"]]
    named = archs or [f"model_type={cfg.get('model_type')!r}"]
    raise ModelLoadError(f"unsupported architecture {named}; supported: {sorted(ARCHITECTURES)}")


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory (the index's shards if an index exists)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({str(f) for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is malformed: {e}") from None
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that do not exist: {missing}")
        return [root / f for f in files]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"model directory {str(path)!r} has no *.safetensors weights")
    return found


def _generation_eos(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return []
    try:
        eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos])]


def _resolve_dtype(dtype: str, cfg: dict[str, Any]) -> str:
    if dtype == "auto":
        text = cfg.get("text_config")
        text_dtype = text.get("dtype") if isinstance(text, dict) else None
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or text_dtype or "float32"
    torch_dtype(dtype)  # raises ValueError for unsupported names
    return dtype


def refuse_unservable(cfg: dict[str, Any]) -> None:
    """ModelLoadError for a config the engine would load but not compute right: quantized checkpoints (their
    scales would be dropped and the raw integers or fp8 values read as weights)."""
    text = cfg.get("text_config")
    for where, section in (("", cfg), ("text_config.", text if isinstance(text, dict) else {})):
        quant = section.get("quantization_config") or section.get("compression_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise ModelLoadError(
                f"config.json has {where}quantization_config (quant_method={method!r}): quantized "
                "checkpoints are not supported; use the unquantized (bf16/fp16/fp32) weights"
            )


def build_on_meta(path: str, dtype: str = "float32") -> CausalLM:
    """The model of a checkpoint directory built on the meta device (shapes only, no weights read). Raises
    ModelLoadError like load_model for a config it cannot build."""
    cfg = read_model_config(Path(path))
    arch = resolve_architecture(cfg)
    refuse_unservable(cfg)
    return _on_meta(path, arch, cfg, _resolve_dtype(dtype, cfg))


def _on_meta(path: str, arch: str, cfg: dict[str, Any], dtype: str) -> CausalLM:
    try:
        with torch.device("meta"):
            model: CausalLM = ARCHITECTURES[arch](cfg, dtype)
            return model
    except (KeyError, ValueError, TypeError, ZeroDivisionError, RuntimeError) as e:
        raise ModelLoadError(f"config.json of {str(path)!r} is malformed or not supported for {arch}: {e}") from None


def load_model(path: str, dtype: str = "float32", device: str = "cpu", load_format: str = "auto") -> CausalLM:
    """Load a supported HF-format model directory onto `device` in `dtype` ("float32", "bfloat16", "float16" or
    "auto" = the config's dtype). Raises ModelLoadError for a missing directory, missing or malformed config.json,
    unsupported architecture, missing weights, missing tensors and shape mismatches. load_format="dummy": random
    weights drawn on the device from config.json alone (no weight files read; vLLM's --load-format dummy), for
    benchmarks at full size."""
    root = Path(path)
    cfg = read_model_config(root)
    arch = resolve_architecture(cfg)
    refuse_unservable(cfg)
    cls = ARCHITECTURES[arch]
    dtype = _resolve_dtype(dtype, cfg)
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available")
    model = _on_meta(path, arch, cfg, dtype)
    if load_format == "dummy":
        _fill_dummy(model, cls, arch, cfg, dtype, target)
    else:
        from hybridpd.engine.models.weights_fit import cast_meta, free_device_bytes, require_room, weight_bytes

        cast_meta(model, cls.keep_fp32, torch_dtype(dtype))  # what the weights will take, checked before reading any
        require_room(weight_bytes(model), free_device_bytes(target))
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        loaded = _read_weights(root, cls, expected, torch_dtype(dtype), target)
        _tie_or_fail(model, cls, loaded, expected, path)
        model.load_state_dict(loaded, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    eos = list(model.eos_token_ids) + [e for e in _generation_eos(root) if e not in model.eos_token_ids]
    model.eos_token_ids = tuple(eos)
    return model


def _fill_dummy(model: Any, cls: ModelClass, arch: str, cfg: dict[str, Any], dtype: str, device: torch.device) -> None:
    from types import SimpleNamespace

    from hybridpd.engine.models.checkpoint import fill_random_weights

    nested = cfg.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else cfg
    family = "nemotron_h" if arch.startswith("NemotronH") else "qwen3_5"
    fill_random_weights(model, cls, family, SimpleNamespace(**text), dtype, device)
    if model.args.tie_word_embeddings:
        for dst, src in cls.tied_weights.items():
            model.get_parameter(dst).data = model.get_parameter(src).data


def _read_weights(
    root: Path, cls: ModelClass, expected: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = {}
    mismatched: list[str] = []
    unexpected: list[str] = []
    for file in weight_files(root):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = cls.checkpoint_name(key)
                    if name is None:
                        continue
                    raw = f.get_tensor(key)
                    if raw.dtype not in SERVABLE_DTYPES:
                        raise ModelLoadError(
                            f"checkpoint tensor {key!r} in {file.name} has dtype {raw.dtype}; only "
                            "float32/bfloat16/float16 weights are supported (quantized checkpoint?)"
                        )
                    for mapped, tensor in cls.split_checkpoint_tensor(name, raw):
                        if mapped not in expected:
                            unexpected.append(mapped)
                        elif tuple(tensor.shape) != expected[mapped]:
                            mismatched.append(f"{mapped}: checkpoint {tuple(tensor.shape)} vs model {expected[mapped]}")
                        else:
                            want = torch.float32 if cls.keep_fp32(mapped) else dtype
                            loaded[mapped] = tensor.to(device=device, dtype=want)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises several types for corrupt files
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from None
    if mismatched:
        raise ModelLoadError(f"{len(mismatched)} tensor shape mismatches, e.g. {mismatched[:5]}")
    if unexpected:
        logger.warning("ignoring %d unexpected checkpoint tensors, e.g. %s", len(unexpected), unexpected[:5])
    return loaded


def _tie_or_fail(
    model: Any, cls: ModelClass, loaded: dict[str, torch.Tensor], expected: dict[str, Any], path: str | Path
) -> None:
    if model.args.tie_word_embeddings:
        for dst, src in cls.tied_weights.items():
            if src in loaded and (cls.always_tie or dst not in loaded):
                loaded[dst] = loaded[src]
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ModelLoadError(
            f"checkpoint in {str(path)!r} lacks {len(missing)} tensors the model needs, e.g. {missing[:8]}"
        )


__all__ = [
    "ARCHITECTURES",
    "build_on_meta",
    "load_model",
    "read_model_config",
    "refuse_unservable",
    "resolve_architecture",
    "weight_files",
]
