"""Requests whose HTTP framing is broken (h11 refuses them before any endpoint runs) get a 400 with an OpenAI-style
JSON error body like every other bad input, not uvicorn's plain-text one, and the connection is closed."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.support.live_stack import LiveStack

MODEL = "tiny"
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
BROKEN = {
    "negative content-length": HEAD + b"Content-Length: -5\r\n\r\n{}",
    "two content-lengths": HEAD + b"Content-Length: 2\r\nContent-Length: 5\r\n\r\n{}",
    "bad chunk size": HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "not http at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
    "non-ascii target": "GET /v1/mödels HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
}


@pytest.fixture(scope="module")
def stack() -> Iterator[LiveStack]:
    with LiveStack(model_name=MODEL) as s:
        yield s


def _exchange(stack: LiveStack, data: bytes) -> bytes:
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            out += chunk
    return out


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_framing_gets_a_json_400(stack: LiveStack, case: str) -> None:
    head, _, body = _exchange(stack, BROKEN[case]).partition(b"\r\n\r\n")
    lines = head.decode().lower().split("\r\n")
    assert lines[0].startswith("http/1.1 400"), head
    assert "content-type: application/json" in lines and "connection: close" in lines
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http" and error["message"]
    assert stack.http.get("/health").status_code == 200
