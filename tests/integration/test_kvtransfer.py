"""kvtransfer over real NIXL (UCX, DRAM) between two OS processes: P is a spawned producer
(`tests/support/kvtransfer_harness.py: serve_producer`), D is this test process.

Exact pages, descriptor counts and bytes; handshake refusals; stale epochs; a hung, killed and restarted producer
must end pulls FAILED within their timeout, never hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hybridpd.kvtransfer import (
    AgentConfig,
    CacheLayout,
    CompatibilityError,
    MetadataError,
    ProtocolMismatchError,
    PullSpec,
    PullState,
    StaleEpochError,
    TransferAgent,
    TransferMetrics,
    UnknownPeerError,
    start_pull,
)
from hybridpd.kvtransfer import metadata as md_codec
from hybridpd.kvtransfer.layout import compat_hash
from prometheus_client import CollectorRegistry

from tests.support.kvtransfer_harness import ATTN_GROUP, STATE_GROUP, ToyCacheSpec, make_caches, serve_producer

pytestmark = pytest.mark.slow
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

SPEC = ToyCacheSpec(attn_layers=3, num_blocks=48, state_layers=2, num_slots=6)  # page 2 KiB; state 192 + 512 B
P_SEED, D_SEED = 5, 9
PAGE, STATE_PAGE = 2048, 192 + 512


class Producer:
    """A spawned P process serving its caches; metadata arrives through the pipe."""

    def __init__(self, ctx: Any, name: str, spec: ToyCacheSpec = SPEC) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_producer, args=(child, spec, name, P_SEED), daemon=True)
        self.proc.start()
        self._blob: bytes | None = None

    @property
    def blob(self) -> bytes:
        if self._blob is None:
            assert self.conn.poll(60), "producer did not start"
            self._blob = self.conn.recv()[1]
        return self._blob

    def releases(self, timeout: float = 5.0) -> list[tuple[str, str, bool]]:
        self.conn.send(("releases", timeout))
        assert self.conn.poll(timeout + 10)
        return list(self.conn.recv()[1])

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@dataclass
class Consumer:
    agent: TransferAgent
    groups: list[Any]
    registry: CollectorRegistry

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"role": "decode", **labels}) or 0.0


def make_consumer(name: str, config: AgentConfig | None = None, spec: ToyCacheSpec = SPEC) -> Consumer:
    groups = make_caches(spec, D_SEED)
    reg = CollectorRegistry()
    layout = CacheLayout.from_tensors(groups, model_id=spec.model_id)
    return Consumer(TransferAgent(name, layout, config=config, metrics=TransferMetrics("decode", reg)), groups, reg)


@pytest.fixture(scope="module")
def ctx() -> Any:
    return mp.get_context("spawn")


@pytest.fixture(scope="module")
def producer(ctx: Any) -> Iterator[Producer]:
    p = Producer(ctx, "P-main")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def consumer(producer: Producer) -> Iterator[Consumer]:
    c = make_consumer("D-main", AgentConfig(telemetry=True))
    yield c
    c.agent.close()


def finish(handle: Any, limit_s: float = 30.0) -> Any:
    deadline = time.monotonic() + limit_s
    while handle.poll() is PullState.PENDING:
        assert time.monotonic() < deadline, "pull neither finished nor failed: hang"
        time.sleep(0.001)
    return handle.result


def pages(groups: list[Any]) -> dict[int, list[torch.Tensor]]:
    return {
        g.group_id: [t for layer in g.tensors for t in ([layer] if torch.is_tensor(layer) else layer)] for g in groups
    }


SRC = [3, 4, 5, 9, 12, 13, 14, 15]  # runs: 3-5 -> 20-22, 9 -> 7, 12-14 -> 30-32, 15 -> 40
DST = [20, 21, 22, 7, 30, 31, 32, 40]
RUNS = 4


def assert_exact_pages(
    c: Consumer, peer: Any, rid: str, skip: frozenset[int] = frozenset(), cache: ToyCacheSpec = SPEC
) -> Any:
    """Pull SRC -> DST (+ state slot 2 -> 5) and check every page of D: moved ones equal P's, all others (but
    `skip`: attention pages earlier pulls of the test wrote) are unchanged. Per-layer caches: one descriptor per
    (run, layer tensor); stacked ones: one per (run, group tensor), every layer inside it."""
    spec = PullSpec(rid, peer.epoch, {ATTN_GROUP: SRC}, {ATTN_GROUP: DST}, {STATE_GROUP: [2]}, {STATE_GROUP: [5]})
    res = finish(start_pull(peer, spec, timeout_s=20))
    assert res.state is PullState.DONE and res.reason is None, res
    want_descs = RUNS + 2 if cache.stacked else RUNS * cache.attn_layers + 1 * 2 * cache.state_layers
    assert res.descriptors == want_descs
    assert res.nbytes == len(SRC) * cache.attn_layers * PAGE + cache.state_layers * STATE_PAGE == 50560
    p_ref, d_before, d_now = pages(make_caches(cache, P_SEED)), pages(make_caches(cache, D_SEED)), pages(c.groups)
    moved = {ATTN_GROUP: dict(zip(DST, SRC, strict=True)), STATE_GROUP: {5: 2}}
    for gid, tensors in d_now.items():
        for layer, t in enumerate(tensors):
            for page in range(t.shape[0]):
                if gid == ATTN_GROUP and page in skip:
                    continue
                want = p_ref[gid][layer][moved[gid][page]] if page in moved[gid] else d_before[gid][layer][page]
                assert torch.equal(t[page], want), (gid, layer, page)
    return res


def test_pull_moves_exactly_the_requested_pages(producer: Producer, consumer: Consumer) -> None:
    peer = consumer.agent.add_peer(producer.blob)
    assert consumer.agent.add_peer(producer.blob) is peer  # idempotent for one epoch
    assert consumer.agent.peer("P-main", peer.epoch) is peer
    res = assert_exact_pages(consumer, peer, "req-exact")
    assert res.nixl_descriptors == 16  # what NIXL posted
    assert consumer.sample("hybridpd_kv_transfer_bytes_total", group="attention") == len(SRC) * 3 * PAGE
    assert consumer.sample("hybridpd_kv_transfer_bytes_total", group="mamba2") == 2 * STATE_PAGE
    assert consumer.sample("hybridpd_kv_transfer_descriptors_sum") == 16
    assert producer.releases() == [("req-exact", peer.epoch, True, "")]


def test_prepped_page_lists_move_the_same_pages(producer: Producer) -> None:
    c = make_consumer("D-prepped", AgentConfig(descriptor_mode="prepped", telemetry=True))
    try:
        res = assert_exact_pages(c, c.agent.add_peer(producer.blob), "req-prepped")
        assert res.nixl_descriptors == 16  # NIXL merged the page-granular indices back into exactly the runs
        assert producer.releases() == [("req-prepped", md_codec.decode(producer.blob).epoch, True, "")]
    finally:
        c.agent.close()


def test_parallel_reads_without_progress_thread_move_the_same_pages_and_release_once(producer: Producer) -> None:
    # how decode workers on GPUs run (no NIXL progress thread: D's polls progress the READs), here cut in 3 READs
    c = make_consumer("D-parallel", AgentConfig(parallel_reads=3, progress_thread=False, telemetry=True))
    try:
        res = assert_exact_pages(c, c.agent.add_peer(producer.blob), "req-parallel")
        assert res.nixl_descriptors is not None and res.nixl_descriptors >= 16  # a run may be cut between READs
        assert res.nixl_seconds is not None and 0 < res.nixl_seconds <= res.seconds
        # one release notice, sent after all three READs are done
        assert producer.releases() == [("req-parallel", md_codec.decode(producer.blob).epoch, True, "")]
    finally:
        c.agent.close()


def test_stacked_layout_moves_all_layers_of_a_run_in_one_descriptor(ctx: Any) -> None:
    """The engine's layout (one tensor per group, layer as dim 1): 16 descriptors become 6, same bytes, exact pages;
    a worker with per-layer tensors is refused at the handshake, naming the difference."""
    stacked = replace(SPEC, stacked=True)
    p = Producer(ctx, "P-stacked", stacked)
    c = make_consumer("D-stacked", AgentConfig(telemetry=True), stacked)
    flat = make_consumer("D-flat", AgentConfig())
    try:
        res = assert_exact_pages(c, c.agent.add_peer(p.blob), "req-stacked", cache=stacked)
        assert res.descriptors == res.nixl_descriptors == RUNS + 2 == 6
        assert p.releases() == [("req-stacked", md_codec.decode(p.blob).epoch, True, "")]
        with pytest.raises(CompatibilityError, match="group.0.stacked"):
            flat.agent.add_peer(p.blob)
    finally:
        c.agent.close()
        flat.agent.close()
        p.stop()


def reencode(blob: bytes, **fingerprint: str) -> bytes:
    md = md_codec.decode(blob)
    fp = {**md.layout.fingerprint, **fingerprint}
    return md_codec.encode(replace(md, layout=replace(md.layout, fingerprint=fp, compat_hash=compat_hash(fp))))


def test_handshake_refuses_bad_metadata(producer: Producer, consumer: Consumer) -> None:
    agent, blob = consumer.agent, producer.blob
    with pytest.raises(MetadataError, match="checksum"):
        agent.add_peer(blob[:60] + bytes([blob[60] ^ 0xFF]) + blob[61:])
    with pytest.raises(MetadataError, match="magic"):
        agent.add_peer(b"\x00" * 100)
    with pytest.raises(ProtocolMismatchError, match="v7"):
        agent.add_peer(blob[:8] + (7).to_bytes(2, "big") + blob[10:])
    with pytest.raises(CompatibilityError, match=r"model_id: 'toy' \(here\) != 'other' \(peer\)"):
        agent.add_peer(reencode(blob, model_id="other"))
    with pytest.raises(CompatibilityError, match="group.0.layer.1.kv"):
        agent.add_peer(reencode(blob, **{"group.0.layer.1.kv": "dtype=bfloat16 page_shape=(2, 16, 2, 8)"}))


def test_stale_epoch_and_unknown_peer_are_refused(producer: Producer, consumer: Consumer) -> None:
    peer = consumer.agent.add_peer(producer.blob)
    with pytest.raises(StaleEpochError, match="live epoch"):
        consumer.agent.peer("P-main", "an-old-epoch")
    with pytest.raises(UnknownPeerError):
        consumer.agent.peer("P-nobody", peer.epoch)
    before = consumer.sample("hybridpd_kv_transfer_failures_total", reason="stale_epoch")
    with pytest.raises(StaleEpochError):
        start_pull(peer, PullSpec("req-stale", "an-old-epoch", {ATTN_GROUP: [1]}, {ATTN_GROUP: [1]}))
    assert consumer.sample("hybridpd_kv_transfer_failures_total", reason="stale_epoch") == before + 1
    with pytest.raises(ValueError, match="1 source ids but 2"):
        start_pull(peer, PullSpec("req-bad", peer.epoch, {ATTN_GROUP: [1]}, {ATTN_GROUP: [1, 2]}))
    with pytest.raises(ValueError, match=r"blocks \(attention groups\): group 1 holds mamba2 layers"):
        start_pull(peer, PullSpec("req-bad", peer.epoch, {STATE_GROUP: [1]}, {STATE_GROUP: [1]}))
    with pytest.raises(ValueError, match=r"destination groups \[\]"):
        start_pull(peer, PullSpec("req-bad", peer.epoch, src_state_slots={STATE_GROUP: [1]}))


def freeze(pid: int, limit_s: float = 10.0) -> None:
    """SIGSTOP and wait until every thread is stopped: the signal lands asynchronously, and P's progress thread
    serves a READ posted before it does."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + limit_s
    while not all(_task_state(pid, t) in "tT" for t in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, "producer did not stop"
        time.sleep(0.001)


def _task_state(pid: int, tid: str) -> str:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_hung_killed_and_restarted_producer(ctx: Any, consumer: Consumer) -> None:
    doomed, restarted = Producer(ctx, "P-doomed"), Producer(ctx, "P-doomed")  # same worker id, new epoch
    agent = consumer.agent
    try:
        peer = agent.add_peer(doomed.blob)
        one = PullSpec("warm", peer.epoch, {ATTN_GROUP: [1]}, {ATTN_GROUP: [1]})
        assert finish(start_pull(peer, one)).state is PullState.DONE

        freeze(doomed.proc.pid)  # hung: a READ cannot complete (its completion needs P's UCX worker)
        t0 = time.monotonic()
        res = finish(start_pull(peer, replace(one, request_id="hung"), timeout_s=1.0))
        assert (res.state, res.reason, res.dst_reusable) == (PullState.FAILED, "timeout", True), res
        assert 1.0 <= time.monotonic() - t0 < 5.0

        h = start_pull(peer, replace(one, request_id="dies"), timeout_s=30.0)
        os.kill(doomed.proc.pid, signal.SIGKILL)  # dies mid-transfer
        t0 = time.monotonic()
        res = finish(h)
        assert (res.state, res.reason) == (PullState.FAILED, "nixl_error"), res
        assert time.monotonic() - t0 < 10.0  # detected by UCX, well before the timeout

        res = finish(start_pull(peer, replace(one, request_id="dead"), timeout_s=30.0))  # dead before the pull
        assert (res.state, res.reason, res.policy) == (PullState.FAILED, "nixl_error", "recompute")
        assert consumer.sample("hybridpd_kv_transfer_failures_total", reason="timeout") == 1
        assert consumer.sample("hybridpd_kv_transfer_failures_total", reason="nixl_error") == 2

        new = agent.add_peer(restarted.blob)  # the worker came back: its new epoch replaces the old peer
        assert new.epoch != peer.epoch and not peer.valid
        with pytest.raises(StaleEpochError):
            agent.peer("P-doomed", peer.epoch)
        with pytest.raises(StaleEpochError):
            start_pull(peer, replace(one, request_id="old-params"))
        assert_exact_pages(consumer, new, "after-restart", skip=frozenset({1}))
    finally:
        doomed.stop()
        restarted.stop()
