"""The step's host-side fast paths give what the straightforward code gives: the reference batch built column by
column (`ModelRunner._build_view`) against a per-sequence loop, and the sampler's all-plain-greedy step against its
general path, bit for bit."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from hybridpd.engine import sampler as sampler_module
from hybridpd.engine.cache.specs import PAD_SLOT_ID
from hybridpd.engine.models.batch import ForwardBatch, SeqInfo
from hybridpd.engine.runner import ModelRunner
from hybridpd.engine.sampler import Sampler
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import ScheduledSeq, SchedulerOutput
from hybridpd.engine.structured.spec import StructuredOutput

BS = 4


def per_sequence_view(out: SchedulerOutput, blocks, slots, checkpoints) -> ForwardBatch:  # type: ignore[no-untyped-def]
    """The reference batch written the obvious way: one sequence, one token at a time."""
    ids: list[int] = []
    pos: list[int] = []
    mapping: list[int] = []
    seqs: list[SeqInfo] = []
    for s, table, slot, ckpts in zip(out.seqs, blocks, slots, checkpoints, strict=True):
        start = s.num_computed_tokens
        seqs.append(
            SeqInfo(
                len(ids),
                s.num_new_tokens,
                start,
                torch.tensor(table, dtype=torch.int64),
                slot if slot > 0 else PAD_SLOT_ID,
                s.has_initial_state,
                list(ckpts),
            )
        )
        ids.extend(s.token_ids)
        for p in range(start, start + s.num_new_tokens):
            pos.append(p)
            mapping.append(table[p // BS] * BS + p % BS if table else PAD_SLOT_ID)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(t(ids), t(pos), t(mapping), seqs, BS)


def random_step(rnd: random.Random, n: int, decode_only: bool) -> tuple[SchedulerOutput, list, list, list]:
    seqs, blocks, slots, ckpts = [], [], [], []
    for i in range(n):
        start = rnd.randrange(0, 40)
        new = 1 if decode_only or rnd.random() < 0.5 else rnd.randrange(2, 12)
        table = () if rnd.random() < 0.15 else tuple(rnd.randrange(1, 500) for _ in range(-(-(start + new) // BS)))
        seqs.append(ScheduledSeq(f"r{i}", start, tuple(rnd.randrange(0, 100) for _ in range(new)), True))
        blocks.append(table)
        slots.append(rnd.choice([0, -1, rnd.randrange(1, 64)]))
        ckpts.append(((start + new, rnd.randrange(64, 128)),) if rnd.random() < 0.3 else ())
    return SchedulerOutput(tuple(seqs), ()), blocks, slots, ckpts


@pytest.mark.parametrize("decode_only", [True, False])
def test_reference_batch_equals_the_per_sequence_loop(decode_only: bool) -> None:
    runner = SimpleNamespace(block_size=BS, device=torch.device("cpu"))
    rnd = random.Random(0)
    for n in (1, 2, 7, 64):
        out, blocks, slots, ckpts = random_step(rnd, n, decode_only)
        got = ModelRunner._build_view(runner, out, blocks, slots, ckpts)  # type: ignore[arg-type]
        want = per_sequence_view(out, blocks, slots, ckpts)
        for name in ("input_ids", "positions", "slot_mapping"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.block_size == want.block_size and len(got.seqs) == len(want.seqs) == n
        for a, b in zip(got.seqs, want.seqs, strict=True):
            assert torch.equal(a.block_table, b.block_table) and a.block_table.dtype == torch.int64
            assert dataclasses.replace(a, block_table=b.block_table) == b
    with pytest.raises(ValueError, match="per scheduled sequence"):
        ModelRunner._build_view(runner, out, blocks[:-1], slots, ckpts)  # type: ignore[arg-type]


SAMPLER_IGNORES_WHEN_GREEDY = {
    "max_tokens",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "min_p",
    "bad_words",
    "skip_special_tokens",
    "prompt_logprobs",
}
"""SamplingParams fields a greedy row's sampling never reads (stop ids only with min_tokens, which is keyed; min_p,
like top-k and top-p, acts after temperature, on sampled rows only; bad_words are read as bad_words_token_ids, which
is keyed; skip_special_tokens only shapes the text; prompt_logprobs are scored by the runner from the scheduled
chunk, not by the sampler)."""


def test_plain_key_covers_every_field_the_sampler_reads() -> None:
    """A field added to SamplingParams must be keyed (or listed as never read): else the fast path would skip it."""
    keyed = set(sampler_module._plain_key.__reduce__()[1])
    assert keyed | SAMPLER_IGNORES_WHEN_GREEDY == {f.name for f in dataclasses.fields(SamplingParams)}
    assert sampler_module._plain_key(SamplingParams(temperature=0)) == sampler_module._PLAIN
    for change in (
        dict(temperature=0.5),
        dict(presence_penalty=0.1),
        dict(frequency_penalty=-0.1),
        dict(repetition_penalty=1.1),
        dict(logit_bias={3: 1.0}),
        dict(min_tokens=1),
        dict(top_logprobs=1),
        dict(structured_output=StructuredOutput("regex", "a+")),
        dict(allowed_token_ids=[3]),
    ):
        params = SamplingParams(**{"temperature": 0, **change})
        assert sampler_module._plain_key(params) != sampler_module._PLAIN, change
    words = SamplingParams(temperature=0, bad_words=["x"]).with_bad_words_token_ids(lambda w: [1])
    assert sampler_module._plain_key(words) != sampler_module._PLAIN


def test_plain_greedy_step_equals_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g) * 4
    lse = torch.logsumexp(logits, dim=-1) + 0.25  # as given by a CUDA graph: used, not recomputed
    rids = [f"r{i}" for i in range(64)]
    same = SamplingParams(temperature=0, max_tokens=7)
    params = [same if i % 2 else SamplingParams(temperature=0, seed=i, stop_token_ids=(5,)) for i in range(64)]
    for given_lse in (None, lse):
        fast = Sampler(torch.device("cpu")).sample_rows(logits, rids, params, given_lse)
        assert fast.tokens.shape == (64,)
        monkeypatch.setattr(sampler_module, "_PLAIN", ("never",))
        slow = Sampler(torch.device("cpu")).sample_rows(logits, rids, params, given_lse)
        monkeypatch.undo()
        assert fast.resolve() == slow.resolve()
        assert torch.equal(fast.tokens, slow.tokens)


def test_tp_step_command_round_trips_empty_and_full_steps() -> None:
    """The follower rebuilds the step field by field (`StepDecoder`): an empty step (only preemptions) and a batch of
    64 come back equal."""
    import pickle

    from hybridpd.engine.parallel.commands import StepDecoder, StepEncoder

    enc, dec = StepEncoder(), StepDecoder()
    rnd = random.Random(1)
    tables = {f"r{i}": ((0, tuple(rnd.randrange(1, 99) for _ in range(3))),) for i in range(64)}
    for k in range(3):
        seqs = tuple(
            ScheduledSeq(rid, 9 + k, (k,), True, t, ((1, i + 1),), ((1, ()),))
            for i, (rid, t) in enumerate(tables.items())
        )
        for out in (SchedulerOutput(seqs, ()), SchedulerOutput((), ("gone",))):
            wire = pickle.loads(pickle.dumps(enc.encode("execute", (out, {}), {})))
            assert dec.decode(wire)[1][0] == out
