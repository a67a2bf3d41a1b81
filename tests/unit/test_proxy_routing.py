"""Worker selection: `proxy.routing.Router` on its own, then through the proxy with two FAKE decode workers."""

from __future__ import annotations

import time

import pytest
from hybridpd.proxy.routing import Router

from tests.polling import wait_for
from tests.support.live_stack import LiveStack

MODEL = "tiny"


def test_round_robin_ignores_load() -> None:
    r = Router(["a", "b", "c"], "round_robin")
    picks = [r.acquire() for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]
    assert r.snapshot() == {"a": 3, "b": 2, "c": 2}


def test_least_loaded_picks_fewest_in_flight() -> None:
    r = Router(["a", "b", "c"], "least_loaded")
    assert [r.acquire() for _ in range(3)] == ["a", "b", "c"]  # idle: ties rotate
    r.release("b")
    assert r.acquire() == "b"  # the only one with 0 in flight
    r.release("a")
    r.release("c")
    assert r.snapshot() == {"a": 0, "b": 1, "c": 0}
    assert r.choose() in ("a", "c")
    assert r.acquire() == "a"  # cursor is past "b": "c" then "a" are tied at 0, "c" was just chosen
    assert r.acquire() == "c"
    assert r.snapshot() == {"a": 1, "b": 1, "c": 1}


def test_least_loaded_ties_rotate_when_idle() -> None:
    r = Router(["a", "b"], "least_loaded")
    seq = []
    for _ in range(4):
        addr = r.acquire()
        seq.append(addr)
        r.release(addr)
    assert seq == ["a", "b", "a", "b"]


def test_router_misuse() -> None:
    with pytest.raises(ValueError):
        Router([], "round_robin")
    with pytest.raises(ValueError):
        Router(["a", "a"], "round_robin")
    r = Router(["a"], "least_loaded")
    with pytest.raises(RuntimeError):
        r.release("a")


def _ids(stack: LiveStack, i: int) -> list[str]:
    return [g.request_id for g in stack.decode[i].generates]


def test_round_robin_through_proxy() -> None:
    with LiveStack(n_prefill=2, n_decode=2, model_name=MODEL, routing="round_robin") as s:
        for _ in range(4):
            r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 200
        assert [len(_ids(s, 0)), len(_ids(s, 1))] == [2, 2]
        assert [len(p.prefills) for p in s.prefill] == [2, 2]
        order = [s.decode[0].generates[0].request_id, s.decode[1].generates[0].request_id,
                 s.decode[0].generates[1].request_id, s.decode[1].generates[1].request_id]
        assert order == [p.request_id for p in sorted(s.prefill[0].prefills + s.prefill[1].prefills,
                                                      key=lambda p: order.index(p.request_id))]
        # each request's Generate carried the params of the prefill worker that served it
        for d in s.decode:
            for g in d.generates:
                owner = next(p for p in s.prefill if g.request_id in [q.request_id for q in p.prefills])
                assert g.params.prefill_address == owner.address


@pytest.mark.parametrize(("policy", "expected"), [("least_loaded", [1, 2]), ("round_robin", [2, 1])])
def test_least_loaded_avoids_busy_decode(policy: str, expected: list[int]) -> None:
    with LiveStack(n_prefill=1, n_decode=2, model_name=MODEL, routing=policy) as s:
        s.decode[0].token_delay_s = 0.05
        long = {"model": MODEL, "prompt": [1, 2], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with s.http.stream("POST", "/v1/completions", json=long) as busy:
            lines = busy.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)  # decode-0 now has one request in flight
            for _ in range(2):
                r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": [3], "max_tokens": 2,
                                                             "ignore_eos": True})
                assert r.status_code == 200
            assert [len(_ids(s, 0)), len(_ids(s, 1))] == expected


def test_a_worker_that_stops_answering_health_gets_no_new_requests() -> None:
    """A frozen worker (SIGSTOP, a wedged event loop) keeps its connections open, so no call fails and its feed does
    not break: only the health probe sees it. While its probe times out, new requests go to the other worker of its
    role; once it answers again it is back in rotation. A role whose every worker is unresponsive still routes
    (slow is not gone: better to wait than to refuse)."""
    with LiveStack(n_prefill=2, n_decode=2, model_name=MODEL, routing="round_robin", health_interval_s=0.1,
                   control_timeout_s=1.0) as s:
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "ignore_eos": True}
        s.prefill[0].health_delay_s = s.decode[1].health_delay_s = 5.0
        wait_for("probes see the stall", lambda: s.http.get("/health").json()["ready"] == {"prefill": 1, "decode": 1},
                 timeout=10, interval=0.05)
        for _ in range(4):
            assert s.http.post("/v1/completions", json=body).status_code == 200
        assert [len(p.prefills) for p in s.prefill] == [0, 4] and [len(_ids(s, i)) for i in (0, 1)] == [4, 0]
        s.prefill[1].health_delay_s = 5.0  # every prefill worker unresponsive: they still get requests
        wait_for("no prefill worker answers", lambda: s.http.get("/health").json()["ready"]["prefill"] == 0, timeout=10,
                 interval=0.05)
        assert s.http.post("/v1/completions", json=body).status_code == 200
        s.prefill[0].health_delay_s = s.prefill[1].health_delay_s = s.decode[1].health_delay_s = 0.0
        wait_for("all answer again", lambda: s.http.get("/health").json()["ready"] == {"prefill": 2, "decode": 2},
                 timeout=10, interval=0.05)
        for _ in range(4):
            assert s.http.post("/v1/completions", json=body).status_code == 200
        assert min(len(p.prefills) for p in s.prefill) >= 1 and len(_ids(s, 1)) >= 1  # both back in rotation


def test_a_prefill_on_a_worker_that_freezes_goes_to_another() -> None:
    """A Prefill in flight on a worker whose health probe stops answering is given up (cancelled: the worker frees
    what it prefilled when it resumes) and sent to another prefill worker that answers, instead of waiting for
    the frozen one for as long as it stays frozen."""
    with LiveStack(n_prefill=2, n_decode=1, model_name=MODEL, routing="round_robin", health_interval_s=0.1,
                   control_timeout_s=1.0) as s:
        s.prefill[0].delay_s = s.prefill[0].health_delay_s = 30.0  # frozen: answers nothing
        t0 = time.perf_counter()
        r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2}, timeout=20)
        assert r.status_code == 200 and time.perf_counter() - t0 < 10
        assert [len(p.prefills) for p in s.prefill] == [1, 1]
        assert s.decode[0].generates[-1].params.prefill_address == s.prefill[1].address
        frozen = 'hybridpd_proxy_prefill_failovers_total{cause="frozen"} 1.0'
        assert frozen in s.http.get("/metrics").text.splitlines()


def test_a_generate_on_a_decode_worker_that_freezes_before_its_first_token_goes_to_another() -> None:
    """Generate sent to a decode worker that then stops answering (health probes time out) and has sent nothing
    yet: the stream is cancelled and the request goes to another decode worker (computing the prompt itself), as
    when the worker is unreachable; the answer is whole."""
    with LiveStack(n_prefill=1, n_decode=2, model_name=MODEL, routing="round_robin", health_interval_s=0.1,
                   control_timeout_s=1.0) as s:
        s.decode[0].token_delay_s = s.decode[0].health_delay_s = 30.0  # frozen: answers nothing
        t0 = time.perf_counter()
        r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3}, timeout=20)
        assert r.status_code == 200 and time.perf_counter() - t0 < 10
        assert r.json()["choices"][0]["token_ids"] == [3, 2, 1]  # (the fake answers the prompt reversed)
        assert len(_ids(s, 0)) == 1 and len(_ids(s, 1)) == 1
        assert not s.decode[1].generates[-1].HasField("params")  # computed there: P's lease was given back
        wait_for("P's lease released", lambda: s.prefill[0].releases, timeout=5, interval=0.05)


def test_a_prefill_worker_that_dies_mid_call_after_being_marked_down_goes_to_another() -> None:
    """A prefill worker dies with a Prefill in flight, and the health monitor marks it down before the call's own
    error comes back: the request still goes to the other prefill worker (it used to be a 503, as if none were
    left, because the count of routable workers had already dropped)."""
    import threading

    import grpc

    from tests.support.fake_workers import Failure

    with LiveStack(n_prefill=2, n_decode=1, model_name=MODEL, routing="round_robin") as s:
        s.prefill[0].delay_s = 0.3
        s.prefill[0].failure = Failure(grpc.StatusCode.UNAVAILABLE, "Stream removed")
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=s.http.post("/v1/completions", json={
            "model": MODEL, "prompt": [1, 2], "max_tokens": 2}, timeout=20)))
        t.start()
        wait_for("P0 has the call", lambda: len(s.prefill[0].prefills) == 1, timeout=5, interval=0.01)

        async def mark_down() -> None:
            s.app.state.proxy.cluster.prefill.block(s.prefill[0].address)

        s.run(mark_down())
        t.join()
        assert box["r"].status_code == 200, box["r"].text
        assert [len(p.prefills) for p in s.prefill] == [1, 1]
        assert 'hybridpd_proxy_prefill_failovers_total{cause="lost"} 1.0' in s.http.get("/metrics").text.splitlines()
