"""Scoring prompt positions on the device (engine.prompt_logprobs holds the results on the host).

For the rows of one step that ask (`ScheduledSeq.prompt_scores`): logits of at most ROWS_PER_PASS rows at a time
(so a long prefill chunk never holds a chunk x vocabulary tensor), float32 log_softmax, the target token's logprob
and rank (how many tokens score at least as high, as vLLM counts it: 1 for the most likely), and the top k. The raw
model distribution, as vLLM reports prompt logprobs (no temperature, penalty or bias). The rows are read on the host
when scored (one device sync for a step that scores; steps without such rows pay nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from hybridpd.engine.prompt_logprobs import ScoredRows
from hybridpd.engine.scheduler import ScheduledSeq

ROWS_PER_PASS = 256
"""Rows whose logits exist at once (a bound on memory: ROWS_PER_PASS x vocabulary float32)."""


def score_prompt_rows(
    hidden: torch.Tensor, seqs: Sequence[ScheduledSeq], compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, ScoredRows]:
    """{request id: its scored rows} of the step's sequences that ask. `hidden`: the step's hidden states, one row
    per scheduled token, sequences in order. Every tensor-parallel rank runs it (compute_logits may gather)."""
    out: dict[str, ScoredRows] = {}
    offset = 0
    for s in seqs:
        if s.prompt_scores is not None:
            k, targets = s.prompt_scores
            out[s.request_id] = _score(
                hidden[offset : offset + len(targets)], targets, k, s.num_computed_tokens, compute_logits
            )
        offset += len(s.token_ids)
    return out


def _score(
    hidden: torch.Tensor,
    targets: tuple[int, ...],
    k: int,
    start: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> ScoredRows:
    tgt = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    lps, ranks, top_v, top_i = [], [], [], []
    for i in range(0, len(targets), ROWS_PER_PASS):
        logprobs = compute_logits(hidden[i : i + ROWS_PER_PASS]).float().log_softmax(-1)
        chosen = logprobs.gather(-1, tgt[i : i + ROWS_PER_PASS, None])
        lps.append(chosen[:, 0])
        ranks.append((logprobs >= chosen).sum(-1))
        v, ix = logprobs.topk(k, dim=-1)
        top_v.append(v)
        top_i.append(ix)
        del logprobs
    return ScoredRows(
        start=start,
        token_ids=list(targets),
        logprobs=torch.cat(lps).tolist(),
        ranks=torch.cat(ranks).tolist(),
        top_ids=torch.cat(top_i).tolist(),
        top_logprobs=torch.cat(top_v).tolist(),
    )
