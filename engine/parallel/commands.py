"""The commands rank 0 sends its followers (`LeaderRunner` -> `follow`), in the form they travel in.

A command is `(name, args, kwargs)`, a runner call. The step (`execute(out, params)`) is most of the traffic and
goes in a compact form: the `SchedulerOutput` as plain tuples of its fields (pickled and rebuilt several times
faster than the dataclasses), without the sampling parameters (followers never sample: their `DiscardingSampler`
ignores them), and a sequence's block tables only when they are not the very tables it had in the previous step
(the same tuple object, so the same content: the cache manager builds them again only when the request's pages
change; tables that could change in place are sent every step). Every other command travels as it is.

    ("execute", (out, params), {})            (or "launch", (out, params, feed): asynchronous scheduling)
       --StepEncoder-->  ("execute*", "execute", (), (every ScheduledSeq field but the tables, per seq),
                          (tables | None, per seq), (every other SchedulerOutput field))
       --StepDecoder-->  ("execute", (out', NO_PARAMS), {})   with out' == out

The fields are read from the dataclasses, so a field added to either travels without a change here. Each side
remembers the block tables of the last step it encoded or decoded (None: "the ones of the previous step"). The
channel delivers every command, in order, or the worker ends, so the two memories never differ; a follower asked
for tables it does not have fails (KeyError: it exits, the worker is restarted).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from hybridpd.engine.scheduler import ScheduledSeq, SchedulerOutput

_STEP = "execute*"
_STEP_CALLS = frozenset({"execute", "launch"})
"""Runner calls whose first argument is the step (`launch` has a third: which samples feed its input tokens)."""
_SEQ_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduledSeq))
_TABLES = _SEQ_FIELDS.index("group_block_ids")
_RID = _SEQ_FIELDS.index("request_id") - (_SEQ_FIELDS.index("request_id") > _TABLES)
_NUM_REST = len(_SEQ_FIELDS) - 1
_OUT_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerOutput) if f.name != "seqs")


def _values(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """obj -> the tuple of its attributes `names` (attrgetter, which returns a bare value for one name)."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    return lambda obj: tuple(getattr(obj, n) for n in names)


_seq_rest = _values(_SEQ_FIELDS[:_TABLES] + _SEQ_FIELDS[_TABLES + 1 :])
_out_rest = _values(_OUT_FIELDS)

Command = tuple[str, tuple[Any, ...], dict[str, Any]]


class _NoParams(Mapping[str, None]):
    """A follower's sampling parameters: None for every request (its sampler discards what it samples)."""

    def __getitem__(self, _rid: str) -> None:
        return None

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


NO_PARAMS = _NoParams()


class StepEncoder:
    """Rank 0's side (one per LeaderRunner; the step thread only)."""

    def __init__(self) -> None:
        self._tables: dict[str, Any] = {}
        """request id -> the block tables of the last encoded step (immutable ones only)."""

    def encode(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The wire form of runner call `name(*args, **kwargs)`."""
        if name not in _STEP_CALLS or not 2 <= len(args) <= 3 or kwargs or type(args[0]) is not SchedulerOutput:
            return (name, args, kwargs)
        out: SchedulerOutput = args[0]
        last: dict[str, Any] = self._tables
        now: dict[str, Any] = {}
        tables: list[Any] = []
        for s in out.seqs:
            rid, t = s.request_id, s.group_block_ids
            if last.get(rid) is t:
                tables.append(None)
                now[rid] = t
            else:
                tables.append(t)
                if _immutable(t):  # a table that could change in place is sent every step
                    now[rid] = t
        self._tables = now
        return (_STEP, name, args[2:], tuple(map(_seq_rest, out.seqs)), tuple(tables), _out_rest(out))


def _immutable(tables: Any) -> bool:
    """Tuples all the way down: the same object is the same tables forever."""
    return type(tables) is tuple and all(type(t) is tuple and type(t[1]) is tuple for t in tables)


class StepDecoder:
    """A follower's side (one per follow loop)."""

    def __init__(self) -> None:
        self._tables: dict[str, Any] = {}
        """request id -> the block tables of the last decoded step."""

    def decode(self, msg: tuple[Any, ...]) -> Command:
        """The runner call a wire form stands for (what the follower executes)."""
        if msg[0] != _STEP:
            name, args, kwargs = msg
            return name, args, kwargs
        _, name, extra, rests, tables, out_rest = msg
        last, k = self._tables, _TABLES
        cols = list(zip(*rests, strict=True)) or [()] * _NUM_REST  # field by field: one map builds the sequences
        rids = cols[_RID]
        seq_tables = [last[rid] if t is None else t for rid, t in zip(rids, tables, strict=True)]
        seqs = tuple(map(ScheduledSeq, *cols[:k], seq_tables, *cols[k:]))
        self._tables = dict(zip(rids, seq_tables, strict=True))
        out = SchedulerOutput(seqs=seqs, **dict(zip(_OUT_FIELDS, out_rest, strict=True)))
        return name, (out, NO_PARAMS, *extra), {}


__all__ = ["NO_PARAMS", "Command", "StepDecoder", "StepEncoder"]
