"""WorkerProcess ports: the first start lets the worker bind free ports itself (no window in which another process
can take a port chosen for it), a restart comes back on the same ports, and one whose ports were taken meanwhile
comes back on new ones instead of staying down."""

from __future__ import annotations

import os
import signal
import socket
import time

from hybridpd.deploy.ray_launcher import WorkerProcess


def _restarted(w: WorkerProcess, old_pid: int, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if w.proc is not None and w.proc.pid != old_pid and w.alive() and w.info.get("pid") == w.proc.pid:
            return
        time.sleep(0.1)
    raise AssertionError("the worker did not come back")


def test_ports_bound_by_the_worker_kept_on_restart_and_replaced_when_taken(checkpoint_dir):  # type: ignore[no-untyped-def]
    w = WorkerProcess(["--role", "decode", "--model", checkpoint_dir("nemotron_attn_mid"),
                       "--kv-cache-memory-bytes", str(8 << 20)], env={"OMP_NUM_THREADS": "1"})
    try:
        grpc_port, metrics_port = w.grpc_port, w.metrics_port
        assert grpc_port > 0 and metrics_port > 0 and w.info["address"].endswith(f":{grpc_port}")
        assert w.proc is not None
        pid = w.proc.pid
        os.kill(pid, signal.SIGKILL)
        _restarted(w, pid)
        assert (w.grpc_port, w.metrics_port) == (grpc_port, metrics_port)  # same address: peers keep it
        assert w.proc is not None
        pid = w.proc.pid
        with socket.socket() as squatter:
            os.kill(pid, signal.SIGKILL)
            w.proc.wait()
            squatter.bind(("127.0.0.1", metrics_port))  # someone takes a port before the restart binds it
            squatter.listen()
            _restarted(w, pid)
            assert w.metrics_port != metrics_port and w.info["metrics_port"] == w.metrics_port
    finally:
        w.stop()
