"""Live membership and cache-aware placement through the real proxy with FAKE workers (no model): register,
heartbeat expiry, drain, leave, bad registrations; routing to the decode worker whose cache holds the prefix, and
skip-prefill when its remainder is short."""

from __future__ import annotations

import asyncio
import time

from hybridpd.proxy.cache_index import prompt_block_hashes
from hybridpd.proxy.config import RoutingWeights
from hybridpd.proxy.membership import Membership
from hybridpd.proxy.routing import Router

from tests.polling import wait_for
from tests.support.fake_workers import FakeDecodeWorker, serve_fake
from tests.support.live_stack import LiveStack

MODEL = "tiny"


def _complete(s: LiveStack, prompt: list[int]) -> None:
    r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text


def _members(s: LiveStack) -> dict[str, dict]:
    return {w["address"]: w["membership"] for w in s.http.get("/v1/cluster").json()["workers"]}


def _register(s: LiveStack, addr: str, ttl: float = 5.0, headers: dict[str, str] | None = None) -> int:
    body = {"role": "decode", "address": addr, "worker_id": "w-new", "epoch": "e1", "ttl_s": ttl}
    return s.http.post("/v1/cluster/workers", json=body, headers=headers).status_code


def test_join_drain_leave_and_expiry_without_restart() -> None:
    with LiveStack(n_prefill=1, n_decode=1, model_name=MODEL, routing="least_loaded") as s:
        new = FakeDecodeWorker("fake-decode-new")
        server = s.run(serve_fake(new))
        try:
            assert _register(s, new.address) == 200
            assert _members(s)[new.address]["static"] is False
            for _ in range(4):
                _complete(s, [1, 2, 3])
            assert len(new.generates) == 2  # least loaded, idle: the two decode workers alternate
            r = s.http.post("/v1/cluster/drain", json={"address": new.address})
            assert r.status_code == 200 and r.json()["draining"] is True
            assert r.json()["worker_told"] is False  # a fake worker has no Drain RPC: this proxy drains it alone
            for _ in range(3):
                _complete(s, [1, 2, 3])
            assert len(new.generates) == 2 and _members(s)[new.address]["state"] == "draining"
            s.http.post("/v1/cluster/drain", json={"address": new.address, "drain": False})
            _complete(s, [1, 2, 3])
            _complete(s, [1, 2, 3])
            assert len(new.generates) == 3
            r = s.http.request("DELETE", "/v1/cluster/workers", json={"address": new.address})
            assert r.json() == {"removed": True} and new.address not in _members(s)
            assert _register(s, new.address, ttl=0.3) == 200  # no renewal: dropped after its lease
            wait_for(
                "the expired registration removed", lambda: new.address not in _members(s), timeout=5, interval=0.05
            )
        finally:
            s.run(server.stop(grace=None))


BAD_REGISTRATIONS = [
    {"role": "decode", "address": "nohost"},
    {"role": "oracle", "address": "h:1"},
    {"role": "decode", "address": "h:1", "ttl_s": 0},
    {"role": "decode", "address": "h:1", "ttl_s": "5"},
    {"role": "decode", "address": "h:99999"},
    {"address": "h:1"},
]


def test_bad_registrations_are_4xx_json() -> None:
    with LiveStack(n_prefill=1, n_decode=1, model_name=MODEL) as s:
        for body in BAD_REGISTRATIONS:
            r = s.http.post("/v1/cluster/workers", json=body)
            assert r.status_code == 400 and r.json()["error"]["message"], body
        r = s.http.post("/v1/cluster/workers", content=b"{not json")
        assert r.status_code == 400
        r = s.http.post("/v1/cluster/drain", json={"address": "h:1"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_registration_needs_the_cluster_token() -> None:
    with LiveStack(n_prefill=1, n_decode=1, model_name=MODEL, cluster_token="secret") as s:
        assert _register(s, "127.0.0.1:1") == 401
        assert _register(s, "127.0.0.1:1", headers={"x-hybridpd-token": "wrong"}) == 401
        assert _register(s, "127.0.0.1:1", headers={"x-hybridpd-token": "secret"}) == 200


def test_a_proxy_with_api_keys_and_no_cluster_token_takes_no_registration() -> None:
    """Its API is closed but nothing could authenticate a worker: anyone reaching it could otherwise add a worker of
    theirs (others' prompts to it, its text as the answer) or remove one, a client's API key included."""
    with LiveStack(n_prefill=1, n_decode=1, model_name=MODEL, api_key="k", cluster_token=None) as s:
        static = s.decode[0].address
        for headers in ({}, {"authorization": "Bearer k"}, {"x-hybridpd-token": ""}):
            r = s.http.post("/v1/cluster/workers", json={"role": "decode", "address": "10.9.9.9:1"}, headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "membership_closed", r.text
            r = s.http.request("DELETE", "/v1/cluster/workers", json={"address": static}, headers=headers)
            assert r.status_code == 403, r.text
        members = _members_with_key(s, "k")
        assert "10.9.9.9:1" not in members and members[static]["state"] == "up"


def _members_with_key(s: LiveStack, key: str) -> dict[str, dict]:
    workers = s.http.get("/v1/cluster", headers={"authorization": f"Bearer {key}"}).json()["workers"]
    return {w["address"]: w["membership"] for w in workers}


def _prefix_stack(weights: RoutingWeights) -> tuple[LiveStack, list[int]]:
    """Two fake decode workers; the second holds the blocks and checkpoints of a 64-token prefix."""
    s = LiveStack(n_prefill=1, n_decode=2, model_name=MODEL, routing="cache_aware", routing_weights=weights)
    prefix = list(range(10, 74))
    hashes = set(prompt_block_hashes(prefix, 16))
    s.decode[0].cache_snapshot = {0: set(), 1: set()}
    s.decode[1].cache_snapshot = {0: hashes, 1: hashes}
    return s, prefix


def test_cache_aware_sends_a_prefix_to_the_worker_that_holds_it() -> None:
    s, prefix = _prefix_stack(RoutingWeights(skip_prefill="never"))
    with s:
        wait_for(
            "both cache indexes synced",
            lambda: all(
                m["cache_index"] and m["cache_index"]["synced"]
                for a, m in _members(s).items()
                if a in (s.decode[0].address, s.decode[1].address)
            ),
            timeout=10,
            interval=0.05,
        )
        for tail in range(5):
            _complete(s, [*prefix, 200 + tail, 7])
        assert len(s.decode[1].generates) == 5 and not s.decode[0].generates
        assert all(g.HasField("params") for g in s.decode[1].generates)  # skip-P off: P prefilled each
        _complete(s, [1, 2, 3, 4])  # no cached prefix anywhere: by load and rotation
        metrics = s.http.get("/metrics").text
        assert 'hybridpd_proxy_route_decisions_total{path="pd"} 6.0' in metrics


def test_skip_prefill_when_the_remainder_is_short() -> None:
    s, prefix = _prefix_stack(RoutingWeights(skip_max_tokens=8, prefill_token_s=1e-9, handoff_s=0.0))
    with s:
        wait_for(
            "the holder's index synced",
            lambda: (_members(s)[s.decode[1].address]["cache_index"] or {}).get("synced"),
            timeout=10,
            interval=0.05,
        )
        _complete(s, [*prefix, 200, 7])  # remainder 65 - 64 = 1 token <= 8: D computes it, no prefill
        _complete(s, [*prefix, *range(100, 130)])  # remainder 30 > 8, and P is estimated cheaper: PD
        first, second = s.decode[1].generates
        assert not first.HasField("params") and second.HasField("params")
        assert len(s.prefill[0].prefills) == 1


def test_a_draining_worker_finishes_what_it_runs() -> None:
    with LiveStack(n_prefill=1, n_decode=2, model_name=MODEL, token_delay_s=0.05) as s:
        addr = s.decode[0].address
        with s.http.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": [1, 2], "max_tokens": 10, "ignore_eos": True, "stream": True},
        ) as r:
            time.sleep(0.1)
            assert s.http.post("/v1/cluster/drain", json={"address": addr}).status_code == 200
            body = "".join(r.iter_text())
        assert body.rstrip().endswith("[DONE]") and '"finish_reason":"length"' in body.replace(" ", "")
        assert len(s.decode[0].generates) == 1 and s.decode[0].generates[0].sampling_params.max_tokens == 10
        _complete(s, [1, 2, 3])
        assert len(s.decode[0].generates) == 1  # drained: the next request went elsewhere


def test_placement_weighs_load_and_room_when_no_index_is_usable() -> None:
    """No cache index (a stale or old worker): least loaded, then the one with room, never the full one."""
    from types import SimpleNamespace

    from hybridpd.proxy.placement import Placer
    from hybridpd.proxy.routing import Router

    decode = Router(["a", "b"], "cache_aware")
    membership = SimpleNamespace(index=lambda addr: None, room={"a": 1.0, "b": 1.0})
    placer = Placer(membership, None, decode, RoutingWeights())  # type: ignore[arg-type]
    decode.take("a")
    assert placer.place((1, 2, 3)).decode_addr == "b"  # a has a request in flight
    decode.release("a")
    membership.room["b"] = 0.0  # every page of b in use
    assert placer.place((1, 2, 3)).decode_addr == "a"
    assert placer.place((1, 2, 3)).prefill_addr is None  # colocated (no prefill router): D computes it


def test_with_every_prefill_worker_drained_decode_workers_prefill_themselves() -> None:
    with LiveStack(n_prefill=1, n_decode=1, model_name=MODEL, routing="cache_aware") as s:
        assert s.http.post("/v1/cluster/drain", json={"address": s.prefill[0].address}).status_code == 200
        _complete(s, [1, 2, 3, 4, 5])
        assert not s.prefill[0].prefills and not s.decode[0].generates[-1].HasField("params")
    with LiveStack(
        n_prefill=1,
        n_decode=1,
        model_name=MODEL,
        routing="cache_aware",
        routing_weights=RoutingWeights(skip_prefill="never"),
    ) as s:
        assert s.http.post("/v1/cluster/drain", json={"address": s.prefill[0].address}).status_code == 200
        r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"


class _DrainClients:
    """What Membership calls on the workers here: Drain (recorded) and background tasks."""

    def __init__(self) -> None:
        self.drains: list[tuple[str, bool]] = []

    async def drain_worker(self, role: str, addr: str, drain: bool) -> None:
        self.drains.append((addr, drain))

    def spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        asyncio.get_running_loop().create_task(coro)


def test_a_worker_drained_here_is_told_again_when_it_restarts() -> None:
    """A restarted worker forgets that it was drained (a new process): every other proxy would route to it again on
    its first registration, so the proxy that drained it tells the new incarnation again."""

    async def run() -> None:
        clients = _DrainClients()
        m = Membership(clients, {"decode": Router([], "least_loaded", dynamic=True)})  # type: ignore[arg-type]
        m.register("decode", "h:1", "w1", "e1", 10.0)
        m.register("decode", "h:2", "w2", "e1", 10.0)
        m.drain("h:1")
        m.worker_draining("h:2", True)  # drained through another proxy: that one tells it again
        m.register("decode", "h:1", "w3", "e2", 10.0, draining=False)  # restarted (a new epoch), not draining
        m.register("decode", "h:2", "w4", "e2", 10.0, draining=False)
        m.register("decode", "h:1", "w3", "e2", 10.0, draining=False)  # its next heartbeat: no second telling
        await asyncio.sleep(0.01)
        assert clients.drains == [("h:1", True)]
        assert m.members["h:1"].draining and m.routers["decode"].addrs == ("h:2",)
        m._feed_up("h:1", "e3")  # a restart seen first in the cache-event feed's snapshot
        await asyncio.sleep(0.01)
        assert clients.drains == [("h:1", True), ("h:1", True)]

    asyncio.run(run())


def test_registrations_past_the_member_cap_are_refused() -> None:
    """An open proxy cannot be made to hold feeds and probes without bound: past its cap a new worker gets a 429
    (a known one still renews), and room comes back when one leaves."""
    with LiveStack(n_prefill=1, n_decode=1, model_name=MODEL) as s:
        s.app.state.proxy.membership.max_members = 3  # the two static workers and one more
        assert _register(s, "10.9.9.1:1") == 200
        r = s.http.post("/v1/cluster/workers", json={"role": "decode", "address": "10.9.9.2:1", "epoch": "e1"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "membership_full"
        assert _register(s, "10.9.9.1:1") == 200  # a renewal
        assert s.http.request("DELETE", "/v1/cluster/workers", json={"address": "10.9.9.1:1"}).status_code == 200
        assert _register(s, "10.9.9.2:1") == 200


def test_a_drain_holds_for_the_address_whatever_happens_to_the_process() -> None:
    """A worker's id and epoch are new with every process, so a drain names the (role, address). It survives the
    worker's registration expiring or being withdrawn (a crash longer than its lease, a stop): the next worker of
    that role there joins drained and is told so. Undrained, it is forgotten; a worker of the other role at that
    address is not drained by it; drains of addresses with no member are bounded."""

    async def run() -> None:
        clients = _DrainClients()
        routers = {r: Router([], "least_loaded", dynamic=True) for r in ("prefill", "decode")}
        m = Membership(clients, routers)  # type: ignore[arg-type]
        m.register("decode", "h:1", "w1", "e1", 10.0)
        m.drain("h:1")
        m.deregister("h:1")  # expired or withdrawn
        m.register("decode", "h:1", "w2", "e2", 10.0, draining=False)  # a new process, a new id
        await asyncio.sleep(0.01)
        assert m.members["h:1"].draining and routers["decode"].addrs == () and clients.drains == [("h:1", True)]
        m.drain("h:1", False)
        m.deregister("h:1")
        m.register("decode", "h:1", "w3", "e3", 10.0, draining=False)
        assert not m.members["h:1"].draining and routers["decode"].addrs == ("h:1",)
        m.drain("h:1")
        m.deregister("h:1")
        m.register("prefill", "h:1", "w4", "e4", 10.0, draining=False)  # another role at that address
        assert not m.members["h:1"].draining and routers["prefill"].addrs == ("h:1",)
        m.max_members = 2
        for i in range(2, 6):
            m.register("decode", f"h:{i}", f"v{i}", "e", 10.0)
            m.drain(f"h:{i}")
            m.deregister(f"h:{i}")
        assert list(m._drained) == [("decode", "h:4"), ("decode", "h:5")]  # the two latest with no member

    asyncio.run(run())
