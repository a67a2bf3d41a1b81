"""`deploy/bench_serve.py` against the proxy with FAKE workers (tests.support.fake_workers): it runs, reports, writes
JSON, and reads prefix-cache hit rates from usage and from worker counters."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hybridpd.deploy import bench_serve
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.support.fake_workers import write_fake_tokenizer
from tests.support.live_stack import LiveStack

MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path_factory.mktemp("tok")))
    with LiveStack(tokenizer=tok, model_name=MODEL, max_model_len=256) as s:
        yield s


def test_random_stream(stack: LiveStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    rc = bench_serve.main(["--base-url", stack.url, "--dataset", "random", "--num-prompts", "12",
                           "--random-input-len", "10", "--random-output-len", "5", "--max-concurrency", "4",
                           "--request-rate", "200", "--out", str(out), "--per-request"])
    assert rc == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_prompt_tokens"] == 120 and s["total_output_tokens"] == 60
    assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["mean"] >= 0 and s["tpot_ms"]["p99"] >= 0
    assert s["usage_transferred_token_rate"] == pytest.approx(1.0)  # fake D: all N prompt tokens pulled from P
    assert s["usage_cached_token_rate"] == s["usage_prefill_cached_token_rate"]  # a pull is not a cache hit
    assert len(doc["requests"]) == 12 and all(len(r["itl"]) == 4 for r in doc["requests"])
    assert doc["worker_prefix_cache"] == {}  # the fakes' metrics ports do not answer
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "request throughput" in printed


def test_prefix_repetition_chat_no_stream(stack: LiveStack) -> None:
    # fake P's hit: longest shared prefix with an earlier prompt, in whole 4-token blocks
    args = bench_serve.build_parser().parse_args(
        ["--base-url", stack.url, "--dataset", "prefix-repetition", "--prefix-len", "16", "--suffix-len", "4",
         "--num-prefixes", "2", "--num-prompts", "8", "--output-len", "3", "--no-stream"])

    async def go() -> dict[str, object]:
        async with httpx.AsyncClient(base_url=stack.url) as client:
            specs = bench_serve.build_prefix_repetition(args, random.Random(0), 256, text=False)
            results, duration = await bench_serve.run_load(client, args, MODEL, specs)
        return bench_serve.summarize(results, duration)

    summary = asyncio.run(go())
    assert summary["completed"] == 8
    assert summary["usage_prefill_cached_token_rate"] == pytest.approx(6 * 16 / (8 * 20))
    rc = bench_serve.main(["--base-url", stack.url, "--endpoint", "chat", "--dataset", "prefix-repetition",
                           "--prefix-len", "12", "--suffix-len", "4", "--num-prompts", "4", "--output-len", "2"])
    assert rc == 0


def test_worker_counter_parsing() -> None:
    text = "\n".join([
        "# TYPE hybridpd_prefix_cache_queries_total counter",
        'hybridpd_prefix_cache_queries_total{role="decode",group="attention"} 100.0',
        'hybridpd_prefix_cache_queries_total{role="decode",group="mamba2"} 50.0',
        'hybridpd_prefix_cache_hits_total{role="decode",group="attention"} 30.0',
        "hybridpd_prefix_cache_hits_created 1.7e9",
    ])
    c = bench_serve.parse_counters(text)
    assert c["hybridpd_prefix_cache_queries_total"] == 150 and c["hybridpd_prefix_cache_hits_total"] == 30
    before = {"decode": dict.fromkeys(bench_serve.CACHE_COUNTERS, 0.0)}
    d = bench_serve.cache_deltas(before, {"decode": c})["decode"]
    assert d["hit_rate"] == pytest.approx(0.2) and d["external_hit_rate"] is None


def test_failures_exit_nonzero(stack: LiveStack) -> None:
    rc = bench_serve.main(["--base-url", stack.url, "--num-prompts", "2", "--random-input-len", "300",
                           "--random-output-len", "4"])
    assert rc == 1  # prompts longer than max_model_len: every request is a 400
