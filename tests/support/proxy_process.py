"""`ProxyProcess`: FAKE workers on a background event loop in this process, and the real proxy started as
`hybridpd proxy` in a process of its own, as deployed; so what a test measures of the proxy (its /health latency,
its event loop) is the proxy's alone. Test support only; nothing here serves a model."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from tests.support.fake_workers import FakeDecodeWorker, FakePrefillWorker, serve_fake

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProxyProcess:
    """    with ProxyProcess(["--admission-max-seqs", "64"], token_delay_s=0.02) as p:
            httpx.get(p.url + "/health"); p.decode[0].running; p.metric("hybridpd_admission_rejected_total")"""

    def __init__(self, flags: list[str], token_delay_s: float = 0.0, env: dict[str, str] | None = None) -> None:
        self.flags = flags
        self.prefill = [FakePrefillWorker("fake-prefill-0")]
        self.decode = [FakeDecodeWorker("fake-decode-0", token_delay_s)]
        self.env = env or {}
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-workers", daemon=True)
        self._servers: list[grpc.aio.Server] = []
        self._proc: subprocess.Popen[bytes] | None = None

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start_fakes(self) -> None:
        workers: list[FakePrefillWorker | FakeDecodeWorker] = [*self.prefill, *self.decode]
        for w in workers:
            self._servers.append(await serve_fake(w))

    async def _stop_fakes(self) -> None:
        for s in self._servers:
            await s.stop(grace=None)

    def __enter__(self) -> ProxyProcess:
        self._thread.start()
        self._run(self._start_fakes())
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "hybridpd.deploy.cli", "proxy", "--port", str(port), "--prefill",
               *(w.address for w in self.prefill), "--decode", *(w.address for w in self.decode), *self.flags]
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        env.pop("HYBRIDPD_API_KEY", None)
        self._proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the proxy exited: {self._proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("the proxy did not become healthy within 60 s")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        try:
            self._run(self._stop_fakes())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the proxy's /metrics (0.0 when absent)."""
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(want + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0
