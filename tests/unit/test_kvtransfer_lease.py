"""kvtransfer lease table (P side): grant, release, reap with an injected clock; epoch checks; metrics."""

from __future__ import annotations

import pytest
from hybridpd.kvtransfer import LeaseTable, StaleEpochError, TransferMetrics
from prometheus_client import CollectorRegistry


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def table(ttl: float = 30.0) -> tuple[LeaseTable, Clock, CollectorRegistry]:
    clock, reg = Clock(), CollectorRegistry()
    return LeaseTable("e1", ttl, clock=clock, metrics=TransferMetrics("prefill", reg)), clock, reg


def expired_metric(reg: CollectorRegistry) -> float | None:
    return reg.get_sample_value("hybridpd_kv_lease_expired_total", {"role": "prefill"})


def test_grant_then_release_returns_the_pages_once() -> None:
    t, clock, _ = table()
    lease = t.grant("r1", {0: [4, 5, 6], 1: [2]})
    assert lease.expires_at == 1030.0 and lease.pages_by_group == {0: (4, 5, 6), 1: (2,)}
    assert "r1" in t and len(t) == 1
    assert t.release("r1", "e1") == lease
    assert t.release("r1", "e1") is None  # idempotent
    assert len(t) == 0
    t.check_integrity()


def test_reaper_frees_expired_leases_oldest_first_and_counts_them() -> None:
    t, clock, reg = table()
    t.grant("a", {0: [1]})
    clock.t += 10
    t.grant("b", {0: [2]}, ttl_s=5)  # expires at 1015, before "a" (1030)
    t.grant("c", {0: [3]})  # 1040
    assert t.reap(1014.9) == []
    assert [le.request_id for le in t.reap(1030.0)] == ["b", "a"]
    assert expired_metric(reg) == 2.0
    clock.t = 2000.0
    assert [le.request_id for le in t.reap()] == ["c"]
    assert expired_metric(reg) == 3.0 and len(t) == 0
    assert t.release("c") is None  # a late release after expiry is harmless
    t.check_integrity()


def test_stale_epoch_is_refused() -> None:
    t, _, _ = table()
    t.grant("r1", {0: [1]})
    with pytest.raises(StaleEpochError, match="'old'"):
        t.release("r1", "old")
    assert "r1" in t
    t.check_epoch(None)
    t.check_epoch("")  # gRPC ReleaseRequest default: the current epoch
    assert t.release("r1", "") is not None


def test_one_lease_per_request() -> None:
    t, _, _ = table()
    t.grant("r1", {0: [1]})
    with pytest.raises(ValueError, match="already holds"):
        t.grant("r1", {0: [2]})


def test_metrics_families_are_shared_per_registry() -> None:
    reg = CollectorRegistry()
    a, b = TransferMetrics("decode", reg), TransferMetrics("prefill", reg)
    a.transfer_done({"attention": 100, "mamba2": 7}, 0.01, 12)
    b.transfer_failed("timeout")
    assert reg.get_sample_value("hybridpd_kv_transfer_bytes_total", {"role": "decode", "group": "attention"}) == 100
    assert reg.get_sample_value("hybridpd_kv_transfer_descriptors_sum", {"role": "decode"}) == 12
    assert reg.get_sample_value("hybridpd_kv_transfer_seconds_count", {"role": "decode"}) == 1
    assert reg.get_sample_value("hybridpd_kv_transfer_failures_total", {"role": "prefill", "reason": "timeout"}) == 1


def test_commit_succeeds_only_for_a_held_lease_of_the_same_epoch_token_and_prompt() -> None:
    from hybridpd.kvtransfer.binding import prompt_digest
    from hybridpd.kvtransfer.lease import CommitRefused

    t, clock, _ = table(ttl=30.0)
    digest = prompt_digest([5, 6, 7, 8], 3, "tenant")
    lease = t.grant("r1", {0: [4, 5]}, token="tok", prompt_digest=digest)
    for epoch, token, dig, reason in (
        ("e0", "tok", digest, "stale_epoch"),
        ("e1", "forged", digest, "token_mismatch"),
    ):
        with pytest.raises(CommitRefused) as e:
            t.commit("r1", epoch, token, dig)
        assert e.value.reason == reason
        assert "r1" in t  # a caller without the lease's token cannot end it
    assert t.commit("r1", "e1", "tok", digest) == lease and "r1" not in t
    with pytest.raises(CommitRefused, match="unknown_lease"):
        t.commit("r1", "e1", "tok", digest)  # a second commit of the same lease (a replay) is refused

    # the READ finished, but the lease expired before D committed: P may have reused the pages
    t.grant("r2", {0: [6]}, token="tok2", prompt_digest=digest)
    clock.t += 31
    assert [le.request_id for le in t.reap()] == ["r2"]
    with pytest.raises(CommitRefused, match="unknown_lease"):
        t.commit("r2", "e1", "tok2", digest)

    # the right lease, another prompt's digest: refused and the lease ended (that pull is void)
    t.grant("r3", {0: [7]}, token="tok3", prompt_digest=digest)
    with pytest.raises(CommitRefused, match="prompt_mismatch"):
        t.commit("r3", "e1", "tok3", prompt_digest([5, 6, 9, 8], 3, "tenant"))
    assert "r3" not in t
    t.check_integrity()


def test_release_with_a_wrong_lease_token_is_ignored() -> None:
    t, _, _ = table()
    t.grant("r1", {0: [4]}, token="tok")
    assert t.release("r1", "e1", token="forged") is None and "r1" in t
    assert t.release("r1", "e1", token="tok") is not None and "r1" not in t
    t.grant("r2", {0: [4]}, token="tok")
    t.grant("r3", {0: [5]}, token="tok3")
    assert t.release("r3", "e1", token="") is None and "r3" in t  # a request id alone (gRPC Release) ends nothing
    assert t.release("r2") is not None  # token None: P ending its own lease (caller gone, Prefill cancelled)


def test_prompt_digest_binds_tokens_count_and_salt() -> None:
    from hybridpd.kvtransfer.binding import prompt_digest

    base = prompt_digest([1, 2, 3, 4], 3)
    assert base == prompt_digest([1, 2, 3, 99], 3)  # only the first n tokens count
    assert base != prompt_digest([1, 2, 3, 4], 4)
    assert base != prompt_digest([1, 2, 4, 4], 3)
    assert base != prompt_digest([1, 2, 3, 4], 3, "salt")
    with pytest.raises(ValueError):
        prompt_digest([1, 2], 3)


def test_membership_proof_needs_the_token_and_covers_the_nonce() -> None:
    from hybridpd.kvtransfer.binding import membership_proof, new_nonce, verify_membership

    nonce = new_nonce()
    proof = membership_proof("secret", nonce, "w1", "e1", b"meta")
    assert verify_membership("secret", nonce, "w1", "e1", b"meta", proof)
    assert not verify_membership("other", nonce, "w1", "e1", b"meta", proof)
    assert not verify_membership("secret", new_nonce(), "w1", "e1", b"meta", proof)  # a replayed answer
    assert not verify_membership("secret", nonce, "w1", "e1", b"other-meta", proof)


def test_commit_refuses_forged_params_and_pages_outside_the_offer_and_ends_the_lease() -> None:
    from hybridpd.kvtransfer.lease import CommitRefused, Offer

    t, _, _ = table()
    # attention groups 0 and 4 (blocks 4 5 6, checkpoint pages 8 9), recurrent group 1 (running slot 2)
    offer = Offer(blocks={0: (4, 5, 6), 4: (4, 5, 6)}, states={1: (2,)}, checkpoint=(8, 9))
    for rid, kwargs, reason in (
        ("r1", {"params_authentic": False, "pages_read": {0: (5, 6), 4: (5, 6), 1: (2,)}}, "params_forged"),
        ("r2", {"pages_read": {0: (4, 6), 4: (4, 6), 1: (2,)}}, "pages_mismatch"),  # a block of another position
        ("r3", {"pages_read": {0: (5, 6), 4: (5, 6), 1: (3,)}}, "pages_mismatch"),  # not the running state
        ("r4", {"pages_read": {0: (5, 6), 4: (5, 6), 1: (2,), 3: (1,)}}, "pages_mismatch"),  # a group not offered
        ("r5", {"pages_read": {0: (6,), 4: (6,)}}, "pages_mismatch"),  # a recurrent group's state not read
        ("r6", {}, "pages_mismatch"),  # nothing said about what was read
        ("r7", {"pages_read": {0: (6, 8, 9), 4: (6,), 1: (2,)}}, "pages_mismatch"),  # the checkpoint in one group
        ("r8", {"pages_read": {0: (6, 9), 4: (6, 9), 1: (2,)}}, "pages_mismatch"),  # part of the checkpoint
        ("r9", {"pages_read": {0: (8, 9), 4: (8, 9, 1), 1: (2,)}}, "pages_mismatch"),  # a page past it
    ):
        t.grant(rid, {0: [4, 5, 6, 8, 9], 4: [4, 5, 6, 8, 9], 1: [2]}, token="tok", offer=offer)
        with pytest.raises(CommitRefused) as e:
            t.commit(rid, "e1", "tok", b"", **kwargs)  # type: ignore[arg-type]
        assert e.value.reason == reason and rid not in t, rid
    for read in (  # suffixes past D's own hit, with the checkpoint's pages or without
        {0: (4, 5, 6, 8, 9), 4: (4, 5, 6, 8, 9), 1: (2,)},
        {0: (6,), 4: (6,), 1: (2,)},
        {0: (8, 9), 4: (8, 9), 1: (2,)},
        {1: (2,)},
    ):
        t.grant("ok", {0: [4, 5, 6, 8, 9], 4: [4, 5, 6, 8, 9], 1: [2]}, token="tok", offer=offer)
        assert t.commit("ok", "e1", "tok", b"", pages_read=read).request_id == "ok"
    t.check_integrity()


def test_params_mac_covers_every_field_and_the_request_id() -> None:
    from hybridpd.kvtransfer.binding import new_mac_key, params_mac, verify_params_mac
    from hybridpd.proto import hybridpd_pb2 as pb

    key = new_mac_key()
    tp = pb.TransferParams(worker_id="w", epoch="e", prefill_address="p:1", num_computed_tokens=41,
                           num_prompt_tokens=41, lease_expiry_unix=1.5e9,
                           checkpoint_num_tokens=32, lease_token="tok", prompt_digest=b"d" * 32,
                           groups=[pb.GroupBlocks(group_id=1, block_ids=[4, 5, 6])],
                           states=[pb.GroupStates(group_id=0, state_slot=3)], checkpoint_pages=[7, 8])
    tp.mac = params_mac(key, "r1", tp)
    assert verify_params_mac(key, "r1", tp)
    assert not verify_params_mac(key, "r2", tp) and not verify_params_mac(new_mac_key(), "r1", tp)
    fields = [f.name for f in pb.TransferParams.DESCRIPTOR.fields if f.name != "mac"]
    for name in fields:
        altered = pb.TransferParams()
        altered.CopyFrom(tp)
        if name == "groups":
            altered.groups[0].block_ids[0] = 9
        elif name == "states":
            altered.states[0].state_slot = 8
        elif name == "checkpoint_pages":
            altered.checkpoint_pages[1] = 9
        else:
            value = getattr(tp, name)
            setattr(altered, name, value + (b"x" if isinstance(value, bytes) else "x" if isinstance(value, str) else 1))
        assert not verify_params_mac(key, "r1", altered), name
    assert len(fields) == 12  # a new TransferParams field must be added to the MAC (kvtransfer.binding)
