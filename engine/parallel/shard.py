"""Cut a loaded model down to one tensor-parallel rank's slice, in place (weights are sliced, not copied twice).

What each rank holds (H heads, KV key/value heads, G Mamba groups, Kh GDN key heads split over tp ranks):

    attention      query heads [r*H/tp, (r+1)*H/tp); KV heads: a slice when tp divides KV, else the one KV head
                   its query heads use (replicated, tp a multiple of KV); o_proj row-parallel
    Mamba-2        heads [r*H/tp, ...) with their gate, x conv channels, dt, A, D, norm weights; B and C groups
                   split like KV heads (a slice, or the one group replicated); out_proj row-parallel. The
                   conv channels of a rank, per part of conv_dim = | x (H*P) | B (G*N) | C (G*N) |:
                       x: [h*P, (h+1)*P) for its heads h;  B: H*P + [g*N, (g+1)*N);  C: H*P + G*N + [g*N, ...)
    Gated DeltaNet value heads split, key heads split or replicated; conv | q (Kh*dk) | k (Kh*dk) | v (Hv*dv) |
                   cut the same way per part; out_proj row-parallel
    MLP / MoE      intermediate split (every expert and the shared expert; shares as even as whole runs of 8
                   channels allow, partition.width_share); one all-reduce per MLP / MoE block;
                   the router (and Qwen3.5-MoE's shared-expert gate) is replicated
    embedding      vocabulary rows split (engine.parallel.layers); LM head gathers the logits

The model's `args` become the rank's (local head counts), so `cache_specs` gives each rank the cache of its slice
and every rank plans the same number of blocks and slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridpd.engine.models.gated_deltanet import GatedDeltaNet
from hybridpd.engine.models.layers import MLP, GatedMLP
from hybridpd.engine.models.mamba2 import Mamba2Mixer
from hybridpd.engine.models.nemotron_h import NemotronHAttention, NemotronHForCausalLM, NemotronHMoE
from hybridpd.engine.models.qwen3_5 import Qwen3_5Attention, Qwen3_5ForCausalLM
from hybridpd.engine.models.sparse_moe import SparseMoeBlock
from hybridpd.engine.parallel.experts import shard_moe_experts
from hybridpd.engine.parallel.group import TPGroup
from hybridpd.engine.parallel.layers import (
    ParallelLMHead,
    SpanningGroupNorm,
    VocabParallelEmbedding,
    all_reduce_output,
    index,
    row_parallel,
    take_cols,
    take_rows,
)
from hybridpd.engine.parallel.partition import (
    blocks,
    gdn_conv_channels,
    group_share,
    mamba_conv_channels,
    split_range,
    width_share,
)
from torch import nn


def _need(count: int, what: str, tp: TPGroup) -> None:
    if count % tp.world:
        raise ValueError(f"{what}={count} is not divisible by tensor_parallel_size={tp.world}")


def _need_groups(count: int, what: str, tp: TPGroup) -> None:
    """Groups (KV heads, Mamba groups, GDN key heads) are split when tp divides them, replicated when they divide
    tp."""
    if count % tp.world and tp.world % count:
        raise ValueError(
            f"{what}={count} can be neither split over nor replicated on tensor_parallel_size={tp.world} ranks "
            f"(one of the two must divide the other)"
        )


def shard_attention(m: NemotronHAttention | Qwen3_5Attention, tp: TPGroup, gated: bool) -> None:
    d = m.head_dim
    _need(m.heads, "num_attention_heads", tp)
    _need_groups(m.kv_heads, "num_key_value_heads", tp)
    heads = split_range(m.heads, tp.world, tp.rank)
    kv = group_share(m.kv_heads, tp.world, tp.rank)
    q_width = 2 * d if gated else d  # Qwen3.5: per head | query | gate |
    take_rows(m.q_proj, index(blocks(heads, q_width)))
    take_rows(m.k_proj, index(blocks(kv, d)))
    take_rows(m.v_proj, index(blocks(kv, d)))
    row_parallel(m.o_proj, index(blocks(heads, d)), tp)
    m.heads, m.kv_heads = len(heads), len(kv)


def _conv(conv: nn.Conv1d, channels: Any) -> None:
    conv.weight = nn.Parameter(conv.weight.data[channels].contiguous(), requires_grad=False)
    if conv.bias is not None:
        conv.bias = nn.Parameter(conv.bias.data[channels].contiguous(), requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = int(channels.numel())


def _vector(p: nn.Parameter, rows: Any) -> nn.Parameter:
    return nn.Parameter(p.data[rows].contiguous(), requires_grad=False)


def shard_mamba(m: Mamba2Mixer, tp: TPGroup) -> None:
    c = m.cfg
    _need(c.num_heads, "mamba_num_heads", tp)
    _need_groups(c.n_groups, "n_groups", tp)
    heads = split_range(c.num_heads, tp.world, tp.rank)
    groups = group_share(c.n_groups, tp.world, tp.rank)
    inter = c.intermediate_size
    conv = mamba_conv_channels(c.num_heads, c.head_dim, c.n_groups, c.state_size, heads, groups)
    gate = blocks(heads, c.head_dim)
    xbc = [range(r.start + inter, r.stop + inter) for r in conv]
    dt = [range(inter + c.conv_dim + h, inter + c.conv_dim + h + 1) for h in heads]
    take_rows(m.in_proj, index(gate + xbc + dt))
    _conv(m.conv1d, index(conv))
    hs = index([heads])
    m.dt_bias, m.A_log, m.D = _vector(m.dt_bias, hs), _vector(m.A_log, hs), _vector(m.D, hs)
    norm_weight = m.norm.weight.data[index(gate)].contiguous()
    group_size = m.norm.group_size
    if c.n_groups % tp.world:  # a norm group spans several ranks' channels
        m.norm = SpanningGroupNorm(norm_weight, group_size, c.n_groups, c.norm_eps, tp)  # type: ignore[assignment]
    else:
        m.norm.weight = nn.Parameter(norm_weight, requires_grad=False)
    row_parallel(m.out_proj, index(gate), tp)
    m.cfg = dataclasses.replace(c, num_heads=len(heads), n_groups=len(groups))


def shard_gdn(m: GatedDeltaNet, tp: TPGroup) -> None:
    c = m.cfg
    _need(c.num_v_heads, "linear_num_value_heads", tp)
    _need_groups(c.num_k_heads, "linear_num_key_heads", tp)
    v_heads = split_range(c.num_v_heads, tp.world, tp.rank)
    k_heads = group_share(c.num_k_heads, tp.world, tp.rank)
    conv = index(gdn_conv_channels(c.num_k_heads, c.head_k_dim, c.head_v_dim, k_heads, v_heads))
    take_rows(m.in_proj_qkv, conv)
    _conv(m.conv1d, conv)
    values = index(blocks(v_heads, c.head_v_dim))
    take_rows(m.in_proj_z, values)
    vs = index([v_heads])
    take_rows(m.in_proj_b, vs)
    take_rows(m.in_proj_a, vs)
    m.dt_bias, m.A_log = _vector(m.dt_bias, vs), _vector(m.A_log, vs)
    row_parallel(m.out_proj, values, tp)
    m.cfg = dataclasses.replace(c, num_k_heads=len(k_heads), num_v_heads=len(v_heads))


def _split_mlp(up: list[nn.Linear], down: nn.Linear, tp: TPGroup, what: str = "intermediate_size") -> None:
    """Column-parallel `up` linears, `down` with its input columns cut (partial sums: the caller reduces). The
    width need not divide by tp (a contiguous share each, partition.width_share: the partial sums add up the
    same); `what`: the config field of the width (for the error when it is narrower than tp)."""
    if down.in_features < tp.world:
        raise ValueError(f"{what}={down.in_features} is narrower than tensor_parallel_size={tp.world}")
    cols = index([width_share(down.in_features, tp.world, tp.rank)])
    for lin in up:
        take_rows(lin, cols)
    take_cols(down, cols, tp)


def shard_mlp(m: MLP | GatedMLP, tp: TPGroup) -> None:
    ups = [m.gate_proj, m.up_proj] if isinstance(m, GatedMLP) else [m.up_proj]
    _split_mlp(ups, m.down_proj, tp)
    all_reduce_output(m.down_proj, tp)


def shard_moe(m: NemotronHMoE, tp: TPGroup, expert_parallel: bool = False) -> None:
    """Tensor parallelism inside every expert: each rank computes its slice of every routed and the shared expert
    (and fc2_latent_proj, linear, on the partial sum); or, with `expert_parallel`, whole routed experts per rank
    (engine.parallel.experts). Either way the block's output is reduced once."""
    if expert_parallel:
        shard_moe_experts(m, tp, lambda up, down, t: _split_mlp(up, down, t, "moe_shared_expert_intermediate_size"))
    else:
        for e in m.experts:
            _split_mlp([e.up_proj], e.down_proj, tp, "moe_intermediate_size")
        shared = m.shared_experts
        _split_mlp([shared.up_proj], shared.down_proj, tp, "moe_shared_expert_intermediate_size")
    if m.latent and m.fc2_latent_proj.bias is not None and not tp.is_leader:
        m.fc2_latent_proj.bias.data.zero_()
    all_reduce_output(m, tp)


def _shard_vocab(model: Any, embed_owner: nn.Module, embed_name: str, tp: TPGroup) -> None:
    full = getattr(embed_owner, embed_name)
    tied = model.lm_head.weight.data_ptr() == full.weight.data_ptr()
    embedding = VocabParallelEmbedding(full, tp)
    setattr(embed_owner, embed_name, embedding)
    model.lm_head = ParallelLMHead(model.lm_head, tp, embedding if tied else None)


def shard_nemotron_h(model: NemotronHForCausalLM, tp: TPGroup, expert_parallel: bool = False) -> None:
    for layer in model.backbone.layers:
        mixer = layer.mixer
        if isinstance(mixer, Mamba2Mixer):
            shard_mamba(mixer, tp)
        elif isinstance(mixer, NemotronHAttention):
            shard_attention(mixer, tp, gated=False)
        elif isinstance(mixer, NemotronHMoE):
            shard_moe(mixer, tp, expert_parallel)
        elif isinstance(mixer, MLP):
            shard_mlp(mixer, tp)
    _shard_vocab(model, model.backbone, "embeddings", tp)
    a = model.args
    first_mamba = next((ly.mixer.cfg for ly in model.backbone.layers if isinstance(ly.mixer, Mamba2Mixer)), a.mamba)
    model.args = dataclasses.replace(
        a,
        num_attention_heads=a.num_attention_heads // tp.world,
        num_key_value_heads=len(group_share(a.num_key_value_heads, tp.world, tp.rank)),
        mamba=first_mamba,
    )


def shard_sparse_moe(m: SparseMoeBlock, tp: TPGroup, expert_parallel: bool = False) -> None:
    """Qwen3.5-MoE's block: every routed expert's and the shared expert's intermediate width cut (the router and
    the shared expert's sigmoid gate, computed on the whole input, replicated); the block's output (routed plus
    gated shared partial sums) reduced once."""
    if expert_parallel:
        raise ValueError("expert parallelism supports NemotronH MoE blocks only (drop --enable-expert-parallel)")
    for e in m.experts:
        _split_mlp([e.gate_proj, e.up_proj], e.down_proj, tp, "moe_intermediate_size")
    shared = m.shared_expert
    _split_mlp([shared.gate_proj, shared.up_proj], shared.down_proj, tp, "shared_expert_intermediate_size")
    all_reduce_output(m, tp)


def shard_qwen3_5(model: Qwen3_5ForCausalLM, tp: TPGroup, expert_parallel: bool = False) -> None:
    layer: Any
    for layer in model.model.layers:
        if layer.layer_type == "linear_attention":
            shard_gdn(layer.linear_attn, tp)
        else:
            shard_attention(layer.self_attn, tp, gated=True)
        if isinstance(layer.mlp, SparseMoeBlock):
            shard_sparse_moe(layer.mlp, tp, expert_parallel)
        else:
            shard_mlp(layer.mlp, tp)
    _shard_vocab(model, model.model, "embed_tokens", tp)
    a = model.args
    layers: list[Any] = list(model.model.layers)
    first_gdn = next((ly.linear_attn.cfg for ly in layers if ly.layer_type == "linear_attention"), a.gdn)
    model.args = dataclasses.replace(
        a,
        num_attention_heads=a.num_attention_heads // tp.world,
        num_key_value_heads=len(group_share(a.num_key_value_heads, tp.world, tp.rank)),
        gdn=first_gdn,
    )


def check_shardable(path: str, world: int, expert_parallel: bool = False) -> None:
    """Raise ValueError, naming the config field, when the checkpoint at `path` cannot be cut over `world` ranks:
    the sharding itself run for rank 0 on the model built on the meta device (no weights, no process group), so
    a worker refuses such a model before it starts any other rank."""
    from hybridpd.engine.models.registry import build_on_meta

    shard_model(build_on_meta(path), TPGroup(rank=0, world=world, group=None, control=None), expert_parallel)


def shard_model(model: Any, tp: TPGroup, expert_parallel: bool = False) -> Any:
    """Cut `model` (as loaded by engine.models.registry) to rank tp.rank's slice, in place; returns it. Raises
    ValueError when a head count cannot be split over tp.world ranks. `expert_parallel`: MoE blocks keep whole
    routed experts per rank instead of a slice of each."""
    if tp.world == 1:
        return model
    model.full_args = model.args  # the whole model's shapes (handoffs between TP sizes plan from these)
    if isinstance(model, NemotronHForCausalLM):
        shard_nemotron_h(model, tp, expert_parallel)
    elif isinstance(model, Qwen3_5ForCausalLM):
        shard_qwen3_5(model, tp, expert_parallel)
    else:
        raise ValueError(f"tensor parallelism does not support {type(model).__name__}")
    model.tp_rank, model.tp_size = tp.rank, tp.world
    model.block_reduce = tp.block_reduce  # its batched forward sums block ends through it
    return model


__all__ = ["check_shardable", "shard_model"]
