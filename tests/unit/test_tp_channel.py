"""Rank 0's command channel to its follower ranks (engine/parallel/channel.py) and the compact form of a step
(engine/parallel/commands.py), in one process: sockets, no torch.distributed.

The channel must keep rank 0's order on every follower (also when a frame does not fit the socket buffer and the
sender thread finishes it), never make rank 0 wait for a follower, and fail closed: a follower gone makes the send
fail and `on_error` run, on whichever thread met it, and every later send raise."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from hybridpd.engine.parallel.channel import (
    RANK_DIED_EXIT_CODE,
    ChannelError,
    LeaderChannel,
    LeaderGone,
    Listener,
    connect,
)
from hybridpd.engine.parallel.commands import NO_PARAMS, StepDecoder, StepEncoder
from hybridpd.engine.scheduler import ScheduledSeq, SchedulerOutput


def _channels(world: int, errors: list[BaseException]) -> tuple[LeaderChannel, list[Any]]:
    listener = Listener()
    try:
        followers = {r: connect(listener.address, r, 5.0) for r in reversed(range(1, world))}  # any connect order
        leader = LeaderChannel(listener.accept(world, 5.0), on_error=errors.append)
    finally:
        listener.close()
    return leader, [followers[r] for r in range(1, world)]


def _receive_all(follower: Any, into: list[Any]) -> None:
    while (msg := follower.recv()) is not None:
        into.append(msg)


def test_order_kept_for_every_follower_with_a_frame_larger_than_the_socket_buffer() -> None:
    errors: list[BaseException] = []
    leader, followers = _channels(3, errors)
    big = bytes(range(256)) * (32 << 10)  # 8 MiB: far past a socket buffer, finished by the sender thread
    before: list[Any] = [("step", i) for i in range(20)] + [("big", big)] + [("step", i) for i in range(20, 40)]
    t0 = time.perf_counter()
    for msg in before:
        leader.send(msg)
    assert leader.pending > 0  # nobody reads yet: send returned with the big frame's rest and what follows queued
    assert time.perf_counter() - t0 < 5.0
    got: list[list[Any]] = [[] for _ in followers]
    readers = [threading.Thread(target=_receive_all, args=(f, g)) for f, g in zip(followers, got, strict=True)]
    for t in readers:
        t.start()
    after: list[Any] = []
    for i in range(40, 400):  # while the followers drain the backlog: new frames must queue behind it
        after.append(("big", big[: 1 << 20]) if i % 50 == 0 else ("step", i))
        leader.send(after[-1])
    leader.send(None)
    assert leader.close(timeout_s=30.0)
    for t in readers:
        t.join(timeout=30.0)
    assert all(g == before + after for g in got)
    assert not errors
    with pytest.raises(LeaderGone):  # rank 0 closed its end: the follower's loop ends quietly
        followers[0].recv()


def test_dead_follower_fails_the_send_on_the_callers_thread() -> None:
    errors: list[BaseException] = []
    leader, followers = _channels(3, errors)
    leader.send("first")
    assert [f.recv() for f in followers] == ["first", "first"]
    followers[1].close()  # rank 2's process is gone
    with pytest.raises(ChannelError):
        for _ in range(3):  # the first frame may still be taken by the kernel; the peer's end is closed by then
            leader.send("second")
    assert len(errors) == 1
    with pytest.raises(ChannelError):  # failed for good: never a command that only some ranks run
        leader.send("third")
    assert len(errors) == 1
    leader.close()


def test_dead_follower_fails_the_channel_from_the_sender_thread() -> None:
    errors: list[BaseException] = []
    failed = threading.Event()
    leader, followers = _channels(2, errors)
    leader.on_error = lambda exc: (errors.append(exc), failed.set())  # type: ignore[func-returns-value]
    leader.send(b"x" * (16 << 20))  # does not fit: the sender thread holds the rest
    assert leader.pending == 1 and not errors
    followers[0].close()
    assert failed.wait(timeout=10.0), "the sender thread swallowed the error"
    assert len(errors) == 1 and isinstance(errors[0], OSError)
    with pytest.raises(ChannelError):
        leader.send("next")
    assert not leader.close(timeout_s=1.0)


def _seq(rid: str, computed: int, tables: Any, slot: int = 1) -> ScheduledSeq:
    return ScheduledSeq(rid, computed, (65,), True, tables, ((1, slot),), ((1, ()),))


def test_steps_round_trip_with_tables_sent_only_when_changed() -> None:
    """Consecutive steps as the scheduler makes them: a request's tables are the same object until its pages
    change. Every decoded step equals the original; unchanged tables are not sent again."""
    a1, a2, b1 = ((0, (1, 2, 3)),), ((0, (1, 2, 3, 512)),), ((0, (9, 10)),)
    prefill = ScheduledSeq("b", 0, tuple(range(40)), False, b1, ((1, 3),), ((1, ((32, 5),)),))
    steps = [
        SchedulerOutput((_seq("a", 40, a1),), (), ((1, ((5, 6),)),), ((0, (1, 2, 3)),)),
        SchedulerOutput((_seq("a", 41, a1), prefill), ("c",), (), ((0, (9, 10)),)),
        SchedulerOutput((_seq("a", 48, a2), _seq("b", 40, b1, slot=3)), (), (), ((0, (512,)),)),
        SchedulerOutput((_seq("b", 41, b1, slot=3),), ("a",), (), ()),  # a preempted
        SchedulerOutput((_seq("a", 0, a2), _seq("b", 42, b1, slot=3)), (), (), ()),  # a back, its tables not
    ]  # in the previous step: sent again
    enc, dec = StepEncoder(), StepDecoder()
    sent_tables = []
    for out in steps:
        wire = pickle.loads(pickle.dumps(enc.encode("execute", (out, {"a": object()}), {})))
        sent_tables.append([tables is not None for tables in wire[4]])
        name, args, kwargs = dec.decode(wire)
        assert name == "execute" and kwargs == {}
        got, params = args
        assert got == out and all(type(s) is ScheduledSeq for s in got.seqs)
        assert params is NO_PARAMS and params["a"] is None  # followers never sample
    assert sent_tables == [[True], [False, True], [True, False], [False], [True, False]]
    fed = SchedulerOutput((_seq("b", 43, b1, slot=3),), ())  # asynchronous scheduling: a step fed from samples
    assert dec.decode(pickle.loads(pickle.dumps(enc.encode("launch", (fed, {}, (0,)), {})))) == \
        ("launch", (fed, NO_PARAMS, (0,)), {})
    other: tuple[str, tuple[int, ...], dict[str, Any]] = ("zero_block_tail", (4, 3, 0), {})
    assert dec.decode(enc.encode(*other)) == other


def test_tables_that_could_change_in_place_are_sent_every_step() -> None:
    enc, dec = StepEncoder(), StepDecoder()
    pages = [1, 2]
    tables = ((0, pages),)  # a list inside: the same object may hold other pages next step
    for _ in range(2):
        wire = enc.encode("execute", (SchedulerOutput((_seq("a", 5, tables),), ()), {}), {})
        assert wire[4] == (((0, pages),),)
        assert dec.decode(pickle.loads(pickle.dumps(wire)))[1][0].seqs[0].group_block_ids == ((0, pages),)
        pages.append(3)


def test_a_follower_missing_tables_fails_instead_of_guessing() -> None:
    enc = StepEncoder()
    tables = ((0, (1, 2)),)
    enc.encode("execute", (SchedulerOutput((_seq("a", 5, tables),), ()), {}), {})
    later = enc.encode("execute", (SchedulerOutput((_seq("a", 6, tables),), ()), {}), {})
    with pytest.raises(KeyError):  # a follower that missed the first step
        StepDecoder().decode(later)


def test_follower_loop_idle_failing_and_orphaned() -> None:
    """Two followers running the real loop (executor.follow) with rank 0 in this process:
    - idle longer than the group's timeout, they are still there (they wait on the channel, not in a gloo
      collective that times out and would end the worker);
    - a command larger than a socket buffer followed at once by a collective that needs it (`on_all`: pages
      written on every rank, results gathered) completes, in order;
    - a command that fails on a follower makes it exit with RANK_DIED_EXIT_CODE (rank 0's watchdog then ends the
      worker);
    - rank 0 gone (its end of the channel closed without a stop command): the other one exits quietly."""
    import torch
    import torch.distributed as dist
    from hybridpd.engine.parallel.executor import ON_ALL
    from hybridpd.engine.parallel.group import free_port, init_tp
    from hybridpd.engine.parallel.handoff import write_pages

    init = f"tcp://127.0.0.1:{free_port()}"
    script = textwrap.dedent(f"""
        import sys, torch
        from hybridpd.engine.parallel.executor import follow
        from hybridpd.engine.parallel.group import init_tp
        rank = int(sys.argv[1])
        class Runner:
            group_tensors = {{0: [torch.zeros(2, 1 << 18)]}}
            def zero_block_tail(self, block, start, group):
                assert not (rank == 2 and block < 0), "a failing call"
                print("ran", block, int(self.group_tensors[0][0].sum()), flush=True)
        print("ready", flush=True)
        tp = init_tp(rank, 3, {init!r}, "cpu", timeout_s=1.0)
        follow(Runner(), tp)
        print("left the loop", flush=True)
    """)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (1, 2)
    ]
    try:
        assert all(c.stdout is not None and c.stdout.readline() == "ready\n" for c in children)
        tp = init_tp(0, 3, init, "cpu", timeout_s=1.0)
        try:
            tp.broadcast(("zero_block_tail", (1, 0, 0), {}))
            time.sleep(2.0)  # longer than the group's timeout
            payload = [[torch.full((1, 1 << 18), float(r))] for r in range(3)]  # 3 MiB
            tp.broadcast((ON_ALL, (write_pages, (0, [1], payload)), {}))
            assert tp.gather_objects(None) == [None, None, None]
            tp.broadcast(("zero_block_tail", (2, 0, 0), {}))
            tp.broadcast(("zero_block_tail", (-1, 0, 0), {}))  # fails on rank 2
            assert children[1].wait(timeout=30) == RANK_DIED_EXIT_CODE
        finally:
            assert isinstance(tp.channel, LeaderChannel)
            tp.channel.close()  # no stop command: as if rank 0's process were gone
            dist.destroy_process_group()
        out, err = children[0].communicate(timeout=30)
        assert children[0].returncode == 0 and out == "ran 1 0\nran 2 262144\nran -1 262144\n", err[-2000:]
        assert "Traceback" not in err
        assert "zero_block_tail failed; exiting" in children[1].communicate(timeout=30)[1]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()


def test_close_with_a_follower_not_reading_gives_up_without_failing_the_worker() -> None:
    errors: list[BaseException] = []
    leader, followers = _channels(2, errors)
    leader.send(b"x" * (16 << 20))  # never read
    assert not leader.close(timeout_s=0.2)
    time.sleep(0.3)  # past the sender thread's poll: it must stop quietly (on_error would end the worker)
    assert not errors
    with pytest.raises(ChannelError):
        leader.send("after close")
    followers[0].close()
