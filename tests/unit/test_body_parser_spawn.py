"""The big-body parser's helper process is spawned off the event loop when the first big body arrives (a proxy
embedded without `proxy.server`, which spawns it before serving): starting a process can take up to a second on
a loaded host, and /health and every stream wait for the loop."""

from __future__ import annotations

import asyncio
import json
import time

from hybridpd.proxy.body_parser import INLINE_BYTES, BodyParser
from hybridpd.proxy.config import RequestLimits
from hybridpd.proxy.openai_schema import CompletionRequest


def test_a_slow_helper_spawn_never_stalls_the_event_loop() -> None:
    parser = BodyParser("m", RequestLimits())
    spawn = parser.start

    def slow_start() -> None:  # a loaded host: the fork itself takes half a second
        time.sleep(0.5)
        spawn()

    parser.start = slow_start  # type: ignore[method-assign]
    body = json.dumps({"model": "m", "prompt": "a" * (INLINE_BYTES + 10), "max_tokens": 3}).encode()

    async def run() -> tuple[int, object, object]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        first, second = await asyncio.gather(parser.parse(body, False), parser.parse(body, False))
        done.set()
        await task
        return ticks, first, second

    try:
        ticks, first, second = asyncio.run(run())
        helper = parser._helper
    finally:
        parser.close()
    assert isinstance(first, CompletionRequest) and isinstance(second, CompletionRequest)
    assert first.prompts == ("a" * (INLINE_BYTES + 10),)
    assert helper is not None
    assert ticks >= 25, ticks  # the loop kept running through the 0.5 s spawn (blocked, it ticks once or twice)
