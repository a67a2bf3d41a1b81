"""The tensor-parallel handshake of PD workers: a D worker checks P's ranks' cache slicing against its own when it
connects (decode/service.py `_connect`) and refuses a peer whose layout differs, naming the keys, before any
request reads from it; equal layouts at other TP sizes are accepted (a TPPeer); two TP 1 workers keep NIXL's own
handshake. Also serve's per-role TP sizes."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from hybridpd.decode.service import DecodeServicer
from hybridpd.deploy.ray_launcher import role_tensor_parallel, with_tensor_parallel
from hybridpd.kvtransfer.errors import CompatibilityError, MetadataError
from hybridpd.kvtransfer.tp_handshake import TPLayout, problems
from hybridpd.kvtransfer.tp_layout import AttentionShape, Mamba2Shape, attention_tensors, mamba2_tensors
from hybridpd.kvtransfer.tp_pull import TPPeer
from hybridpd.proto import hybridpd_pb2 as pb

EXTRA = {"model_id": "m", "checkpoint_interval": "32", "groups": "0:attention,1:mamba2", "block_size": "16"}


def _layout(tp: int, kv_dtype: str = "float32", kv_heads: int = 2, **extra: str) -> TPLayout:
    attn = attention_tensors("g0", AttentionShape(1, 16, kv_heads, 8, kv_dtype), tp)
    mamba = mamba2_tensors("g1", Mamba2Shape(2, 4, 8, 1, 16, 4, "float32", "float32"), tp)
    return TPLayout(tp, tuple(b"rank%d" % r for r in range(tp)), {0: attn, 1: mamba}, {**EXTRA, **extra})


def _connect(mine: TPLayout | None, peer: TPLayout | None, agent: object = None) -> object:
    ctx = SimpleNamespace(tp_layout=mine, agent=agent)
    md = pb.TransferMetadata(
        agent_metadata=b"blob", worker_id="p1", epoch="e1", tp_layout=peer.encode() if peer is not None else b""
    )
    return DecodeServicer._connect(SimpleNamespace(ctx=ctx), md)  # type: ignore[arg-type]


def test_layout_round_trip_and_malformed_blobs() -> None:
    lay = _layout(2)
    back = TPLayout.decode(lay.encode())
    assert back == lay
    with pytest.raises(MetadataError):
        TPLayout.decode(b"HPDKVTP\x00{not json")
    with pytest.raises(MetadataError):
        TPLayout.decode(b"something else")
    short = TPLayout(2, (b"r0",), lay.tensors, lay.extra).encode()  # a rank blob missing
    with pytest.raises(MetadataError):
        TPLayout.decode(short)


def test_same_model_at_other_tp_sizes_is_compatible() -> None:
    for p, d in ((1, 2), (2, 1), (2, 2)):
        assert problems(_layout(d), _layout(p)) == []


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        (_layout(1, kv_dtype="bfloat16"), "g0.kv.dtype"),
        (_layout(1, kv_heads=4), "g0.kv.page_shape"),
        (_layout(1, checkpoint_interval="64"), "checkpoint_interval"),
    ],
)
def test_a_mismatch_is_refused_at_connect_naming_the_key(peer: TPLayout, key: str) -> None:
    assert any(p.startswith(key) for p in problems(_layout(2), peer))
    with pytest.raises(CompatibilityError, match=key):
        _connect(_layout(2), peer)


def test_connect_accepts_other_tp_sizes_and_keeps_nixl_handshake_at_tp1() -> None:
    peer = _connect(_layout(2), _layout(1))
    assert isinstance(peer, TPPeer) and peer.key == ("p1", "e1")
    added: list[bytes] = []

    def add_peer(blob: bytes) -> str:
        added.append(blob)
        return "nixl-peer"

    agent = SimpleNamespace(add_peer=add_peer)
    assert _connect(_layout(1), _layout(1), agent) == "nixl-peer" and added == [b"blob"]
    with pytest.raises(CompatibilityError, match="no tensor-parallel layout"):
        _connect(_layout(2), None)  # a P that publishes no layout cannot serve a TP 2 D


def test_serve_tp_per_role() -> None:
    argv = ["--model", "m", "--tensor-parallel-size", "2", "--dtype", "float32"]
    assert with_tensor_parallel(argv, 1) == ["--model", "m", "--dtype", "float32"]
    assert with_tensor_parallel(argv, 4)[-2:] == ["--tensor-parallel-size", "4"]
    args = SimpleNamespace(tensor_parallel_size=2, prefill_tp=None, decode_tp=1)
    assert role_tensor_parallel(args) == {"prefill": 2, "decode": 1}


class _Ranks:
    """Stands in for the ranks' control channel: each call returns every rank's scripted answer."""

    def __init__(self, checks: list[list[str]], start: list[str]) -> None:
        self.checks, self.start, self.calls = checks, start, []  # type: ignore[var-annotated]

    def __call__(self, core: object, fn: object, *args: object) -> Sequence[object]:
        from hybridpd.kvtransfer import tp_pull

        self.calls.append(fn)
        if fn is tp_pull.start_rank_pull:
            return [(s, {"attention": 100}, 3) for s in self.start]
        if fn is tp_pull.check_rank_pull:
            return self.checks.pop(0)
        if fn is tp_pull.forget_rank_pull:
            return [True] * len(self.start)
        raise AssertionError(fn)


def _tp_pull(monkeypatch: pytest.MonkeyPatch, ranks: _Ranks, timeout_s: float = 10.0) -> object:
    from hybridpd.engine.parallel import handoff
    from hybridpd.kvtransfer.pull import PullSpec
    from hybridpd.kvtransfer.tp_pull import TPPullHandle

    monkeypatch.setattr(handoff, "on_ranks", ranks)
    spec = PullSpec("r1", "e1", src_blocks={0: [3, 4]}, dst_blocks={0: [5, 6]})
    return TPPullHandle(None, TPPeer("p1", "e1", b""), spec, timeout_s, "recompute", None)


def test_tp_pull_is_done_only_when_every_rank_is(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridpd.kvtransfer.pull import PullState
    from hybridpd.kvtransfer.tp_pull import forget_rank_pull

    ranks = _Ranks([["DONE", "PROC"], ["DONE", "DONE"]], ["PROC", "PROC"])
    h = _tp_pull(monkeypatch, ranks)
    assert h.poll() is PullState.PENDING  # type: ignore[attr-defined]
    assert h.poll() is PullState.DONE  # type: ignore[attr-defined]
    assert h.result.nbytes == 200 and h.result.dst_reusable  # type: ignore[attr-defined]
    assert ranks.calls[-1] is forget_rank_pull  # every rank's READs released


@pytest.mark.parametrize(
    ("start", "reason"), [(["DONE", "ERR rank 1: peer gone"], "nixl_error"), (["PROC", "PROC"], "timeout")]
)
def test_a_failure_on_any_rank_or_the_deadline_fails_the_whole_pull(
    monkeypatch: pytest.MonkeyPatch, start: list[str], reason: str
) -> None:
    from hybridpd.kvtransfer.pull import PullState
    from hybridpd.kvtransfer.tp_pull import forget_rank_pull

    ranks = _Ranks([["DONE", "PROC"]], start)
    h = _tp_pull(monkeypatch, ranks, timeout_s=0.0)
    assert h.poll() is PullState.FAILED  # type: ignore[attr-defined]
    assert h.result.reason == reason and h.result.nbytes == 0  # type: ignore[attr-defined]
    assert ranks.calls[-1] is forget_rank_pull
