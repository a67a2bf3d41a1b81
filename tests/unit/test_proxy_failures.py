"""Worker failures and client disconnects, against FAKE workers (tests.support.fake_workers): status codes and bodies,
no hangs, and the cleanup RPCs (D.Abort, P.Release) the proxy owes the workers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest

from tests.support.fake_workers import Failure
from tests.support.live_stack import LiveStack

MODEL = "tiny"
LONG = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 500, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack() -> Iterator[LiveStack]:
    with LiveStack(model_name=MODEL) as s:
        yield s


@pytest.fixture(autouse=True)
def reset(stack: LiveStack) -> Iterator[None]:
    yield
    stack.prefill[0].failure = None
    stack.prefill[0].delay_s = 0.0
    stack.decode[0].failure = None
    stack.decode[0].token_delay_s = 0.0


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def in_flight(stack: LiveStack) -> list[int]:
    return [w["in_flight"] for w in stack.http.get("/v1/cluster").json()["workers"]]


def counter(stack: LiveStack, status: str) -> float:
    text = stack.http.get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith(f'hybridpd_requests_total{{status="{status}"}}'))
    return float(line.split()[-1])


def test_disconnect_mid_stream_aborts_on_decode(stack: LiveStack) -> None:
    d = stack.decode[0]
    d.token_delay_s = 0.02
    aborted_before = counter(stack, "aborted")
    with stack.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert sum(line.startswith("data: ") for line in got) >= 3
    rid = d.generates[-1].request_id
    wait_for(lambda: rid in d.aborts)
    wait_for(lambda: rid not in d.running)
    assert rid not in stack.prefill[0].releases  # D owns P's lease once it has the request
    wait_for(lambda: in_flight(stack) == [0, 0])
    assert counter(stack, "aborted") == aborted_before + 1


def test_disconnect_non_stream_aborts_on_decode(stack: LiveStack) -> None:
    d = stack.decode[0]
    d.token_delay_s = 0.02
    with pytest.raises(httpx.ReadTimeout):
        stack.http.post("/v1/completions", json=LONG, timeout=0.3)
    rid = d.generates[-1].request_id
    wait_for(lambda: rid in d.aborts)
    wait_for(lambda: in_flight(stack) == [0, 0])


def test_disconnect_during_prefill_releases_on_prefill(stack: LiveStack) -> None:
    p, d = stack.prefill[0], stack.decode[0]
    p.delay_s = 0.5
    n_generates = len(d.generates)
    with pytest.raises(httpx.ReadTimeout):
        stack.http.post("/v1/completions", json={**LONG, "stream": True}, timeout=0.2)
    rid = p.prefills[-1].request_id
    wait_for(lambda: rid in p.releases)
    assert len(d.generates) == n_generates  # Generate never sent
    wait_for(lambda: in_flight(stack) == [0, 0])


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.UNAVAILABLE, 503),  # with skip_prefill "never" (else the decode worker computes it: below)
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
    (grpc.StatusCode.INTERNAL, 500),
])
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_is_json_error(stack: LiveStack, code: grpc.StatusCode, status: int, stream: bool) -> None:
    if code == grpc.StatusCode.UNAVAILABLE:
        stack.run(_set_skip_prefill(stack, "never"))
    stack.prefill[0].failure = Failure(code, "prefill exploded")
    n_generates = len(stack.decode[0].generates)
    t0 = time.monotonic()
    try:
        r = stack.http.post("/v1/completions", json={**LONG, "stream": stream}, timeout=10)
    finally:
        stack.run(_set_skip_prefill(stack, "auto"))
    assert time.monotonic() - t0 < 5
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert "prefill exploded" in err["message"]
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # every prefill worker refused: shed, with a retry hint
        assert r.headers["retry-after"] == "1" and err["code"] == "overloaded"
    else:
        assert stack.prefill[0].address in err["message"]
    assert err["type"] == ("service_unavailable" if status == 503 else "internal_error")
    assert r.headers["connection"] == "close"  # a 5xx never leaves a keep-alive connection in doubt
    assert len(stack.decode[0].generates) == n_generates


async def _set_skip_prefill(stack: LiveStack, value: str) -> None:
    import dataclasses

    proxy = stack.app.state.proxy
    cfg = proxy.cluster.config
    weights = dataclasses.replace(cfg.routing_weights, skip_prefill=value)
    object.__setattr__(proxy.cluster, "config", dataclasses.replace(cfg, routing_weights=weights))


@pytest.mark.parametrize("stream", [False, True])
def test_every_prefill_worker_down_the_decode_worker_computes_the_prompt(stack: LiveStack, stream: bool) -> None:
    """The only prefill worker is down (UNAVAILABLE): the request is answered, the decode worker computing the
    prompt itself (a Generate without transfer params: skip-P, exact as colocated), as it is while a prefill
    worker restarts; skip_prefill "never" keeps the 503 (above)."""
    stack.prefill[0].failure = Failure(grpc.StatusCode.UNAVAILABLE, "prefill exploded")
    n_generates = len(stack.decode[0].generates)
    r = stack.http.post("/v1/completions", json={**LONG, "stream": stream}, timeout=10)
    assert r.status_code == 200, r.text
    assert len(stack.decode[0].generates) == n_generates + 1
    assert not stack.decode[0].generates[-1].HasField("params")
    wait_for(lambda: in_flight(stack) == [0, 0])


def test_worker_invalid_argument_is_400_with_its_message(stack: LiveStack) -> None:
    stack.prefill[0].failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, "prompt uses reserved token 3")
    r = stack.http.post("/v1/completions", json=LONG)
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt uses reserved token 3"
    stack.prefill[0].failure = None
    stack.decode[0].failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, "stale epoch")
    r = stack.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [], "max_tokens": 1})
    assert r.status_code == 400  # proxy-side validation first
    r = stack.http.post("/v1/completions", json=LONG)
    assert r.status_code == 400 and r.json()["error"]["message"] == "stale epoch"
    # a stream has had P's first token already: the error ends it
    r = stack.http.post("/v1/completions", json={**LONG, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and "stale epoch" in events[-2] and events[-1] == "data: [DONE]"


def test_decode_failure_before_first_token_releases_prefill(stack: LiveStack) -> None:
    stack.decode[0].failure = Failure(grpc.StatusCode.UNAVAILABLE, "decode overloaded")
    r = stack.http.post("/v1/completions", json=LONG)
    assert r.status_code == 503 and "decode overloaded" in r.json()["error"]["message"]
    rid = stack.prefill[0].prefills[-1].request_id
    wait_for(lambda: rid in stack.prefill[0].releases)
    wait_for(lambda: in_flight(stack) == [0, 0])


def test_decode_failure_mid_stream(stack: LiveStack) -> None:
    stack.decode[0].failure = Failure(grpc.StatusCode.INTERNAL, "kernel fault", after_tokens=2)
    r = stack.http.post("/v1/completions", json={**LONG, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2] and "kernel fault" in events[-2]
    assert len(events) == 4  # two tokens, the error, [DONE]
    r = stack.http.post("/v1/completions", json=LONG)
    assert r.status_code == 500 and "kernel fault" in r.json()["error"]["message"]
    rid = stack.decode[0].generates[-1].request_id
    assert rid not in stack.prefill[0].releases  # D had taken over the lease


def test_serving_resumes_after_failures(stack: LiveStack) -> None:
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": [7, 8], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " 8 7"
    assert in_flight(stack) == [0, 0]


@pytest.mark.parametrize("skip_prefill", ["auto", "never"])
def test_unreachable_prefill_is_not_a_hang(skip_prefill: str) -> None:
    """The only prefill worker unreachable: answered by the decode worker alone (skip-P), or with skip_prefill
    "never" a 503; never a hang. /health says the PD cluster is not whole either way."""
    from hybridpd.proxy.config import RoutingWeights

    weights = RoutingWeights(skip_prefill=skip_prefill)  # type: ignore[arg-type]
    with LiveStack(n_prefill=0, model_name=MODEL, prefill_addrs_extra=["127.0.0.1:1"], routing_weights=weights) as s:
        t0 = time.monotonic()
        r = s.http.post("/v1/completions", json={**LONG, "stream": True}, timeout=20)
        assert time.monotonic() - t0 < 10
        if skip_prefill == "never":
            assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
        else:
            assert r.status_code == 200 and "[DONE]" in r.text and not s.decode[0].generates[-1].HasField("params")
        h = s.http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "unavailable"
        cluster = s.http.get("/v1/cluster").json()
        dead = next(w for w in cluster["workers"] if w["role"] == "prefill")
        assert dead["reachable"] is False and "UNAVAILABLE" in dead["error"]


@pytest.mark.parametrize("with_prefill", [True, False])
def test_a_decode_worker_lost_mid_generation_restarts_a_non_streamed_request(with_prefill: bool) -> None:
    """Nothing of a non-streamed request has reached the client when its decode worker dies mid-generation: the
    request continues on the other decode worker from its start (after P's first token under PD), and the answer
    is whole and right (the fake rule: the prompt reversed). A streamed one cannot be taken back: an error."""
    n_prefill = 1 if with_prefill else 0
    extra = {} if with_prefill else {"colocated": True}
    with LiveStack(n_prefill=n_prefill, n_decode=2, model_name=MODEL, routing="round_robin", **extra) as s:
        body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 6}
        for d in s.decode:
            d.failure = None
        s.decode[0].failure = Failure(grpc.StatusCode.UNAVAILABLE, "worker died", after_tokens=3)
        answers = [s.http.post("/v1/completions", json=body, timeout=10) for _ in range(2)]  # one lands on D0
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        assert all(r.json()["choices"][0]["token_ids"] == [6, 5, 4, 3, 2, 1] for r in answers)
        assert all(r.json()["usage"]["completion_tokens"] == 6 for r in answers)
        assert len(s.decode[0].generates) >= 1 and len(s.decode[1].generates) == 2  # each one ended on D1
        streamed = [s.http.post("/v1/completions", json={**body, "stream": True}, timeout=10) for _ in range(2)]
        assert any("worker died" in r.text for r in streamed)  # the one on D0: an error event after its tokens
        wait_for(lambda: not any(in_flight(s)))  # every worker's count given back (the lost one's too)
