"""NemotronH (`NemotronHForCausalLM`): a stack of pre-norm residual blocks, one mixer per block, chosen by
`layers_block_type` (or the legacy `hybrid_override_pattern`: M = Mamba-2, * = attention, - = MLP, E = MoE).

    h = embeddings(ids);  for each block: h = h + mixer(RMSNorm(h));  hidden = RMSNorm_f(h);  logits = lm_head(hidden)

Attention layers have no positional embedding (the Mamba layers carry position). Module names equal the HF
checkpoint names (`backbone.layers.N.mixer.*`, `lm_head.weight`) so safetensors load directly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hybridpd.engine.cache.specs import CacheSpec, FullAttentionSpec
from hybridpd.engine.models.base import AttentionCache, LayerCache, residual_norms
from hybridpd.engine.models.batch import ForwardBatch
from hybridpd.engine.models.config_checks import require_multiple, require_routing
from hybridpd.engine.models.fast_path import (
    grouped_moe_available,
    moe_routed,
    moe_routed_masked,
    relu2_fast,
    stack_experts,
    varlen_attention,
)
from hybridpd.engine.models.layers import MLP, RMSNorm, relu2
from hybridpd.engine.models.mamba2 import Mamba2Config, Mamba2Mixer
from hybridpd.engine.models.reference import StepMetadata, paged_attention
from hybridpd.engine.models.varlen import VarlenBatch, VarlenMetadata
from torch import nn

PATTERN_TO_TYPE = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
LAYER_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
CACHED = ("linear_attention", "full_attention")
"""Layer types whose mixer reads a cache (Mamba-2: a StateCache, attention: an AttentionCache)."""


def _pick(cfg: dict[str, Any], name: str, default: Any, *legacy: str) -> Any:
    """A config value the way transformers reads it: a legacy key (if present) wins over the current name."""
    for key in legacy:
        if key in cfg:
            return cfg[key]
    value = cfg.get(name, default)
    return default if value is None and default is not None else value


def nemotron_h_layer_types(cfg: dict[str, Any]) -> list[str]:
    """`layers_block_type` (alias `layer_types`), else `hybrid_override_pattern`, else transformers' default."""
    types = cfg.get("layers_block_type", cfg.get("layer_types"))
    if types is None:
        pattern = cfg.get("hybrid_override_pattern")
        if pattern is None:
            types = ["linear_attention", "moe", "full_attention", "mlp"]
        else:
            bad = sorted(set(pattern) - set(PATTERN_TO_TYPE))
            if bad:
                raise ValueError(f"hybrid_override_pattern has unknown symbols {bad}; expected M, *, -, E")
            types = [PATTERN_TO_TYPE[c] for c in pattern]
    types = [LEGACY_TYPES.get(t, t) for t in types]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"layers_block_type has unknown types {bad}; expected {list(LAYER_TYPES)}")
    return types


@dataclass(frozen=True)
class NemotronHArgs:
    """The config fields the engine uses, resolved with transformers 5.23's names, aliases and defaults."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mlp_hidden_act: str
    mlp_bias: bool
    norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    mamba: Mamba2Config
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> NemotronHArgs:
        hidden = int(cfg.get("hidden_size", 4096))
        heads = int(cfg.get("num_attention_heads", 32))
        eps = float(cfg.get("layer_norm_epsilon", 1e-5))
        eos = cfg.get("eos_token_id", 2)
        kv_heads = cfg.get("num_key_value_heads", 8)
        mamba = Mamba2Config(
            hidden_size=hidden,
            num_heads=int(cfg.get("mamba_num_heads", 128)),
            head_dim=int(cfg.get("mamba_head_dim", 64)),
            n_groups=int(_pick(cfg, "n_groups", 8, "mamba_n_groups")),
            state_size=int(cfg.get("ssm_state_size", 128)),
            conv_kernel=int(_pick(cfg, "conv_kernel", 4, "mamba_d_conv")),
            chunk_size=int(_pick(cfg, "chunk_size", 128, "mamba_chunk_size")),
            use_bias=bool(cfg.get("use_bias", False)),
            use_conv_bias=bool(_pick(cfg, "use_conv_bias", True, "mamba_conv_bias")),
            activation=str(cfg.get("mamba_hidden_act", "silu")),
            norm_eps=eps,
            time_step_min=float(_pick(cfg, "time_step_min", 0.001, "mamba_dt_min")),
            ssm_dtype=str(cfg.get("mamba_ssm_cache_dtype", "float32")),
        )
        args = cls(
            vocab_size=int(cfg.get("vocab_size", 131072)),
            hidden_size=hidden,
            layer_types=tuple(nemotron_h_layer_types(cfg)),
            num_attention_heads=heads,
            num_key_value_heads=int(heads if kv_heads is None else kv_heads),
            # `attention_head_dim`: the Nemotron-H 4B/8B/47B/56B name (their remote code's); 128: transformers' default
            head_dim=int(cfg.get("head_dim") or cfg.get("attention_head_dim") or 128),
            intermediate_size=int(cfg.get("intermediate_size", 21504)),
            mlp_hidden_act=str(cfg.get("mlp_hidden_act", "relu2")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            norm_eps=eps,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            mamba=mamba,
            n_routed_experts=int(_pick(cfg, "n_routed_experts", 8, "num_local_experts")),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 7688)),
            # 0 (or null) falls back to intermediate_size, as transformers' NemotronHMLP does (`size or ...`)
            moe_shared_expert_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size", 7688)
                                                    or cfg.get("intermediate_size", 21504)),
            moe_latent_size=cfg.get("moe_latent_size"),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=int(cfg.get("n_group", 1)),
            topk_group=int(cfg.get("topk_group", 1)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )
        args.check()
        return args

    def check(self) -> None:
        """The shape relations the layers of this config rely on (ValueError naming the fields)."""
        types = set(self.layer_types)
        if "full_attention" in types:
            require_multiple(self.num_attention_heads, "num_attention_heads", self.num_key_value_heads,
                             "num_key_value_heads")
        if "linear_attention" in types:
            m = self.mamba
            require_multiple(m.num_heads, "mamba_num_heads", m.n_groups, "n_groups")
        if "moe" in types:
            require_routing(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group)


class NemotronHAttention(nn.Module):
    """GQA self-attention without rotary embedding or biases, scale head_dim**-0.5."""

    def __init__(self, a: NemotronHArgs) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, self.heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, self.kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * a.head_dim, a.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, cache: AttentionCache, meta: StepMetadata) -> torch.Tensor:
        q, k, v = self._project(h)
        return self.o_proj(paged_attention(q, k, v, cache.kv, meta, self.head_dim**-0.5).flatten(1))

    def forward_varlen(self, h: torch.Tensor, cache: AttentionCache, meta: VarlenMetadata) -> torch.Tensor:
        q, k, v = self._project(h)
        return self.o_proj(varlen_attention(q, k, v, cache.kv, meta, self.head_dim**-0.5).flatten(1))

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        q = self.q_proj(h).view(n, self.heads, self.head_dim)
        k = self.k_proj(h).view(n, self.kv_heads, self.head_dim)
        return q, k, self.v_proj(h).view(n, self.kv_heads, self.head_dim)


class NemotronHRouter(nn.Module):
    """Sigmoid top-k router with score-correction bias and group-limited selection (DeepSeek-V3 style)."""

    def __init__(self, a: NemotronHArgs) -> None:
        super().__init__()
        self.a = a
        self.weight = nn.Parameter(torch.zeros(a.n_routed_experts, a.hidden_size))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(a.n_routed_experts, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> (weights fp32 [T, k], expert ids [T, k])."""
        a = self.a
        scores = F.linear(h.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if a.topk_group < a.n_group:  # keep the best groups' experts (every group kept: nothing to mask)
            per_group = a.n_routed_experts // a.n_group
            group_scores = choice.view(-1, a.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=a.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            score_mask = group_mask[:, :, None].expand(-1, a.n_group, per_group).reshape(-1, a.n_routed_experts)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        idx = torch.topk(choice, k=a.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.routed_scaling_factor, idx


class NemotronHMoE(nn.Module):
    """Routed non-gated experts (optionally in a latent space) plus a shared expert."""

    def __init__(self, a: NemotronHArgs) -> None:
        super().__init__()
        in_dim = a.moe_latent_size or a.hidden_size
        self.gate = NemotronHRouter(a)
        self.experts = nn.ModuleList(
            MLP(in_dim, a.moe_intermediate_size, a.mlp_hidden_act) for _ in range(a.n_routed_experts)
        )
        self.shared_experts = MLP(a.hidden_size, a.moe_shared_expert_intermediate_size, a.mlp_hidden_act, a.mlp_bias)
        self.latent = a.moe_latent_size is not None
        self.grouped = False
        """True once `use_grouped_gemm` stacked the experts (fast path: bf16 on CUDA)."""
        if self.latent:
            self.fc1_latent_proj = nn.Linear(a.hidden_size, in_dim, bias=a.mlp_bias)
            self.fc2_latent_proj = nn.Linear(in_dim, a.hidden_size, bias=a.mlp_bias)

    def use_grouped_gemm(self) -> None:
        stack_experts(self)
        self.grouped = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(h)
        x = self.fc1_latent_proj(h) if self.latent else h
        if self.grouped:  # fast path: no host sync (CUDA graphs)
            grouped = grouped_moe_available(x, self.stacked_up_proj, self.stacked_down_proj)
            route = moe_routed if grouped else moe_routed_masked
            out = route(self, x, weights, idx).to(h.dtype)
            out = self.fc2_latent_proj(out) if self.latent else out
            return out + self.shared_experts(h)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            tok, pos = torch.where(idx == e)
            y = self.experts[e](x[tok]) * weights[tok, pos, None]
            routed.index_add_(0, tok, y.float())
        out = routed.to(h.dtype)
        if self.latent:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(h)


class NemotronHBlock(nn.Module):
    def __init__(self, a: NemotronHArgs, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.norm = RMSNorm(a.hidden_size, a.norm_eps)
        self.mixer: nn.Module
        if layer_type == "linear_attention":
            self.mixer = Mamba2Mixer(a.mamba)
        elif layer_type == "full_attention":
            self.mixer = NemotronHAttention(a)
        elif layer_type == "moe":
            self.mixer = NemotronHMoE(a)
        else:
            self.mixer = MLP(a.hidden_size, a.intermediate_size, a.mlp_hidden_act, a.mlp_bias)

    def forward(self, h: torch.Tensor, cache: LayerCache, meta: StepMetadata) -> torch.Tensor:
        """The reference block: h + mixer(norm(h))."""
        if self.layer_type in CACHED:
            return h + self.mixer(self.norm(h), cache, meta)
        return h + self.mixer(self.norm(h))

    def mix_varlen(self, x: torch.Tensor, cache: LayerCache, meta: VarlenMetadata) -> torch.Tensor:
        """The batched path's mixer on the normed input (the model fuses the norm and residual add)."""
        if self.layer_type in CACHED:
            return self.mixer.forward_varlen(x, cache, meta)  # type: ignore[operator]
        return self.mixer(x)


class NemotronHBackbone(nn.Module):
    def __init__(self, a: NemotronHArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers: Sequence[NemotronHBlock] = nn.ModuleList(  # type: ignore[assignment]
            NemotronHBlock(a, t) for t in a.layer_types)
        self.norm_f = RMSNorm(a.hidden_size, a.norm_eps)


class NemotronHForCausalLM(nn.Module):
    """The engine's NemotronH. Built by `engine.models.registry.load_model` (on the meta device, then weights are
    assigned); implements the `CausalLM` protocol of engine.models.base."""

    architecture = "NemotronHForCausalLM"

    block_reduce: Any = None
    """Under tensor parallelism: the group's engine.parallel.group.BlockReduce (set by engine.parallel.shard)."""

    @property
    def block_ends(self) -> int:
        """Residual norms of a batched forward that take a block's output (each a TP all-reduce)."""
        return len(self.backbone.layers)

    def __init__(self, config: dict[str, Any], dtype: str = "float32") -> None:
        super().__init__()
        self.args = NemotronHArgs.from_dict(config)
        self.dtype_name = dtype
        self.vocab_size = self.args.vocab_size
        self.hidden_size = self.args.hidden_size
        self.eos_token_ids: tuple[int, ...] = self.args.eos_token_ids
        self.backbone = NemotronHBackbone(self.args)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)

    # -- CausalLM -------------------------------------------------------------------------------------------

    def cache_specs(self, block_size: int) -> dict[int, CacheSpec]:
        a = self.args
        specs: dict[int, CacheSpec] = {}
        for i, t in enumerate(a.layer_types):
            if t == "full_attention":
                specs[i] = FullAttentionSpec(block_size, a.num_key_value_heads, a.head_dim, self.dtype_name)
            elif t == "linear_attention":
                specs[i] = a.mamba.state_spec(self.dtype_name)
        return specs

    @torch.no_grad()
    def forward_reference(self, batch: ForwardBatch, caches: list[LayerCache]) -> torch.Tensor:
        device = self.lm_head.weight.device
        metas = StepMetadata.per_layer(batch, device, len(self.backbone.layers))
        h = self.backbone.embeddings(batch.input_ids.to(device))
        for i, layer in enumerate(self.backbone.layers):
            h = layer(h, caches[i], metas[i])
        return self.backbone.norm_f(h)

    @torch.no_grad()
    def forward_varlen(self, batch: VarlenBatch, caches: list[LayerCache]) -> torch.Tensor:
        """The batched path: each residual add fused into the next norm."""
        from hybridpd.engine.kernels.fused import rms_norm

        metas = batch.per_layer(len(self.backbone.layers))
        h = self.backbone.embeddings(batch.input_ids)
        x = None
        with residual_norms(self, h.shape[0], h.dtype) as add_norm:  # a block's output: x, the residual: h
            for i, layer in enumerate(self.backbone.layers):
                w, eps = layer.norm.weight, layer.norm.eps
                normed, h = rms_norm(h, w, eps) if x is None else add_norm(x, w, eps, False, h)
                x = layer.mix_varlen(normed, caches[i], metas[i])
            final = self.backbone.norm_f
            return add_norm(x, final.weight, final.eps, False, h)[0] if x is not None else final(h)

    def enable_fast_path(self) -> None:
        """Prepare the batched CUDA path: MoE layers stack their experts for grouped GEMMs; relu2 MLPs (dense and
        shared experts) square in one kernel."""
        for layer in self.backbone.layers:
            mixer = layer.mixer
            if isinstance(mixer, NemotronHMoE):
                mixer.use_grouped_gemm()
            for mlp in (mixer, getattr(mixer, "shared_experts", None)):
                if isinstance(mlp, MLP) and mlp.act is relu2:
                    mlp.act = relu2_fast

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- loading --------------------------------------------------------------------------------------------

    tied_weights = {"lm_head.weight": "backbone.embeddings.weight"}
    always_tie = False
    """transformers' NemotronH never ties lm_head; the embeddings stand in only when the checkpoint lacks
    lm_head.weight and tie_word_embeddings is set."""

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Checkpoint tensor name -> module name (`model.` prefix -> `backbone.`); None drops it (`mtp*`)."""
        if name.startswith("mtp"):
            return None
        if name.startswith("model."):
            return "backbone." + name[len("model.") :]
        return name

    @staticmethod
    def split_checkpoint_tensor(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Merged 3-D expert tensors (transformers' in-memory layout) -> one tensor per expert."""
        merged = re.fullmatch(r"(.*\.mixer\.experts)\.(up_proj|down_proj)", name)
        if merged and tensor.dim() == 3:
            return [(f"{merged[1]}.{e}.{merged[2]}.weight", tensor[e]) for e in range(tensor.shape[0])]
        return [(name, tensor)]

    @staticmethod
    def keep_fp32(name: str) -> bool:
        return name.endswith("e_score_correction_bias")


__all__ = ["NemotronHArgs", "NemotronHForCausalLM", "nemotron_h_layer_types"]
