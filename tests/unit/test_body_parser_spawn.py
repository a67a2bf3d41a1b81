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


def test_the_helper_exits_when_its_proxy_is_killed() -> None:
    """A proxy killed without closing its parser (SIGKILL, OOM) must not leave the helper process behind."""
    import os
    import signal
    import subprocess
    import sys

    script = (
        "import os, sys, time\n"
        "from hybridpd.proxy.body_parser import BodyParser\n"
        "from hybridpd.proxy.config import RequestLimits\n"
        "p = BodyParser('m', RequestLimits()); p.start()\n"
        "print(p._helper.submit(os.getpid).result(timeout=60), flush=True); time.sleep(60)\n"
    )
    proxy = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(proxy.stdout.readline())  # type: ignore[union-attr]
        os.kill(helper, 0)  # alive while its proxy is
        proxy.send_signal(signal.SIGKILL)
        proxy.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(helper, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(helper, signal.SIGKILL)
        raise AssertionError("the parser helper outlived its killed proxy")
    finally:
        proxy.kill()
