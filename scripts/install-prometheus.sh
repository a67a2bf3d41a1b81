#!/usr/bin/env bash
# Install Prometheus and promtool from Debian's `prometheus` package, without starting the service.
#
# Idempotent: does nothing when /usr/bin/prometheus and /usr/bin/promtool already exist.
# Never fails the caller: if the install is impossible (not Debian, no root and no sudo, registry unreachable),
# it prints why and exits 0; tests that need promtool then skip with a reason.
#
#   bash scripts/install-prometheus.sh
#
# Used by: tests/unit/test_dashboard.py (promtool check config / check rules), the lead's live dashboard test,
# and docs/DEPLOY.md (local Prometheus pointed at deploy/prometheus/prometheus.yml).
set -u

say() { echo "install-prometheus: $*"; }

version() {
  prometheus --version 2>&1 | head -n 1
  promtool --version 2>&1 | head -n 1
}

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  say "already installed"
  version
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  say "apt-get not found (not a Debian/Ubuntu system); install Prometheus >= 2.40 yourself. Skipping."
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  say "not root and no passwordless sudo; cannot install. Skipping."
  exit 0
fi

# A policy-rc.d that refuses service starts keeps the package's postinst from launching prometheus.service
# (harmless where there is no init system, which is the usual case in containers and CI).
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null && $SUDO chmod +x "$POLICY" && ADDED_POLICY=1
fi
cleanup() { if [ "$ADDED_POLICY" -eq 1 ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
if ! $SUDO apt-get update -qq; then
  say "apt-get update failed (no network to the Debian mirror?). Skipping."
  exit 0
fi
# --no-install-recommends: skip prometheus-node-exporter and friends; we only need the two binaries.
if ! $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
  say "apt-get install prometheus failed. Skipping."
  exit 0
fi
# Stop the service in case an init system started it anyway (policy-rc.d should prevent that).
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
  $SUDO systemctl stop prometheus || true
fi
say "installed in $(( $(date +%s) - start )) s"
version
