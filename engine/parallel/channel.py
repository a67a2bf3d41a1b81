"""Rank 0's commands to the follower ranks of one worker: one length-prefixed pickle per command, per follower, over
a Unix socket (the ranks are processes of one host).

    rank 0                                               rank r (r = 1..N-1)
    send(obj): pickle once, frame = | len: u64 | pickle |
      per follower: try the socket now (non-blocking) --> recv(): read the length, the pickle; unpickle
      what did not fit --> backlog --> sender thread     (blocks until the next command; EOF: rank 0 is gone)
                                     (writes it when the socket drains)

Rank 0 never waits for a follower: the common frame (a step, a few KB to a few hundred KB) goes into the socket
buffer in one system call on the caller's thread, and a frame that does not fit is finished by the sender thread
while rank 0 goes on with its own step. (A thread for every frame would wait for the GIL while rank 0's step runs
Python: up to the interpreter's switch interval, milliseconds.) Order is kept per follower (a frame goes to the
backlog whenever one is pending). A send that fails (a follower gone: EPIPE / ECONNRESET) fails the channel: every
later `send` raises ChannelError and `on_error` runs once (by default it ends the process with RANK_DIED_EXIT_CODE:
ranks out of step must never compute again; the worker is restarted whole).

Set-up (`Listener`, `connect`): rank 0 listens on a socket in a fresh 0700 directory (only this user can connect),
tells the followers its path over another channel (the worker's gloo group), and accepts exactly one connection per
follower rank, each announcing its rank. Ownership: the channel lives as long as the worker's group; rank 0 closes it
after its stop command (`LeaderChannel.close` delivers what is pending first).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import shutil
import socket
import struct
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hybridpd.tp")

RANK_DIED_EXIT_CODE = 70
"""The exit code of a worker whose ranks can no longer run in step (a rank died or could not be reached)."""

FRAME_HEADER = struct.Struct("<Q")
RANK_HEADER = struct.Struct("<I")
_NO_SIGPIPE = getattr(socket, "MSG_NOSIGNAL", 0)


class ChannelError(ConnectionError):
    """Rank 0 can no longer deliver commands to every follower (one is gone, or the channel was closed)."""


class LeaderGone(EOFError):
    """A follower's channel reached its end: rank 0 closed it (its process ended) without a stop command."""


def fail_worker(exc: BaseException) -> None:
    """The default `on_error`: a follower missed a command, so no rank may compute again."""
    log.critical("tensor-parallel control channel failed (%s): the worker exits to be restarted whole", exc)
    os._exit(RANK_DIED_EXIT_CODE)


class Listener:
    """Rank 0's end of the set-up: a listening socket at `address` until `close` (which removes it)."""

    def __init__(self) -> None:
        base = tempfile.gettempdir()
        if len(base) > 64 and os.path.isdir("/tmp"):  # a socket path holds at most ~100 bytes
            base = "/tmp"
        self._dir = tempfile.mkdtemp(prefix="hybridpd-tp-", dir=base)  # mode 0700
        self.address = os.path.join(self._dir, "control")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen()

    def accept(self, world: int, timeout_s: float) -> list[socket.socket]:
        """The connections of ranks 1..world-1, in rank order (each announces its rank)."""
        self._sock.settimeout(timeout_s)
        by_rank: dict[int, socket.socket] = {}
        while len(by_rank) < world - 1:
            conn, _ = self._sock.accept()
            conn.settimeout(timeout_s)
            (rank,) = RANK_HEADER.unpack(_read_exact(conn, RANK_HEADER.size))
            if not 0 < rank < world or rank in by_rank:
                conn.close()
                raise ChannelError(f"control channel: unexpected rank {rank} (world {world})")
            by_rank[rank] = conn
        return [by_rank[r] for r in range(1, world)]

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def connect(address: str, rank: int, timeout_s: float) -> FollowerChannel:
    """A follower's end: connect to rank 0's listener and announce `rank`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(address)
    sock.sendall(RANK_HEADER.pack(rank))
    sock.settimeout(None)  # a follower waits for rank 0's next command as long as the worker lives
    return FollowerChannel(sock)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LeaderGone("control channel closed")
        got += k
    return bytes(buf)


class FollowerChannel:
    """A follower's end: `recv` returns rank 0's commands in the order it sent them."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._file = sock.makefile("rb")

    def recv(self) -> Any:
        """The next command (blocks); LeaderGone when rank 0 closed the channel."""
        head = self._file.read(FRAME_HEADER.size)
        if len(head) < FRAME_HEADER.size:
            raise LeaderGone("rank 0 closed the control channel")
        (size,) = FRAME_HEADER.unpack(head)
        body = self._file.read(size)
        if len(body) < size:
            raise LeaderGone("rank 0 closed the control channel mid-command")
        return pickle.loads(body)

    def close(self) -> None:
        self._file.close()
        self._sock.close()


class LeaderChannel:
    """Rank 0's end: `send` is FIFO per follower and returns without waiting for any follower.

    Threads: `send` and `close` from one thread at a time (the engine's step thread); the sender thread only
    finishes frames that did not fit a socket buffer. `on_error(exc)` runs once, on the thread that met the error."""

    def __init__(self, socks: list[socket.socket], on_error: Callable[[BaseException], None] = fail_worker) -> None:
        self._socks = socks
        for s in socks:
            s.setblocking(False)
        self._backlog: list[deque[memoryview]] = [deque() for _ in socks]
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closing = False
        self.on_error = on_error
        self._thread = threading.Thread(target=self._drain_loop, name="tp-control-send", daemon=True)
        self._thread.start()

    def send(self, obj: Any) -> None:
        """Queue `obj` for every follower (pickled now: later changes to it are not sent)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        frame = memoryview(FRAME_HEADER.pack(len(data)) + data)
        error: BaseException | None = None
        with self._cond:
            if self._error is not None or self._closing:
                raise ChannelError("the control channel is closed") from self._error
            queued = False
            for i, backlog in enumerate(self._backlog):
                if backlog:  # a frame before this one is still going out: keep the order
                    backlog.append(frame)
                    continue
                try:
                    sent = self._socks[i].send(frame, _NO_SIGPIPE)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    error = self._error = exc
                    break
                if sent < len(frame):
                    backlog.append(frame[sent:])
                    queued = True
            if queued:  # only then: waking the sender thread costs the caller a GIL hand-over
                self._cond.notify_all()
        if error is not None:
            self.on_error(error)
            raise ChannelError(f"a follower rank is unreachable: {error}") from error

    @property
    def pending(self) -> int:
        """Frames (or their rests) not yet handed to the followers' sockets."""
        with self._cond:
            return sum(len(b) for b in self._backlog)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Deliver what is pending (up to `timeout_s`), then close the sockets. True when everything went out."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            delivered = self._cond.wait_for(lambda: self._error is not None or not any(self._backlog), timeout_s)
            delivered = delivered and self._error is None
            if self._error is None and not delivered:  # the sender thread stops without reporting it
                self._error = ChannelError("closed with commands undelivered")
        self._thread.join(timeout=1.0)
        for s in self._socks:
            s.close()
        return delivered

    def _drain_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._error is not None or self._closing or any(self._backlog))
                if self._error is not None or (self._closing and not any(self._backlog)):
                    return
                waiting = [self._socks[i] for i, b in enumerate(self._backlog) if b]
            try:
                poller = select.poll()  # not select(): file descriptors past 1024 in a busy worker
                for s in waiting:
                    poller.register(s, select.POLLOUT)
                poller.poll(100)
                with self._cond:
                    if self._error is not None:  # closed meanwhile
                        return
                    self._write_backlogs()
                    self._cond.notify_all()
            except (OSError, ValueError) as exc:  # ValueError: a socket closed under it
                with self._cond:
                    if self._error is not None:
                        return
                    self._error = exc
                    self._cond.notify_all()
                self.on_error(exc)
                return

    def _write_backlogs(self) -> None:
        """Write what each socket takes now (called with the lock held)."""
        for sock, backlog in zip(self._socks, self._backlog, strict=True):
            while backlog:
                try:
                    sent = sock.send(backlog[0], _NO_SIGPIPE)
                except BlockingIOError:
                    break
                if sent < len(backlog[0]):
                    backlog[0] = backlog[0][sent:]
                    break
                backlog.popleft()


__all__ = [
    "RANK_DIED_EXIT_CODE",
    "ChannelError",
    "FollowerChannel",
    "LeaderChannel",
    "LeaderGone",
    "Listener",
    "connect",
    "fail_worker",
]
