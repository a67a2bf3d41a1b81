"""Running one worker's ranks: rank 0 runs the EngineCore (scheduler, cache manager, sampler: the control plane
is unchanged) and broadcasts every runner call that touches the caches or runs the model; ranks 1.. run only
their EngineCore's runner, executing what rank 0 broadcasts.

    rank 0 (the caller's process)                 ranks 1..tp-1 (spawned processes)
    EngineCore.step -> LeaderRunner.execute(out)  follow(): loop { msg = broadcast(); runner.<name>(*args) }
        broadcast (name, args) on the channel              same model forward on its head slice
        (sent, not waited for: engine.parallel.channel;    collectives meet rank 0's inside the forward
         the step in compact form: engine.parallel.commands)
        runner.execute(out) on its head slice
    (asynchronous scheduling: `launch(out, params, feed)` the same way; each launch ends with rank 0's sampled
     tokens broadcast to every rank, which a step fed from them reads on the device)

Every rank builds the same cache plan (same budget: the minimum over ranks, engine.core; same per-rank page
shapes), so block ids and state slots mean the same pages everywhere. Sampling happens on rank 0 only (every rank
has all logits; followers discard theirs).

Faults: a follower that dies leaves rank 0 inside a collective that may never return (NCCL), so rank 0's watchdog
ends the whole process (exit code 70): the worker is restarted whole and no request gets a wrong token. A follower
frozen (stopped by a signal) for FROZEN_RANK_S is treated the same way. A command rank 0 cannot deliver ends it the
same way (the channel's error handler), and so does a broadcast call that fails on rank 0 itself: the followers
run the same call, so rank 0 stopping part-way leaves them inside a collective rank 0 will not join (its next
collective would meet theirs: a hang, or sums of the wrong tensors). Rank 0 kills its followers before it exits (a
frozen one could not notice that it is gone); followers exit when rank 0's process is gone (its end of the channel
closes).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hybridpd.engine.parallel.channel import RANK_DIED_EXIT_CODE, LeaderChannel, LeaderGone, fail_worker
from hybridpd.engine.parallel.commands import StepDecoder, StepEncoder
from hybridpd.engine.parallel.group import TPGroup, free_port, init_tp, rank_device

log = logging.getLogger("hybridpd.tp")

BROADCAST_CALLS = frozenset({"execute", "launch", "save_states", "zero_blocks", "zero_block_tail"})
"""Runner methods that change the caches or run the model: every rank must run them, in the same order."""

ON_ALL = "<on_all>"
"""The broadcast name of `LeaderRunner.on_all` (a function run on every rank, results gathered)."""


class LeaderRunner:
    """Rank 0's ModelRunner: the calls in BROADCAST_CALLS go to every rank, everything else is rank 0's runner."""

    def __init__(self, runner: Any, tp: TPGroup, on_error: Callable[[BaseException], None] = fail_worker) -> None:
        """`on_error(exc)`: a broadcast call failed on rank 0 (the ranks are out of step); it ends the worker."""
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_tp", tp)
        object.__setattr__(self, "_encoder", StepEncoder())
        object.__setattr__(self, "_on_error", on_error)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._runner, name)
        if name in BROADCAST_CALLS:
            return functools.partial(self._call, name)
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        if name in BROADCAST_CALLS:  # a wrapper of a broadcast call (a test's spy) wraps the whole call
            object.__setattr__(self, name, value)
        else:
            setattr(self._runner, name, value)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._tp.broadcast(self._encoder.encode(name, args, kwargs))
        return self._in_step(getattr(self._runner, name), *args, **kwargs)

    def _in_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Rank 0's part of a call every rank runs: an exception here ends the worker (`on_error`), never only
        the call (the followers may be waiting in a collective of it)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            log.critical("tensor-parallel rank 0: a call every rank runs failed; the ranks are out of step")
            self._on_error(exc)
            raise

    def on_all(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(runner, rank, *args)` on every rank (fn a module-level function: it is pickled by name); returns
        every rank's result in rank order."""
        self._tp.broadcast((ON_ALL, (fn, args), {}))
        return self._tp.gather_objects(self._in_step(fn, self._runner, 0, *args))


class DiscardingSampler:
    """A follower's sampler: rank 0 samples; the followers' tokens are never read."""

    def bind(self, *_: Any) -> None:
        pass

    def forget(self, _rid: str) -> None:
        pass

    def take_top_logprobs(self) -> dict[str, Any]:
        return {}

    def hold_top_logprobs(self, _top: dict[str, Any]) -> None:
        pass

    def sample_rows(self, logits: Any, rids: list[str], params: Any, lse: Any = None) -> None:
        """Nothing: with asynchronous scheduling the runner receives rank 0's samples instead (TPGroup)."""
        return None


def follow(runner: Any, tp: TPGroup, leader_pid: int | None = None) -> None:
    """A follower's loop: execute rank 0's broadcast calls until it sends None. A call that fails here may have
    left rank 0 inside a collective this rank will never join: the follower exits, and rank 0's watchdog ends the
    worker (restarted whole; fail closed rather than ranks out of step). When rank 0's process is gone (the worker
    stopped or was killed), the follower exits quietly."""
    runner.sampler = DiscardingSampler()
    decoder = StepDecoder()
    while True:
        try:
            msg = tp.broadcast(None)
        except LeaderGone:  # rank 0's process ended without a stop command
            os._exit(0)
        except Exception:
            if leader_pid is not None and not _alive(leader_pid):
                os._exit(0)
            log.exception("tensor-parallel rank %d: lost rank 0's commands; exiting", tp.rank)
            os._exit(RANK_DIED_EXIT_CODE)
        if msg is None:
            return
        name = msg[0]
        try:
            name, args, kwargs = decoder.decode(msg)
            if name == ON_ALL:
                fn, fn_args = args
                tp.gather_objects(fn(runner, tp.rank, *fn_args))
            else:
                getattr(runner, name)(*args, **kwargs)
        except Exception:
            log.exception("tensor-parallel rank %d: %s failed; exiting", tp.rank, name)
            os._exit(RANK_DIED_EXIT_CODE)


def rank_config(config: Any, rank: int) -> Any:
    """The engine config of `rank`: its own device (cuda:N+rank)."""
    device = rank_device(config.model.device, rank)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))


def follower_main(config: Any, rank: int, init_method: str, leader_pid: int) -> None:
    """Entry point of a spawned rank: join the group, build the same engine on its slice, follow rank 0."""
    from hybridpd.engine.core import EngineCore

    _exit_when_gone(leader_pid)
    config = rank_config(config, rank)
    world = config.parallel.tensor_parallel_size
    tp = init_tp(rank, world, init_method, config.model.device)
    core = EngineCore(config, tp=tp)
    follow(core.runner, tp, leader_pid)
    core.runner.release_graphs()
    left = leave_group()
    # The work is done and the group left: end here rather than in the interpreter's teardown, where torch's C++
    # statics (process-group and store objects, their threads) are destroyed in no fixed order and can abort
    # ("terminate called without an active exception", SIGABRT) after a clean stop.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if left else LEFT_UNCLEANLY_EXIT_CODE)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # gone since kill(0) answered, or no /proc (not Linux)
        return not os.path.isdir("/proc")
    except OSError:
        return False


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (SIGSTOP, SIGTSTP: state T; not a debugger's trace stop)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:  # gone, or no /proc
        return False


def _exit_when_gone(pid: int) -> None:
    def watch() -> None:
        while _alive(pid):
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="tp-leader-watch", daemon=True).start()


FROZEN_RANK_S = 5.0
"""How long a follower may stay stopped (SIGSTOP) before rank 0 ends the worker: rank 0 would wait in the
collective it left unjoined for the group's whole timeout (minutes), and computes nothing meanwhile."""

WATCH_POLL_S = 0.2
"""How often rank 0 looks at its followers' processes."""

EXIT_CLOSE_TIMEOUT_S = 10.0
"""How long interpreter exit waits for an engine nobody shut down to stop its followers and leave the group."""

LEFT_UNCLEANLY_EXIT_CODE = 1
"""A follower's exit code when the group could not be left cleanly at the stop (0 when it could)."""

LEAVE_TIMEOUT_S = 30.0
"""How long a rank waits for the others to leave the group with it (NCCL's communicator teardown waits for every
rank) before it gives up on a clean exit."""


def leave_group(timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """Leave the worker's process groups. Every rank calls it at the stop (rank 0 after sending it, a follower on
    receiving it), each after destroying its CUDA graphs: NCCL tears a communicator down only once every rank does
    and once no graph that captured its kernels lives, so a rank leaving alone, or with its graphs alive, hangs.
    Bounded: a rank that never leaves costs a warning and an abort, not a hang. Returns whether the groups were
    left cleanly."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    if _bounded(dist.destroy_process_group, timeout_s):
        return True
    log.warning("the tensor-parallel group was not left within %.0f s (a rank did not leave): aborting it", timeout_s)
    if not _bounded(dist.distributed_c10d._abort_process_group, 5.0):
        log.error("aborting the tensor-parallel group did not finish either: leaving it behind")
    return False


def _bounded(fn: Callable[[], Any], timeout_s: float) -> bool:
    """Run `fn` in a daemon thread; whether it finished, without an error, within `timeout_s`."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:
            log.exception("%s failed", getattr(fn, "__name__", fn))
        else:
            done.set()

    threading.Thread(target=run, name="tp-leave-group", daemon=True).start()
    return done.wait(timeout_s)


class Followers:
    """Rank 0's handle on ranks 1..tp-1: starts them (`python -m hybridpd.engine.parallel.executor`, the config
    pickled on stdin: no re-import of the caller's main module), joins the group with them, watches them."""

    def __init__(self, config: Any) -> None:
        world = config.parallel.tensor_parallel_size
        init = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        if not config.model.device.startswith("cuda"):  # CPU ranks share the cores: no spinning thread pools
            env.setdefault("OMP_NUM_THREADS", "1")
        self.procs: list[subprocess.Popen[bytes]] = []
        for r in range(1, world):
            cmd = [sys.executable, "-m", "hybridpd.engine.parallel.executor"]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps((config, r, init, os.getpid())))
            proc.stdin.close()
            self.procs.append(proc)
        self.closing = False
        self.before_leave: Callable[[], None] = lambda: None
        """Rank 0's part of the stop before the group is left (the engine destroys its CUDA graphs: leave_group)."""
        atexit.register(self._closing)
        threading.Thread(target=self._watch, name="tp-followers-watch", daemon=True).start()
        try:
            self.tp = init_tp(0, world, init, rank_config(config, 0).model.device)
        except BaseException:
            self.abort()
            raise
        assert isinstance(self.tp.channel, LeaderChannel)
        self.tp.channel.on_error = self._unreachable

    def _closing(self) -> None:
        """At interpreter exit: an engine nobody shut down still stops its followers and leaves the group (a
        process group alive while the interpreter tears down can abort it: "terminate called ..."). Bounded: a
        step thread still inside a collective must not hold the exit (the followers exit once this process is
        gone)."""

        def close_quietly() -> None:
            try:
                self.close()
            except Exception:
                self.closing = True

        closer = threading.Thread(target=close_quietly, name="tp-close-at-exit", daemon=True)
        closer.start()
        closer.join(timeout=EXIT_CLOSE_TIMEOUT_S)

    def _unreachable(self, exc: BaseException) -> None:
        """A command could not reach a follower (the channel's error handler, any thread): ranks out of step."""
        if not self.closing:
            self.fail(exc)

    def fail(self, exc: BaseException | str) -> None:
        """The ranks can no longer run in step: kill the followers (one frozen, or stuck in a collective, would never
        notice that rank 0 is gone), then end this process with RANK_DIED_EXIT_CODE (the worker is restarted
        whole). Any thread."""
        log.critical("tensor-parallel worker failed (%s): it exits to be restarted whole", exc)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        os._exit(RANK_DIED_EXIT_CODE)

    def close(self) -> None:
        """Stop the followers (they leave their loop, then the group with rank 0, and exit), leave the group (a new
        engine may start in this process)."""
        if self.closing:
            return
        self.closing = True
        atexit.unregister(self._closing)
        try:
            self.tp.broadcast(None)
        except Exception:  # a follower already gone: nothing left to stop
            log.warning("tensor-parallel followers did not take the stop message")
        assert isinstance(self.tp.channel, LeaderChannel)
        if not self.tp.channel.close():
            log.warning("tensor-parallel followers did not take every command before the stop")
        try:
            self.before_leave()
        except Exception:  # the group is left all the same (its graphs alive, NCCL's exit is then bounded)
            log.exception("tensor-parallel rank 0: its part of the stop failed")
        leave_group()

    def abort(self) -> None:
        """Rank 0 failed while starting (after its followers were spawned): kill them wherever they are in their
        own start (no stop message: they may not be listening yet), close the channel, leave the group, so that
        the caller's error is the whole story and a later engine may start in this process."""
        self.closing = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        channel = getattr(getattr(self, "tp", None), "channel", None)
        if isinstance(channel, LeaderChannel):
            channel.close(timeout_s=0.0)
        leave_group(timeout_s=5.0)  # the killed followers never leave: gloo's exit is local, NCCL's is aborted

    def _watch(self) -> None:
        """Every WATCH_POLL_S: a follower that exited, or one seen stopped (state T, nothing else: a GC pause, a
        compile or a slow host is R, S or D) at every poll for FROZEN_RANK_S, ends the worker. Counted in polls as
        well as in time: rank 0 stopped itself (the whole worker stopped and continued) sees the clock jump
        between two polls, and a follower seen stopped on both sides of the jump was not stopped alone."""
        stopped: dict[int, tuple[float, int]] = {}  # rank -> (first seen stopped, polls seen stopped in a row)
        while not self.closing:
            now = time.monotonic()
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None and not self.closing:
                    self.fail(f"rank {r} (pid {p.pid}) died (exit code {p.returncode})")
                if not _stopped(p.pid):
                    stopped.pop(r, None)
                    continue
                since, polls = stopped.get(r, (now, 0))
                stopped[r] = (since, polls + 1)
                if now - since >= FROZEN_RANK_S and polls * WATCH_POLL_S >= FROZEN_RANK_S - 1e-9 and not self.closing:
                    self.fail(f"rank {r} (pid {p.pid}) stopped (frozen) for {FROZEN_RANK_S:.0f} s")
            time.sleep(WATCH_POLL_S)


def start_tensor_parallel(config: Any) -> Followers | None:
    """Rank 0 of a new worker: spawn ranks 1..tp-1 and join them (None at tensor_parallel_size 1)."""
    world = config.parallel.tensor_parallel_size
    if world <= 1:
        return None
    device = config.model.device
    if device.startswith("cuda"):
        import torch

        last = rank_device(device, world - 1)
        if int(last.split(":")[1]) >= torch.cuda.device_count():
            from hybridpd.engine.errors import InvalidRequestError

            raise InvalidRequestError(
                f"tensor_parallel_size={world} on {device} needs {last}, but {torch.cuda.device_count()} GPUs are "
                "visible"
            )
    return Followers(config)


__all__ = [
    "BROADCAST_CALLS",
    "RANK_DIED_EXIT_CODE",
    "Followers",
    "LeaderRunner",
    "follow",
    "follower_main",
    "start_tensor_parallel",
]


if __name__ == "__main__":  # a follower rank, started by Followers
    logging.basicConfig(level=logging.WARNING)
    follower_main(*pickle.loads(sys.stdin.buffer.read()))
