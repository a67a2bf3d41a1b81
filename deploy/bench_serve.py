"""`hybridpd bench serve`: a load generator against the proxy's OpenAI API (httpx async; no torch).

    python -m hybridpd.deploy.bench_serve --base-url http://127.0.0.1:8000 --dataset random \
        --random-input-len 512 --random-output-len 64 --num-prompts 200 --max-concurrency 16 --out run.json
    python -m hybridpd.deploy.bench_serve --dataset prefix-repetition --prefix-len 1024 --suffix-len 64 \
        --num-prefixes 4 --num-prompts 100 --request-rate 8

Datasets (prompts are token ids on /v1/completions, so lengths are exact; on /v1/chat/completions they are text
of random lowercase words, `len` characters, which is `len` tokens only for a byte-level tokenizer):
  random             input ~ U[L(1-r), L(1+r)] tokens, output ~ U[O(1-r), O(1+r)] tokens (r = --random-range-ratio)
  prefix-repetition  --num-prefixes random prefixes of --prefix-len tokens, each followed by a fresh random suffix
                     of --suffix-len tokens; requests spread evenly over the prefixes, then shuffled
Arrivals: --request-rate R (Poisson, R req/s; default inf = all at once), capped by --max-concurrency.
Reports TTFT, TPOT (per output token after the first), ITL (between streamed chunks) and E2E latency (mean, p50,
p90, p99, ms), request and token throughput, and prefix-cache hit rates: from usage (decode's cached_tokens and
the prefill worker's own hit, `usage.hybridpd.prefill_cached_tokens`) and, when `/v1/cluster` lists worker
metrics URLs that answer, from the workers' `hybridpd_prefix_cache_{queries,hits}_total` counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import string
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

CACHE_COUNTERS = ("hybridpd_prefix_cache_queries_total", "hybridpd_prefix_cache_hits_total",
                  "hybridpd_external_prefix_cache_queries_total", "hybridpd_external_prefix_cache_hits_total")


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int] | str
    prompt_len: int
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    prefill_cached_tokens: int = 0
    transferred_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


# -- datasets ----------------------------------------------------------------------------------------------------


def _random_prompt(rng: random.Random, n: int, vocab: int, text: bool) -> list[int] | str:
    if text:
        chars = [rng.choice(string.ascii_lowercase) if i % 6 else " " for i in range(1, n + 1)]
        return "".join(chars)
    return [rng.randrange(vocab) for _ in range(n)]


def _around(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def build_random(args: argparse.Namespace, rng: random.Random, vocab: int, text: bool) -> list[RequestSpec]:
    specs = []
    for _ in range(args.num_prompts):
        n = _around(rng, args.random_input_len, args.random_range_ratio)
        specs.append(RequestSpec(_random_prompt(rng, n, vocab, text), n,
                                 _around(rng, args.random_output_len, args.random_range_ratio)))
    return specs


def build_prefix_repetition(args: argparse.Namespace, rng: random.Random, vocab: int,
                            text: bool) -> list[RequestSpec]:
    prefixes = [_random_prompt(rng, args.prefix_len, vocab, text) for _ in range(args.num_prefixes)]
    specs = []
    for i in range(args.num_prompts):
        prefix, suffix = prefixes[i % len(prefixes)], _random_prompt(rng, args.suffix_len, vocab, text)
        prompt: list[int] | str = prefix + suffix  # type: ignore[operator]
        specs.append(RequestSpec(prompt, args.prefix_len + args.suffix_len, args.output_len))
    rng.shuffle(specs)
    return specs


# -- one request -------------------------------------------------------------------------------------------------


def _payload(args: argparse.Namespace, model: str, spec: RequestSpec) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "temperature": args.temperature,
                            "ignore_eos": args.ignore_eos, "stream": args.stream}
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


def _absorb_usage(res: RequestResult, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    res.prompt_tokens = int(usage.get("prompt_tokens", 0))
    res.output_tokens = int(usage.get("completion_tokens", 0))
    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
    res.prefill_cached_tokens = int((usage.get("hybridpd") or {}).get("prefill_cached_tokens", 0) or 0)
    res.transferred_tokens = int((usage.get("hybridpd") or {}).get("transferred_tokens", 0) or 0)


def _is_token_chunk(event: dict[str, Any]) -> bool:
    """A streamed chunk that carries output (the chat role-only first chunk and the usage chunk do not)."""
    choices = event.get("choices") or []
    if not choices:
        return False
    delta = choices[0].get("delta")
    if delta is not None and delta.get("role") and not delta.get("content"):
        return False
    return True


async def send_one(client: httpx.AsyncClient, args: argparse.Namespace, model: str,
                   spec: RequestSpec) -> RequestResult:
    path, body = _payload(args, model, spec)
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    try:
        if not args.stream:
            r = await client.post(path, json=body)
            res.e2e = time.perf_counter() - t0
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            _absorb_usage(res, r.json().get("usage"))
            res.ok = True
            return res
        last = t0
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    res.error = str(event["error"].get("message"))
                    return res
                now = time.perf_counter()
                if _is_token_chunk(event):
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                _absorb_usage(res, event.get("usage"))
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


# -- load and report ---------------------------------------------------------------------------------------------


async def run_load(client: httpx.AsyncClient, args: argparse.Namespace, model: str,
                   specs: Sequence[RequestSpec]) -> tuple[list[RequestResult], float]:
    """Launch `specs` with Poisson arrivals (or all at once), at most `max_concurrency` in flight."""
    sem = asyncio.Semaphore(args.max_concurrency or len(specs) or 1)
    rng = random.Random(args.seed + 1)

    bar = _progress(len(specs), getattr(args, "quiet", False))

    async def limited(spec: RequestSpec) -> RequestResult:
        async with sem:
            result = await send_one(client, args, model, spec)
        bar.update(1)
        return result

    t0 = time.perf_counter()
    tasks = []
    for spec in specs:
        tasks.append(asyncio.create_task(limited(spec)))
        if math.isfinite(args.request_rate) and args.request_rate > 0:
            await asyncio.sleep(rng.expovariate(args.request_rate))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        bar.close()
    return list(results), time.perf_counter() - t0


def _progress(total: int, quiet: bool) -> Any:
    """A tqdm progress bar on stderr (disabled with --quiet or when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=quiet or not sys.stderr.isatty(), file=sys.stderr)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 in milliseconds (linear interpolation); NaN when empty."""
    if not values:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
    xs = sorted(values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": 1e3 * sum(xs) / len(xs), "p50": 1e3 * q(0.5), "p90": 1e3 * q(0.9), "p99": 1e3 * q(0.99)}


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        "total_prompt_tokens": prompt, "total_output_tokens": output,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "usage_cached_token_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "usage_prefill_cached_token_rate": sum(r.prefill_cached_tokens for r in ok) / prompt if prompt else 0.0,
        "usage_transferred_token_rate": sum(r.transferred_tokens for r in ok) / prompt if prompt else 0.0,
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def parse_counters(text: str) -> dict[str, float]:
    """Sum of each CACHE_COUNTERS family over all label sets, from Prometheus text format."""
    out = dict.fromkeys(CACHE_COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[-1])
    return out


async def scrape_workers(client: httpx.AsyncClient) -> dict[str, dict[str, float]]:
    """Per role, summed cache counters of every worker whose metrics URL answers. Empty when none is reachable."""
    try:
        workers = (await client.get("/v1/cluster", timeout=5.0)).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return {}
    per_role: dict[str, dict[str, float]] = {}
    for w in workers:
        url = w.get("metrics_url")
        if not url:
            continue
        try:
            r = await client.get(url, timeout=5.0)
        except httpx.HTTPError:
            continue
        if r.status_code != 200:
            continue
        role = per_role.setdefault(w["role"], dict.fromkeys(CACHE_COUNTERS, 0.0))
        for k, v in parse_counters(r.text).items():
            role[k] += v
    return per_role


def cache_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role, counters in after.items():
        d = {k: v - before.get(role, {}).get(k, 0.0) for k, v in counters.items()}
        q, h = d["hybridpd_prefix_cache_queries_total"], d["hybridpd_prefix_cache_hits_total"]
        eq, eh = d["hybridpd_external_prefix_cache_queries_total"], d["hybridpd_external_prefix_cache_hits_total"]
        out[role] = {"queries": q, "hits": h, "hit_rate": h / q if q else None,
                     "external_queries": eq, "external_hits": eh, "external_hit_rate": eh / eq if eq else None}
    return out


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> None (strict JSON), recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def print_report(summary: dict[str, Any], workers: dict[str, Any]) -> None:
    print(f"{'completed / failed':<38}{summary['completed']} / {summary['failed']}")
    print(f"{'duration (s)':<38}{summary['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<38}{summary['request_throughput']:.2f}")
    print(f"{'output throughput (tok/s)':<38}{summary['output_throughput']:.1f}")
    print(f"{'total token throughput (tok/s)':<38}{summary['total_token_throughput']:.1f}")
    print(f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        print(f"{key[:-3].upper():<12}{s['mean']:>10.2f}{s['p50']:>10.2f}{s['p90']:>10.2f}{s['p99']:>10.2f}")
    print(f"{'cached prompt (usage cached_tokens)':<38}{100 * summary['usage_cached_token_rate']:.1f}%")
    print(f"{'pulled from prefill (usage)':<38}{100 * summary['usage_transferred_token_rate']:.1f}%")
    print(f"{'prefix hit (prefill, usage)':<38}{100 * summary['usage_prefill_cached_token_rate']:.1f}%")
    for role, c in workers.items():
        rate = "n/a" if c["hit_rate"] is None else f"{100 * c['hit_rate']:.1f}%"
        print(f"{'prefix hit (' + role + ' metrics)':<38}{rate}  ({c['hits']:.0f} / {c['queries']:.0f} tokens)")
    for err in summary["errors"]:
        print(f"error: {err}", file=sys.stderr)


# -- entry point -------------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    from hybridpd.deploy.cli_parser import SuggestingParser

    p = SuggestingParser(prog="hybridpd bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the proxy's URL")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="which OpenAI endpoint the requests go to")
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: env HYBRIDPD_API_KEY)")
    p.add_argument("--dataset", choices=["random", "prefix-repetition"], default="random",
                   help="random token prompts, or a few shared prefixes with unique suffixes")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--random-input-len", type=int, default=256, help="random: prompt tokens")
    p.add_argument("--random-output-len", type=int, default=64, help="random: output tokens")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn from [len * (1 - r), len * (1 + r)]")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="prefix-repetition: unique suffix tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes")
    p.add_argument("--output-len", type=int, default=32, help="prefix-repetition output tokens")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn from [0, V); default: "
                   "/v1/models vocab_size, else 256")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (none: no limit)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested tokens (--no-ignore-eos: let EOS end requests early)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream responses (TTFT and ITL need it)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt and length draws")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--per-request", action="store_true", help="include every request's record in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar (the summary table is still printed)")
    return p


async def _amain(args: argparse.Namespace) -> int:
    args.api_key = args.api_key or os.environ.get("HYBRIDPD_API_KEY")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        card = (await client.get("/v1/models")).raise_for_status().json()["data"][0]
        model = args.model or card["id"]
        vocab = args.vocab_size or int(card.get("vocab_size") or 256)
        rng = random.Random(args.seed)
        text = args.endpoint == "chat"
        build = build_random if args.dataset == "random" else build_prefix_repetition
        specs = build(args, rng, vocab, text)
        before = await scrape_workers(client)
        results, duration = await run_load(client, args, model, specs)
        after = await scrape_workers(client)
    summary = summarize(results, duration)
    workers = cache_deltas(before, after)
    print_report(summary, workers)
    if args.out:
        cfg = {k: v for k, v in vars(args).items() if k != "api_key"}
        doc: dict[str, Any] = {"config": cfg, "model": model, "summary": summary, "worker_prefix_cache": workers}
        if args.per_request:
            doc["requests"] = [asdict(r) for r in results]
        with open(args.out, "w") as f:
            json.dump(_json_safe(doc), f, indent=2, allow_nan=False)
    return 0 if summary["failed"] == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry (`hybridpd bench serve ARGS`): run the benchmark; exit status 1 if any request failed."""
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be >= 1")
    for name in ("httpx", "httpcore"):  # one INFO line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return asyncio.run(_amain(args))
    except (httpx.ConnectError, httpx.HTTPStatusError) as e:
        print(f"hybridpd bench serve: error: cannot reach the server at {args.base_url}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
