"""A worker announces itself to the proxies it is given: `POST /v1/cluster/workers` every `interval_s` (a
registration that doubles as the heartbeat; it expires on the proxy after `ttl_s`), `DELETE` when it stops.

Each proxy URL's host is resolved on every round to all of its addresses, so one name that resolves to every proxy
replica (a Kubernetes headless Service) reaches them all, and replicas that come later are found. The cluster token
goes as header `x-hybridpd-token`. Failures are logged once per proxy state change and retried next round: the
proxies may start after the workers.

Ownership: one `Announcer` per worker process, on its event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

log = logging.getLogger(__name__)

PATH = "/v1/cluster/workers"


def _targets(url: str) -> list[str]:
    """The registration URL for every address `url`'s host resolves to (the URL itself if it does not resolve)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host, port = parts.hostname or "", parts.port
    try:
        infos = socket.getaddrinfo(host, port or 80, type=socket.SOCK_STREAM)
    except OSError:
        return [urlunsplit((parts.scheme, parts.netloc, PATH, "", ""))]
    out = []
    for info in infos:
        ip = str(info[4][0])
        netloc = f"[{ip}]" if ":" in ip else ip
        if port:
            netloc += f":{port}"
        target = urlunsplit((parts.scheme, netloc, PATH, "", ""))
        if target not in out:
            out.append(target)
    return out


class Announcer:
    def __init__(
        self,
        proxies: Sequence[str],
        ctx: Any,
        role: str,
        address: str,
        worker_id: str,
        epoch: str,
        cluster_token: str | None,
        interval_s: float = 1.0,
        ttl_s: float = 5.0,
    ) -> None:
        self.proxies = list(proxies)
        self.ctx = ctx
        """The worker's context: its `draining` flag goes with every registration."""
        self.body = {"role": role, "address": address, "worker_id": worker_id, "epoch": epoch, "ttl_s": ttl_s}
        self.headers = {"x-hybridpd-token": cluster_token} if cluster_token else {}
        self.interval_s = interval_s
        self._ok: dict[str, bool] = {}
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=max(1.0, self.interval_s))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.announce_once()
            await asyncio.sleep(self.interval_s)

    async def announce_once(self) -> None:
        targets = [t for url in self.proxies for t in await asyncio.to_thread(_targets, url)]
        await asyncio.gather(*(self._post(t) for t in targets))

    async def _post(self, target: str) -> None:
        assert self._client is not None
        try:
            body = {**self.body, "draining": bool(getattr(self.ctx, "draining", False))}
            r = await self._client.post(target, json=body, headers=self.headers)
            ok, why = r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok != self._ok.get(target):
            (log.info if ok else log.warning)("registration with %s: %s", target, "ok" if ok else why)
        self._ok[target] = ok

    async def stop(self) -> None:
        """Stop announcing and leave every proxy (best effort, a second at most)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is None:
            return
        targets = [t for t, ok in self._ok.items() if ok]
        leave = [
            self._client.request("DELETE", t, json={"address": self.body["address"]}, headers=self.headers)
            for t in targets
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*leave, return_exceptions=True), 1.0)
        except asyncio.TimeoutError:
            pass
        await self._client.aclose()
