"""An anonymous attacker against the real proxy, run as `hybridpd proxy` in its own process in front of FAKE
workers with a realistic per-token delay: n=128 floods, floods within one client's share, a flooding API key, 100
abandoned n=4 streams, slowloris headers and bodies, huge stop / logit_bias / prompt lists, a connection flood.
Each reports (printed; appended to $HYBRIDPD_ATTACK_REPORT as JSON when set): attacks tried, accepted beyond the
limits (sequences on the decode worker over the budget or over one client's share: 0), wrong 200s (0), the
legitimate client's latency against idle, the proxy's /health latency and RSS before and after.

Bars: nothing accepted beyond the budget, no wrong 200, every legitimate request finishes, /health max under 0.5 s,
and, where the attack leaves the legitimate client its share of the workers, its p50 latency within 2x of idle."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import httpx
import pytest
from hybridpd.proxy.config import HttpLimits

from tests.support.attack import AttackReport, Limits, Observer, flood
from tests.support.flood_client import abandon_streams, slowloris
from tests.support.live_stack import LiveStack
from tests.support.proxy_process import ProxyProcess

pytestmark = pytest.mark.slow  # starts the proxy as a process

TOKEN_DELAY_S = 0.02  # 50 tokens/s per sequence, a decode worker under load
ATTACK_S = 1.2
ANON_LIMITS = Limits(seqs=64, per_client=32)


def check(r: AttackReport, latency_bar: bool = True) -> None:
    assert r.accepted_beyond_limits == 0 and r.wrong_200s == 0, r
    assert r.legit_failed == 0 and r.legit_ok >= 1, r
    # The bar is /health under 0.5 s at worst. Typical p99 is 20-80 ms; 0.32 s was seen once in CI while the other
    # test process started a whole serve on the same two cores.
    assert r.health_max_s < 0.5, r
    if latency_bar:
        assert r.legit_p50_s < 2 * r.idle_p50_s, r


@pytest.fixture(scope="module")
def anon() -> Iterator[ProxyProcess]:
    """One proxy for the anonymous attacks: 64 sequences, 32 per client, 0.5 s wait, 1 s header/body deadlines."""
    flags = ["--admission-max-seqs", "64", "--admission-queue-timeout", "0.5", "--header-timeout", "1",
             "--body-timeout", "1", "--max-prompts", "64"]
    with ProxyProcess(flags, token_delay_s=TOKEN_DELAY_S) as p:
        yield p


def in_thread(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> threading.Thread:
    box: dict[str, Any] = {}

    def run() -> None:
        box["result"] = asyncio.run(coro_fn())

    t = threading.Thread(target=run)
    t.box = box  # type: ignore[attr-defined]
    t.start()
    return t


def test_n128_flood_and_share_flood(anon: ProxyProcess) -> None:
    """n=128 is a 400 at once (more than a client's 32); n=32 floods hold one share, the rest wait or get 503."""
    big = {"prompt": list(range(10, 20)), "max_tokens": 16, "n": 128}
    share_prompt = list(range(30, 40))
    share = {"prompt": share_prompt, "max_tokens": 40, "n": 32, "ignore_eos": True}  # 0.8 s > the wait
    with Observer(anon, ANON_LIMITS, {tuple(share_prompt)}, pid=anon.pid) as obs:
        box: dict[str, dict[str, int]] = {}
        t = threading.Thread(target=lambda: box.update(big=flood(anon.url, "127.0.0.2", 1, big, ATTACK_S)))
        t.start()
        box["share"] = flood(anon.url, "127.0.0.3", 2, share, ATTACK_S)
        t.join()
    big_c, share_c = box["big"], box["share"]
    r = obs.report("n=128 flood + n=32 share flood (budget 64, 32 per client)",
                   attacks_tried=big_c["tried"] + share_c["tried"],
                   wrong_200s=big_c["wrong_200s"] + share_c["wrong_200s"], n128=big_c, n32=share_c)
    assert big_c.get("400") == big_c["tried"] > 0  # can never fit a client's share
    assert share_c.get("200", 0) > 0 and share_c.get("503", 0) > 0  # one share at a time; the rest shed
    assert r.max_attacker_running == 32
    check(r)


def test_flooding_key_cannot_starve_another_key(tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice sk-alice\nmallory sk-mallory max_concurrency=24\n")
    keys.chmod(0o600)
    with ProxyProcess(["--api-keys-file", str(keys), "--admission-max-seqs", "48", "--admission-queue-timeout",
                       "0.3"], token_delay_s=TOKEN_DELAY_S) as p:
        prompt = list(range(50, 60))
        body = {"prompt": prompt, "max_tokens": 10, "n": 16}
        with Observer(p, Limits(48, 24), {tuple(prompt)}, headers={"Authorization": "Bearer sk-alice"},
                      pid=p.pid) as obs:
            c = flood(p.url, "127.0.0.2", 2, body, ATTACK_S, headers={"Authorization": "Bearer sk-mallory"})
        r = obs.report("API key flood (mallory: max_concurrency 24, n=16 x 2 clients)", attacks_tried=c["tried"],
                       wrong_200s=c["wrong_200s"], mallory=c)
        assert c.get("200", 0) > 0 and c.get("429", 0) > 0  # mallory's 2nd concurrent request: 16 + 16 > 24
        assert p.metric("hybridpd_admission_rejected_total", reason="key_concurrency") == c["429"]
        assert httpx.post(f"{p.url}/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 401
    check(r)


def test_abandoned_streams_are_cancelled_within_a_second() -> None:
    """100 streams of n=4 from one client under the default budget of one decode worker (256 sequences, 128 per
    client): 32 start (128 sequences on the worker), the others are shed with 503; every started stream is read
    to its first event, then dropped (RST). All their generations on the decode worker end within 1 s, each
    aborted; /health and a legitimate client go on meanwhile."""
    with ProxyProcess(["--admission-queue-timeout", "1"], token_delay_s=0.05) as p:
        port = int(p.url.rsplit(":", 1)[1])
        prompt = list(range(60, 70))
        body = {"prompt": prompt, "max_tokens": 400, "n": 4, "ignore_eos": True, "stream": True}
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        attacker = ctx.Process(target=abandon_streams, args=(port, "127.0.0.2", json.dumps(body).encode(), 100, out))
        with Observer(p, Limits(256, 128), {tuple(prompt)}, pid=p.pid) as obs:
            attacker.start()
            statuses, dropped = out.get(timeout=60)
            attacker.join(10)
            while any(d.running for d in p.decode) and time.perf_counter() - dropped < 5:
                time.sleep(0.01)
            cancel_s = time.perf_counter() - dropped
            time.sleep(0.3)
        aborts = len(set(p.decode[0].aborts))
        r = obs.report("100 abandoned n=4 streams (default budget of one decode worker)", attacks_tried=100,
                       wrong_200s=0, statuses=statuses, all_cancelled_within_s=round(cancel_s, 3),
                       decode_aborts=aborts)
        assert statuses == {"200": 32, "503": 68}, statuses
        assert r.max_attacker_running == 128  # the work really was on the worker
        assert cancel_s < 1.0, cancel_s
        assert aborts == 128  # every sequence aborted on D, not just its stream cancelled
        assert p.metric("hybridpd_admission_in_flight_sequences") == 0
    check(r)


def test_slowloris_headers_and_bodies_are_dropped(anon: ProxyProcess) -> None:
    port = int(anon.url.rsplit(":", 1)[1])
    before = {r: anon.metric("hybridpd_admission_rejected_total", reason=r) for r in ("header_timeout",
                                                                                       "body_timeout")}

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    attacker = ctx.Process(target=slowloris, args=(port, 250, 50, out))  # its CPU is not the observer's
    # the legitimate requests start early and go on until every slow client is dropped: they overlap the attack
    with Observer(anon, ANON_LIMITS, pid=anon.pid, legit_delay_s=0.3) as obs:
        attacker.start()
        results = out.get(timeout=60)
        attacker.join(10)
    head_s = [d for d, _ in results[:250]]
    body = results[250:]
    r = obs.report("slowloris (250 slow headers, 50 slow bodies; deadlines 1 s)", attacks_tried=300,
                   wrong_200s=0, header_drop_max_s=round(max(head_s), 3),
                   body_drop_max_s=round(max(d for d, _ in body), 3),
                   body_408s=sum(g.startswith(b"HTTP/1.1 408") for _, g in body))
    # dropped at the 1 s deadlines, not at the attacker's 6 s give-up (the bound leaves room for a loaded box:
    # 300 clients on one thread notice a close late)
    assert max(head_s) < 3.0, sorted(head_s)[-5:]
    assert all(d < 3.0 and g.startswith(b"HTTP/1.1 408") for d, g in body), body[:3]
    assert anon.metric("hybridpd_admission_rejected_total", reason="header_timeout") - before["header_timeout"] >= 250
    assert anon.metric("hybridpd_admission_rejected_total", reason="body_timeout") - before["body_timeout"] >= 50
    check(r)


def test_connection_cap_closes_the_excess() -> None:
    with LiveStack(http=HttpLimits(max_connections=20)) as s:
        port = int(s.url.rsplit(":", 1)[1])

        async def attack() -> int:
            conns = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
                     for _ in range(40)]

            async def closed_by_server(reader: asyncio.StreamReader) -> bool:
                try:
                    return await asyncio.wait_for(reader.read(1), 0.5) == b""
                except asyncio.TimeoutError:
                    return False
                except ConnectionError:
                    return True

            closed = sum(await asyncio.gather(*(closed_by_server(r) for r, _ in conns)))
            for _, writer in conns:
                writer.transport.abort()
            return closed

        t = in_thread(attack)
        t.join(60)
        assert t.box["result"] >= 20  # type: ignore[attr-defined]
        assert s.app.state.proxy.admission.rejected.labels(reason="connection_cap")._value.get() >= 20
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_huge_lists_are_400_and_cheap(anon: ProxyProcess) -> None:
    """60,000 stop strings, 20,000 logit_bias entries, 256 prompts (limit 64) and 40 prompts x 3,500 tokens (more
    queued prompt tokens than one client's share: 64 x 4096 / 2), posted back to back together."""
    base = {"prompt": list(range(70, 80)), "max_tokens": 4}
    bodies = {"stop": {**base, "stop": [f"s{i}" for i in range(60_000)]},
              "logit_bias": {**base, "logit_bias": {str(i): 1 for i in range(20_000)}},
              "prompts": {**base, "prompt": [[1, 2]] * 256},
              "prompt_tokens": {**base, "prompt": [[(i + j) % 250 + 1 for j in range(3500)] for i in range(40)]}}
    codes = {"stop": "limit_exceeded", "logit_bias": "limit_exceeded", "prompts": "limit_exceeded",
             "prompt_tokens": "request_too_large"}
    for name, body in bodies.items():  # each refused with its own reason
        resp = httpx.post(f"{anon.url}/v1/completions", json=body, timeout=30)
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, codes[name]), (name, resp.text)
    counts: dict[str, dict[str, int]] = {}
    with Observer(anon, ANON_LIMITS, pid=anon.pid) as obs:
        generates = len(anon.decode[0].generates)
        threads = [threading.Thread(target=lambda n=n, b=b: counts.update({n: flood(  # type: ignore[misc]
            anon.url, "127.0.0.2", 1, b, 2.0)})) for n, b in bodies.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    r = obs.report("huge stop / logit_bias / prompt lists, too many prompt tokens",
                   attacks_tried=sum(c["tried"] for c in counts.values()),
                   wrong_200s=sum(c["wrong_200s"] for c in counts.values()), counts=counts)
    for c in counts.values():
        assert c.get("400") == c["tried"] > 0, counts
    reached = {tuple(g.prompt_token_ids) for g in anon.decode[0].generates[generates:]}
    assert reached <= {tuple(range(1, 9))}  # nothing but the legitimate requests reached D
    check(r)  # big bodies are parsed in the proxy's helper process, not on its event loop's GIL


def test_slow_headers_on_a_kept_alive_connection_are_dropped() -> None:
    """uvicorn's keep-alive timer stops at the first byte of the next request: the header deadline must restart."""
    with LiveStack(http=HttpLimits(header_timeout_s=1.0, keep_alive_timeout_s=5)) as s:
        port = int(s.url.rsplit(":", 1)[1])

        async def attack() -> tuple[bytes, float]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"prompt": [1, 2], "max_tokens": 2}'
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # the first answer: kept alive
            length = int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            t0 = time.perf_counter()
            writer.write(b"GET /health HTTP/1.1\r\n")
            dropped = float("inf")
            for _ in range(30):  # one header byte every 0.2 s: would take 6 s
                try:
                    got = await asyncio.wait_for(reader.read(1), 0.2)
                except asyncio.TimeoutError:
                    writer.write(b"X")
                    continue
                except ConnectionError:
                    got = b""
                assert got == b"", got  # nothing but the close
                dropped = time.perf_counter() - t0
                break
            writer.transport.abort()
            return first, dropped

        t = in_thread(attack)
        t.join(30)
        first, dropped_after = t.box["result"]  # type: ignore[attr-defined]
        assert first.startswith(b"HTTP/1.1 200")
        assert dropped_after < 2.0, dropped_after
