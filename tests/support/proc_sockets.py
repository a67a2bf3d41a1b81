"""What a process tree exposes, read from /proc (Linux; no psutil): its processes and its listening sockets.

tree(pid)            pid and every descendant (deploy.reaper.descendants)
listeners(pids)      [(pid, command, "addr:port", proto)] of the TCP sockets in LISTEN and bound UDP sockets
                     that those processes hold
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import NamedTuple

from hybridpd.deploy.reaper import descendants

LOOPBACK = ("127.0.0.1", "::1")


class Listener(NamedTuple):
    pid: int
    command: str
    address: str
    port: int
    proto: str

    def on_loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback


def tree(pid: int) -> set[int]:
    return {pid} | descendants(pid)


def _socket_inodes(pid: int) -> set[str]:
    out: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            out.add(m.group(1))
    return out


def _decode(hex_addr: str) -> tuple[str, int]:
    """'0100007F:1F90' (little-endian words, as in /proc/net/tcp) -> ('127.0.0.1', 8080)."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def listeners(pids: set[int]) -> list[Listener]:
    by_inode = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table, proto, state in (
        ("tcp", "tcp", "0A"),
        ("tcp6", "tcp", "0A"),
        ("udp", "udp", "07"),
        ("udp6", "udp", "07"),
    ):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == state and f[9] in by_inode:
                pid = by_inode[f[9]]
                addr, port = _decode(f[1])
                found.append(Listener(pid, _command(pid), addr, port, proto))
    return found
