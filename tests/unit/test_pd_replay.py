"""Replayed worker calls (a holder of the cluster token sending a call again) never cost another request its
answer: a second Generate under the id of one still streaming on the decode worker is refused, and the first one
streams to its end."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from hybridpd.decode.service import DecodeServicer
from hybridpd.proto import hybridpd_pb2 as pb

from tests.oracle import random_prompts
from tests.support.pd_pair import Aborted, FakeContext, make_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_replayed_generate_is_refused_and_the_running_one_still_ends(checkpoint_dir, monkeypatch):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir("nemotron_attn_mid"), monkeypatch)
        try:
            prompt = random_prompts([40], vocab=256, seed=21)[0]
            sp = pb.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            req = pb.GenerateRequest(request_id="same", prompt_token_ids=prompt, sampling_params=sp)

            async def consume() -> list[int]:
                return [t async for c in pair.d.Generate(req, FakeContext()) for t in c.token_ids]  # type: ignore[arg-type]

            first = asyncio.create_task(consume())
            while not await pair.d.ctx.aengine.acall(lambda c: "same" in c.scheduler.requests):
                await asyncio.sleep(0.01)
            with pytest.raises(Aborted) as refused:
                await consume()
            assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
            assert len(await asyncio.wait_for(first, timeout=20)) == 24  # not left waiting on a closed stream
        finally:
            pair.close()

    asyncio.run(run())


class _Handle:
    def __init__(self, epoch: str) -> None:
        self.epoch, self.valid = epoch, True


class _Agent:
    """TransferAgent.add_peer's rule: a new epoch of a known worker id replaces (invalidates) its peer handle."""

    def __init__(self) -> None:
        self.loaded: dict[str, _Handle] = {}

    def add_peer(self, blob: bytes) -> _Handle:
        worker, epoch = blob.decode().split("/")
        old = self.loaded.get(worker)
        if old is not None and old.epoch == epoch:
            return old
        if old is not None:
            old.valid = False
        self.loaded[worker] = _Handle(epoch)
        return self.loaded[worker]


def test_a_worker_id_claimed_under_another_epoch_does_not_cut_off_the_real_prefill_worker(checkpoint_dir, monkeypatch):  # type: ignore[no-untyped-def]
    """A holder of the cluster token answers the handshake under a live prefill worker's id with an epoch of its
    own: the agent replaces that worker's peer. Its next params must handshake again rather than be refused
    (stale epoch, recomputed) for as long as the decode worker lives."""

    async def run() -> None:
        pair = await make_pair(checkpoint_dir("nemotron_attn_mid"), monkeypatch)
        try:
            answers = {"p:1": ("w1", "e1"), "claim:1": ("w1", "e2")}

            class Stub:
                def __init__(self, address: str) -> None:
                    self.address = address

                async def GetTransferMetadata(self, req, timeout, metadata):  # type: ignore[no-untyped-def]
                    worker, epoch = answers[self.address]
                    blob = f"{worker}/{epoch}".encode()
                    return pb.TransferMetadata(agent_metadata=blob, worker_id=worker, epoch=epoch)

            monkeypatch.setattr(pair.d.ctx, "agent", _Agent())
            monkeypatch.setattr(pair.d, "_prefill_stub", Stub)
            real = pb.TransferParams(worker_id="w1", epoch="e1", prefill_address="p:1")
            claim = pb.TransferParams(worker_id="w1", epoch="e2", prefill_address="claim:1")
            assert (await DecodeServicer._peer(pair.d, real)).valid
            await DecodeServicer._peer(pair.d, claim)
            again = await DecodeServicer._peer(pair.d, real)
            assert again is not None and again.valid and again.epoch == "e1"
        finally:
            pair.close()

    asyncio.run(run())


class _InlineEngine:
    """What the decode servicer uses of AsyncEngine, its step thread run inline (`step()`: the per-step hooks)."""

    def __init__(self) -> None:
        self.core = SimpleNamespace(transfer_canceller=None, expire_imports=lambda: None, runner=None)
        self.hooks: list[Any] = []

    def add_hook(self, fn: Any, needs_poll: Any = None) -> None:
        self.hooks.append(fn)

    def call(self, fn: Any) -> Future:
        done: Future = Future()
        done.set_result(fn(self.core))
        return done

    async def acall(self, fn: Any) -> Any:
        return fn(self.core)

    def step(self) -> None:
        for hook in self.hooks:
            hook(self.core)


def test_prefill_peers_of_gone_workers_are_forgotten_and_bounded(monkeypatch):  # type: ignore[no-untyped-def]
    """A prefill worker id lives as long as its process, so each restart is a new peer: the decode worker forgets
    (and has its transfer agent remove) the peer verified at an address once another worker is verified there, and
    the least recently used past MAX_PREFILL_PEERS; never one with a pull in flight (removed at the first step
    after it ended); a tensor-parallel peer on every rank."""
    import hybridpd.decode.service as service
    from hybridpd.kvtransfer import tp_pull
    from hybridpd.worker.context import WorkerContext

    removed: list[str] = []

    class Agent(_Agent):
        def remove_peer(self, handle: _Handle) -> bool:
            removed.append(handle.epoch)
            return True

    async def run() -> None:
        engine = _InlineEngine()
        d = DecodeServicer(WorkerContext(role="decode", aengine=engine, model_name="m", address="d:1"))  # type: ignore[arg-type]
        answers: dict[str, tuple[str, str]] = {}

        class Stub:
            def __init__(self, address: str) -> None:
                self.address = address

            async def GetTransferMetadata(self, req, timeout, metadata):  # type: ignore[no-untyped-def]
                worker, epoch = answers[self.address]
                blob = f"{worker}/{epoch}".encode()
                return pb.TransferMetadata(agent_metadata=blob, worker_id=worker, epoch=epoch)

        monkeypatch.setattr(d.ctx, "agent", Agent())
        monkeypatch.setattr(d, "_prefill_stub", Stub)
        monkeypatch.setattr(service, "MAX_PREFILL_PEERS", 3)

        async def handshake(addr: str, worker: str, epoch: str) -> None:
            answers[addr] = (worker, epoch)
            tp = pb.TransferParams(worker_id=worker, epoch=epoch, prefill_address=addr)
            assert await DecodeServicer._peer(d, tp) is not None

        await handshake("p:1", "w1", "e1")
        await handshake("p:1", "w2", "e2")  # p:1 restarted: w1 is gone
        assert list(d._peers) == [("w2", "e2")] and removed == ["e1"]
        # a pull from w3 in flight: when it is pushed out, the agent keeps it until the pull ends
        await handshake("p:3", "w3", "e3")
        pending = SimpleNamespace(params=pb.TransferParams(worker_id="w3", epoch="e3"), committing=True)
        d.consumer.pending["r"] = pending  # type: ignore[assignment]
        for i in (4, 5, 6):
            await handshake(f"p:{i}", f"w{i}", f"e{i}")
        assert list(d._peers) == [("w4", "e4"), ("w5", "e5"), ("w6", "e6")]  # the 3 most recent
        engine.step()
        assert removed == ["e1", "e2"]  # w3 is still being pulled from
        del d.consumer.pending["r"]
        engine.step()
        assert removed == ["e1", "e2", "e3"]
        # a tensor-parallel peer: every D rank drops its plan and has its agent remove the P ranks it loaded
        rank = tp_pull._RankState(agent=Agent(), tensors={})
        rank.peers[("wt", "et")] = tp_pull._PeerPlan(handles={0: _Handle("rank0"), 1: _Handle("rank1")}, groups={})
        monkeypatch.setattr(tp_pull, "_RANK", rank)
        d._remember(("wt", "et"), tp_pull.TPPeer("wt", "et", b""), "p:9")
        d._remember(("wt2", "et2"), _Handle("et2"), "p:9")  # p:9 restarted
        assert not rank.peers and removed[-2:] == ["rank0", "rank1"]

    asyncio.run(run())
