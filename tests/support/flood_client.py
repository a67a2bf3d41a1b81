"""One attacker process for `tests.support.attack.flood`: imports only httpx, so a spawned copy starts fast."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx


def expected_ids(prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """What the fake decode worker answers: the prompt reversed, cut at max_tokens (cycled with ignore_eos)."""
    rev = list(reversed(prompt))
    return [rev[i % len(rev)] for i in range(max_tokens)] if ignore_eos else rev[:max_tokens]


def wrong_choices(body: dict[str, Any], prompt: list[int], max_tokens: int, ignore_eos: bool = False,
                  expected: list[int] | None = None) -> int:
    """Choices of a 200 whose tokens are not `expected` (default: the fake's answer for `prompt`)."""
    want = expected if expected is not None else expected_ids(prompt, max_tokens, ignore_eos)
    return sum(1 for c in body["choices"] if c.get("token_ids") != want)


def flood_client(url: str, source_ip: str, content: bytes, headers: dict[str, str], start_at: float,
                 seconds: float, request: dict[str, Any], out: Any) -> None:
    """One attacker (its own process): from `start_at` (time.time()), post `content` back to back for `seconds`;
    put its counts on `out`. A common `start_at` makes the attackers of a flood overlap however slowly they spawn."""
    counts: dict[str, int] = {"tried": 0, "wrong_200s": 0}
    time.sleep(max(0.0, start_at - time.time()))
    end = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address=source_ip)) as c:
        while time.monotonic() < end:
            r = c.post("/v1/completions", content=content, headers=headers)
            counts["tried"] += 1
            counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1
            if r.status_code == 200 and request.get("check", True):
                counts["wrong_200s"] += wrong_choices(r.json(), request["prompt"], request["max_tokens"],
                                                      bool(request.get("ignore_eos")), request.get("expected"))
            elif r.status_code in (429, 503):
                if "Retry-After" not in r.headers or not r.json()["error"]["code"]:
                    counts["malformed_rejections"] = counts.get("malformed_rejections", 0) + 1
                time.sleep(0.05)
    out.put(counts)




async def _abandon(port: int, source_ip: str, body: bytes, count: int) -> dict[str, int]:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")

    async def open_one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source_ip, 0))
        writer.write(head + body)
        await writer.drain()
        return reader, writer

    conns = await asyncio.gather(*(open_one() for _ in range(count)))
    statuses: dict[str, int] = {}
    for reader, _ in conns:
        status = (await asyncio.wait_for(reader.readuntil(b"\r\n"), 20)).split()[1].decode()
        statuses[status] = statuses.get(status, 0) + 1
        if status == "200":
            await asyncio.wait_for(reader.readuntil(b"data:"), 20)  # the stream has started
    for _, writer in conns:
        writer.transport.abort()  # RST: the client is gone
    return statuses


def abandon_streams(port: int, source_ip: str, body: bytes, count: int, out: Any) -> None:
    """Open `count` streaming requests at once, read each to its first event (or its error status), then drop
    every connection; put (statuses, time.perf_counter() at the drop) on `out`."""
    statuses = asyncio.run(_abandon(port, source_ip, body, count))
    out.put((statuses, time.perf_counter()))


async def _slow_client(port: int, source_ip: str, head: bytes, drip: bytes, interval_s: float,
                       give_up_s: float) -> tuple[float, bytes]:
    """Send `head`, then `drip` one byte every `interval_s`; (seconds from connected until the server closed, what
    it sent). Timed from the connection, not from the call: 300 clients connecting at once on a loaded box may wait
    for their handshake, and the server's deadlines start at its accept."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source_ip, 0))
    t0 = time.perf_counter()
    got = b""
    try:
        writer.write(head)
        for i in range(int(give_up_s / interval_s)):
            try:
                chunk = await asyncio.wait_for(reader.read(4096), interval_s)
            except asyncio.TimeoutError:
                writer.write(drip[i % len(drip):i % len(drip) + 1])
                continue
            got += chunk
            if not chunk:
                return time.perf_counter() - t0, got
    except (ConnectionError, OSError):
        return time.perf_counter() - t0, got
    finally:
        writer.transport.abort()
    return float("inf"), got


def slowloris(port: int, heads: int, bodies: int, out: Any) -> None:
    """`heads` clients dripping header bytes (from 127.0.0.2) and `bodies` dripping a body byte by byte (from
    127.0.0.3), one byte every 0.2 s, each giving up after 6 s; put each one's (seconds from connected until the
    server closed, what it sent) on `out`, the header clients first."""

    async def attack() -> list[tuple[float, bytes]]:
        slow_heads = [_slow_client(port, "127.0.0.2", b"POST /v1/completions HTTP/1.1\r\n", b"X-Pad: aaaaaaaa\r\n",
                                   0.2, 6.0) for _ in range(heads)]
        slow_bodies = [_slow_client(port, "127.0.0.3", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
                                    b'"prompt": [1, 2, 3]     ', 0.2, 6.0) for _ in range(bodies)]
        return list(await asyncio.gather(*slow_heads, *slow_bodies))

    out.put(asyncio.run(attack()))
