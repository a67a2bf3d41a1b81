"""What the runner hands a model for one forward step on the reference path (`ModelRunner.build_batch`; the batched
path's step is `engine.models.varlen.VarlenBatch`), and the cache-group views both paths share.

Tokens of all scheduled sequences are flattened into one varlen batch:

    flat tokens:  | seq0 chunk (prefill)      | seq1 (decode) | seq2 chunk | pad... |
    query_start:    0                           n0              n0+1
    positions:      c0 .. c0+n0-1               c1              c2 ..
    slot_mapping:   block_table0[p//bs]*bs+p%bs ...                          -1 (PAD_SLOT_ID)

Per sequence, `num_computed_tokens` tokens are already in the caches (attention KV in its blocks, recurrent
state in `state_slot`), and `num_new_tokens` are computed now. Padded rows carry PAD_SLOT_ID in every index
tensor and are never read or written.

Several cache groups of a kind (`GroupViews`): view k pairs the k-th attention group with the k-th recurrent
group; each view has its own block tables, slot mapping, state slots and checkpoints, the tokens are shared.

    groups:  attention A0 (layers 1, 5)  A1 (layer 3)      recurrent R0 (layers 0, 2)  R1 (layers 4, 6)
    views:   view 0 = A0 + R0  (ForwardBatch itself)        view 1 = A1 + R1  (ForwardBatch.views[0])
    layer_views = (0, 0, 0, 1, 1, 0, 1)

With at most one group of each kind there is one view and `layer_views` is empty: every layer reads the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from hybridpd.engine.cache.specs import PAD_SLOT_ID

if TYPE_CHECKING:
    from hybridpd.engine.cache.specs import CacheGroup


@dataclass
class SeqInfo:
    """One sequence's slice of the flat batch."""

    query_start: int
    """Offset of this sequence's first new token in the flat arrays."""
    num_new_tokens: int
    num_computed_tokens: int
    """Tokens already cached before this step (context length = num_computed_tokens + num_new_tokens)."""
    block_table: torch.Tensor
    """int64 [n] attention block ids of this sequence in this view's attention group, covering the whole context
    (empty: the view has no attention group)."""
    state_slot: int
    """Running recurrent-state slot in this view's recurrent group (same index for every layer of the group);
    PAD_SLOT_ID for padded rows and views without a recurrent group."""
    has_initial_state: bool
    """False: the recurrent state starts from zeros (the slot's old contents are ignored, never read)."""
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    """(num_tokens, dest_slot): after processing `num_tokens` tokens in total (a position inside or at the end
    of this chunk: num_computed_tokens < num_tokens <= num_computed_tokens + num_new_tokens), copy the
    recurrent state (conv + ssm) of every recurrent layer into `dest_slot`."""


@dataclass
class ForwardBatch:
    """The reference path's step (`CausalLM.forward_reference`)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]; attention cache slot = block_id * block_size + offset; -1 = pad
    seqs: list[SeqInfo]
    block_size: int
    views: list[ForwardBatch] = field(default_factory=list)
    """Views 1.. (see GroupViews): the same tokens with the other groups' slot mapping and seqs."""
    layer_views: tuple[int, ...] = ()
    """The view each layer reads (0: this batch); empty: every layer reads this batch."""


T = TypeVar("T")


def per_layer(views: Sequence[T], layer_views: tuple[int, ...], num_layers: int) -> list[T]:
    """What each layer reads: `views[layer_views[layer]]`, or views[0] for every layer when layer_views is empty
    (at most one group of each kind). Either path's per-view metadata (engine.models.reference.StepMetadata,
    engine.models.varlen.VarlenMetadata), each built once per step."""
    if not layer_views:
        return [views[0]] * num_layers
    return [views[v] for v in layer_views]


@dataclass(frozen=True)
class GroupViews:
    """Which view of a step each layer reads (see the module docstring). Built once by the runner from its cache
    groups. View k reads entry k of a scheduled sequence's `group_block_ids`, `group_state_slots` and
    `group_checkpoints` (the scheduler lists every group of a kind, in group order)."""

    layer_views: tuple[int, ...] = ()
    """View of each layer; empty with a single view."""
    attention: tuple[bool, ...] = (True,)
    """Whether view k has an attention group."""
    recurrent: tuple[bool, ...] = (True,)
    """Whether view k has a recurrent group."""

    @classmethod
    def of(cls, groups: Sequence[CacheGroup], num_layers: int) -> GroupViews:
        att = [g for g in groups if g.is_attention]
        rec = [g for g in groups if not g.is_attention]
        n = max(len(att), len(rec), 1)
        if n == 1:
            return cls(attention=(bool(att),), recurrent=(bool(rec),))
        layer_views = [0] * num_layers
        for kind in (att, rec):
            for k, g in enumerate(kind):
                for layer in g.layer_ids:
                    layer_views[layer] = k
        return cls(tuple(layer_views), tuple(k < len(att) for k in range(n)), tuple(k < len(rec) for k in range(n)))

    @property
    def count(self) -> int:
        return len(self.attention)

    def block_ids(self, seqs: Sequence[Any], k: int) -> list[tuple[int, ...]]:
        """Each ScheduledSeq's block table in view k's attention group (() where the view has none)."""
        if not self.attention[k]:
            return [()] * len(seqs)
        return [s.group_block_ids[k][1] for s in seqs]

    def state_slots(self, seqs: Sequence[Any], k: int) -> list[int]:
        """Each ScheduledSeq's running slot in view k's recurrent group (PAD_SLOT_ID where the view has none)."""
        if not self.recurrent[k]:
            return [PAD_SLOT_ID] * len(seqs)
        return [s.group_state_slots[k][1] for s in seqs]

    def checkpoints(self, s: Any, k: int) -> tuple[tuple[int, int], ...]:
        """A ScheduledSeq's checkpoints (num_tokens, slot) in view k's recurrent group."""
        return s.group_checkpoints[k][1] if self.recurrent[k] else ()  # type: ignore[no-any-return]


SINGLE_VIEW = GroupViews()
"""At most one cache group of each kind: one view, every layer reads it."""


__all__ = ["ForwardBatch", "GroupViews", "SINGLE_VIEW", "SeqInfo", "PAD_SLOT_ID", "per_layer"]
