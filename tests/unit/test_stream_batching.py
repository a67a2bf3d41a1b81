"""A decode stream that fell behind the engine sends the waiting deltas as one message, never across an end."""

from __future__ import annotations

import asyncio

from hybridpd.engine.async_engine import OutputDelta, take_pending


def _delta(tok: int, text: str, finish: str | None = None) -> OutputDelta:
    return OutputDelta((tok,), (-0.5 * tok,), (((tok, -0.1),),), finish, None, text, 3, 0, 0)


def test_waiting_deltas_merge_in_order_up_to_the_end() -> None:
    async def run() -> tuple[OutputDelta, OutputDelta, OutputDelta]:
        q: asyncio.Queue = asyncio.Queue()
        for d in (_delta(2, "a"), _delta(3, "ab"), _delta(4, "abc", "stop")):
            q.put_nowait(d)
        merged = take_pending(q, _delta(1, ""))
        q.put_nowait(_delta(5, "x"))
        alone = take_pending(q, _delta(9, "y", "length"))  # an end is never merged with what follows
        return merged, alone, q.get_nowait()

    merged, alone, left = asyncio.run(run())
    assert merged.token_ids == (1, 2, 3, 4) and merged.logprobs == (-0.5, -1.0, -1.5, -2.0)
    assert len(merged.top_logprobs) == 4 and merged.text == "abc" and merged.finish_reason == "stop"
    assert alone.token_ids == (9,) and left.token_ids == (5,)
