#!/usr/bin/env bash
# Set up everything the tests need (venv, package, Debian's prometheus) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's prometheus installs while pip does (independent; each waits on downloads and unpacking)
prom_log=$(mktemp)
prom_pid=""
if [ -f scripts/install-prometheus.sh ]; then
  (bash scripts/install-prometheus.sh || echo "prometheus not installed: the live-Prometheus tests will skip") \
    > "$prom_log" 2>&1 &
  prom_pid=$!
fi
bash scripts/setup.sh test
if [ -n "$prom_pid" ]; then
  wait "$prom_pid" || true
fi
cat "$prom_log"
rm -f "$prom_log"
export PATH="$PWD/.venv/bin:$PATH"
# Two test processes (xdist), each taking whole files so module fixtures (stacks, clusters) are built once per
# file, in collection order (tests/conftest.py puts the longest files first, so both finish together);
# HYBRIDPD_TEST_WORKERS=0 runs in one process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${HYBRIDPD_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
