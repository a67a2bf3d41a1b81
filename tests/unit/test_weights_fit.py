"""Weights take their final dtype before they reach the device, and a model whose weights cannot fit fails before
any is allocated, with the numbers (engine/models/weights_fit.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hybridpd.engine.errors import ModelLoadError
from hybridpd.engine.models import weights_fit
from hybridpd.engine.models.checkpoint import hf_config, preset, write_random_checkpoint
from hybridpd.engine.models.registry import ARCHITECTURES, load_model


def _meta_model(name: str):  # type: ignore[no-untyped-def]
    family, overrides = preset(name)
    cls = ARCHITECTURES["NemotronHForCausalLM" if family == "nemotron_h" else "Qwen3_5ForCausalLM"]
    with torch.device("meta"):
        return cls(hf_config(family, **overrides).to_dict(), "bfloat16"), cls


def test_meta_cast_gives_the_bf16_size_of_a_30b_moe() -> None:
    model, cls = _meta_model("nemotron-3-nano-30b-a3b")
    built = weights_fit.weight_bytes(model)
    weights_fit.cast_meta(model, cls.keep_fp32, torch.bfloat16)
    final = weights_fit.weight_bytes(model)
    # built in fp32 on meta (what to_empty used to allocate: ~118 GiB, more than an 80 GB GPU); bf16 after the cast
    assert 55 * 2**30 < final < 62 * 2**30 and built > 1.9 * final
    kept = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype == torch.float32]
    assert kept and all(cls.keep_fp32(n) for n in kept)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was allocated


def test_require_room_names_the_numbers() -> None:
    weights_fit.require_room(10, None)  # unknown free memory (CPU): not checked
    weights_fit.require_room(10, 10)
    with pytest.raises(ModelLoadError, match=r"take 59\.0 GiB, the device has 20\.0 GiB free"):
        weights_fit.require_room(59 * 2**30, 20 * 2**30)


@pytest.mark.parametrize("load_format", ["dummy", "auto"])
def test_a_model_that_cannot_fit_fails_before_allocating(tmp_path, monkeypatch, load_format) -> None:
    path = write_random_checkpoint(tmp_path / "m", "nemotron_h", seed=0, weights=load_format == "auto")
    monkeypatch.setattr(weights_fit, "free_device_bytes", lambda device: 1024)
    with pytest.raises(ModelLoadError, match="does not fit"):
        load_model(path, "bfloat16", load_format=load_format)


def test_dummy_weights_are_allocated_in_their_final_dtype(tmp_path, monkeypatch) -> None:
    seen: list[tuple[str, torch.dtype]] = []
    to_empty = torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):  # type: ignore[no-untyped-def]
        if not seen:  # the model's own call (modules recurse through it)
            seen.extend((n, t.dtype) for n, t in [*self.named_parameters(), *self.named_buffers()])
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    model: Any = load_model(
        write_random_checkpoint(tmp_path / "m", "nemotron_h", weights=False), "bfloat16", load_format="dummy"
    )
    assert seen and {d for _, d in seen} <= {torch.bfloat16, torch.float32}
    assert all(d == torch.bfloat16 for n, d in seen if "e_score_correction_bias" not in n)
    assert all(t.dtype == torch.bfloat16 for n, t in model.state_dict().items() if "e_score" not in n)
