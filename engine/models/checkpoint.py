"""Random-weight HF-format checkpoints of the supported families (for `hybridpd init-model`, tests, benchmarks).

`write_random_checkpoint` builds the transformers config (tiny defaults, every field overridable), instantiates
transformers' own model in fp32, re-initialises every weight from a seeded generator with scales chosen so the
model is not degenerate (activations O(1), logits with std ~2.5, Mamba/GDN decays in a useful range), saves it
with `save_pretrained(safe_serialization=True)` and writes the byte-level tokenizer. The same arguments write
byte-identical weight files.

Derived defaults scale with `hidden_size` (<= 128: tiny test model; larger: benchmark-sized heads), e.g.
`write_random_checkpoint(d, "nemotron_h", hidden_size=1024, num_hidden_layers=24)` is a ~0.3B-parameter model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from hybridpd.engine.tokenizer import write_tokenizer_files

FAMILIES = ("nemotron_h", "qwen3_5", "qwen3_5_moe")

NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # nvidia/Nemotron-H-8B-Base-8K (public config): 52 layers, 4 attention, Mamba-2 128 heads x 64, state 128.
    "nemotron-h-8b": ("nemotron_h", {
        "vocab_size": 131072, "hidden_size": 4096, "pattern": NEMOTRON_H_8B_PATTERN,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "chunk_size": 128, "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "max_position_embeddings": 8192,
    }),
    # Qwen/Qwen3.5-9B text model: 32 layers (3 Gated-DeltaNet : 1 gated attention), GDN 16 k / 32 v heads x 128,
    # attention 16 q / 4 kv heads x 256, partial rotary 0.25.
    "qwen3.5-9b": ("qwen3_5", {
        "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(32)],
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                                               "partial_rotary_factor": 0.25},
    }),
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B (public config): 52 layers (23 Mamba-2, 23 MoE, 6 attention), 128 routed
    # experts top-6 + 1 shared, sigmoid router with scaling 2.5.
    "nemotron-3-nano-30b-a3b": ("nemotron_h", {
        "vocab_size": 131072, "hidden_size": 2688, "pattern": NEMOTRON_3_NANO_PATTERN,
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "chunk_size": 128, "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "max_position_embeddings": 262144,
        "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True,
    }),
    # The ~1B shapes (hidden 2048, 24 layers, the families' default heads and state): 0.67 B and
    # 1.72 B parameters here (the 0.79 / 1.85 B came with a larger vocabulary).
    "nemotron-h-0.7b": ("nemotron_h", {"hidden_size": 2048, "num_hidden_layers": 24, "pattern": "M-M-M*-M-"}),
    "qwen3.5-1.7b": ("qwen3_5", {"hidden_size": 2048, "num_hidden_layers": 24}),
}
"""Full-size public shapes with random weights (`hybridpd init-model --preset NAME`, benchmarks/roofline.py).
Tokenizer, eos and bos stay the byte-level ones of the tiny models (ids < 257 exist in every vocabulary)."""
EOS_ID = 256  # <|endoftext|> of the byte-level tokenizer
DEFAULT_NEMOTRON_H_PATTERN = "M*-M-"
DEFAULT_QWEN3_5_LAYERS = ("linear_attention", "linear_attention", "full_attention", "linear_attention")


def nemotron_h_config(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for transformers' NemotronHConfig. Extra keys: `pattern` (alias of
    hybrid_override_pattern) and `num_hidden_layers` (repeats the pattern to that many layers)."""
    o = dict(overrides)
    hidden = int(o.pop("hidden_size", 64))
    tiny = hidden <= 128
    pattern = o.pop("pattern", None)
    pattern = pattern or o.pop("hybrid_override_pattern", None) or DEFAULT_NEMOTRON_H_PATTERN
    layers = o.pop("num_hidden_layers", None)
    if layers is not None:
        pattern = (pattern * layers)[:layers]
    head_dim = 32 if tiny else 64
    heads = max(2, hidden // head_dim)
    mamba_head_dim = 16 if tiny else 64
    cfg: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": head_dim,
        "intermediate_size": 4 * hidden,
        "mamba_num_heads": 2 * hidden // mamba_head_dim,
        "mamba_head_dim": mamba_head_dim,
        "n_groups": 2 if tiny else 4,
        "ssm_state_size": 16 if tiny else 64,
        "conv_kernel": 4,
        "chunk_size": 128,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden,
        "moe_shared_expert_intermediate_size": hidden,
        "max_position_embeddings": 4096,
        "eos_token_id": EOS_ID,
        "bos_token_id": None,
        "pad_token_id": EOS_ID,
        "tie_word_embeddings": False,
    }
    if "layers_block_type" not in o:
        cfg["hybrid_override_pattern"] = pattern
    cfg.update(o)
    return cfg


def qwen3_5_config(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for transformers' Qwen3_5TextConfig. `num_hidden_layers` without `layer_types` repeats
    the default [linear, linear, full, linear] cycle."""
    o = dict(overrides)
    hidden = int(o.pop("hidden_size", 64))
    tiny = hidden <= 128
    layer_types = o.pop("layer_types", None)
    layers = o.pop("num_hidden_layers", None)
    if layer_types is None:
        n = layers or len(DEFAULT_QWEN3_5_LAYERS)
        layer_types = [DEFAULT_QWEN3_5_LAYERS[i % len(DEFAULT_QWEN3_5_LAYERS)] for i in range(n)]
    key_heads = 2 if tiny else max(2, hidden // 128)
    heads = 2 if tiny else hidden // 64
    cfg: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden if tiny else 3 * hidden,
        "num_hidden_layers": len(layer_types),
        "layer_types": list(layer_types),
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 32 if tiny else 128,
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": 2 * key_heads,
        "linear_key_head_dim": 16 if tiny else 128,
        "linear_value_head_dim": 16 if tiny else 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 4096,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
    }
    cfg.update(o)
    return cfg


def qwen3_5_moe_config(**overrides: Any) -> dict[str, Any]:
    """qwen3_5_config plus the sparse MoE block's fields (4 experts, top 2 at the tiny size)."""
    hidden = int(overrides.get("hidden_size", 64))
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
           "shared_expert_intermediate_size": 2 * hidden}
    moe.update({k: overrides.pop(k) for k in list(overrides) if k in moe})
    cfg = qwen3_5_config(**overrides)
    cfg.pop("intermediate_size", None)
    return {**cfg, **moe}


QK_CORRELATION = 0.9
"""GDN keys are initialised as 0.9 * the query weights + noise (in in_proj_qkv and conv1d), so a token's query
finds its own key, as in a trained model. With independent q/k the GDN outputs are tiny cancellations that its
per-head RMSNorm amplifies, and fp32 rounding alone then moves logprobs by ~1e-4 (in transformers too)."""


def preset(name: str) -> tuple[str, dict[str, Any]]:
    """(family, config overrides) of a preset in PRESETS."""
    try:
        family, overrides = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None
    return family, dict(overrides)


def _init_value(name: str, t: torch.Tensor, family: str, config: Any, g: torch.Generator) -> torch.Tensor:
    """The re-initialised value of one parameter/buffer, by checkpoint name (drawn on `g`'s device, fp32)."""
    hidden = config.hidden_size

    def randn(std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(t.shape, generator=g, dtype=torch.float32, device=g.device) * std + mean

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(t.shape, generator=g, dtype=torch.float32, device=g.device) * (hi - lo) + lo

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(("embeddings.weight", "embed_tokens.weight")):
        return randn()
    if name == "lm_head.weight":
        return randn(2.5 / math.sqrt(hidden))
    if leaf == "A_log":
        return torch.log(uniform(1.0, 8.0) if family == "nemotron_h" else uniform(0.05, 1.0))
    if leaf == "dt_bias":
        if family == "qwen3_5":
            return randn(0.2, 1.0)
        dt = torch.exp(uniform(math.log(0.02), math.log(0.2)))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if leaf == "D":
        return uniform(0.5, 1.5)
    if leaf == "e_score_correction_bias":
        return randn(0.1)
    if "conv1d" in name and leaf == "bias":
        return randn(0.1)
    if "conv1d" in name or name.endswith("in_proj_qkv.weight"):
        value = randn(1.0 / math.sqrt(t.shape[-1]))
        if family == "qwen3_5":
            kd = config.linear_num_key_heads * config.linear_key_head_dim
            mix = QK_CORRELATION
            value[kd : 2 * kd] = mix * value[:kd] + math.sqrt(1 - mix * mix) * value[kd : 2 * kd]
        return value
    if "norm" in name and leaf == "weight":
        zero_centred = family == "qwen3_5" and "linear_attn.norm" not in name
        return randn(0.1, 0.0 if zero_centred else 1.0)
    if leaf == "bias":
        return randn(0.02)
    if t.dim() in (2, 3):  # linear layers, router, merged experts [E, out, in]
        return randn(1.0 / math.sqrt(t.shape[-1]))
    raise ValueError(f"no init rule for {name} {tuple(t.shape)}")


@torch.no_grad()
def _reinit(model: torch.nn.Module, family: str, config: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    for name in sorted(tensors):
        tensors[name].copy_(_init_value(name, tensors[name], family, config, g))


def write_random_checkpoint(
    out_dir: str | Path, family: str, seed: int = 0, weights: bool = True, **overrides: Any
) -> str:
    """Write a random-weight HF checkpoint of `family` ("nemotron_h" | "qwen3_5") plus a byte-level tokenizer
    into `out_dir` (created if needed); returns the path. `overrides` are config fields (see nemotron_h_config /
    qwen3_5_config). Deterministic in (family, seed, overrides). weights=False writes config.json and the tokenizer
    only: a directory for `load_format="dummy"` (random weights drawn on the device at load)."""
    if family == "nemotron_h":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        cfg_kwargs = nemotron_h_config(**overrides)
        config: Any = NemotronHConfig(**cfg_kwargs)
        model_cls: Any = NemotronHForCausalLM
    elif family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg_kwargs = qwen3_5_config(**overrides)
        config = Qwen3_5TextConfig(**cfg_kwargs)
        model_cls = Qwen3_5ForCausalLM
    elif family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        config = Qwen3_5MoeTextConfig(**qwen3_5_moe_config(**overrides))
        model_cls = Qwen3_5MoeForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not weights:
        config.architectures = [model_cls.__name__]
        config.save_pretrained(str(out))
        write_tokenizer_files(out, config.vocab_size, config.max_position_embeddings)
        return str(out)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _reinit(model, "qwen3_5" if family == "qwen3_5_moe" else family, config, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    write_tokenizer_files(out, config.vocab_size, config.max_position_embeddings)
    return str(out)


def write_preset_checkpoint(out_dir: str | Path, name: str, seed: int = 0, weights: bool = True) -> str:
    """write_random_checkpoint at a full-size preset (fp32 weights on disk: ~4 bytes per parameter; weights=False:
    config and tokenizer only, for load_format="dummy")."""
    family, overrides = preset(name)
    return write_random_checkpoint(out_dir, family, seed=seed, weights=weights, **overrides)


def hf_config(family: str, **overrides: Any) -> Any:
    """transformers' config object of `family` with `overrides` (see nemotron_h_config / qwen3_5_config)."""
    if family == "nemotron_h":
        from transformers import NemotronHConfig

        return NemotronHConfig(**nemotron_h_config(**overrides))
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**qwen3_5_config(**overrides))
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(**qwen3_5_moe_config(**overrides))
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


@torch.no_grad()
def random_engine_model(family: str, dtype: str, device: str, seed: int = 0, **overrides: Any) -> Any:
    """The engine's own model of `family`, built directly on `device` with random weights drawn there by the same
    rules as write_random_checkpoint (not the same values: a device generator). For benchmarks at full size, where
    writing and reading a 16-32 GB fp32 checkpoint would dominate; never for correctness against transformers."""
    from hybridpd.engine.models.registry import ARCHITECTURES

    config = hf_config(family, **overrides)
    cfg = config.to_dict()
    cls = ARCHITECTURES["NemotronHForCausalLM" if family == "nemotron_h" else "Qwen3_5ForCausalLM"]
    with torch.device("meta"):
        model = cls(cfg, dtype)
    fill_random_weights(model, cls, family, config, dtype, device, seed)
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def fill_random_weights(model: Any, cls: Any, family: str, config: Any, dtype: str, device: str | torch.device,
                        seed: int = 0) -> None:
    """Materialise a meta-device engine model on `device` with random weights drawn there (random_engine_model's
    rules; `load_format="dummy"`). `config` needs the attributes _init_value reads (an HF config or a namespace)."""
    from hybridpd.engine.models.layers import torch_dtype
    from hybridpd.engine.models.weights_fit import cast_meta, free_device_bytes, require_room, weight_bytes

    target = torch.device(device)
    # final dtypes first, on meta: to_empty would otherwise allocate every weight in the dtype the modules were built
    # with (fp32), twice the bf16 weights (a 59 GiB model then ran an 80 GB GPU out of memory while loading)
    cast_meta(model, cls.keep_fp32, torch_dtype(dtype))
    require_room(weight_bytes(model), free_device_bytes(target))
    model.to_empty(device=target)
    g = torch.Generator(device=target).manual_seed(seed)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        value = _init_value(name, t, family, config, g)  # fp32, one tensor at a time
        t.copy_(value)  # into the storage to_empty made: no second copy of the weights on the device
        del value


__all__ = ["FAMILIES", "PRESETS", "fill_random_weights", "hf_config", "nemotron_h_config", "preset", "qwen3_5_config",
           "random_engine_model", "write_preset_checkpoint", "write_random_checkpoint"]
