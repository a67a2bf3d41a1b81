"""The commands rank 0 sends its followers (`LeaderRunner` -> `follow`), in the form they travel in.

A command is `(name, args, kwargs)`, a runner call. The step (`execute(out, params)`) is most of the traffic and
goes in a compact form: the `SchedulerOutput` as plain tuples of its fields (pickled and rebuilt about twice as fast
as the dataclasses), without the sampling parameters (followers never sample: their `DiscardingSampler` ignores
them). Every other command travels as it is.

    ("execute", (out, params), {})  --encode-->  ("execute*", (seq fields...) per seq, (other output fields))
                                    --decode-->  ("execute", (out', NO_PARAMS), {})   with out' == out
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator, Mapping
from typing import Any

from hybridpd.engine.scheduler import ScheduledSeq, SchedulerOutput

_STEP = "execute*"
_SEQ_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduledSeq))
_OUT_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerOutput))
assert _OUT_FIELDS[0] == "seqs" and len(_SEQ_FIELDS) > 1 and len(_OUT_FIELDS) > 2  # attrgetter gives tuples
_seq_values = operator.attrgetter(*_SEQ_FIELDS)
_out_rest = operator.attrgetter(*_OUT_FIELDS[1:])

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


def encode(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The wire form of runner call `name(*args, **kwargs)`."""
    if name == "execute" and len(args) == 2 and not kwargs and type(args[0]) is SchedulerOutput:
        out = args[0]
        return (_STEP, tuple(map(_seq_values, out.seqs)), _out_rest(out))
    return (name, args, kwargs)


def decode(msg: tuple[Any, ...]) -> Command:
    """The runner call a wire form stands for (what a follower executes)."""
    if msg[0] == _STEP:
        _, seqs, rest = msg
        out = SchedulerOutput(tuple(ScheduledSeq(*v) for v in seqs), *rest)
        return "execute", (out, NO_PARAMS), {}
    name, args, kwargs = msg
    return name, args, kwargs


__all__ = ["NO_PARAMS", "Command", "decode", "encode"]
