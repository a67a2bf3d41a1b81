"""Adversarial probes against a real cluster: does anything break the serving standard?

    python benchmarks/adversarial_probe.py --out probe.json [--colocated] [--storm 300] [--send-timeout 5]

Starts the built-in tiny model as plain processes (1 prefill + 1 decode worker and the proxy, or one colocated
worker), then, one after the other:

  edge       malformed and hostile HTTP bodies and framing: each must be a 4xx with an OpenAI-style JSON error
             (or a 200 where the request is valid), never a 5xx, a hang or a plain-text body
  storm      hundreds of concurrent requests (streamed or not, n>1, structured output, prompt logprobs, several
             prompts) whose clients go away at random points: before the answer, right after the headers, after
             the first token, mid-stream
  race       tiny requests (1-3 tokens) cancelled at random sub-second points, racing their own completion
  unread     streams whose client stops reading, its connection open: dropped after --send-timeout
  large      /health latency while the proxy renders one 130 MB non-streamed answer (n=32, echo, logprobs=20)
  kill       SIGKILL of the prefill worker, then of the decode worker, under greedy load: every 200 must carry the
             tokens an undisturbed run gives (a stream that fails must have been a correct prefix)

After each probe every worker must go back to idle (Stats: nothing running, waiting, pinned or in use) and the
proxy's admission ledger and in-flight counts to zero. Prints one table row per probe and writes JSON (the
figures, and `violations`: what broke the standard; empty is the bar). About 3-4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

IDLE_GAUGES = (
    "hybridpd_admission_in_flight_sequences",
    "hybridpd_admission_queued_prompt_tokens",
    "hybridpd_admission_waiting_requests",
    "hybridpd_proxy_in_flight_requests",
)


class Probe:
    def __init__(self, c: Any) -> None:
        self.c, self.url, self.model = c, c.url, c.model_name
        self.rows: list[dict[str, Any]] = []
        self.violations: list[str] = []

    # -- idle check ------------------------------------------------------------------------------------------------
    def busy(self) -> list[str]:
        """What is not idle: worker Stats and the proxy's ledger gauges."""
        out = []
        for w in self.c.prefill + self.c.decode:
            try:
                s = self.c.worker_stats(w)
            except Exception as e:  # noqa: BLE001 - a worker restarting: not idle yet
                out.append(f"{w.info['role']}: no Stats ({type(e).__name__})")
                continue
            held = [f"{p.kind}:{p.in_use}" for p in s.pools if p.in_use]
            if s.num_running or s.num_waiting or s.leases_pinned or held:
                out.append(
                    f"{w.info['role']}: running={s.num_running} waiting={s.num_waiting} "
                    f"leases={s.leases_pinned} in_use={held}"
                )
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(IDLE_GAUGES) and float(line.rsplit(" ", 1)[1]) != 0:
                out.append(line)
        return out

    def settle(self, name: str, timeout: float = 45.0) -> float:
        """Seconds until idle; a violation when it never is."""
        t0 = time.monotonic()
        left = self.busy()
        while left and time.monotonic() - t0 < timeout:
            time.sleep(0.5)
            left = self.busy()
        if left:
            self.violations.append(f"{name}: not idle after {timeout:g} s: {left}")
        return round(time.monotonic() - t0, 1)

    def row(self, name: str, **figures: Any) -> None:
        figures["idle_after_s"] = self.settle(name)
        self.rows.append({"probe": name, **figures})
        print(f"{name:8s} {json.dumps(figures)}", flush=True)

    # -- probes ----------------------------------------------------------------------------------------------------
    def edge(self) -> None:
        m = self.model
        ok = {"model": m, "prompt": "hi", "max_tokens": 2}
        bodies: list[bytes] = [
            b'{"model":"x","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b'{"prompt":"\xff\xfe"}',
            b'{"prompt":"\\ud800"}',
            b'{"temperature":NaN}',
            b'{"max_tokens":1e400}',
            b'{"max_tokens":' + b"9" * 5000 + b"}",
            b"",
            b"[1]",
            b"null",
            json.dumps({**ok, "n": 10**9}).encode(),
            json.dumps({**ok, "max_tokens": 10**12}).encode(),
            json.dumps({**ok, "stop": ["x"] * 1000}).encode(),
            json.dumps({**ok, "stop": ["x" * 5000]}).encode(),
            json.dumps({**ok, "logit_bias": {str(i): 1 for i in range(5000)}}).encode(),
            json.dumps({**ok, "prompt": [10**12]}).encode(),
            json.dumps({**ok, "guided_regex": "(("}).encode(),
            json.dumps({**ok, "prompt_logprobs": 10**6}).encode(),
            json.dumps({**ok, "model": "nope"}).encode(),
            json.dumps(
                {
                    "model": m,
                    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                }
            ).encode(),
            json.dumps({"model": m, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
            json.dumps({**ok, "prompt": "a" * (5 * 2**20)}).encode(),
        ]
        bad = 0
        for b in bodies:
            r = httpx.post(
                f"{self.url}/v1/completions", content=b, headers={"content-type": "application/json"}, timeout=60
            )
            if not (400 <= r.status_code < 500 and "error" in r.json()):
                bad += 1
                self.violations.append(f"edge: {b[:60]!r} -> {r.status_code} {r.text[:100]}")
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        framing = [
            head + b"Content-Length: -5\r\n\r\n{}",
            head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"\x16\x03\x01\x02\x00" + b"\x00" * 64,
        ]
        for raw in framing:
            reply = _raw_exchange(self.url, raw)
            if not (reply.startswith(b"HTTP/1.1 4") and b"application/json" in reply):
                bad += 1
                self.violations.append(f"edge framing: {raw[:40]!r} -> {reply[:80]!r}")
        self.row("edge", cases=len(bodies) + len(framing), not_a_json_4xx=bad)

    def storm(self, n: int) -> None:
        bodies = [
            {"prompt": "hello there " * 20, "max_tokens": 64, "ignore_eos": True},
            {"prompt": "x" * 600, "max_tokens": 32, "ignore_eos": True},
            {"prompt": "abc", "max_tokens": 40, "n": 3, "temperature": 1.0, "ignore_eos": True},
            {"prompt": "struct", "max_tokens": 40, "guided_regex": "[a-z]{5,30}"},
            {"prompt": "plp " * 30, "max_tokens": 20, "prompt_logprobs": 5, "logprobs": 3, "ignore_eos": True},
            {"prompt": ["multi a", "multi b"], "max_tokens": 30, "ignore_eos": True},
        ]

        async def one(rng: random.Random) -> str:
            body = {"model": self.model, **rng.choice(bodies)}
            mode = rng.choice(["cut", "headers", "first", "mid"])
            body["stream"] = mode != "cut" and "prompt_logprobs" not in body
            try:
                async with httpx.AsyncClient(timeout=60) as c:
                    if not body["stream"]:
                        r = await asyncio.wait_for(
                            c.post(f"{self.url}/v1/completions", json=body), rng.choice([0.005, 0.05, 0.3, 30.0])
                        )
                        return str(r.status_code)
                    async with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        if mode == "headers" or r.status_code != 200:
                            return str(r.status_code)
                        k = 0
                        async for line in r.aiter_lines():
                            k += line.startswith("data: ")
                            if mode == "first" or (mode == "mid" and k >= rng.randint(1, 10)):
                                return "cut"
                    return "done"
            except (asyncio.TimeoutError, httpx.HTTPError) as e:
                return type(e).__name__

        rng = random.Random(1)
        outcomes = asyncio.run(_gather([one(random.Random(rng.random())) for _ in range(n)]))
        fives = sum(1 for o in outcomes if o.startswith("5") and o != "503")  # 503: shed by admission
        if fives:
            self.violations.append(f"storm: {fives} 5xx other than 503")
        self.row("storm", requests=n, outcomes=_count(outcomes))

    def race(self, n: int) -> None:
        async def one(c: httpx.AsyncClient, rng: random.Random) -> str:
            body = {
                "model": self.model,
                "prompt": "race " * rng.randint(1, 40),
                "max_tokens": rng.randint(1, 3),
                "n": rng.choice([1, 2, 4]),
                "stream": rng.random() < 0.5,
                "temperature": 1.0,
            }
            try:
                r = await asyncio.wait_for(c.post(f"{self.url}/v1/completions", json=body), rng.uniform(0.001, 2.0))
                return str(r.status_code)
            except (asyncio.TimeoutError, httpx.HTTPError) as e:
                return type(e).__name__

        async def all_of() -> list[str]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1000)) as c:
                rng = random.Random(2)
                return await _gather([one(c, random.Random(rng.random())) for _ in range(n)])

        self.row("race", requests=n, outcomes=_count(asyncio.run(all_of())))

    def unread(self, streams: int, send_timeout: float) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        body = json.dumps(
            {
                "model": self.model,
                "prompt": "slow reader",
                "max_tokens": 3000,
                "ignore_eos": True,
                "stream": True,
                "logprobs": 20,
                "n": streams,
            }
        ).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:
            deadline = time.monotonic() + 30
            while not self.busy() and time.monotonic() < deadline:  # admitted and streaming
                time.sleep(0.1)
            t0 = time.monotonic()
            before = len(self.violations)
            self.settle("unread", timeout=send_timeout + 60)
            back = round(time.monotonic() - t0, 1) if len(self.violations) == before else None
        finally:
            sock.close()
        self.row("unread", streams=streams, budget_back_after_s=back)

    def large(self) -> None:
        lat: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=120) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    c.get(f"{self.url}/health")
                    lat.append(time.perf_counter() - t)
                    time.sleep(0.02)

        th = threading.Thread(target=probe, daemon=True)
        th.start()
        body = {
            "model": self.model,
            "prompt": [i % 500 + 1 for i in range(2000)],
            "max_tokens": 1,
            "n": 32,
            "echo": True,
            "logprobs": 20,
        }
        t0 = time.monotonic()
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=600)
        took = time.monotonic() - t0
        stop.set()
        th.join(130)
        self.row(
            "large",
            status=r.status_code,
            mb=len(r.content) >> 20,
            seconds=round(took, 1),
            health_max_s=round(max(lat), 2),
            health_p99_s=round(sorted(lat)[int(0.99 * (len(lat) - 1))], 2),
        )

    def kill(self, role: str, n: int) -> None:
        workers = self.c.prefill if role == "prefill" else self.c.decode
        if not workers:
            return
        prompts = [f"prompt number {k} " * 8 for k in range(4)]
        greedy = {"model": self.model, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        ref = {
            p: httpx.post(f"{self.url}/v1/completions", json={**greedy, "prompt": p}, timeout=120).json()["choices"][0][
                "token_ids"
            ]
            for p in prompts
        }

        async def one(c: httpx.AsyncClient, i: int) -> str:
            p = prompts[i % 4]
            stream = i % 2 == 0
            try:
                r = await c.post(f"{self.url}/v1/completions", json={**greedy, "prompt": p, "stream": stream})
            except httpx.HTTPError as e:
                return type(e).__name__
            if r.status_code != 200:
                return str(r.status_code)
            if not stream:
                return "200" if r.json()["choices"][0]["token_ids"] == ref[p] else "WRONG 200"
            toks, err = [], False
            for ev in r.text.split("\n\n"):
                if ev.startswith("data: {"):
                    obj = json.loads(ev[6:])
                    err = err or "error" in obj
                    toks += [t for ch in obj.get("choices", []) for t in ch["token_ids"]]
            if toks != ref[p][: len(toks)] or (not err and toks != ref[p]):
                return "WRONG stream"
            return "stream error" if err else "200"

        async def load() -> list[str]:
            async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=1000)) as c:
                tasks = [asyncio.ensure_future(one(c, i)) for i in range(n)]
                await asyncio.sleep(1.5)
                os.kill(workers[0].proc.pid, signal.SIGKILL)  # its supervisor starts it again (new epoch)
                return await _gather(tasks)

        outcomes = asyncio.run(load())
        wrong = sum(o.startswith("WRONG") for o in outcomes)
        if wrong:
            self.violations.append(f"kill {role}: {wrong} wrong answers")
        deadline = time.monotonic() + 120
        while not workers[0].alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        self.row(f"kill_{role[0]}", requests=n, outcomes=_count(outcomes))


async def _gather(aws: list[Any]) -> list[str]:
    return list(await asyncio.gather(*aws))


def _count(outcomes: list[str]) -> dict[str, int]:
    return {k: outcomes.count(k) for k in sorted(set(outcomes))}


def _raw_exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="adversarial_probe.json")
    ap.add_argument("--colocated", action="store_true")
    ap.add_argument("--storm", type=int, default=300, help="requests of the disconnect storm")
    ap.add_argument("--send-timeout", type=float, default=5.0, help="the proxy's --send-timeout for this run")
    args = ap.parse_args()
    from hybridpd.deploy.local_cluster import start_cluster
    from hybridpd.engine.default_model import default_model_path

    c = start_cluster(
        default_model_path(), colocated=args.colocated, proxy_args=["--send-timeout", str(args.send_timeout)]
    )
    p = Probe(c)
    try:
        p.edge()
        p.storm(args.storm)
        p.race(args.storm)
        p.unread(16, args.send_timeout)
        p.large()
        p.kill("prefill", 150)
        p.kill("decode", 150)
    finally:
        c.stop()
    out = {"colocated": args.colocated, "rows": p.rows, "violations": p.violations}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{len(p.violations)} violations" + "".join(f"\n  {v}" for v in p.violations))
    print(f"wrote {args.out}")
    sys.exit(1 if p.violations else 0)


if __name__ == "__main__":
    main()
