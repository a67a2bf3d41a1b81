"""Qwen3.5 text model (`Qwen3_5ForCausalLM`, config `Qwen3_5TextConfig`, model_type `qwen3_5_text`).

    h = embed_tokens(ids)
    per layer: h = h + mixer(norm1(h));  h = h + GatedMLP(norm2(h))
        mixer = Gated-DeltaNet (`linear_attention`) or gated full attention (`full_attention`):
        q (+ output gate) / k / v projections, per-head zero-centred RMSNorm on q and k, partial rotary embedding,
        GQA causal attention, output * sigmoid(gate), o_proj
    hidden = norm(h);  logits = lm_head(hidden)   (lm_head tied to embed_tokens when tie_word_embeddings)

Also loads the text part of a multimodal `Qwen3_5ForConditionalGeneration` checkpoint (config `text_config`,
weights `model.language_model.*`; the vision tower and MTP weights are ignored).

Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`, and the text part of
`Qwen3_5MoeForConditionalGeneration`) is the same model with every GatedMLP replaced by a sparse MoE block
(engine.models.sparse_moe; config `num_experts` > 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hybridpd.engine.cache.specs import CacheSpec, FullAttentionSpec
from hybridpd.engine.models.base import AttentionCache, LayerCache, residual_norms
from hybridpd.engine.models.batch import ForwardBatch
from hybridpd.engine.models.config_checks import require_multiple
from hybridpd.engine.models.fast_path import varlen_attention
from hybridpd.engine.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from hybridpd.engine.models.layers import GatedMLP, RotaryEmbedding, ZeroCenteredRMSNorm, apply_rotary, fuse_linears
from hybridpd.engine.models.reference import StepMetadata, paged_attention
from hybridpd.engine.models.rope_scaling import rope_frequencies
from hybridpd.engine.models.sparse_moe import SparseMoeArgs, SparseMoeBlock, split_fused_experts
from hybridpd.engine.models.varlen import VarlenBatch, VarlenMetadata
from torch import nn

LAYER_TYPES = ("linear_attention", "full_attention")


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text config: `text_config` of a multimodal config, else cfg itself. A multimodal model ties lm_head by
    its own (top-level) `tie_word_embeddings`, default False, whatever text_config says (as transformers does);
    a top-level eos fills in a missing one."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    merged = dict(text)
    merged["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    if merged.get("eos_token_id") is None and cfg.get("eos_token_id") is not None:
        merged["eos_token_id"] = cfg["eos_token_id"]
    return merged


def _rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], float, float]:
    """(rope parameters, rope_theta, partial_rotary_factor) with transformers' precedence: rope_scaling,
    rope_parameters, then top-level keys, then defaults (10000, 0.25). The rope type is checked by
    engine.models.rope_scaling (default, linear and yarn are served; others raise ValueError naming rope_type)."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return rope, float(theta), float(factor)


@dataclass(frozen=True)
class Qwen3_5Args:
    """The config fields the engine uses, resolved with transformers 5.23's names and defaults."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    norm_eps: float
    attention_bias: bool
    rope_theta: float
    rotary_dim: int
    rope_parameters: dict[str, Any]
    """The config's rope dict (rope_type and its scaling fields; engine.models.rope_scaling)."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    gdn: GatedDeltaNetConfig
    moe: SparseMoeArgs | None = None
    """Qwen3.5-MoE: every layer's MLP is a sparse MoE block; None: dense GatedMLPs."""

    @classmethod
    def from_dict(cls, config: dict[str, Any], defaults: dict[str, Any] | None = None) -> Qwen3_5Args:
        """`defaults`: the family's transformers defaults where they differ from the dense model's (MoE)."""
        cfg = _text_config(config)
        cfg = {**(defaults or {}), **{k: v for k, v in cfg.items() if v is not None}}
        hidden = int(cfg.get("hidden_size", 4096))
        layer_types = cfg.get("layer_types")
        num_layers = int(cfg.get("num_hidden_layers") or (len(layer_types) if layer_types else 32))
        if layer_types is None:
            interval = int(cfg.get("full_attention_interval", 4))
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
        if len(layer_types) < num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {num_layers}")
        layer_types = layer_types[:num_layers]
        bad = sorted(set(layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types has unknown types {bad}; expected {list(LAYER_TYPES)}")
        heads = int(cfg.get("num_attention_heads", 16))
        head_dim = int(cfg.get("head_dim") or 256)  # transformers' default when config.json has none
        rope, theta, factor = _rope(cfg)
        max_positions = int(cfg.get("max_position_embeddings", 32768))
        rope_frequencies(rope, theta, int(head_dim * factor), max_positions)  # an unsupported rope_type: ValueError
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        act = str(cfg.get("hidden_act", "silu"))
        eos = cfg.get("eos_token_id")
        args = cls(
            vocab_size=int(cfg.get("vocab_size", 248320)),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 12288)),
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", 4)),
            head_dim=head_dim,
            hidden_act=act,
            norm_eps=eps,
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_theta=theta,
            rotary_dim=int(head_dim * factor),
            rope_parameters=rope,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            gdn=GatedDeltaNetConfig(
                hidden_size=hidden,
                num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
                num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
                head_k_dim=int(cfg.get("linear_key_head_dim", 128)),
                head_v_dim=int(cfg.get("linear_value_head_dim", 128)),
                conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                activation=act,
                norm_eps=eps,
            ),
            moe=SparseMoeArgs.from_dict(cfg),
        )
        args.check()
        return args

    def check(self) -> None:
        """The shape relations the layers of this config rely on (ValueError naming the fields)."""
        if "full_attention" in self.layer_types:
            require_multiple(self.num_attention_heads, "num_attention_heads", self.num_key_value_heads,
                             "num_key_value_heads")
        if "linear_attention" in self.layer_types:
            require_multiple(self.gdn.num_v_heads, "linear_num_value_heads", self.gdn.num_k_heads,
                             "linear_num_key_heads")


class Qwen3_5Attention(nn.Module):
    """Gated GQA attention: q_proj yields per head [query | gate]; q/k get a per-head zero-centred RMSNorm and
    partial RoPE; the attention output is multiplied by sigmoid(gate) before o_proj."""

    def __init__(self, a: Qwen3_5Args) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        bias = a.attention_bias
        self.q_proj = nn.Linear(a.hidden_size, self.heads * a.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(a.hidden_size, self.kv_heads * a.head_dim, bias=bias)
        self.v_proj = nn.Linear(a.hidden_size, self.kv_heads * a.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * a.head_dim, a.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(a.head_dim, a.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(a.head_dim, a.norm_eps)
        self.qkv: torch.Tensor | None = None
        """[q_proj | k_proj | v_proj] weights in one tensor (fast path, bias-free only); the three are views."""

    def fuse(self) -> None:
        if self.q_proj.bias is None:
            self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: AttentionCache, meta: StepMetadata
    ) -> torch.Tensor:
        n = h.shape[0]
        q, gate, k, v = self._project(h)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, cache.kv, meta, self.head_dim**-0.5).reshape(n, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))

    def forward_varlen(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: AttentionCache, meta: VarlenMetadata
    ) -> torch.Tensor:
        """The batched path: one GEMM and fused q/k norms (when `fuse`d), rope and output gate in one kernel each."""
        from hybridpd.engine.kernels.fused import rope as rope_kernel
        from hybridpd.engine.kernels.fused import sigmoid_gate

        qkv = self.qkv
        q, gate, k, v = self._project(h) if qkv is None else self._project_fused(h, qkv)
        cos, sin = rope
        q, k = rope_kernel(q, cos, sin), rope_kernel(k, cos, sin)
        out = varlen_attention(q, k, v, cache.kv, meta, self.head_dim**-0.5).reshape(h.shape[0], -1)
        return self.o_proj(sigmoid_gate(out, gate))

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (normed), the output gate, k (normed), v: [n, heads, head_dim] each."""
        n = h.shape[0]
        q, gate = self.q_proj(h).view(n, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_norm(self.k_proj(h).view(n, self.kv_heads, self.head_dim))
        return self.q_norm(q), gate, k, self.v_proj(h).view(n, self.kv_heads, self.head_dim)

    def _project_fused(self, h: torch.Tensor, qkv: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same with one GEMM (`qkv`: the fused weight) and the norms in one kernel each."""
        from hybridpd.engine.kernels.fused import rms_norm

        n, d = h.shape[0], self.head_dim
        qg, k, v = F.linear(h, qkv).split([2 * self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q, gate = qg.view(n, self.heads, 2 * d).chunk(2, dim=-1)
        q = rms_norm(q, self.q_norm.weight, self.q_norm.eps, True)[0]
        k = rms_norm(k.view(n, self.kv_heads, d), self.k_norm.weight, self.k_norm.eps, True)[0]
        return q, gate, k, v.view(n, self.kv_heads, d)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, a: Qwen3_5Args, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(a.gdn)
        else:
            self.self_attn = Qwen3_5Attention(a)
        self.mlp: GatedMLP | SparseMoeBlock = (
            SparseMoeBlock(a.hidden_size, a.moe, a.hidden_act) if a.moe is not None
            else GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act)
        )
        self.input_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.norm_eps)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerCache, meta: StepMetadata
    ) -> torch.Tensor:
        """The reference layer: h + mixer(norm1(h)), then h + mlp(norm2(h))."""
        x = self.input_layernorm(h)
        if self.layer_type == "linear_attention":
            h = h + self.linear_attn(x, cache, meta)
        else:
            h = h + self.self_attn(x, rope, cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    def mix_varlen(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                   meta: VarlenMetadata) -> torch.Tensor:
        """The batched path's token mixer on the normed input (the model fuses the norms and residual adds)."""
        if self.layer_type == "linear_attention":
            return self.linear_attn.forward_varlen(x, cache, meta)
        return self.self_attn.forward_varlen(x, rope, cache, meta)


class Qwen3_5TextModel(nn.Module):
    def __init__(self, a: Qwen3_5Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers: Sequence[Qwen3_5DecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            Qwen3_5DecoderLayer(a, t) for t in a.layer_types)
        self.norm = ZeroCenteredRMSNorm(a.hidden_size, a.norm_eps)


class Qwen3_5ForCausalLM(nn.Module):
    """The engine's Qwen3.5 text model. Built by `engine.models.registry.load_model` (meta device, then weights
    are assigned); implements the `CausalLM` protocol of engine.models.base."""

    architecture = "Qwen3_5ForCausalLM"
    config_defaults: dict[str, Any] = {}
    """transformers' defaults of this family where they differ from Qwen3_5TextConfig's (read in from_dict)."""

    block_reduce: Any = None
    """Under tensor parallelism: the group's engine.parallel.group.BlockReduce (set by engine.parallel.shard)."""

    @property
    def block_ends(self) -> int:
        """Residual norms of a batched forward that take a block's output (each a TP all-reduce)."""
        return 2 * len(self.model.layers)

    def __init__(self, config: dict[str, Any], dtype: str = "float32") -> None:
        super().__init__()
        self.args = Qwen3_5Args.from_dict(config, self.config_defaults)
        self.dtype_name = dtype
        self.vocab_size = self.args.vocab_size
        self.hidden_size = self.args.hidden_size
        self.eos_token_ids: tuple[int, ...] = self.args.eos_token_ids
        self.model = Qwen3_5TextModel(self.args)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        a = self.args
        self.rotary = RotaryEmbedding(a.rotary_dim, a.rope_theta, *rope_frequencies(
            a.rope_parameters, a.rope_theta, a.rotary_dim, a.max_position_embeddings))

    # -- CausalLM -------------------------------------------------------------------------------------------

    def cache_specs(self, block_size: int) -> dict[int, CacheSpec]:
        a = self.args
        specs: dict[int, CacheSpec] = {}
        for i, t in enumerate(a.layer_types):
            if t == "full_attention":
                specs[i] = FullAttentionSpec(block_size, a.num_key_value_heads, a.head_dim, self.dtype_name)
            else:
                specs[i] = a.gdn.state_spec(self.dtype_name)
        return specs

    @torch.no_grad()
    def forward_reference(self, batch: ForwardBatch, caches: list[LayerCache]) -> torch.Tensor:
        device = self.lm_head.weight.device
        metas = StepMetadata.per_layer(batch, device, len(self.model.layers))
        h = self.model.embed_tokens(batch.input_ids.to(device))
        rope = self.rotary.cos_sin(metas[0].positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, rope, caches[i], metas[i])
        return self.model.norm(h)

    @torch.no_grad()
    def forward_varlen(self, batch: VarlenBatch, caches: list[LayerCache]) -> torch.Tensor:
        """The batched path: each residual add fused into the next norm."""
        from hybridpd.engine.kernels.fused import rms_norm

        metas = batch.per_layer(len(self.model.layers))
        h = self.model.embed_tokens(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions, h.dtype)
        x = None
        with residual_norms(self, h.shape[0], h.dtype) as add_norm:  # a block's output: x, the residual: h
            for i, layer in enumerate(self.model.layers):
                n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
                normed, h = rms_norm(h, n1.weight, n1.eps, True) if x is None else add_norm(x, n1.weight, n1.eps,
                                                                                          True, h)
                normed, h = add_norm(layer.mix_varlen(normed, rope, caches[i], metas[i]), n2.weight, n2.eps, True, h)
                x = layer.mlp.forward_fused(normed)
            final = self.model.norm
            return add_norm(x, final.weight, final.eps, True, h)[0] if x is not None else final(h)

    def enable_fast_path(self) -> None:
        """Prepare the batched path: one GEMM for each GDN layer's four input projections, for each attention
        layer's q/k/v (when bias-free) and for each MLP's gate and up (the modules' weights become views)."""
        for layer in self.model.layers:
            layer.mlp.fuse()
            if layer.layer_type == "linear_attention":
                layer.linear_attn.fuse()
            else:
                layer.self_attn.fuse()

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- loading --------------------------------------------------------------------------------------------

    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    always_tie = True
    """As in transformers: with tie_word_embeddings, lm_head is the embedding matrix."""

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Checkpoint tensor name -> module name (`model.language_model.` -> `model.`); None drops it (vision
        tower, `mtp*`)."""
        if name.startswith(("mtp", "model.visual.", "visual.")):
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model.") :]
        return name

    @staticmethod
    def split_checkpoint_tensor(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """MoE: transformers' fused 3-D expert tensors become the per-expert weights the Hub ships."""
        return split_fused_experts(name, tensor) or [(name, tensor)]

    @staticmethod
    def keep_fp32(name: str) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: the same model, every MLP a sparse MoE block (its args' `moe`)."""

    architecture = "Qwen3_5MoeForCausalLM"
    config_defaults = {"hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2, "num_experts": 256,
                       "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
    """Qwen3_5MoeTextConfig's defaults that differ from the dense config's."""

    def __init__(self, config: dict[str, Any], dtype: str = "float32") -> None:
        super().__init__(config, dtype)
        if self.args.moe is None:
            raise ValueError("a Qwen3.5-MoE config needs num_experts > 0")


__all__ = ["Qwen3_5Args", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]
