"""Several `Generation`s answered as one response: a list of prompts, `n` samples each (choice index =
prompt_index * n + sample_index). One worker request per choice. The 2nd..nth samples of a prompt start once the
first has its first token, so they find the prompt's blocks in the prefix cache (P's in PD, D's when colocated) and
the prompt is computed once.

Lifecycle (like `Generation`'s): `start()` -> first delta of every choice (fails as a whole: the others are
cancelled), `rest()` -> (index, delta) in arrival order, `close()` always.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from hybridpd.proxy.deltas import Delta, Usage
from hybridpd.proxy.generation import Generation

T = TypeVar("T")
_END = object()


async def gather_or_cancel(aws: Sequence[Awaitable[T]]) -> list[T]:
    """All results, or the first exception after cancelling the rest (asyncio.gather leaves them running)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


class Choices:
    def __init__(self, gens: Sequence[Generation]) -> None:
        self.gens = list(gens)
        self._leader: list[int] = []  # per choice: the index of its prompt's first sample
        for i, g in enumerate(self.gens):
            self._leader.append(i if g.req.counts_prompt or i == 0 else self._leader[i - 1])
        self._started = [asyncio.Event() for _ in self.gens]

    @property
    def usages(self) -> list[Usage]:
        return [g.usage for g in self.gens]

    async def _start(self, i: int) -> Delta:
        leader = self._leader[i]
        if leader != i:
            await self._started[leader].wait()
        try:
            return await self.gens[i].start()
        finally:
            self._started[i].set()

    async def start(self) -> list[Delta]:
        return await gather_or_cancel([self._start(i) for i in range(len(self.gens))])

    async def rest(self) -> AsyncIterator[tuple[int, Delta]]:
        if len(self.gens) == 1:
            async for d in self.gens[0].rest():
                yield 0, d
            return
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            try:
                async for d in gen.rest():
                    queue.put_nowait((i, d))
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                queue.put_nowait((i, exc))
                return
            queue.put_nowait((i, _END))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.gens)]
        try:
            open_ = len(tasks)
            while open_:
                i, item = await queue.get()
                if item is _END:
                    open_ -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    assert isinstance(item, Delta)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def close(self) -> None:
        for g in self.gens:
            g.close()

    def record_error(self) -> None:
        for g in self.gens:
            if not g.finished:
                g.record_error()
                return
