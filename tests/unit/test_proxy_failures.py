"""Worker failures and client disconnects, against FAKE workers (tests.support.fake_workers): status codes and bodies,
no hangs, and the cleanup RPCs (D.Abort, P.Release) the proxy owes the workers."""

from __future__ import annotations

import json
import threading
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


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.UNAVAILABLE, 503),  # with skip_prefill "never" (else the decode worker computes it: below)
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
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


def _stream(r: httpx.Response) -> tuple[list[int], str, list[dict]]:
    """A completion stream's tokens, text and error events (asserting it ends with [DONE])."""
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]", events
    bodies = [json.loads(e) for e in events[:-1]]
    choices = [c for b in bodies for c in b.get("choices", [])]
    return (
        [t for c in choices for t in c["token_ids"]],
        "".join(c["text"] for c in choices),
        [b for b in bodies if "error" in b],
    )


def failovers(stack: LiveStack, cause: str, outcome: str) -> float:
    text = stack.http.get("/metrics").text
    key = f'hybridpd_proxy_decode_failovers_total{{cause="{cause}",outcome="{outcome}"}}'
    return float(next(ln for ln in text.splitlines() if ln.startswith(key)).split()[-1])


@pytest.mark.parametrize("with_prefill", [True, False])
def test_a_decode_worker_lost_mid_generation_resumes_the_request_elsewhere(with_prefill: bool) -> None:
    """A decode worker dies after sending part of the output: the request resumes on the other decode worker, which
    is sent what the client already has (the first token, the lost worker's tokens after it, the text's length) and
    streams only the rest. Streamed or not, the client gets every token once, in order, and the whole text (the
    fake rule: the prompt reversed); counted as a resumed failover."""
    n_prefill = 1 if with_prefill else 0
    extra = {} if with_prefill else {"colocated": True}
    with LiveStack(n_prefill=n_prefill, n_decode=2, model_name=MODEL, routing="round_robin", **extra) as s:
        body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 6}
        s.decode[0].failure = Failure(grpc.StatusCode.UNAVAILABLE, "worker died", after_tokens=3)
        answers = [s.http.post("/v1/completions", json=body, timeout=10) for _ in range(2)]  # one lands on D0
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        assert all(r.json()["choices"][0]["token_ids"] == [6, 5, 4, 3, 2, 1] for r in answers)
        assert all(r.json()["choices"][0]["text"] == " 6 5 4 3 2 1" for r in answers)
        assert all(r.json()["usage"]["completion_tokens"] == 6 for r in answers)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        for _ in range(2):  # one lands on D0
            r = s.http.post("/v1/completions", json=stream, timeout=10)
            tokens, text, errors = _stream(r)
            assert (tokens, text, errors) == ([6, 5, 4, 3, 2, 1], " 6 5 4 3 2 1", []), r.text
            assert json.loads(r.text.split("\n\n")[-3].removeprefix("data: "))["usage"]["completion_tokens"] == 6
        resumed = [g for g in s.decode[1].generates if g.HasField("resume")]
        lost = len(s.decode[0].generates)  # (each one broke after its third token)
        assert lost >= 2 and len(resumed) == lost and all(g.first_token.token_id == 6 for g in resumed)
        assert all(list(g.resume.token_ids) == [5, 4] and g.resume.text_chars == len(" 6 5 4") for g in resumed)
        assert all(not g.HasField("params") for g in resumed)  # D computes the prompt and the output itself
        assert failovers(s, "lost", "resumed") == lost and failovers(s, "lost", "failed") == 0
        s.decode[1].resumes = False  # a worker that predates resuming would send the tokens again: an error instead
        tokens, _, errors = _stream(s.http.post("/v1/completions", json=stream, timeout=10))
        assert tokens == [6, 5, 4] and len(errors) == 1 and "did not resume" in errors[0]["error"]["message"]
        wait_for(lambda: not any(in_flight(s)))  # every worker's count given back (the lost one's too)


@pytest.mark.parametrize("n_decode", [2, 1])
def test_a_decode_worker_that_stalls_mid_stream_is_given_up(n_decode: int) -> None:
    """A decode worker freezes after two tokens, its connection open: after the inter-token timeout the proxy
    gives it up for the request (cancelled, and told to abort it) and resumes the stream on the other decode
    worker, every token once; with no other decode worker, the stream ends with a clear error event, not a hang.
    Both counted as stalled failovers."""
    with LiveStack(
        n_prefill=1, n_decode=n_decode, model_name=MODEL, routing="round_robin", inter_token_timeout_s=0.3
    ) as s:
        body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 6, "stream": True}
        s.decode[0].freeze_after_tokens = 3
        t0 = time.monotonic()
        streams = [_stream(s.http.post("/v1/completions", json=body, timeout=10)) for _ in range(n_decode)]
        assert time.monotonic() - t0 < 5
        frozen_rid = s.decode[0].generates[0].request_id
        wait_for(lambda: frozen_rid in s.decode[0].aborts and frozen_rid in s.decode[0].cancelled)
        if n_decode == 2:
            assert all(st == ([6, 5, 4, 3, 2, 1], " 6 5 4 3 2 1", []) for st in streams), streams
            stalled = len(s.decode[0].generates)  # (the rotation comes back to it after each failover)
            assert failovers(s, "stalled", "resumed") == stalled and failovers(s, "stalled", "failed") == 0
        else:
            ((tokens, _, errors),) = streams
            assert tokens == [6, 5, 4] and len(errors) == 1 and "made no progress" in errors[0]["error"]["message"]
            assert failovers(s, "stalled", "failed") == 1 and counter(s, "error") == 1
        wait_for(lambda: not any(in_flight(s)))


def test_a_decode_worker_process_that_freezes_mid_stream_is_left_at_its_health_probe() -> None:
    """The whole decode worker process freezes mid-stream (its Health unanswered too): the stream is given up as
    soon as the health monitor finds it unresponsive while the other decode worker answers, well before the
    inter-token timeout (30 s here), and resumes there, every token once."""
    with LiveStack(
        n_prefill=1, n_decode=2, model_name=MODEL, routing="round_robin", health_interval_s=0.1, control_timeout_s=0.3
    ) as s:
        s.decode[0].freeze_after_tokens, s.decode[0].freeze_health = 3, True
        body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 6, "stream": True}
        t0 = time.monotonic()
        got = _stream(s.http.post("/v1/completions", json=body, timeout=20))
        assert got == ([6, 5, 4, 3, 2, 1], " 6 5 4 3 2 1", []) and time.monotonic() - t0 < 5
        assert len(s.decode[0].generates) == 1 and failovers(s, "stalled", "resumed") == 1


def test_a_decode_worker_whose_engine_wedges_is_left_when_its_health_says_not_ready() -> None:
    """A decode worker whose gRPC server still answers (Health too) while its engine is stuck: its Generate sends
    nothing, not even its first chunk, and its Health answers not ready (mid-stream, the same wakes the stream as a
    worker whose Health goes unanswered does). The request is given up there
    as soon as the health monitor sees that, well before the deadlines (request 600 s, inter-token 30 s), and served
    whole by the other decode worker; counted as a stalled failover, and D0 is told to abort it."""
    with LiveStack(n_prefill=1, n_decode=2, model_name=MODEL, routing="round_robin", health_interval_s=0.1) as s:
        s.decode[0].freeze_after_tokens = 0
        body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 6, "stream": True}
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(s.http.post("/v1/completions", json=body, timeout=20)))
        t0 = time.monotonic()
        t.start()
        wait_for(lambda: bool(s.decode[0].running))  # Generate reached D0, which is about to hang
        s.decode[0].ready = False
        t.join(20)
        assert out and time.monotonic() - t0 < 5
        assert _stream(out[0]) == ([6, 5, 4, 3, 2, 1], " 6 5 4 3 2 1", [])
        rid = s.decode[0].generates[0].request_id
        wait_for(lambda: rid in s.decode[0].cancelled)
        assert failovers(s, "stalled", "resumed") == 1
        r = s.http.post("/v1/completions", json={**body, "stream": False}, timeout=20)  # new requests skip D0
        assert r.status_code == 200 and len(s.decode[0].generates) == 1
        wait_for(lambda: not any(in_flight(s)))
