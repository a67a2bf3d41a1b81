"""A decode worker lost or frozen mid-stream: is the client's stream still exact, and how long does it pause?

    python benchmarks/decode_failover.py --out failover_cpu.json [--device cuda --dtype float32] [--after 32,256]

Starts 1 prefill + 2 decode workers and the proxy (plain processes, real gRPC + NIXL; a killed worker is restarted
by its supervisor and waited for), then for greedy and seeded sampling streams one request undisturbed and, for
each K in --after, once with its decode worker SIGKILLed (lost) and once SIGSTOPped (frozen: given up after
--inter-token-timeout) after K streamed tokens. Each faulted stream is compared with the undisturbed one (token ids
and text, each token once) and timed: the longest pause between two chunks the client saw (the failover: the
next decode worker recomputes prompt + K tokens, plus the timeout for a frozen one) and the whole request. Prints a
table and writes JSON. Identical is the bar in float32; in bfloat16 a recompute may round differently.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 7}}


def _stream(url: str, body: dict[str, Any], after: int, fault: Any) -> dict[str, Any]:
    """Stream `body`; `fault()` once `after` tokens came. Token ids, text, error events, longest gap, seconds."""
    tokens: list[int] = []
    text, errors, gap, faulted = "", [], 0.0, False
    t0 = last = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
            obj = json.loads(line[len("data: ") :])
            if "error" in obj:
                errors.append(obj["error"]["message"])
            for c in obj.get("choices", []):
                tokens += c["token_ids"]
                text += c["text"]
            if fault is not None and not faulted and len(tokens) >= after:
                faulted = True
                fault()
                last = time.perf_counter()
    return {"tokens": tokens, "text": text, "errors": errors, "max_gap_s": gap, "seconds": time.perf_counter() - t0}


def _busy_decode(c: Any) -> Any:
    for w in httpx.get(f"{c.url}/v1/cluster", timeout=10).json()["workers"]:
        if w["role"] == "decode" and w.get("in_flight"):
            return next(d for d in c.decode if d.info["address"] == w["address"])
    raise RuntimeError("no decode worker has the request in flight")


def _all_up(c: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = httpx.get(f"{c.url}/v1/cluster", timeout=10).json()["workers"]
        if all(w.get("reachable") and (w.get("membership") or {}).get("state") == "up" for w in workers):
            return
        time.sleep(0.2)
    raise RuntimeError("a worker did not come back")


def _failovers(c: Any) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{c.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("hybridpd_proxy_decode_failovers_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("hybridpd_proxy_decode_failovers_total") :]] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random NemotronH)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--after", default="32,256", help="streamed tokens before the fault, comma-separated")
    ap.add_argument("--inter-token-timeout", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from hybridpd.deploy.local_cluster import start_cluster
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    from tests.oracle import random_prompts

    model = args.model or str(write_random_checkpoint(tempfile.mkdtemp(), "nemotron_h", seed=0))
    c = start_cluster(
        model,
        num_decode=2,
        proxy_args=["--inter-token-timeout", str(args.inter_token_timeout)],
        worker_args=["--device", args.device, "--dtype", args.dtype, "--kv-cache-memory-bytes", str(1 << 30)],
    )
    prompt = random_prompts([args.prompt_tokens], vocab=256, seed=3)[0]
    rows = []
    try:
        for mode, sampling in MODES.items():
            body = {
                "model": c.model_name,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                **sampling,
            }
            want = _stream(c.url, body, 0, None)
            rows.append(
                {
                    "mode": mode,
                    "fault": "none",
                    "after": 0,
                    "identical": True,
                    "errors": [],
                    "max_gap_ms": 1e3 * want["max_gap_s"],
                    "seconds": want["seconds"],
                }
            )
            for after in (int(x) for x in args.after.split(",")):
                for fault, sig in (("lost", signal.SIGKILL), ("frozen", signal.SIGSTOP)):
                    hit: list[Any] = []

                    def inject(sig: signal.Signals = sig, hit: list[Any] = hit) -> None:
                        hit.append(_busy_decode(c))
                        os.kill(hit[0].proc.pid, sig)

                    got = _stream(c.url, body, after, inject)
                    if sig == signal.SIGSTOP and hit:
                        os.kill(hit[0].proc.pid, signal.SIGCONT)
                    _all_up(c)
                    rows.append(
                        {
                            "mode": mode,
                            "fault": fault,
                            "after": after,
                            "errors": got["errors"],
                            "identical": (got["tokens"], got["text"]) == (want["tokens"], want["text"]),
                            "max_gap_ms": 1e3 * got["max_gap_s"],
                            "seconds": got["seconds"],
                        }
                    )
        result = {
            "device": args.device,
            "dtype": args.dtype,
            "date": time.strftime("%Y-%m-%d"),
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "inter_token_timeout_s": args.inter_token_timeout,
            "failovers": _failovers(c),
            "rows": rows,
        }
    finally:
        c.stop()
    print(f"{'mode':>7} {'fault':>7} {'after':>6} {'identical':>9} {'max gap ms':>11} {'request s':>10}  errors")
    for r in rows:
        print(
            f"{r['mode']:>7} {r['fault']:>7} {r['after']:>6} {r['identical']!s:>9} {r['max_gap_ms']:>11.1f} "
            f"{r['seconds']:>10.2f}  {'; '.join(r['errors'])}"
        )
    print("failovers:", result["failovers"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["identical"] and not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
