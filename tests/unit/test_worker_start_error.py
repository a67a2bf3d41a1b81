"""A worker that cannot start (a model that does not fit, a bad flag) is reported with its own message by every
launcher: `WorkerProcess` raises it, the Ray actor of `hybridpd serve` hands it to the driver instead of dying (Ray
would restart it and the driver see only ActorUnavailableError), and serve ends with it as a one-line error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hybridpd.deploy import ray_launcher
from hybridpd.deploy.ray_launcher import WorkerProcess, WorkerStartError, check_started, worker_error

BAD = ["--role", "decode", "--gpu-memory-utilization", "0"]
WHY = r"gpu_memory_utilization must be in \(0, 1\], got 0.0 \(exit code 2\)$"


def test_worker_process_raises_the_workers_own_error_line() -> None:
    with pytest.raises(WorkerStartError, match="^decode worker did not start: " + WHY):
        WorkerProcess(BAD, restart=False)


def test_without_an_error_line_the_last_lines_are_the_reason() -> None:
    tail = ["INFO loading\n", "Traceback (most recent call last):\n", "  File x\n", "MemoryError\n", "\n"]
    assert str(worker_error("prefill", -9, tail)) == (
        "prefill worker did not start: Traceback (most recent call last): | File x | MemoryError (exit code -9)"
    )
    assert str(worker_error("decode", 1, [])).endswith("no output on stderr (exit code 1)")


def test_the_serve_actor_keeps_the_reason_and_the_driver_raises_it() -> None:
    fake_ray = SimpleNamespace(remote=lambda **opts: lambda cls: cls)  # the actor class as a plain class
    actor = ray_launcher._make_actor_class(fake_ray)(BAD, "127.0.0.1")
    info = actor.info()
    assert set(info) == {"error"} and "gpu_memory_utilization must be in (0, 1]" in info["error"]
    actor.stop()  # nothing started: nothing to stop, no error
    assert actor.pid() == -1
    good = {"address": "127.0.0.1:1"}
    with pytest.raises(WorkerStartError, match="^prefill and decode worker did not start: " + WHY):  # said once
        check_started([("prefill", info), ("decode", info), ("decode", good)])
    check_started([("decode", good)])


def test_the_proxy_admits_what_every_auto_fitted_worker_holds() -> None:
    from hybridpd.deploy.ray_launcher import served_max_model_len

    infos = [("prefill", {"kv_cache": {"max_model_len": 4096}}), ("decode", {"kv_cache": {"max_model_len": 3000}})]
    assert served_max_model_len(4096, infos) == 3000
    assert served_max_model_len(2048, infos) == 2048  # asked for less: as asked
    assert served_max_model_len(4096, [("decode", {})]) == 4096


def test_an_actor_that_dies_or_never_answers_is_a_one_line_error() -> None:
    """`serve` waits for every actor's worker: an actor killed (out of host memory: RayActorError) or still not ready
    after the wait (GetTimeoutError) ends serve with a WorkerStartError naming the role, not a Ray traceback."""
    import ray.exceptions
    from hybridpd.deploy.ray_launcher import gather_infos

    def fake_ray(failure: BaseException | None) -> SimpleNamespace:
        def get(ref: dict, timeout: float) -> dict:
            if failure is not None and ref.get("fail"):
                raise failure
            return ref

        return SimpleNamespace(get=get, exceptions=ray.exceptions)

    def actor(info: dict) -> SimpleNamespace:
        return SimpleNamespace(info=SimpleNamespace(remote=lambda: info))

    actors = [("prefill", actor({"address": "a"})), ("decode", actor({"fail": True}))]
    assert gather_infos(fake_ray(None), actors, 5.0) == [("prefill", {"address": "a"}), ("decode", {"fail": True})]
    with pytest.raises(WorkerStartError, match=r"^decode worker did not start: not ready in 5 s"):
        gather_infos(fake_ray(ray.exceptions.GetTimeoutError("x")), actors, 5.0)
    with pytest.raises(WorkerStartError, match=r"^decode worker did not start: its Ray actor died"):
        gather_infos(fake_ray(ray.exceptions.RayActorError()), actors, 5.0)


def test_a_worker_that_hangs_silently_times_out(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A worker that writes nothing (stuck loading, or in a collective) is given up after ready_timeout_s: the wait
    must not sit in a blocking read of its stdout past the deadline."""
    import sys
    import time

    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(hang))  # the worker command: python -m hybridpd.deploy.cli worker ...
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"^decode worker did not start: not ready in 0.5 s"):
        WorkerProcess(["--role", "decode"], restart=False, ready_timeout_s=0.5)
    assert time.monotonic() - t0 < 5
