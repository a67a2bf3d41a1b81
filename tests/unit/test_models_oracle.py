"""Our model families against transformers' own implementation on the same random weights (fp32).

A tiny runner (`Harness`) allocates caches from `cache_specs` (NaN-filled, including the null block 0 and slots
0/1 which are never handed out), assigns blocks non-contiguously in reverse order, and feeds sequences in chunks,
mixed batches, decode steps, checkpoints and resumes. Every computed position's log-softmax is compared with
transformers' full-sequence forward.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hybridpd.engine.cache.specs import PAD_SLOT_ID, FullAttentionSpec
from hybridpd.engine.errors import ModelLoadError
from hybridpd.engine.models.base import AttentionCache, LayerCache, StateCache
from hybridpd.engine.models.batch import ForwardBatch, SeqInfo
from hybridpd.engine.models.checkpoint import write_random_checkpoint
from hybridpd.engine.models.layers import torch_dtype
from hybridpd.engine.models.registry import load_model, read_model_config
from hybridpd.engine.tokenizer import Tokenizer

BS = 16
NUM_BLOCKS = 64
NUM_SLOTS = 12
TOL = 1e-4

CASES = {
    "nemotron_h-M*-M-": ("nemotron_h", {}),
    "nemotron_h-*MEM-M": ("nemotron_h", {"pattern": "*MEM-M"}),
    "qwen3_5-llfl": ("qwen3_5", {}),
    "qwen3_5-fll": (
        "qwen3_5",
        {"layer_types": ["full_attention", "linear_attention", "linear_attention"], "linear_num_value_heads": 2},
    ),
}


@dataclass
class Seq:
    tokens: list[int]
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    first: int = 0  # first position whose logprobs we computed (the resume point)
    has_state: bool = False
    logprobs: list[torch.Tensor] = field(default_factory=list)


class Harness:
    """Just enough of a runner: caches, block/slot allocation, ForwardBatch building."""

    def __init__(self, model, device: str = "cpu", num_blocks: int = NUM_BLOCKS, num_slots: int = NUM_SLOTS) -> None:
        self.model = model
        specs = model.cache_specs(BS)
        self.caches: list[LayerCache] = []
        for i in range(len(model.args.layer_types)):
            spec = specs.get(i)
            if spec is None:
                self.caches.append(None)
            elif isinstance(spec, FullAttentionSpec):
                shape = (num_blocks, 2, BS, spec.num_kv_heads, spec.head_dim)
                kv = torch.full(shape, math.nan, dtype=torch_dtype(spec.dtype), device=device)
                self.caches.append(AttentionCache(kv))
            else:
                conv_dt, ssm_dt = torch_dtype(spec.conv_dtype), torch_dtype(spec.ssm_dtype)
                conv = torch.full((num_slots, *spec.conv_shape), math.nan, dtype=conv_dt, device=device)
                ssm = torch.full((num_slots, *spec.ssm_shape), math.nan, dtype=ssm_dt, device=device)
                self.caches.append(StateCache(conv, ssm))
        # reverse order, odd ids first: consecutive logical blocks are never physically adjacent
        self.free_blocks = list(range(num_blocks - 1, 0, -2)) + list(range(num_blocks - 2, 0, -2))
        self.free_slots = list(range(num_slots - 1, 1, -1))  # never 0 (null) or 1

    def new_seq(self, tokens: list[int], prefix: Seq | None = None, prefix_len: int = 0, slot: int | None = None):
        seq = Seq(list(tokens), self.free_slots.pop(0) if slot is None else slot)
        if prefix is not None:
            seq.blocks = prefix.blocks[: math.ceil(prefix_len / BS)]
            seq.num_computed = seq.first = prefix_len
            seq.has_state = True
        return seq

    def step(self, work: list[tuple[Seq, int, list[tuple[int, int]]]], pad: int = 0) -> None:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        infos: list[SeqInfo] = []
        for seq, n, ckpts in work:
            start = seq.num_computed
            while len(seq.blocks) * BS < start + n:
                seq.blocks.append(self.free_blocks.pop(0))
            table = torch.tensor(seq.blocks, dtype=torch.int64)
            infos.append(SeqInfo(len(ids), n, start, table, seq.slot, seq.has_state, list(ckpts)))
            for p in range(start, start + n):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // BS] * BS + p % BS)
        if pad:
            infos.append(SeqInfo(len(ids), pad, 0, torch.zeros(0, dtype=torch.int64), PAD_SLOT_ID, False))
            ids += [0] * pad
            pos += [0] * pad
            slots += [PAD_SLOT_ID] * pad
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots, dtype=torch.int64), infos, BS)
        logprobs = self.model.compute_logits(self.model.forward_reference(batch, self.caches)).log_softmax(-1).cpu()
        assert logprobs.dtype == torch.float32 and torch.isfinite(logprobs).all()
        for (seq, n, _), info in zip(work, infos, strict=False):
            seq.logprobs.extend(logprobs[info.query_start : info.query_start + n])
            seq.num_computed += n
            seq.has_state = True

    def prefill(self, seq: Seq, sizes: list[int], ckpts: dict[int, int] | None = None) -> None:
        """Run seq's remaining prompt in chunks cycling through `sizes`; ckpts maps num_tokens -> dest slot."""
        i = 0
        while seq.num_computed < len(seq.tokens):
            n = min(sizes[i % len(sizes)], len(seq.tokens) - seq.num_computed)
            end = seq.num_computed + n
            here = [(t, d) for t, d in (ckpts or {}).items() if seq.num_computed < t <= end]
            self.step([(seq, n, here)])
            i += 1

    def decode(self, seq: Seq, steps: int) -> None:
        for _ in range(steps):
            seq.tokens.append(int(seq.logprobs[-1].argmax()))
            self.step([(seq, 1, [])])

    def assert_null_untouched(self) -> None:
        for c in self.caches:
            if isinstance(c, AttentionCache):
                assert torch.isnan(c.kv[0]).all(), "null block 0 was written"
            elif isinstance(c, StateCache):
                for t in (c.conv, c.ssm):
                    assert torch.isnan(t[0]).all() and torch.isnan(t[1]).all(), "slot 0/1 was written"


def reference(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def max_diff(hf, seq: Seq) -> float:
    ref = reference(hf, seq.tokens[: seq.num_computed])[seq.first :]
    ours = torch.stack(seq.logprobs)
    assert ours.shape == ref.shape
    return (ours - ref).abs().max().item()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    family, overrides = CASES[request.param]
    path = write_random_checkpoint(tmp_path_factory.mktemp(family), family, seed=3, **overrides)
    ours = load_model(path, "float32", "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, hf, path


def test_chunked_prefill_and_decode_match_transformers(models):
    ours, hf, _ = models
    h = Harness(ours)
    diffs = []
    for length, sizes, seed in [(1, [1], 0), (5, [2], 1), (33, [64], 2), (300, [7, 64, 1], 3), (140, [1, 16], 4)]:
        seq = h.new_seq(prompt(length, seed))
        h.prefill(seq, sizes)
        h.decode(seq, 4)
        diffs.append(max_diff(hf, seq))
    h.assert_null_untouched()
    assert max(diffs) < TOL, diffs


def test_mixed_batch_matches_transformers(models):
    ours, hf, _ = models
    h = Harness(ours)
    a, b, c = h.new_seq(prompt(150, 10)), h.new_seq(prompt(20, 11)), h.new_seq(prompt(1, 12))
    h.step([(b, 20, []), (a, 13, []), (c, 1, [])], pad=3)  # two prefills and a 1-token prompt, padded
    for i in range(8):  # a keeps prefilling while b and c decode, all in one batch
        for s in (b, c):
            s.tokens.append(int(s.logprobs[-1].argmax()))
        n = min(17, len(a.tokens) - a.num_computed)
        h.step([(b, 1, []), (a, n, []), (c, 1, [])], pad=i % 2)
    h.prefill(a, [64])
    for s in (a, b, c):
        assert max_diff(hf, s) < TOL
    h.assert_null_untouched()


def test_checkpoints_resume_exactly(models):
    ours, hf, _ = models
    h = Harness(ours)
    a = h.new_seq(prompt(120, 20))
    ck32, ck64, ck121 = h.free_slots.pop(0), h.free_slots.pop(0), h.free_slots.pop(0)
    # 32 lies inside the first chunk (0, 40], 64 inside the second (40, 70]: intermediate states
    h.prefill(a, [40, 30, 50], ckpts={32: ck32, 64: ck64})
    a.tokens.append(int(a.logprobs[-1].argmax()))
    h.step([(a, 1, [])])  # a decode step; its state is then copied out, as the engine saves a chunk-end checkpoint
    for cache in h.caches:
        if isinstance(cache, StateCache):
            cache.conv[ck121], cache.ssm[ck121] = cache.conv[a.slot], cache.ssm[a.slot]
    assert max_diff(hf, a) < TOL
    cases = [(32, ck32, [7, 64]), (64, ck64, [1, 1, 30]), (121, ck121, [5])]
    for resume_at, slot, sizes in cases:
        tail = prompt(40, 100 + resume_at)
        seq = h.new_seq(a.tokens[:resume_at] + tail, prefix=a, prefix_len=resume_at, slot=slot)
        if resume_at % BS:  # the partial last block is private to a; give the new sequence its own copy
            block = h.free_blocks.pop(0)
            for cache in h.caches:
                if isinstance(cache, AttentionCache):
                    cache.kv[block] = cache.kv[seq.blocks[-1]]
            seq.blocks[-1] = block
        h.prefill(seq, sizes)
        h.decode(seq, 2)
        assert max_diff(hf, seq) < TOL, resume_at
    h.assert_null_untouched()


def test_bfloat16_runs_and_stays_close(models):
    _, hf, path = models
    ours = load_model(path, "bfloat16", "cpu")
    h = Harness(ours)
    seq = h.new_seq(prompt(70, 30))
    h.prefill(seq, [16, 1, 64])
    h.decode(seq, 2)
    assert max_diff(hf, seq) < 0.5  # bf16 rounding (and, with MoE, a possible routing flip) vs fp32


# ---------------------------------------------------------------------------------------------------------------
# checkpoint writer, tokenizer, loader errors


def test_random_checkpoint_is_deterministic(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", "nemotron_h", seed=7)
    b = write_random_checkpoint(tmp_path / "b", "nemotron_h", seed=7)
    c = write_random_checkpoint(tmp_path / "c", "nemotron_h", seed=8)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name
    assert (Path(a) / "model.safetensors").read_bytes() != (Path(c) / "model.safetensors").read_bytes()


def test_tokenizer_matches_transformers(models):
    from transformers import AutoTokenizer

    _, _, path = models
    ours = Tokenizer.from_pretrained(path)
    theirs = AutoTokenizer.from_pretrained(path)
    text = "Hello, wörld! 你好 <|im_end|>\n\ttabs"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode("héllo wörld")) == "héllo wörld"
    assert ours.eos_token_ids[0] == theirs.eos_token_id == 256
    assert ours.vocab_size == read_model_config(path)["vocab_size"]
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _broken_copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loader_errors(models, tmp_path):
    from safetensors.torch import load_file, save_file

    ours, _, path = models
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    d = _broken_copy(path, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(d))
    d = _broken_copy(path, tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(str(d))
    d = _broken_copy(path, tmp_path / "arch")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="NemotronHForCausalLM"):
        load_model(str(d))
    d = _broken_copy(path, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(d))
    tensors = load_file(str(Path(path) / "model.safetensors"))
    d = _broken_copy(path, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_model(str(d))
    d = _broken_copy(path, tmp_path / "shape")
    save_file({**tensors, "lm_head.weight": tensors["lm_head.weight"][:-1].clone()}, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(str(d))
    # sharded checkpoints with an index load to the same weights
    d = _broken_copy(path, tmp_path / "sharded")
    names = sorted(tensors)
    (d / "model.safetensors").unlink()
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(d / file))
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_model(str(d))
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
