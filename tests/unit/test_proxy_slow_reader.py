"""A client that opens a stream and stops reading it, its connection left open: once the proxy's writes to it have
been blocked (the socket's buffers full) for `HttpLimits.send_timeout_s`, the connection is dropped, the request
aborted on its workers and its admission budget given back; counted as an admission rejection `send_timeout`.
Without it, such a client held its sequences of the budget, the decode router's count and a stream task for as long
as it kept the connection open, however long after its workers finished."""

from __future__ import annotations

import json
import socket
import time

from hybridpd.proxy.config import HttpLimits

from tests.polling import wait_for
from tests.support.live_stack import LiveStack

MODEL = "tiny"


def _metric(stack: LiveStack, prefix: str) -> float:
    line = next(ln for ln in stack.http.get("/metrics").text.splitlines() if ln.startswith(prefix))
    return float(line.split()[-1])


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_budget_returned() -> None:
    with LiveStack(model_name=MODEL, http=HttpLimits(send_timeout_s=0.5)) as s:
        s.decode[0].token_text = lambda t: "x" * 20_000  # ~6 MB of stream: more than the sockets' buffers hold
        body = json.dumps(
            {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 300, "ignore_eos": True, "stream": True}
        ).encode()
        host, port = s.url.removeprefix("http://").split(":")
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect((host, int(port)))
        try:
            reader.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_for(
                "the stream admitted",
                lambda: _metric(s, "hybridpd_admission_in_flight_sequences") == 1,
                timeout=5,
                interval=0.05,
            )
            t0 = time.monotonic()
            wait_for(
                "the budget given back",
                lambda: _metric(s, "hybridpd_admission_in_flight_sequences") == 0,
                timeout=10,
                interval=0.05,
            )
            assert time.monotonic() - t0 < 5
            assert _metric(s, 'hybridpd_admission_rejected_total{reason="send_timeout"}') == 1
            assert _metric(s, 'hybridpd_proxy_in_flight_requests{role="decode"') == 0
            assert (
                s.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2}).status_code
                == 200
            )
        finally:
            reader.close()
