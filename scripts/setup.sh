#!/usr/bin/env bash
# Create .venv and install hybridpd (CPU torch from the local wheel cache when available). Idempotent.
# Usage: bash scripts/setup.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: nixl depends on it, and an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q "torch>=2.4"
.venv/bin/python -m pip install -q -e ".${extra}"
