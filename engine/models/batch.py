"""What the runner hands a model for one forward step (built in one place: `ModelRunner.build_batch` for the
reference path, `engine/models/varlen.py: build_varlen` for the batched GPU path).

Tokens of all scheduled sequences are flattened into one varlen batch:

    flat tokens:  | seq0 chunk (prefill)      | seq1 (decode) | seq2 chunk | pad... |
    query_start:    0                           n0              n0+1
    positions:      c0 .. c0+n0-1               c1              c2 ..
    slot_mapping:   block_table0[p//bs]*bs+p%bs ...                          -1 (PAD_SLOT_ID)

Per sequence, `num_computed_tokens` tokens are already in the caches (attention KV in its blocks, recurrent
state in `state_slot`), and `num_new_tokens` are computed now. Padded rows carry PAD_SLOT_ID in every index
tensor and are never read or written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.cache.specs import PAD_SLOT_ID


@dataclass
class SeqInfo:
    """One sequence's slice of the flat batch."""

    query_start: int
    """Offset of this sequence's first new token in the flat arrays."""
    num_new_tokens: int
    num_computed_tokens: int
    """Tokens already cached before this step (context length = num_computed_tokens + num_new_tokens)."""
    block_table: torch.Tensor
    """int64 [n] attention block ids of this sequence (attention group), covering the whole context."""
    state_slot: int
    """Running recurrent-state slot (same index for every recurrent layer); PAD_SLOT_ID for padded rows."""
    has_initial_state: bool
    """False: the recurrent state starts from zeros (the slot's old contents are ignored, never read)."""
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    """(num_tokens, dest_slot): after processing `num_tokens` tokens in total (a position inside or at the end
    of this chunk: num_computed_tokens < num_tokens <= num_computed_tokens + num_new_tokens), copy the
    recurrent state (conv + ssm) of every recurrent layer into `dest_slot`."""


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]; attention cache slot = block_id * block_size + offset; -1 = pad
    seqs: list[SeqInfo]
    block_size: int
    varlen: Any = None
    """engine.models.varlen.VarlenMetadata on the batched fast path (then `seqs` is empty), else None."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


__all__ = ["ForwardBatch", "SeqInfo", "PAD_SLOT_ID"]
