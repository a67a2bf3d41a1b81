"""HTTP connection hardening for uvicorn's h11 protocol: header and body deadlines and a connection cap.

uvicorn bounds header size (h11's 16 KiB) and idle keep-alive time, but not how long a client may take to send a
request: a connection that dribbles its headers or body a byte at a time (slowloris) stays open forever, and
nothing caps open connections. `guarded_h11(limits, on_reject)` returns an `H11Protocol` subclass that adds:

    connect / previous response --(header_timeout_s)--> headers complete --(body_timeout_s)--> body complete
            missed: the connection is closed             missed: 408 (if no response started), then closed
    more than max_connections open: the new one is closed at once
    writes blocked for send_timeout_s (the client stopped reading: its socket's buffers are full): dropped
    framing h11 refuses (a bad Content-Length, chunk or request line): a 400 with a JSON error body, then closed

A dropped connection's request sees `http.disconnect` (its stream is aborted on the workers and its admission budget
given back): a client that stops reading a stream, its connection open, would otherwise hold them for as long as
it keeps the connection. Each drop calls `on_reject(reason)` (reason: connection_cap, header_timeout, body_timeout,
send_timeout). Timers are
`loop.call_later` handles owned by the connection and cancelled when it closes. Event loop only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from hybridpd.proxy.config import HttpLimits
from uvicorn.protocols.http.h11_impl import H11Protocol

RejectHook = Callable[[str], None]

_TIMEOUT_BODY = json.dumps({"error": {"message": "the request body did not arrive in time", "type":
                                      "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()


def _error_body(message: str, code: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()


def guarded_h11(limits: HttpLimits, on_reject: RejectHook) -> type[H11Protocol]:
    """An H11Protocol class enforcing `limits` (see the module doc)."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_for: str = ""  # "headers", "body" or "" (nothing due from the client)
        _send_deadline: asyncio.TimerHandle | None = None  # set while the transport has paused our writes

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                on_reject("connection_cap")
                transport.abort()
                return
            self._expect("headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._expect("")
            self._cancel_send_deadline()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_deadline is None and not self.transport.is_closing():
                self._send_deadline = self.loop.call_later(limits.send_timeout_s, self._send_expired)

        def resume_writing(self) -> None:
            self._cancel_send_deadline()
            super().resume_writing()

        def _cancel_send_deadline(self) -> None:
            if self._send_deadline is not None:
                self._send_deadline.cancel()
                self._send_deadline = None

        def _send_expired(self) -> None:
            """The client read nothing of what we sent for send_timeout_s: drop it (abort: what is buffered for it
            would never drain, so a close would keep the socket open). connection_lost tells the request."""
            self._send_deadline = None
            if self.transport.is_closing():
                return
            on_reject("send_timeout")
            self.transport.abort()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track_request()

        def _track_request(self) -> None:
            state = self.conn.their_state
            if state is h11.IDLE:
                if self._waiting_for != "headers":
                    self._expect("headers")
            elif state is h11.SEND_BODY:
                if self._waiting_for != "body":
                    self._expect("body")
            else:
                self._expect("")

        def _expect(self, what: str) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._waiting_for = what
            if what and not self.transport.is_closing():
                delay = limits.header_timeout_s if what == "headers" else limits.body_timeout_s
                self._deadline = self.loop.call_later(delay, self._expired, what)

        def _expired(self, what: str) -> None:
            self._deadline = None
            if self.transport.is_closing() or self._waiting_for != what:
                return
            on_reject("header_timeout" if what == "headers" else "body_timeout")
            if what == "body" and self.cycle is not None and not self.cycle.response_started:
                self._send_408()
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # the app's receive() now answers http.disconnect
                self.cycle.message_event.set()
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """h11 refused the request's framing (a bad Content-Length, chunk or request line): uvicorn answers a
            plain-text 400; this one carries an OpenAI-style JSON error like every other bad input."""
            body = _error_body(f"invalid HTTP request: {msg}", "invalid_http")
            self._send_error(400, b"Bad Request", body)
            self.transport.close()

        def _send_error(self, status: int, reason: bytes, body: bytes) -> None:
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            try:
                for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=body),
                              h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass  # the connection cannot carry a response any more: just close it

        def _send_408(self) -> None:
            self._send_error(408, b"Request Timeout", _TIMEOUT_BODY)

    return GuardedH11Protocol


def uvicorn_config(app: Any, limits: HttpLimits, on_reject: RejectHook, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn.Config serving `app` over the guarded h11 protocol with `limits`' keep-alive timeout."""
    return uvicorn.Config(app, http=guarded_h11(limits, on_reject), timeout_keep_alive=limits.keep_alive_timeout_s,
                          **kwargs)
