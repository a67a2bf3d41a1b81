"""The attacks of the admission suite against REAL engines: 1 prefill + 1 decode worker and the proxy as plain
processes (no Ray), the proxy with its admission flags; one table + JSON.

    python benchmarks/admission_attack.py --device cpu --out admission_cpu.json                 # tiny model
    python benchmarks/admission_attack.py --device cuda --dtype bfloat16 --size medium --gpus 0,0 \
        --out admission_gpu.json

Attacks (each `--seconds` long, attackers in their own processes from 127.0.0.2/3): two clients sending n=128
back to back; 100 abandoned n=4 streams; 256 prompts x `--long-prompt` tokens; 250 slowloris connections; 60,000
stop strings. Meanwhile a legitimate client (127.0.0.1) sends 8-token greedy requests one after another, checked
token for token against its answer when idle, and /health is probed every 20 ms. "Accepted beyond limits" counts
samples (every 20 ms) of the proxy's `hybridpd_admission_in_flight_sequences` above `--admission-max-seqs`;
"wrong 200s" counts attacker and legitimate choices that differ from their idle greedy answer (the list attacks
must all be 400s: their 200s, if any, show in `counts`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import httpx  # noqa: E402

from benchmarks.offline_throughput import PATTERN, SIZES  # noqa: E402
from tests.support.attack import LEGIT_MAX_TOKENS, LEGIT_PROMPT, AttackReport, Limits, Observer, flood  # noqa: E402
from tests.support.flood_client import abandon_streams  # noqa: E402


class _Target:
    def __init__(self, url: str) -> None:
        self.url = url
        self.decode: list[Any] = []


def _greedy(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def _proxy_ledger(url: str) -> Any:
    def sample() -> tuple[int, int]:
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("hybridpd_admission_in_flight_sequences "):
                return int(float(line.split()[1])), 0
        return 0, 0

    return sample


async def _slowloris(port: int, count: int, seconds: float) -> list[float]:
    async def one() -> float:
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\n")
            while time.perf_counter() - t0 < seconds:
                try:
                    if await asyncio.wait_for(reader.read(4096), 0.5) == b"":
                        return time.perf_counter() - t0
                except asyncio.TimeoutError:
                    writer.write(b"X")
        except (ConnectionError, OSError):
            return time.perf_counter() - t0
        finally:
            writer.transport.abort()
        return float("inf")

    return list(await asyncio.gather(*(one() for _ in range(count))))


def run_attacks(url: str, proxy_pid: int, args: argparse.Namespace) -> list[AttackReport]:
    limits = Limits(args.admission_max_seqs, int(args.admission_max_seqs * 0.5))
    port = int(url.rsplit(":", 1)[1])
    legit = _greedy(url, LEGIT_PROMPT, LEGIT_MAX_TOKENS)
    reports = []

    def observer() -> Observer:
        return Observer(_Target(url), limits, ledger=_proxy_ledger(url), expected=legit, pid=proxy_pid)

    big: dict[str, Any] = {"prompt": list(range(10, 42)), "max_tokens": 64, "n": 128, "temperature": 0,
                           "ignore_eos": True}
    want = _greedy(url, big["prompt"], 64)
    with observer() as obs:
        c = flood(url, "127.0.0.2", 2, big, args.seconds, expected=want)
    reports.append(obs.report("two clients of n=128 back to back", c["tried"], c["wrong_200s"], counts=c))

    stream = {"prompt": list(range(60, 92)), "max_tokens": 512, "n": 4, "ignore_eos": True, "stream": True}
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with observer() as obs:
        p = ctx.Process(target=abandon_streams, args=(port, "127.0.0.2", json.dumps(stream).encode(), 100, out))
        p.start()
        statuses, _ = out.get(timeout=300)
        p.join(10)
        time.sleep(args.seconds)
    reports.append(obs.report("100 abandoned n=4 streams", 100, 0, statuses=statuses))

    many = {"prompt": [[(i * 7 + j) % 200 + 1 for j in range(args.long_prompt)] for i in range(256)],
            "max_tokens": 4}
    with observer() as obs:
        c = flood(url, "127.0.0.3", 2, many, args.seconds, check=False)
    reports.append(obs.report(f"256 prompts x {args.long_prompt} tokens", c["tried"], 0, counts=c))

    with observer() as obs:
        drops = asyncio.run(_slowloris(port, 250, max(args.seconds, args.header_timeout + 5)))
    reports.append(obs.report("250 slowloris connections", 250, 0, drop_max_s=round(max(drops), 3)))

    stops = {"prompt": LEGIT_PROMPT, "max_tokens": 4, "stop": [f"s{i}" for i in range(60_000)]}
    with observer() as obs:
        c = flood(url, "127.0.0.3", 2, stops, args.seconds, check=False)
    reports.append(obs.report("60,000 stop strings", c["tried"], 0, counts=c))
    return reports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--family", default="nemotron_h")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--gpus", default="0,0", help="CUDA devices of prefill,decode")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="engine batch per worker")
    ap.add_argument("--admission-max-seqs", type=int, default=256)
    ap.add_argument("--header-timeout", type=float, default=5.0)
    ap.add_argument("--long-prompt", type=int, default=1000, help="tokens per prompt of the 256-prompt attack")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each attack")
    ap.add_argument("--out", default="admission_attack.json")
    args = ap.parse_args(argv)

    from hybridpd.deploy.local_cluster import start_cluster
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        overrides: dict[str, Any] = {**SIZES[args.size], **(PATTERN[args.family] if args.size != "tiny" else {})}
        model = write_random_checkpoint(f"{tmp}/model", args.family, seed=0, **overrides)
        wargs = ["--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                 "--max-model-len", str(args.long_prompt + 600)]
        wargs += (["--kv-cache-memory-bytes", str(256 * 2**20)] if args.device == "cpu"
                  else ["--gpu-memory-utilization", str(args.gpu_memory_utilization)])
        gp, gd = (args.gpus.split(",") + ["0"])[:2]
        env_p = {"CUDA_VISIBLE_DEVICES": gp} if args.device != "cpu" else {}
        env_d = {"CUDA_VISIBLE_DEVICES": gd} if args.device != "cpu" else {}
        proxy_args = ["--admission-max-seqs", str(args.admission_max_seqs), "--header-timeout",
                      str(args.header_timeout)]
        c = start_cluster(model, worker_args=wargs, prefill_env=env_p, decode_env=env_d, proxy_args=proxy_args)
        try:
            reports = run_attacks(c.url, c.proxy.pid, args)
        finally:
            c.stop()
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": [r.__dict__ for r in reports]}, f, indent=2)
    print("| attack | tried | beyond limits | wrong 200s | legit ok/failed | idle p50 s | legit p50/p99 s | "
          "/health p99/max ms | proxy RSS MB |")
    for r in reports:
        print(f"| {r.attack} | {r.attacks_tried} | {r.accepted_beyond_limits} | {r.wrong_200s} | {r.legit_ok}/"
              f"{r.legit_failed} | {r.idle_p50_s:.3f} | {r.legit_p50_s:.3f}/{r.legit_p99_s:.3f} | "
              f"{1e3 * r.health_p99_s:.0f}/{1e3 * r.health_max_s:.0f} | {r.rss_before_mb:.0f}->{r.rss_after_mb:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
