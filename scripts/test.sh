#!/usr/bin/env bash
# Set up everything the tests need (venv, package, Debian's prometheus) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if [ -f scripts/install-prometheus.sh ]; then
  bash scripts/install-prometheus.sh || echo "prometheus not installed: the live-Prometheus tests will skip"
fi
export PATH="$PWD/.venv/bin:$PATH"
# Two test processes (xdist), each taking whole files so module fixtures (stacks, clusters) are built once per
# file; HYBRIDPD_TEST_WORKERS=0 runs in one process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${HYBRIDPD_TEST_WORKERS:-2}" --dist loadfile "$@"
