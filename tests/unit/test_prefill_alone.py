"""P-alone, the prefill worker's mixed role: the placement sends a whole request to a prefill worker while the
decode worker is saturated (by count against its capacity, or by its measured time per token) or busier than the
prefill worker (balance), and a prefill worker has room (its cap, its queue); through the real proxy with FAKE
workers (no model): the path taken and counted, a prefill worker that refuses it before any chunk replaced by a
decode worker, one that dies mid-stream resumed on a decode worker (every token once), drain. The outputs against
a real engine: tests/unit/test_prefill_alone_engine.py."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import httpx
import pytest
from hybridpd.proxy.config import RoutingWeights
from hybridpd.proxy.placement import Placer
from hybridpd.proxy.routing import NoWorkerError, Router

from tests.polling import wait_for
from tests.support.fake_workers import Failure
from tests.support.live_stack import LiveStack

MODEL = "tiny"
PROMPT = (5, 6, 7, 8, 9, 10, 11, 12)


def _placer(**weights: object) -> tuple[Placer, Router, Router, SimpleNamespace]:
    prefill, decode = Router(["p"], "cache_aware"), Router(["d"], "cache_aware")
    membership = SimpleNamespace(index=lambda addr: None, room={}, capacity={"d": 10, "p": 4})
    # decode_balance 0: saturation alone (balance has tests of its own below)
    w = RoutingWeights(**{"skip_prefill": "never", "decode_balance": 0.0, **weights})  # type: ignore[arg-type]
    return Placer(membership, prefill, decode, w), prefill, decode, membership  # type: ignore[arg-type]


def test_prefill_alone_only_while_the_decode_worker_is_saturated() -> None:
    placer, prefill, decode, membership = _placer()
    assert placer.place(PROMPT).kind == "pd"
    for _ in range(8):
        decode.take("d")
    assert placer.place(PROMPT).kind == "pd"  # 8 of 10 in flight: below 0.9
    decode.take("d")
    p = placer.place(PROMPT)  # 9 of 10: saturated
    assert (p.kind, p.decode_addr, p.prefill_addr, p.on_prefill) == ("prefill_alone", "p", None, True)
    assert "9 of 10" in p.reason
    prefill.take("p", tokens=10**6)  # P's queue is long: its prefill role first
    assert placer.place(PROMPT).kind == "pd"
    prefill.release("p", tokens=10**6)
    for _ in range(4):
        placer.whole_started("p")
    assert placer.place(PROMPT).kind == "pd"  # P at its cap (4 whole requests)
    placer.whole_ended("p")
    assert placer.place(PROMPT).kind == "prefill_alone"
    membership.capacity.pop("p")  # capacity unknown (no Stats yet, or a worker without the mixed role)
    assert placer.place(PROMPT).kind == "pd"
    membership.capacity["p"] = 4
    prefill.block("p")  # drained or down: never chosen (and with skip-P off, no path is left)
    with pytest.raises(NoWorkerError):
        placer.place(PROMPT)
    assert placer.decisions["prefill_alone"] == 2 and placer.decisions["pd"] == 5


def test_prefill_alone_by_measured_time_per_token() -> None:
    placer, prefill, decode, _ = _placer(tpot_budget_s=0.05)
    placer.costs.token_gap("d", 0.2)
    assert placer.place(PROMPT).kind == "pd"  # slow, but idle (a stale figure): not saturated
    decode.take("d")
    assert placer.place(PROMPT).kind == "prefill_alone"  # 200 ms per token on D, P unmeasured
    placer.costs.token_gap("p", 0.3)
    assert placer.place(PROMPT).kind == "prefill_alone"  # P runs no whole request: its figure is stale, probe it
    placer.whole_started("p")
    assert placer.place(PROMPT).kind == "pd"  # P's own tokens come slower still: no gain
    placer.costs.token_gap("d", 0.01)
    placer.costs.token_gap("d", 0.01)  # D recovered (moving average): 0.2 -> 0.164 -> 0.133, still above
    assert placer.decode_saturated("d") is not None
    for _ in range(20):
        placer.costs.token_gap("d", 0.01)
    assert placer.decode_saturated("d") is None


def test_no_prefill_alone_while_its_own_tokens_are_over_budget() -> None:
    placer, _, decode, _ = _placer(tpot_budget_s=0.05)
    for _ in range(9):
        decode.take("d")  # saturated by count
    placer.whole_started("p")
    placer.costs.token_gap("p", 0.04)
    assert placer.place(PROMPT).kind == "prefill_alone"
    placer.costs.token_gap("p", 0.5)  # its prefill chunks slow its decodes past the budget
    assert placer.place(PROMPT).kind == "pd"


def test_balance_shares_the_requests_whole_as_two_colocated_replicas() -> None:
    """Balance (decode_balance 1): with nothing in flight, the PD path (low-load TTFT); from then on every request
    goes whole to the less loaded of P and D, alternating as least-loaded routing between colocated replicas."""
    placer, prefill, decode, _ = _placer(decode_balance=1.0, skip_prefill="auto")
    assert placer.place(PROMPT).kind == "pd"  # nothing in flight anywhere
    decode.take("d")
    kinds = []
    for _ in range(7):  # counted as generation does: D's router (PD, skip-P), P's router + whole_started (P-alone)
        p = placer.place(PROMPT)
        kinds.append(p.kind)
        assert p.prefill_addr is None and "balance" in p.reason
        if p.kind == "skip_prefill":
            assert p.decode_addr == "d"
            decode.take("d")
        else:
            assert p.decode_addr == "p"
            prefill.take("p", tokens=len(PROMPT))
            placer.whole_started("p")
    assert kinds == [
        "prefill_alone",
        "skip_prefill",
        "prefill_alone",
        "skip_prefill",
        "prefill_alone",
        "skip_prefill",
        "prefill_alone",
    ]
    assert (decode.in_flight("d"), placer.whole_on_prefill["p"]) == (4, 4)
    decode.take("d")
    p = placer.place(PROMPT)  # P at its cap (4 whole requests): D, although P holds fewer
    assert (p.kind, p.decode_addr) == ("skip_prefill", "d")
    placer.whole_ended("p")
    prefill.release("p", tokens=len(PROMPT))
    assert placer.place(PROMPT).kind == "prefill_alone"  # 3 + 1 <= 5


def test_balance_counts_the_prompts_p_computes_and_has_no_pace_rule() -> None:
    """P's load is its router's count (whole requests and the PD prompts it computes); a TPOT target does not shut
    P out under balance (that loop sent the rest through PD in earlier forms); decode_balance 0.5 halves P's share."""
    placer, prefill, decode, _ = _placer(decode_balance=1.0, tpot_budget_s=0.05, skip_prefill="auto")
    for _ in range(3):
        decode.take("d")
    prefill.take("p", tokens=500)
    prefill.take("p", tokens=500)  # two PD prompts being computed on P: it holds 2, +1 <= 3
    assert placer.place(PROMPT).kind == "prefill_alone"
    prefill.take("p", tokens=500)  # 3 + 1 > 3: D takes it whole
    assert placer.place(PROMPT).kind == "skip_prefill"
    prefill.release("p", tokens=500)
    placer.costs.token_gap("p", 0.5)  # P's streams far slower than the target: still its turn by count
    placer.costs.token_gap("d", 0.5)
    assert placer.place(PROMPT).kind == "prefill_alone"
    placer2, prefill2, decode2, _ = _placer(decode_balance=0.5, skip_prefill="auto")
    for _ in range(4):
        decode2.take("d")
    assert placer2.place(PROMPT).kind == "prefill_alone"  # 0 + 1 <= 0.5 x 4
    prefill2.take("p", tokens=8)
    assert placer2.place(PROMPT).kind == "prefill_alone"  # 1 + 1 <= 2
    prefill2.take("p", tokens=8)
    assert placer2.place(PROMPT).kind == "skip_prefill"  # 2 + 1 > 2


def test_balance_when_one_side_is_full_and_when_off() -> None:
    """D at its cap: P takes it whole even when it holds more; both full: D (it queues there, as on a colocated
    replica); P unable to take whole requests (cap 0): D; balance off: PD (the cost model) throughout."""
    placer, prefill, decode, membership = _placer(decode_balance=1.0, skip_prefill="auto")
    membership.capacity.update({"d": 2, "p": 3})
    decode.take("d")
    decode.take("d")  # D full
    for _ in range(3):
        p = placer.place(PROMPT)
        assert p.kind == "prefill_alone"
        prefill.take("p", tokens=8)
        placer.whole_started("p")
    assert placer.place(PROMPT).kind == "skip_prefill"  # both full
    membership.capacity["p"] = 0
    decode.release("d")
    assert placer.place(PROMPT).kind == "skip_prefill"
    off, _, off_decode, _ = _placer(decode_balance=0.0, skip_prefill="auto")
    kinds = []
    for _ in range(4):
        kinds.append(off.place(PROMPT).kind)
        off_decode.take("d")
    assert kinds == ["pd"] * 4  # D holds 4 of 10: not saturated, and by cost P's prefill is the faster


def test_never_and_always() -> None:
    placer, _, decode, _ = _placer(prefill_decode="never")
    for _ in range(10):
        decode.take("d")
    assert placer.place(PROMPT).kind == "pd"
    placer, _, _, membership = _placer(prefill_decode="always")
    membership.capacity.clear()
    assert placer.place(PROMPT).kind == "prefill_alone"  # the worker's own cap decides (it refuses beyond)


# -- through the proxy (fake workers) ----------------------------------------------------------------------------


def _stack(**weights: object) -> LiveStack:
    # decode_saturation 0: the decode worker counts as saturated as soon as its capacity is known
    w = RoutingWeights(**{"skip_prefill": "never", "decode_saturation": 0.0, **weights})  # type: ignore[arg-type]
    s = LiveStack(
        n_prefill=1, n_decode=1, model_name=MODEL, routing="adaptive", routing_weights=w, health_interval_s=0.1
    )
    s.prefill[0].max_generate = 2
    s.decode[0].max_generate = 8
    return s


def _ready(s: LiveStack) -> None:
    def known() -> bool:
        w = {x["address"]: x for x in s.http.get("/v1/cluster").json()["workers"]}
        return w[s.prefill[0].address].get("whole_capacity") == 2

    wait_for("the workers' capacities", known, timeout=10, interval=0.05)


def _complete(s: LiveStack, prompt: list[int], **extra: object) -> dict:
    r = s.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True, **extra}
    )
    assert r.status_code == 200, r.text
    return r.json()


def _paths(s: LiveStack) -> dict[str, float]:
    out = {}
    for line in s.http.get("/metrics").text.splitlines():
        if line.startswith("hybridpd_proxy_route_decisions_total{"):
            out[line.split('path="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_whole_request_on_the_prefill_worker_and_back_to_decode_when_it_refuses() -> None:
    with _stack() as s:
        _ready(s)
        p, d = s.prefill[0], s.decode[0]
        got = _complete(s, [3, 1, 4, 1, 5])
        assert got["choices"][0]["token_ids"] == [5, 1, 4, 1, 3]  # the fake rule (reversed prompt)
        assert len(p.whole.generates) == 1 and not p.whole.generates[0].HasField("params")
        assert not p.prefills and not d.generates
        assert _paths(s) == {"prefill_alone": 1.0}
        cluster = s.http.get("/v1/cluster").json()
        assert cluster["placements"]["prefill_alone"] == 1
        assert {w["address"]: w.get("whole_requests") for w in cluster["workers"]}[p.address] == 0  # ended
        p.whole.failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "at its cap")  # refused before any chunk
        got = _complete(s, [3, 1, 4, 1, 5])
        assert got["choices"][0]["token_ids"] == [5, 1, 4, 1, 3]
        assert len(d.generates) == 1 and not d.generates[0].HasField("params")  # D computed it whole
        assert _paths(s) == {"prefill_alone": 1.0, "skip_prefill": 1.0}


def test_the_prefill_worker_dying_mid_stream_resumes_on_a_decode_worker() -> None:
    """A prefill worker running a whole request dies after two tokens: the decode worker resumes it after them
    (sent the tokens and text the client has), streamed or not; every token once, the output whole."""
    with _stack() as s:
        _ready(s)
        s.prefill[0].whole.failure = Failure(grpc.StatusCode.UNAVAILABLE, "worker died", after_tokens=2)
        r = s.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": [9, 8, 7, 6, 5], "max_tokens": 5, "ignore_eos": True}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [5, 6, 7, 8, 9]
        with s.http.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": [9, 8, 7, 6, 5], "max_tokens": 5, "ignore_eos": True, "stream": True},
        ) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        bodies = [json.loads(e) for e in events[:-1]]
        assert not any("error" in b for b in bodies)
        assert "".join(b["choices"][0]["text"] for b in bodies) == " 5 6 7 8 9"
        resumed = s.decode[0].generates
        assert len(resumed) == 2 and all(
            list(g.resume.token_ids) == [6] and g.first_token.token_id == 5 for g in resumed
        )


def test_drained_prefill_worker_finishes_its_whole_requests_and_gets_no_new_one() -> None:
    with _stack(skip_prefill="auto") as s:
        _ready(s)
        p = s.prefill[0]
        p.whole.token_delay_s = 0.05
        with s.http.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True, "stream": True},
        ) as r:
            time.sleep(0.1)
            assert s.http.post("/v1/cluster/drain", json={"address": p.address}).status_code == 200
            body = "".join(r.iter_text())
        assert body.rstrip().endswith("[DONE]") and '"finish_reason":"length"' in body.replace(" ", "")
        _complete(s, [4, 5, 6])  # P drained: D prefills it itself (skip-P), saturated or not
        assert len(p.whole.generates) == 1 and len(s.decode[0].generates) == 1
        health = s.http.get("/health").json()
        assert health["ready"]["prefill"] == 1  # drained, not down: still healthy


@pytest.mark.parametrize("share", ["never", "auto"])
def test_unsaturated_decode_keeps_pd(share: str) -> None:
    with _stack(decode_saturation=0.9, prefill_decode=share) as s:
        _ready(s)
        _complete(s, [3, 1, 4])
        assert not s.prefill[0].whole.generates and len(s.decode[0].generates) == 1
        assert _paths(s) == {"pd": 1.0}


def test_concurrent_decode_heavy_streams_are_shared_with_the_prefill_worker() -> None:
    """Balance through the real proxy: D is far from saturated (4 of 8), yet with streams already running on it the
    next ones go whole to P, and every answer is right."""
    with _stack(decode_saturation=0.9, decode_balance=1.0) as s:
        _ready(s)
        p, d = s.prefill[0], s.decode[0]
        d.token_delay_s = p.whole.token_delay_s = 0.05
        prompts = [[3, 1, 4, i] for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            futures = []
            for prompt in prompts:  # one at a time into flight: each placement sees the streams before it
                futures.append(pool.submit(_complete, s, prompt, max_tokens=8))
                wait_for(
                    "the stream to start",
                    lambda: len(p.prefills) + len(p.whole.generates) >= len(futures),
                    timeout=10,
                    interval=0.01,
                )
            got = [f.result()["choices"][0]["token_ids"] for f in futures]
        assert got == [list(reversed(x)) * 2 for x in prompts]  # the fake rule (cycled: ignore_eos)
        assert len(p.whole.generates) == 2 and len(d.generates) == 2  # PD, P-alone, PD, P-alone
        assert _paths(s) == {"pd": 2.0, "prefill_alone": 2.0}


def _counts(s: LiveStack) -> tuple[dict[str, int], dict[str, int], dict[str, int], int, int]:
    """What the proxy holds against its workers: whole requests on P, each router's in-flight requests, P's queued
    prompt tokens, P's and D's slots for the fake pair."""
    cluster = s.app.state.proxy.cluster
    p, d = s.prefill[0].address, s.decode[0].address

    async def read() -> tuple[dict[str, int], dict[str, int], dict[str, int], int, int]:
        return (
            dict(cluster.placer.whole_on_prefill),
            cluster.prefill.snapshot(),
            cluster.decode.snapshot(),
            cluster.prefill.tokens_in_flight(p),
            cluster.decode.tokens_in_flight(d),
        )

    return s.run(read())


def _settled(s: LiveStack) -> bool:
    whole, p_in, d_in, p_tokens, d_tokens = _counts(s)
    return not whole and not any(p_in.values()) and not any(d_in.values()) and p_tokens == d_tokens == 0


def test_no_count_leaks_on_the_error_and_cancel_paths() -> None:
    """A client gone before P's first chunk, P refusing then D failing, P failing mid-stream, a client gone
    mid-stream: afterwards the proxy counts nothing on either worker (P does not look full, D not saturated)."""
    with _stack() as s:
        _ready(s)
        p, d = s.prefill[0], s.decode[0]
        body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 6, "ignore_eos": True, "stream": True}
        p.whole.token_delay_s = 0.3  # the client gives up before P's first chunk
        with pytest.raises(httpx.ReadTimeout):
            s.http.post("/v1/completions", json=body, timeout=0.1)
        wait_for("P's whole request cancelled", lambda: len(p.whole.cancelled) == 1, timeout=5, interval=0.02)
        wait_for("nothing counted", lambda: _settled(s), timeout=5, interval=0.02)
        p.whole.token_delay_s = 0.0
        p.whole.failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "at its cap")  # refused: D, which fails
        d.failure = Failure(grpc.StatusCode.INTERNAL, "boom")
        r = s.http.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code >= 500 and len(d.generates) == 1
        assert _settled(s)
        d.failure = None
        p.whole.failure = Failure(grpc.StatusCode.UNAVAILABLE, "died", after_tokens=2)  # fails after streaming
        r = s.http.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 200 and len(d.generates) == 2  # resumed on D
        assert _settled(s)
        p.whole.failure = None
        p.whole.token_delay_s = 0.05  # the client goes away mid-stream
        with s.http.stream("POST", "/v1/completions", json=body) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data: "))
        wait_for("P's stream cancelled", lambda: len(p.whole.cancelled) == 2, timeout=5, interval=0.02)
        wait_for("nothing counted", lambda: _settled(s), timeout=5, interval=0.02)
        assert _paths(s)["prefill_alone"] >= 1
