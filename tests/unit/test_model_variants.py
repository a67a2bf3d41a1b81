"""Held-out config.json variants (benchmarks/model_zoo.py's sweep, a compact subset): checkpoints written by
transformers itself (its own model class and init), served by the engine (chunked prefill, prefix caching with a
repeated prompt), greedy tokens and logprobs equal to transformers' (fp32). Variants the engine cannot serve must
be refused at load with a ModelLoadError naming the field. The whole list (and TP 2 vs TP 1) runs in the sweep:
`python -m benchmarks.model_zoo`."""

from __future__ import annotations

from typing import Any

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.errors import ModelLoadError

from benchmarks import model_zoo
from tests.oracle import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 4
SETTINGS = {**model_zoo.SETTINGS, "kv_cache_memory_bytes": 4 * 2**20}


def _checkpoint(name: str, out: str) -> tuple[str, str]:
    family, overrides = model_zoo.VARIANTS[name]
    path = model_zoo.write_hf_checkpoint(out, family, overrides)
    if name in model_zoo.EDITS:
        model_zoo._edit_config(path, model_zoo.EDITS[name])
    return path, family


def _engine(path: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    llm = LLM(model=path, **SETTINGS)
    first = llm.generate(prompt_token_ids=prompts[:-1], sampling_params=greedy)
    again = llm.generate(prompt_token_ids=prompts[-1:], sampling_params=greedy)  # a prefix-cache hit
    return [(list(o.token_ids), list(o.logprobs or [])) for o in first + again]


@pytest.mark.parametrize(
    "name",
    [
        "nem_attention_head_dim",  # legacy `attention_head_dim` (Nemotron-H 4B/8B/47B/56B), no `head_dim`
        "nem_3nano_like",  # MoE, sigmoid router with scaling, 1 KV head, head_dim != hidden / heads
        "nem_moe_groups",  # group-limited routing (n_group / topk_group)
        "nem_no_shared",  # moe_shared_expert_intermediate_size 0: transformers falls back to intermediate_size
        "qwen_kdim16_vdim8",  # GDN key head dim != value head dim
        "qwen_top_level_rope",  # rope_theta / partial_rotary_factor at the top level
        "mm_tie_top_only",  # multimodal: lm_head tied by the top-level flag only
        "mm_tie_text_only",  # multimodal: text_config says tie, the top level (which transformers reads) does not
        "qwen_rope_yarn",  # YaRN rope scaling (positions past original_max_position_embeddings)
        "qwen_rope_linear",
    ],
)
def test_variant_matches_transformers(name: str, tmp_path: Any) -> None:
    path, family = _checkpoint(name, str(tmp_path))
    prompts = model_zoo.prompts_for(300)[1:]
    got = _engine(path, prompts)
    for prompt, (tokens, lps) in zip(prompts, got, strict=True):
        if family in model_zoo.MULTIMODAL:
            want, want_lps = model_zoo.multimodal_greedy(path, family, prompt, NEW)
        else:
            want, want_lps = hf_greedy(path, prompt, NEW)
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < model_zoo.TOL


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("qwen_rope_dynamic", "rope_type"),  # dynamic NTK: frequencies that change with the sequence length
    ],
)
def test_unsupported_variant_is_refused_at_load(name: str, field: str, tmp_path: Any) -> None:
    path, _ = _checkpoint(name, str(tmp_path))
    with pytest.raises(ModelLoadError, match=field):
        LLM(model=path, **SETTINGS)


def test_quantized_checkpoints_are_refused_at_load(tmp_path: Any) -> None:
    """A quantization_config (top level or in a multimodal text_config) or fp8 / integer weight tensors: refused,
    never loaded with the scales dropped."""
    import json

    import torch
    from hybridpd.engine.models.checkpoint import write_random_checkpoint
    from hybridpd.engine.models.registry import load_model
    from safetensors.torch import load_file, save_file

    path = write_random_checkpoint(str(tmp_path), "nemotron_h", pattern="M*")
    config_file = tmp_path / "config.json"
    plain = json.loads(config_file.read_text())
    for cfg in (
        {**plain, "quantization_config": {"quant_method": "fp8"}},
        {**plain, "text_config": {"quantization_config": {"quant_method": "awq"}}},
    ):
        config_file.write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match="quantization_config"):
            load_model(path)
    config_file.write_text(json.dumps(plain))
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="float8"):
        load_model(path)


@pytest.mark.parametrize(
    ("family", "arch"),
    [
        ("nemotron_h", "NemotronHForCausalLM"),
        ("qwen3_5", "Qwen3_5ForCausalLM"),
        ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    ],
)
def test_missing_fields_take_transformers_defaults(family: str, arch: str) -> None:
    """A config.json that leaves fields out: the engine's shapes are those transformers builds from it."""
    import torch
    from hybridpd.engine.models.registry import ARCHITECTURES

    minimal = {
        "vocab_size": 300,
        "hidden_size": 64,
        "num_attention_heads": 8,  # a multiple of every default KV head count
        "intermediate_size": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "n_groups": 2,
        "ssm_state_size": 8,
        "moe_intermediate_size": 8,
        "n_routed_experts": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "layers_block_type": ["linear_attention", "full_attention", "moe"],
        "num_hidden_layers": 2,
    }
    keep = set(model_zoo.hf_config(family, {}).to_dict())
    cfg = {k: v for k, v in minimal.items() if k in keep or k == "layers_block_type" and family == "nemotron_h"}
    if family != "nemotron_h":
        cfg.pop("layers_block_type", None)
    else:
        cfg.pop("layer_types", None)
        cfg.pop("num_hidden_layers", None)
    hf = model_zoo.hf_config(family, {**cfg, "initializer_range": 0.02})
    from transformers import AutoModelForCausalLM

    want = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(hf).state_dict().items()}
    with torch.device("meta"):
        model = ARCHITECTURES[arch](cfg)
    cls = ARCHITECTURES[arch]
    got: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        got[name] = tuple(t.shape)
    mapped = {}
    for name, shape in want.items():
        target = cls.checkpoint_name(name)
        if target is None:
            continue
        for piece, tensor in cls.split_checkpoint_tensor(target, torch.empty(shape, device="meta")):
            mapped[piece] = tuple(tensor.shape)
    assert {n: s for n, s in mapped.items() if n in got} == {n: got[n] for n in mapped if n in got}
    assert set(got) - set(mapped) <= {"lm_head.weight"}, sorted(set(got) - set(mapped))[:5]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 3.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "beta_slow": 2,
        },
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.3},
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},  # the legacy key
    ],
)
def test_rope_frequencies_equal_transformers(rope: dict[str, Any]) -> None:
    import torch
    from hybridpd.engine.models.rope_scaling import rope_frequencies
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**rope, "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    config = model_zoo.hf_config(
        "qwen3_5", {**model_zoo.QWEN_BASE, "head_dim": 40, "max_position_embeddings": 256, "rope_parameters": params}
    )
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        want_scale = 1.0  # transformers' default rope: 1 / base^(2i/d)
        want = 1.0 / (1e6 ** (torch.arange(0, 20, 2, dtype=torch.int64).float() / 20))
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    got, scale = rope_frequencies(params, 1e6, 20, 256)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12)


def test_mixed_variant_at_tp2(tmp_path: Any) -> None:
    """Sharding-sensitive fields together (GQA group 6 on one KV head, head dim 24, attention biases, a GDN key head
    shared by 4 value heads, key dim != value dim, tied embeddings over an odd vocabulary, YaRN): TP 1 equals
    transformers and TP 2 equals TP 1 (the sweep's check: 2 prompts and a prefix hit, 4 tokens each)."""
    row = model_zoo.check_variant("qwen_tp_mix", (1, 2), workdir=str(tmp_path), lengths=(3, 21), new=NEW)
    assert row["tp1_vs_hf"]["ok"] and row["tp2_vs_tp1"]["ok"], row


@pytest.mark.parametrize(
    ("family", "fields", "named"),
    [
        ("nemotron_h", {"num_attention_heads": 6, "num_key_value_heads": 4}, "num_key_value_heads=4"),
        ("nemotron_h", {"mamba_num_heads": 6, "n_groups": 4}, "n_groups=4"),
        ("nemotron_h", {"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
        ("nemotron_h", {"n_group": 3}, "n_group=3"),
        (
            "nemotron_h",
            {"n_routed_experts": 8, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
            "num_experts_per_tok=3",
        ),
        ("qwen3_5", {"linear_num_key_heads": 2, "linear_num_value_heads": 3}, "linear_num_key_heads=2"),
        ("qwen3_5", {"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads=3"),
    ],
)
def test_inconsistent_shapes_are_refused_at_load(
    family: str, fields: dict[str, Any], named: str, tmp_path: Any
) -> None:
    """Shape relations the layers rely on (heads over KV heads or groups, routing over expert groups): a config
    that breaks one is refused at load naming the fields, not run into an error or a wrong result at a step."""
    import json

    from hybridpd.engine.models.registry import build_on_meta

    base = model_zoo.NEMOTRON_BASE if family == "nemotron_h" else model_zoo.QWEN_BASE
    cfg = {**model_zoo.hf_config(family, base).to_dict(), **fields}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=named):
        build_on_meta(str(tmp_path))
