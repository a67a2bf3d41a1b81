#!/usr/bin/env bash
# Set up everything the tests need (venv, package, Debian's prometheus) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if [ -f scripts/install-prometheus.sh ]; then
  bash scripts/install-prometheus.sh || echo "prometheus not installed: the live-Prometheus tests will skip"
fi
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
