"""NemotronH's router against transformers' NemotronHTopkRouter (fp32, same weights): the same experts and routing
weights with group-limited selection (fewer groups kept than exist) and without it (every group kept, where the
engine skips the group mask as a no-op)."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine.models.checkpoint import hf_config
from hybridpd.engine.models.nemotron_h import NemotronHArgs, NemotronHRouter


@pytest.mark.parametrize(("n_group", "topk_group"), [(1, 1), (4, 2), (4, 4)])
def test_router_matches_transformers(n_group: int, topk_group: int) -> None:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    cfg = hf_config("nemotron_h", pattern="E", hidden_size=64, n_routed_experts=16, num_experts_per_tok=3,
                    n_group=n_group, topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5)
    ref = NemotronHTopkRouter(cfg)
    ours = NemotronHRouter(NemotronHArgs.from_dict(cfg.to_dict()))
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 64, generator=g))
        ref.e_score_correction_bias.copy_(torch.rand(16, generator=g) * 0.1)
        ours.weight.copy_(ref.weight)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    h = torch.randn(50, 64, generator=g)
    _, want_w, want_idx = ref(h)
    got_w, got_idx = ours(h)
    order_ref, order_ours = want_idx.sort(-1), got_idx.sort(-1)
    assert torch.equal(order_ref.values, order_ours.values)
    torch.testing.assert_close(got_w.gather(1, order_ours.indices), want_w.gather(1, order_ref.indices), rtol=0,
                               atol=0)
    if topk_group < n_group:  # the limit holds, and it changed the choice of some token
        per_group = 16 // n_group
        assert max((row // per_group).unique().numel() for row in got_idx) <= topk_group
        unlimited = torch.topk(torch.sigmoid(h @ ref.weight.T) + ref.e_score_correction_bias, k=3).indices
        assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(got_idx, unlimited, strict=True))
