"""Failing closed, proxy side, against FAKE workers: request deadlines (504 / error event + [DONE]), D-side aborts,
RESOURCE_EXHAUSTED retried then shed, /health from a cache (fast while a worker stalls, details behind the API key),
Connection: close after a 5xx, the cluster token on worker calls, and where the secrets come from."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest
from hybridpd.proxy.credentials import resolve_api_key, resolve_cluster_token

from tests.support.fake_workers import Failure
from tests.support.live_stack import LiveStack

LONG = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True}


def metric(stack: LiveStack, status: str) -> float:
    line = next(x for x in stack.http.get("/metrics").text.splitlines()
                if x.startswith(f'hybridpd_requests_total{{status="{status}"'))
    return float(line.split()[-1])


def test_deadline_is_504_or_error_event_then_done() -> None:
    with LiveStack(token_delay_s=0.3, request_timeout_s=0.6) as s:
        errors = metric(s, "error")
        t0 = time.monotonic()
        r = s.http.post("/v1/completions", json=LONG)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout" and time.monotonic() - t0 < 3
        assert r.headers["connection"] == "close"
        r = s.http.post("/v1/completions", json={**LONG, "stream": True})
        assert r.status_code == 200
        blocks = [b for b in r.text.split("\n\n") if b]
        assert blocks[-1] == "data: [DONE]"
        assert json.loads(blocks[-2][len("data: "):])["error"]["code"] == "timeout"
        assert metric(s, "error") == errors + 2
        s.prefill[0].delay_s = 1.0  # the deadline also bounds Prefill
        r = s.http.post("/v1/completions", json=LONG)
        assert r.status_code == 504 and "prefill" in r.json()["error"]["message"]


def test_decode_abort_ends_the_stream_with_an_error() -> None:
    with LiveStack(token_delay_s=0.05) as s:
        async def abort_when_running() -> None:
            while not s.decode[0].running:
                await asyncio.sleep(0.01)
            s.decode[0]._abort_requested.update(s.decode[0].running)  # D aborts it (not the client)

        aborter = threading.Thread(target=s.run, args=(abort_when_running(),))
        aborter.start()
        r = s.http.post("/v1/completions", json={**LONG, "stream": True})
        aborter.join()
        blocks = [b for b in r.text.split("\n\n") if b]
        assert blocks[-1] == "data: [DONE]" and json.loads(blocks[-2][6:])["error"]["code"] == "aborted"


def test_resource_exhausted_retries_another_prefill_then_sheds() -> None:
    with LiveStack(n_prefill=2) as s:
        s.prefill[0].failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many leases")
        for _ in range(2):  # whichever worker round robin picks first, the request lands on prefill 1
            assert s.http.post("/v1/completions", json=LONG).status_code == 200
        assert len(s.prefill[1].prefills) == 2
        s.prefill[1].failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many leases")
        r = s.http.post("/v1/completions", json=LONG)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"


def test_unreachable_prefill_worker_is_skipped_for_a_live_one() -> None:
    with LiveStack(n_prefill=1, prefill_addrs_extra=["127.0.0.1:1"]) as s:
        for _ in range(3):  # round robin puts the dead worker first for some of these
            assert s.http.post("/v1/completions", json=LONG).status_code == 200
        assert len(s.prefill[0].prefills) == 3


def test_health_is_cached_fast_and_details_need_the_key() -> None:
    with LiveStack(api_key="k", health_interval_s=0.2) as s:
        s.prefill[0].health_delay_s = 3.0  # a stalled worker
        time.sleep(0.5)
        worst = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            h = s.http.get("/health")
            worst = max(worst, time.perf_counter() - t0)
        assert worst < 0.5, worst  # cached: far below the stalled worker's 3 s (0.05 failed on a loaded 2-core box)
        assert "workers" not in h.json() and set(h.json()["ready"]) == {"prefill", "decode"}
        detailed = s.http.get("/health", headers={"Authorization": "Bearer k"}).json()
        assert {w["address"] for w in detailed["workers"]} == {s.prefill[0].address, s.decode[0].address}


def test_cluster_token_on_every_call_and_none_without() -> None:
    with LiveStack(cluster_token="sesame") as s:
        assert s.http.post("/v1/completions", json=LONG).status_code == 200
        assert s.prefill[0].tokens[-1] == "sesame" and s.decode[0].tokens[-1] == "sesame"
    with LiveStack(cluster_token=None) as s:
        assert s.http.post("/v1/completions", json=LONG).status_code == 200
        assert s.decode[0].tokens[-1] is None


def test_secrets_from_file_env_then_flag(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("HYBRIDPD_API_KEY", raising=False)
    monkeypatch.delenv("HYBRIDPD_API_KEY_FILE", raising=False)
    monkeypatch.delenv("HYBRIDPD_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("HYBRIDPD_CLUSTER_TOKEN_FILE", raising=False)
    assert resolve_api_key(None, None) is None and resolve_cluster_token(None) is None
    assert resolve_api_key(None, "flag") == "flag"
    monkeypatch.setenv("HYBRIDPD_API_KEY", "env")
    assert resolve_api_key(None, "flag") == "env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert resolve_api_key(str(f), "flag") == "from-file"
    monkeypatch.setenv("HYBRIDPD_CLUSTER_TOKEN", "tok")
    assert resolve_cluster_token(None) == "tok"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_cluster_token(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_key(str(tmp_path / "missing"))
