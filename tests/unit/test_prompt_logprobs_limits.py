"""Prompt logprobs too large for one worker message: the scores of a prompt ride on one GenerateChunk (P's first
chunk under PD, the Generate worker's first otherwise), and the proxy's channels take messages of at most 64 MiB
(about 414k prompt tokens at prompt_logprobs 20: 162 bytes a token). Over that the answer cannot arrive; the
request must be a clear 400 before any worker computes it, not a worker error or an 'at capacity' 503 with
Retry-After (under PD every prefill worker was tried, each prefilling and scoring the whole prompt and keeping its
lease until it expired). The limit is lowered here so that a short prompt is over it."""

from __future__ import annotations

import pytest
from hybridpd.proxy import workers

from tests.support.live_stack import LiveStack

MODEL = "m"
LIMIT = 256 * 1024


@pytest.mark.parametrize("n_prefill", [2, 0])
def test_prompt_logprobs_that_cannot_fit_one_message_are_a_400(monkeypatch: pytest.MonkeyPatch, n_prefill: int) -> None:
    opts = [(k, LIMIT if k.endswith("message_length") else v) for k, v in workers._CHANNEL_OPTIONS]
    monkeypatch.setattr(workers, "_CHANNEL_OPTIONS", opts)
    with LiveStack(n_prefill=n_prefill, model_name=MODEL, max_model_len=8192) as s:
        prompt = [1 + i % 200 for i in range(6000)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20}
        r = s.http.post("/v1/completions", json=body, timeout=20)
        assert r.status_code == 400, (r.text, [len(p.prefills) for p in s.prefill])
        assert r.json()["error"]["param"] == "prompt_logprobs"
        assert not any(p.prefills for p in s.prefill) and not any(d.generates for d in s.decode)
        ok = s.http.post("/v1/completions", json={**body, "prompt": prompt[:500]}, timeout=20)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["prompt_logprobs"]) == 500
