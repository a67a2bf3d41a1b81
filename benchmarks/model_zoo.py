"""Held-out model-configuration sweep: many config.json variants of the supported families, each checked end to end.

For every variant a random-weight checkpoint is written by transformers itself (`AutoModelForCausalLM.from_config`
with transformers' own seeded init at `initializer_range` = hidden**-0.5, then every 1-D parameter and the router's
score-correction bias perturbed by seeded noise so norms and biases are not trivially 0 or 1; `save_pretrained`),
plus the byte-level tokenizer. Then, all fp32 on the CPU:

    TP 1 vs HF   hybridpd.engine.LLM (chunked prefill at 16 tokens a step, prefix caching, a repeated prompt that
                 hits the cache) against tests/oracle.py's hf_greedy: greedy tokens identical, logprobs within 1e-4
    TP n vs TP 1 LLM(tensor_parallel_size=n) (gloo ranks) against TP 1, for each n of --tp above 1 (default 2):
                 tokens identical, logprobs within 1e-4; a TP size the shapes cannot take: "TP refused", not a failure
    refused      variants the engine must not serve: loading must raise ModelLoadError naming the field

    python -m benchmarks.model_zoo                       # every variant: a table, and the rows in model_zoo.json
    python -m benchmarks.model_zoo --only qwen_kv1 --tp 1   # a few variants, TP 1 only
    python -m benchmarks.model_zoo --only tp_ --tp 1 2 3 4  # the tensor-parallel shapes at TP 2, 3 and 4
    python -m benchmarks.model_zoo --list
    python -m benchmarks.model_zoo --device cuda         # the engine's CUDA paths (fused kernels, fla-core)
    python -m benchmarks.model_zoo --fast-path --tp 1    # the batched path on the CPU (Triton interpreted)

Heavy (tens of minutes on 2 cores for the whole list); CI runs a compact parametrised subset
(tests/unit/test_model_variants.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

NEW_TOKENS = 8
LENGTHS = (3, 21, 40)
TOL = 1e-4
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "max_num_batched_tokens": 16,
    "kv_cache_memory_bytes": 8 * 2**20,
    "enable_prefix_caching": True,
    "max_model_len": 64,
}

FAST_PATH = False
"""--fast-path: TP 1 engines run the batched path (its Triton kernels under TRITON_INTERPRET=1 on the CPU)."""

L, F = "linear_attention", "full_attention"
NEMOTRON_BASE: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "mamba_num_heads": 8,
    "mamba_head_dim": 8,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
    "layers_block_type": [L, F, "mlp", L, "moe"],
}
QWEN_BASE: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "layer_types": [L, F, L],
}
QWEN_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def _nem(**o: Any) -> tuple[str, dict[str, Any]]:
    return "nemotron_h", {**NEMOTRON_BASE, **o}


def _qwen(**o: Any) -> tuple[str, dict[str, Any]]:
    return "qwen3_5", {**QWEN_BASE, **o}


def _qmoe(**o: Any) -> tuple[str, dict[str, Any]]:
    base = {k: v for k, v in QWEN_BASE.items() if k != "intermediate_size"}
    return "qwen3_5_moe", {**base, **QWEN_MOE, **o}


VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # -- NemotronH (Nemotron-H 8B/47B/56B, Nemotron-Nano 9B/12B v2, Nemotron-3-Nano-30B-A3B shapes in miniature)
    "nem_base": _nem(),
    "nem_head_dim_32": _nem(head_dim=32),  # head_dim != hidden / heads
    "nem_head_dim_24": _nem(head_dim=24),
    "nem_kv1": _nem(num_key_value_heads=1),
    "nem_kv_eq_heads": _nem(num_key_value_heads=4),
    "nem_groups1": _nem(n_groups=1),
    "nem_groups8": _nem(n_groups=8),  # one Mamba head per group
    "nem_mamba_hd16": _nem(mamba_head_dim=16, mamba_num_heads=4),
    "nem_mamba_hd10": _nem(mamba_head_dim=10, mamba_num_heads=8),  # Nano-v2: 80 (not a power of 2)
    "nem_mamba_heads12": _nem(mamba_num_heads=12, n_groups=4),  # Mamba width 96, not 2 x hidden
    "nem_group5_hd24": _nem(num_attention_heads=10, num_key_value_heads=2, head_dim=24),  # Nano-9B-v2: 40 / 8
    "nem_state12": _nem(ssm_state_size=12),  # not a power of two
    "nem_state8": _nem(ssm_state_size=8),
    "nem_state64": _nem(ssm_state_size=64),
    "nem_conv2": _nem(conv_kernel=2),
    "nem_conv3": _nem(conv_kernel=3),
    "nem_no_conv_bias": _nem(use_conv_bias=False),
    "nem_use_bias": _nem(use_bias=True),
    "nem_mlp_bias": _nem(mlp_bias=True),
    "nem_attention_bias": _nem(attention_bias=True),
    "nem_eps1e-6": _nem(layer_norm_epsilon=1e-6),
    "nem_residual_fp32": _nem(residual_in_fp32=True),
    "nem_tie": _nem(tie_word_embeddings=True),
    "nem_chunk4": _nem(chunk_size=4),
    "nem_chunk128": _nem(chunk_size=128),
    "nem_vocab259": _nem(vocab_size=259),
    "nem_vocab1000": _nem(vocab_size=1000),
    "nem_maxpos64": _nem(max_position_embeddings=64),
    "nem_mlp_silu": _nem(mlp_hidden_act="silu"),
    "nem_dt_min": _nem(time_step_min=0.01, time_step_limit=(0.0, float("inf"))),
    "nem_pattern_legacy": _nem(layers_block_type=None, hybrid_override_pattern="M-M*-"),
    "nem_start_attn": _nem(layers_block_type=[F, L, "mlp", L]),
    "nem_end_attn": _nem(layers_block_type=[L, "mlp", L, F]),
    "nem_start_mlp": _nem(layers_block_type=["mlp", L, F]),
    "nem_end_mlp": _nem(layers_block_type=[L, F, L, "mlp"]),
    "nem_start_moe": _nem(layers_block_type=["moe", L, F, L]),
    "nem_end_moe": _nem(layers_block_type=[L, F, "moe"]),
    "nem_mamba_only": _nem(layers_block_type=[L, L, "mlp"]),
    "nem_moe_8x1": _nem(n_routed_experts=8, num_experts_per_tok=1),
    "nem_moe_8x4": _nem(n_routed_experts=8, num_experts_per_tok=4),
    "nem_moe_no_norm": _nem(norm_topk_prob=False),
    "nem_moe_scale2.5": _nem(routed_scaling_factor=2.5),
    "nem_moe_groups": _nem(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2),
    "nem_moe_latent": _nem(moe_latent_size=32),
    "nem_moe_latent_bias": _nem(moe_latent_size=32, mlp_bias=True),
    "nem_no_shared": _nem(moe_shared_expert_intermediate_size=0, n_shared_experts=0),
    "nem_groups3": _nem(mamba_num_heads=6, n_groups=3),  # TP 2 can neither split nor replicate 3 groups
    "nem_3nano_like": _nem(
        layers_block_type=[L, "moe", L, F, "moe", L, "moe"],
        n_routed_experts=8,
        num_experts_per_tok=3,
        routed_scaling_factor=2.5,
        num_key_value_heads=1,
        head_dim=32,
    ),
    # -- Qwen3.5 dense (0.8B ... 27B shapes in miniature)
    "qwen_base": _qwen(),
    "qwen_head_dim_32": _qwen(head_dim=32),
    "qwen_kv1": _qwen(num_key_value_heads=1),
    "qwen_kv_eq_heads": _qwen(num_key_value_heads=4),
    "qwen_partial_0.5": _qwen(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    ),
    "qwen_partial_1.0": _qwen(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    ),
    "qwen_theta_1e7": _qwen(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
    "qwen_mrope": _qwen(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [1, 1, 0],
        }
    ),
    "qwen_attention_bias": _qwen(attention_bias=True),
    "qwen_conv2": _qwen(linear_conv_kernel_dim=2),
    "qwen_conv3": _qwen(linear_conv_kernel_dim=3),
    "qwen_group6_hd24": _qwen(num_attention_heads=6, num_key_value_heads=1, head_dim=24),  # 27B: 24 / 4
    "qwen_kdim12": _qwen(linear_key_head_dim=12),  # not a power of two
    "qwen_kdim16_vdim8": _qwen(linear_key_head_dim=16, linear_value_head_dim=8),
    "qwen_kdim8_vdim16": _qwen(linear_key_head_dim=8, linear_value_head_dim=16),
    "qwen_k1_v4": _qwen(linear_num_key_heads=1, linear_num_value_heads=4),
    "qwen_k2_v2": _qwen(linear_num_key_heads=2, linear_num_value_heads=2),
    "qwen_k2_v6": _qwen(linear_num_key_heads=2, linear_num_value_heads=6),
    "qwen_eps1e-5": _qwen(rms_norm_eps=1e-5),
    "qwen_tie": _qwen(tie_word_embeddings=True),
    "qwen_vocab259": _qwen(vocab_size=259),
    "qwen_maxpos64": _qwen(max_position_embeddings=64),
    "qwen_start_full": _qwen(layer_types=[F, L, L]),
    "qwen_end_full": _qwen(layer_types=[L, L, F]),
    "qwen_linear_only": _qwen(layer_types=[L, L]),
    "qwen_interval": _qwen(layer_types=None, num_hidden_layers=4, full_attention_interval=2),
    "qwen_attn_gate_key": _qwen(attn_output_gate=True),
    "qwen_gelu": _qwen(hidden_act="gelu"),  # the MLP's and the GDN conv's activation (the gated norm stays silu)
    # several sharding-sensitive fields at once (tests/unit/test_model_variants.py runs it at TP 2)
    "qwen_tp_mix": _qwen(
        vocab_size=301,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=24,
        attention_bias=True,
        tie_word_embeddings=True,
        linear_num_key_heads=1,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "partial_rotary_factor": 0.25,
        },
    ),
    # tensor-parallel shapes (run with --tp 1 2 4, or 3 where the heads allow): widths TP does not divide, one
    # KV head / Mamba group / GDN key head under TP 4, an odd vocabulary untied
    "tp_nem_odd_widths": _nem(intermediate_size=90, moe_intermediate_size=30, moe_shared_expert_intermediate_size=42),
    "tp_nem_prime_widths": _nem(intermediate_size=37, moe_intermediate_size=13, moe_shared_expert_intermediate_size=21),
    "tp_nem_kv1_g1": _nem(num_key_value_heads=1, n_groups=1, layers_block_type=[F, L, "moe", L, "mlp"]),
    "tp_nem_attn_last": _nem(layers_block_type=[L, "moe", L, "mlp", F], vocab_size=263),
    "tp_nem_top1_latent": _nem(moe_latent_size=24, mlp_bias=True, num_experts_per_tok=1),
    "tp_nem_tp3": _nem(
        num_attention_heads=6, num_key_value_heads=1, head_dim=8, mamba_num_heads=12, n_groups=1, intermediate_size=99
    ),
    "tp_qwen_k1_kv1": _qwen(num_key_value_heads=1, linear_num_key_heads=1, intermediate_size=45, layer_types=[F, L, L]),
    "tp_qwen_v8_vocab": _qwen(linear_num_value_heads=8, linear_value_head_dim=4, vocab_size=262),
    "tp_qwen_tp3": _qwen(
        num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=3, linear_num_value_heads=6
    ),
    "tp_qmoe_top1_odd": _qmoe(
        num_experts=6, num_experts_per_tok=1, moe_intermediate_size=17, shared_expert_intermediate_size=20
    ),
    "tp_qmoe_kv1_k1": _qmoe(num_key_value_heads=1, linear_num_key_heads=1, moe_intermediate_size=18),
    # -- Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B shapes in miniature)
    "qmoe_base": _qmoe(),
    "qmoe_8x1": _qmoe(num_experts=8, num_experts_per_tok=1),
    "qmoe_8x8": _qmoe(num_experts=8, num_experts_per_tok=8),
    "qmoe_shared16": _qmoe(shared_expert_intermediate_size=16),
    "qmoe_no_shared": _qmoe(shared_expert_intermediate_size=0),
    "qmoe_tie": _qmoe(tie_word_embeddings=True),
    "qmoe_kv1_hd32": _qmoe(num_key_value_heads=1, head_dim=32),
    # -- rope scaling types: served only if the engine implements them, else refused at load
    "qwen_rope_linear": _qwen(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.25}
    ),
    "qwen_rope_dynamic": _qwen(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.25}
    ),
    "qwen_rope_yarn_mscale": _qwen(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "partial_rotary_factor": 0.5,
        }
    ),
    "qwen_rope_yarn": _qwen(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "partial_rotary_factor": 0.25,
        }
    ),
}


def _legacy_head_dim(cfg: dict[str, Any]) -> None:
    """Nemotron-H 4B/8B/47B/56B ship `attention_head_dim`, no `head_dim` (transformers then uses its default 128)."""
    cfg["attention_head_dim"] = cfg.pop("head_dim")


def _legacy_mamba_names(cfg: dict[str, Any]) -> None:
    """Older NemotronH names, which transformers maps (and lets win over the current ones)."""
    for new, old in (
        ("n_groups", "mamba_n_groups"),
        ("conv_kernel", "mamba_d_conv"),
        ("chunk_size", "mamba_chunk_size"),
        ("use_conv_bias", "mamba_conv_bias"),
    ):
        cfg[old] = cfg[new]
        cfg[new] = {"n_groups": 1, "conv_kernel": 2, "chunk_size": 64, "use_conv_bias": False}[new]  # ignored


def _nemotron_rms_norm_eps(cfg: dict[str, Any]) -> None:
    """Nemotron-H configs also carry `rms_norm_eps`, which transformers ignores (layer_norm_epsilon counts)."""
    cfg["rms_norm_eps"] = 0.5


def _top_level_rope(cfg: dict[str, Any]) -> None:
    """Pre-`rope_parameters` style: rope_theta / partial_rotary_factor at the top level."""
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"], cfg["partial_rotary_factor"] = rope["rope_theta"], rope["partial_rotary_factor"]


EDITS: dict[str, Any] = {
    # config.json edited after save_pretrained (the reference loads the edited file too)
    "nem_attention_head_dim": _legacy_head_dim,
    "nem_legacy_mamba_names": _legacy_mamba_names,
    "nem_rms_norm_eps_key": _nemotron_rms_norm_eps,
    "qwen_top_level_rope": _top_level_rope,
}
VARIANTS.update(
    {
        "nem_attention_head_dim": _nem(num_attention_heads=2, num_key_value_heads=1, head_dim=128),
        "nem_legacy_mamba_names": _nem(n_groups=4, conv_kernel=3, chunk_size=4, use_conv_bias=True),
        "nem_rms_norm_eps_key": _nem(),
        "qwen_top_level_rope": _qwen(
            rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}
        ),
        # the multimodal wrapper (text part); transformers ties lm_head by the TOP-LEVEL tie_word_embeddings
        "mm_dense": ("qwen3_5_mm", {**QWEN_BASE}),
        "mm_moe": ("qwen3_5_moe_mm", {k: v for k, v in {**QWEN_BASE, **QWEN_MOE}.items() if k != "intermediate_size"}),
        "mm_tie_top_only": ("qwen3_5_mm", {**QWEN_BASE, "top_tie": True, "tie_word_embeddings": False}),
        "mm_tie_text_only": ("qwen3_5_mm", {**QWEN_BASE, "top_tie": False, "tie_word_embeddings": True}),
    }
)
MULTIMODAL = {
    "qwen3_5_mm": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "qwen3_5_moe_mm": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
}


def hf_config(family: str, overrides: dict[str, Any]) -> Any:
    import transformers

    if family in MULTIMODAL:
        config_cls, _, text_family = MULTIMODAL[family]
        text = dict(overrides)
        top_tie = text.pop("top_tie", text.get("tie_word_embeddings", False))
        text_cfg = hf_config(text_family, text).to_dict()
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 4,
            "out_hidden_size": text_cfg["hidden_size"],
            "spatial_merge_size": 1,
            "temporal_patch_size": 1,
        }
        return getattr(transformers, config_cls)(
            text_config=text_cfg, vision_config=vision, tie_word_embeddings=top_tie
        )
    cls = {"nemotron_h": "NemotronHConfig", "qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig"}[
        family
    ]
    o = {k: v for k, v in overrides.items() if v is not None}
    if family != "nemotron_h" and "layer_types" in o:
        o.setdefault("num_hidden_layers", len(o["layer_types"]))
    o.setdefault("initializer_range", float(o.get("hidden_size", 64)) ** -0.5)
    o.setdefault("eos_token_id", 256)
    o.setdefault("pad_token_id", 256)
    return getattr(transformers, cls)(**o)


@torch.no_grad()
def write_hf_checkpoint(out: str | Path, family: str, overrides: dict[str, Any], seed: int = 0) -> str:
    """A random-weight checkpoint written by transformers' own model class and init (seeded), 1-D parameters and
    score-correction biases perturbed (seeded); plus the byte-level tokenizer. Returns the directory."""
    from hybridpd.engine.tokenizer import write_tokenizer_files
    from transformers import AutoModelForCausalLM

    config = hf_config(family, overrides)
    torch.manual_seed(seed)
    if family in MULTIMODAL:
        import transformers

        model = getattr(transformers, MULTIMODAL[family][1])._from_config(config, dtype=torch.float32)
        text_config = config.get_text_config()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        text_config = config
    g = torch.Generator().manual_seed(seed + 1)
    named = dict(model.named_parameters())
    named.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    for name in sorted(named):
        t = named[name]
        if t.dim() <= 1 and t.is_floating_point():
            t.add_(0.1 * torch.randn(t.shape, generator=g))
    model.save_pretrained(str(out), safe_serialization=True)
    write_tokenizer_files(out, text_config.vocab_size, text_config.max_position_embeddings)
    return str(out)


def _edit_config(path: str, edit: Any) -> None:
    file = Path(path) / "config.json"
    cfg = json.loads(file.read_text())
    edit(cfg)
    file.write_text(json.dumps(cfg, indent=2))


@torch.no_grad()
def multimodal_greedy(path: str, family: str, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """transformers' multimodal model itself (not AutoModelForCausalLM), uncached greedy on a text prompt."""
    import transformers

    model = (
        getattr(transformers, MULTIMODAL[family][1])
        .from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        .eval()
    )
    ids, tokens, lps = list(prompt), [], []
    for _ in range(new):
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float(), -1)
        tokens.append(int(lp.argmax()))
        lps.append(float(lp[tokens[-1]]))
        ids.append(tokens[-1])
    return tokens, lps


def _engine_runs(path: str, tp: int, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    from hybridpd.engine import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    from contextlib import nullcontext

    from tests.support.forward_path import forward_path

    with forward_path(True) if FAST_PATH and tp == 1 else nullcontext():
        llm = LLM(model=path, tensor_parallel_size=tp, **SETTINGS)
    assert not (FAST_PATH and tp == 1) or llm.engine.runner.fast_path, "the batched path was not chosen"
    try:
        first = llm.generate(prompt_token_ids=prompts[:-1], sampling_params=greedy)
        again = llm.generate(prompt_token_ids=prompts[-1:], sampling_params=greedy)  # prefix-cache hit
        return [(list(o.token_ids), [float(x) for x in o.logprobs or []]) for o in first + again]
    finally:
        llm.shutdown()


def _compare(want: list[tuple[list[int], list[float]]], got: list[tuple[list[int], list[float]]]) -> dict[str, Any]:
    same = all(w[0] == g[0] for w, g in zip(want, got, strict=True))
    err = 0.0
    for (wt, wl), (gt, gl) in zip(want, got, strict=True):
        for a, b, x, y in zip(wt, gt, wl, gl, strict=False):
            if a != b:
                break
            err = max(err, abs(x - y))
    return {"tokens_equal": same, "max_lp_err": err, "ok": same and err < TOL}


def _has_attention(overrides: dict[str, Any]) -> bool:
    types = overrides.get("layers_block_type") or overrides.get("layer_types")
    pattern = overrides.get("hybrid_override_pattern")
    return (types is None and pattern is None) or F in (types or []) or "*" in (pattern or "")


def prompts_for(vocab: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    from tests.oracle import random_prompts

    prompts = random_prompts(list(lengths), min(vocab, 256), seed=3)
    return [*prompts, prompts[-1] + [7, 8, 9]]


def check_variant(
    name: str,
    tp_sizes: tuple[int, ...] = (1, 2),
    workdir: str | None = None,
    lengths: tuple[int, ...] = LENGTHS,
    new: int = NEW_TOKENS,
) -> dict[str, Any]:
    """One variant's row: TP 1 vs transformers and TP n vs TP 1 for every n > 1 in tp_sizes, on prompts of
    `lengths` plus the last one again with 3 more tokens (a prefix-cache hit), `new` greedy tokens each."""
    from hybridpd.engine.errors import InvalidRequestError, ModelLoadError

    from tests.oracle import hf_greedy, hf_greedy_uncached

    family, overrides = VARIANTS[name]
    row: dict[str, Any] = {"variant": name, "family": family}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        try:
            path = write_hf_checkpoint(tmp, family, overrides)
            if name in EDITS:
                _edit_config(path, EDITS[name])
        except Exception as e:  # transformers itself rejects the config: nothing to serve
            row["result"] = f"hf-rejects: {type(e).__name__}: {str(e)[:120]}"
            return row
        prompts = prompts_for(overrides.get("vocab_size", 300), lengths)
        try:
            tp1 = _engine_runs(path, 1, prompts, new)
        except ModelLoadError as e:
            row["result"] = f"refused: {str(e)[:160]}"
            return row
        if family in MULTIMODAL:
            ref = [multimodal_greedy(path, family, p, new) for p in prompts]
        elif _has_attention(overrides):
            ref = [hf_greedy(path, p, new) for p in prompts]
        else:  # transformers' generate needs an attention layer: one uncached forward per token
            ref = [hf_greedy_uncached(path, p, new) for p in prompts]
        row["tp1_vs_hf"] = _compare(ref, tp1)
        for tp in (n for n in tp_sizes if n > 1):
            try:
                row[f"tp{tp}_vs_tp1"] = _compare(tp1, _engine_runs(path, tp, prompts, new))
            except InvalidRequestError as e:
                row[f"tp{tp}_vs_tp1"] = {"ok": None, "refused": str(e)[:160]}
    ok = [c["ok"] for k, c in row.items() if k.endswith(("_vs_hf", "_vs_tp1")) and c["ok"] is not None]
    row["result"] = "pass" if all(ok) else "FAIL"
    return row


def _cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    if c.get("ok") is None:
        return "TP refused: " + c.get("refused", "")[:60]
    return f"{'same' if c['tokens_equal'] else 'DIFF'} tokens, lp err {c['max_lp_err']:.1e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help="variant names (prefix match)")
    p.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    p.add_argument("--out", default="model_zoo.json", help="the rows as JSON")
    p.add_argument("--list", action="store_true")
    p.add_argument("--fast-path", action="store_true", help="TP 1 on the batched path (CPU: Triton interpreted)")
    p.add_argument("--device", default="cpu", help="the engine's device (the transformers reference stays on the CPU)")
    args = p.parse_args(argv)
    SETTINGS["device"] = args.device
    if args.fast_path:
        global FAST_PATH
        FAST_PATH = True
        if args.device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    names = [n for n in VARIANTS if not args.only or any(n.startswith(o) for o in args.only)]
    if args.list:
        print("\n".join(names))
        return 0
    torch.set_num_threads(1)
    rows = []
    tps = [n for n in args.tp if n > 1]
    head = "".join(f" TP{n} vs TP1 |" for n in tps)
    print(f"| variant | TP1 vs HF |{head} result |\n|---|---|{'---|' * len(tps)}---|", flush=True)
    for name in names:
        t0 = time.time()
        try:
            row = check_variant(name, tuple(args.tp))
        except Exception as e:
            row = {
                "variant": name,
                "result": f"CRASH: {type(e).__name__}: {str(e)[:200]}",
                "trace": traceback.format_exc()[-3000:],
            }
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        cells = "".join(f" {_cell(row.get(f'tp{n}_vs_tp1'))} |" for n in tps)
        print(f"| {name} | {_cell(row.get('tp1_vs_hf'))} |{cells} {row['result']} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1, default=lambda x: x if math.isfinite(x) else str(x)) + "\n")
    return 0 if all(r["result"].startswith(("pass", "refused")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
