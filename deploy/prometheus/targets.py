"""Prometheus file_sd targets for a running cluster (format: deploy/prometheus/targets/README.md).

`targets_from_cluster()` turns the proxy's `GET /v1/cluster` answer into target groups; `write_targets()` writes
them atomically where deploy/prometheus/prometheus.yml looks (`targets/*.json` beside it). `hybridpd serve` can
call both at start and remove the file at shutdown; by hand:

    python deploy/prometheus/targets.py --proxy 127.0.0.1:8000     # writes deploy/prometheus/targets/local.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
ROLES = ("proxy", "prefill", "decode")


def _hostport(url: str) -> str:
    """`http://h:p/metrics` -> `h:p` (IPv6 hosts keep their brackets)."""
    netloc = urlsplit(url).netloc
    if not netloc:
        raise ValueError(f"not a metrics URL: {url!r}")
    return netloc


def targets_from_cluster(cluster: dict[str, Any], proxy: str) -> list[dict[str, Any]]:
    """Target groups, one per role, from `GET /v1/cluster` (`workers[].role`, `workers[].metrics_url`) plus the
    proxy's own `host:port`. Workers that reported no metrics port (unreachable, or metrics off) are left out."""
    by_role: dict[str, list[str]] = {"proxy": [proxy]}
    for worker in cluster.get("workers", []):
        role, url = worker.get("role"), worker.get("metrics_url")
        if role in ("prefill", "decode") and url:
            by_role.setdefault(role, []).append(_hostport(url))
    return [{"targets": sorted(set(by_role[r])), "labels": {"role": r}} for r in ROLES if by_role.get(r)]


def write_targets(groups: list[dict[str, Any]], path: Path = TARGETS_DIR / "local.json") -> Path:
    """Write atomically (temporary file + rename), so Prometheus never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".targets-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(groups, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxy", default="127.0.0.1:8000", help="the proxy's host:port")
    p.add_argument("--out", type=Path, default=TARGETS_DIR / "local.json")
    args = p.parse_args(argv)
    with urllib.request.urlopen(f"http://{args.proxy}/v1/cluster", timeout=10) as resp:
        cluster = json.load(resp)
    groups = targets_from_cluster(cluster, args.proxy)
    print(f"wrote {write_targets(groups, args.out)}: {json.dumps(groups)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
