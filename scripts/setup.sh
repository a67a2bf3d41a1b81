#!/usr/bin/env bash
# Create .venv and install hybridpd (CPU torch from the local wheel cache when available). Idempotent.
# Usage: bash scripts/setup.sh [test] [gpu]        extras: test (pytest, ...), gpu (fla-core fast-path kernels)
# HYBRIDPD_PYTHON=python bash scripts/setup.sh gpu  installs into that interpreter instead of .venv (the Dockerfile
# does this: the image's Ray runs the workers with its own Python)
set -euo pipefail
cd "$(dirname "$0")/.."
extras=()
for arg in "$@"; do
  case "$arg" in
    test|gpu) extras+=("$arg") ;;
    *) echo "setup.sh: unknown extra '$arg' (test, gpu)" >&2; exit 2 ;;
  esac
done
extra=""
if [ ${#extras[@]} -gt 0 ]; then
  extra="[$(IFS=,; echo "${extras[*]}")]"
fi
py="${HYBRIDPD_PYTHON:-}"
if [ -z "$py" ]; then
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  py=.venv/bin/python
fi
"$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: nixl depends on it, and an unpinned torch would pull a multi-GB CUDA build.
"$py" -m pip install -q "torch==2.13.0" || "$py" -m pip install -q "torch>=2.4"
"$py" -m pip install -q -e ".${extra}"
