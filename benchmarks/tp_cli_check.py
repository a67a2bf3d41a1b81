"""Tensor parallelism through the real command line: `hybridpd generate --tensor-parallel-size N` against TP 1.

For each benchmarks/model_zoo.py variant asked for, a random-weight checkpoint written by transformers itself
(config.json, safetensors, the byte-level tokenizer), then `hybridpd generate` as a user runs it (fp32 on the CPU,
greedy, prompts of 1 to 80 characters, a 16-token step budget so prompts are chunked), once at TP 1 and once per
TP size asked for. A row passes when every TP size gives TP 1's token ids, or exits with code 2 and a one-line
error naming the config field that size cannot split (no traceback).

    python -m benchmarks.tp_cli_check --only tp_ --tp 2 3 4         # the tensor-parallel shapes
    python -m benchmarks.tp_cli_check --only nem_base qwen_base --tp 2 --out tp_cli.json

Heavy (a process start per run: minutes for a dozen variants on 2 cores); CI runs one CLI case
(tests/unit/test_tensor_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = (
    "Hello, hybrid world",
    "The quick brown fox jumps over the lazy dog, again and again, until the very end of time!",
    "a",
)
FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-tokens", "10", "--max-num-batched-tokens", "16",
         "--max-model-len", "128", "--kv-cache-memory-bytes", str(8 << 20))  # fmt: skip


def generate(path: str, tp: int) -> dict[str, Any]:
    """One `hybridpd generate` run: exit code, the token ids of each prompt, the last line of stderr, seconds."""
    cmd = [sys.executable, "-m", "hybridpd.deploy.cli", "generate", "--model", path, *FLAGS]
    cmd += ["--tensor-parallel-size", str(tp)]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    t0 = time.time()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    err = run.stderr.strip().splitlines()
    return {
        "rc": run.returncode,
        "tokens": [line["token_ids"] for line in lines],
        "error": err[-1] if err and run.returncode else "",
        "traceback": "Traceback" in run.stderr,
        "seconds": round(time.time() - t0, 1),
    }


def check(name: str, tp_sizes: list[int], workdir: str | None = None) -> dict[str, Any]:
    from benchmarks.model_zoo import EDITS, VARIANTS, _edit_config, write_hf_checkpoint

    family, overrides = VARIANTS[name]
    row: dict[str, Any] = {"variant": name}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = write_hf_checkpoint(tmp, family, overrides)
        if name in EDITS:
            _edit_config(path, EDITS[name])
        base = generate(path, 1)
        if base["rc"]:
            row["result"] = f"TP 1 failed: {base['error'][:160]}"
            return row
        ok = True
        for tp in tp_sizes:
            got = generate(path, tp)
            if got["rc"] == 0:
                same = got["tokens"] == base["tokens"]
                row[f"tp{tp}"] = "same" if same else "DIFF"
                ok &= same
            else:
                clear = got["rc"] == 2 and not got["traceback"] and "tensor parallelism" in got["error"]
                row[f"tp{tp}"] = ("refused: " if clear else f"CRASH rc={got['rc']}: ") + got["error"][:120]
                ok &= clear
        row["result"] = "pass" if ok else "FAIL"
    return row


def main(argv: list[str] | None = None) -> int:
    from benchmarks.model_zoo import VARIANTS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help="model_zoo variant names (prefix match)")
    p.add_argument("--tp", type=int, nargs="*", default=[2], help="TP sizes compared with TP 1")
    p.add_argument("--out", default="tp_cli_check.json", help="the rows as JSON")
    args = p.parse_args(argv)
    names = [n for n in VARIANTS if not args.only or any(n.startswith(o) for o in args.only)]
    print(f"| variant |{''.join(f' TP {n} |' for n in args.tp)} result |", flush=True)
    print(f"|---|{'---|' * len(args.tp)}---|", flush=True)
    rows = []
    for name in names:
        row = check(name, args.tp)
        rows.append(row)
        cells = "".join(f" {row.get(f'tp{n}', '-')} |" for n in args.tp)
        print(f"| {name} |{cells} {row['result']} |", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["result"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
