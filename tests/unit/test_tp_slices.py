"""The hetero-TP handoff planner: for every pair of TP sizes, the pieces a D rank reads from the P ranks rebuild
exactly the slice that D rank's model holds (pages built from one random whole-model page, cut by P's and D's
index rules, moved byte by byte as the plan says). Covers attention with 1, 2 and 4 KV heads, Mamba-2 conv state
(x, B, C parts) with B/C groups split (8 groups) or replicated (1 and 2 groups below the TP size), SSM and GDN
state by heads, GDN conv (q, k, v parts) with key heads split or replicated; and the handshake check."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine.parallel.partition import WIDTH_GRANULE, width_share
from hybridpd.kvtransfer.tp_layout import (
    AttentionShape,
    GDNShape,
    Mamba2Shape,
    attention_tensors,
    gdn_tensors,
    mamba2_tensors,
)
from hybridpd.kvtransfer.tp_slices import ShardedTensor, incompatibilities, plan_peer, plan_pieces

PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _models():  # type: ignore[no-untyped-def]
    for kv in (1, 2, 4):
        yield f"attn_kv{kv}", lambda tp, kv=kv: attention_tensors("g0", AttentionShape(2, 4, kv, 8, "bfloat16"), tp)
    for groups in (1, 2, 8):
        yield (
            f"mamba_g{groups}",
            lambda tp, g=groups: mamba2_tensors("g1", Mamba2Shape(2, 8, 4, g, 3, 4, "float32", "float32"), tp),
        )
    for k in (1, 2, 4):
        yield f"gdn_k{k}", lambda tp, k=k: gdn_tensors("g1", GDNShape(2, k, 8, 4, 6, 4, "bfloat16"), tp)


MODELS = dict(_models())


def _rank_page(full: torch.Tensor, t: ShardedTensor, rank: int) -> torch.Tensor:
    return full.index_select(t.axis, torch.tensor(t.held[rank])).contiguous()


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize(("tp_p", "tp_d"), PAIRS)
def test_pieces_rebuild_the_d_rank_slice(model, tp_p, tp_d) -> None:  # type: ignore[no-untyped-def]
    make = MODELS[model]
    src, dst = make(tp_p), make(tp_d)
    gen = torch.Generator().manual_seed(tp_p * 10 + tp_d)
    for s, d in zip(src, dst, strict=True):
        full = torch.randn(s.page_shape, generator=gen).to(DTYPES[s.dtype])
        p_pages = [_as_bytes(_rank_page(full, s, r)) for r in range(tp_p)]
        for rank in range(tp_d):
            want = _rank_page(full, d, rank)
            got = torch.full((want.numel() * want.element_size(),), 0xAB, dtype=torch.uint8)
            for p in plan_pieces(s, d, rank):
                got[p.dst_offset : p.dst_offset + p.nbytes] = p_pages[p.src_rank][
                    p.src_offset : p.src_offset + p.nbytes
                ]
            assert torch.equal(got, _as_bytes(want)), f"{d.name} D rank {rank} of {tp_d} from P TP {tp_p}"


def test_mamba_conv_parts_come_from_each_part() -> None:
    """TP 1 -> 2 with one B/C group: each D rank holds its half of x and ALL of B and C (replicated): rank 0 reads
    two runs (x[:16], then B and C), not the first half of conv_dim; rank 1's x tail and B, C happen to adjoin."""
    shape = Mamba2Shape(
        layers=1,
        num_heads=8,
        head_dim=4,
        n_groups=1,
        state_size=3,
        conv_kernel=4,
        conv_dtype="float32",
        ssm_dtype="float32",
    )
    src, dst = mamba2_tensors("m", shape, 1)[0], mamba2_tensors("m", shape, 2)[0]
    assert dst.held[1] == tuple(range(16, 32)) + tuple(range(32, 35)) + tuple(range(35, 38))
    k1 = 3 * 4  # bytes per channel (K-1 floats)
    runs = [
        [(p.src_offset // k1, p.dst_offset // k1, p.nbytes // k1) for p in plan_pieces(src, dst, r)] for r in (0, 1)
    ]
    assert runs == [[(0, 0, 16), (32, 16, 6)], [(16, 0, 22)]]
    # at TP 4 -> 2 with 2 groups: x from two P ranks, B and C from the rank holding the group
    shape2 = Mamba2Shape(1, 8, 4, 2, 3, 4, "float32", "float32")
    by_rank = plan_peer(mamba2_tensors("m", shape2, 4), mamba2_tensors("m", shape2, 2), 1)["m.conv"]
    assert sorted(by_rank) == [2, 3]


def test_handshake_refuses_a_different_layout() -> None:
    a = attention_tensors("g0", AttentionShape(2, 16, 4, 64, "bfloat16"), 2)
    assert incompatibilities(a, attention_tensors("g0", AttentionShape(2, 16, 4, 64, "bfloat16"), 4)) == []
    bad_dim = incompatibilities(a, attention_tensors("g0", AttentionShape(2, 16, 4, 128, "bfloat16"), 1))
    assert bad_dim and "page_shape" in bad_dim[0]
    bad_dtype = incompatibilities(a, attention_tensors("g0", AttentionShape(2, 16, 4, 64, "float32"), 1))
    assert any("dtype" in m for m in bad_dtype)
    m = mamba2_tensors("g1", Mamba2Shape(2, 8, 4, 2, 3, 4, "float32", "float32"), 2)
    assert "cache tensors differ" in incompatibilities(a, m)[0]
    with pytest.raises(ValueError, match="page_shape"):
        plan_pieces(a[0], attention_tensors("g0", AttentionShape(2, 16, 2, 64, "bfloat16"), 2)[0], 0)


@pytest.mark.parametrize(("total", "world"), [(45, 2), (62, 4), (32, 3), (8, 8), (96, 4), (48, 4), (1856, 8), (12, 4)])
def test_mlp_widths_split_contiguously_even_when_tp_does_not_divide(total: int, world: int) -> None:
    """An MLP or expert width TP does not divide: contiguous shares that cover it once; in whole runs of 8 channels
    when the width is made of enough of them (bf16 grouped GEMMs need 16-byte strides), else sizes differing by at
    most one; a width narrower than TP is refused (a rank would hold nothing)."""
    shares = [width_share(total, world, r) for r in range(world)]
    assert [i for s in shares for i in s] == list(range(total))
    assert min(map(len, shares)) >= 1
    if total % WIDTH_GRANULE == 0 and total >= WIDTH_GRANULE * world:
        assert all(len(s) % WIDTH_GRANULE == 0 for s in shares)
        assert max(map(len, shares)) - min(map(len, shares)) <= WIDTH_GRANULE
    else:
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert [len(width_share(48, 4, r)) for r in range(4)] == [16, 16, 8, 8]
    with pytest.raises(ValueError, match="fewer than one"):
        width_share(world - 1, world, 0)
