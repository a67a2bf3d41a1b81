"""The text part of multimodal Qwen3.5 checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`: config `text_config`, weights `model.language_model.*`, a vision tower the
engine drops), as the Hub ships Qwen3.5: greedy tokens and logprobs of a text prompt equal transformers' own
multimodal model's (fp32, uncached forwards)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.models.checkpoint import qwen3_5_config, qwen3_5_moe_config, write_tokenizer_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 17, 99, 3, 250, 7, 8, 9, 11, 40, 41]
NEW = 6


def _multimodal(kind: str, out: str) -> Any:
    import transformers

    names = {"dense": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", qwen3_5_config),
             "moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", qwen3_5_moe_config)}
    config_cls, model_cls, text_config = names[kind]
    text = text_config(layer_types=["linear_attention", "full_attention"])
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
              "out_hidden_size": text["hidden_size"], "spatial_merge_size": 1, "temporal_patch_size": 1}
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(text_config=text,
                                                                               vision_config=vision))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(out)
    write_tokenizer_files(out, text["vocab_size"], text["max_position_embeddings"])
    return model


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_text_part_of_a_multimodal_checkpoint(kind, tmp_path):  # type: ignore[no-untyped-def]
    model = _multimodal(kind, str(tmp_path))
    ids, want, want_lps = torch.tensor([PROMPT]), [], []
    with torch.no_grad():
        for _ in range(NEW):
            lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, -1].float(), dim=-1)
            want.append(int(lp.argmax()))
            want_lps.append(float(lp[want[-1]]))
            ids = torch.cat([ids, torch.tensor([[want[-1]]])], dim=1)
    llm = LLM(model=str(tmp_path), kv_cache_memory_bytes=8 << 20, max_model_len=256)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=NEW, temperature=0,
                                                                                  ignore_eos=True))[0]
    assert out.token_ids == want
    assert max(abs(a - b) for a, b in zip(out.logprobs, want_lps, strict=True)) < 1e-4
