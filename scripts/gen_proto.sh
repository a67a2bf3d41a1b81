#!/usr/bin/env bash
# Regenerate the Python gRPC stubs of proto/hybridpd.proto into proto/ (committed).
#
#   scripts/gen_proto.sh          regenerate in place
#   scripts/gen_proto.sh --check  regenerate into a temp dir and diff; exit 1 if the committed stubs are stale
#
# protoc runs with the repository root as include path, so the generated gRPC module imports
# `from proto import hybridpd_pb2`, rewritten to `from hybridpd.proto import hybridpd_pb2` (the installed name). Python: $PYTHON, else .venv/bin/python, else python3 (needs grpcio-tools).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
  PY="$ROOT/.venv/bin/python"
else
  PY="python3"
fi
PROTOS=(proto/hybridpd.proto)

generate() {  # generate <include_root> <out_root>
  (cd "$1" && "$PY" -m grpc_tools.protoc -I. --python_out="$2" --pyi_out="$2" --grpc_python_out="$2" "${PROTOS[@]}")
  # Mark the stubs as generated for linters that are handed the files explicitly (`ruff check proto/*.py`
  # ignores pyproject's extend-exclude for explicit paths).
  local f
  for f in "$2"/proto/*_pb2.py "$2"/proto/*_pb2_grpc.py "$2"/proto/*_pb2.pyi; do
    { echo "# ruff: noqa"; cat "$f"; } >"$f.tmp" && mv "$f.tmp" "$f"
  done
  # The stubs are installed as `hybridpd.proto` (setup.py): the gRPC module imports its messages from there.
  sed -i 's/^from proto import /from hybridpd.proto import /' "$2"/proto/*_pb2_grpc.py
}

case "${1:-}" in
  "")
    generate "$ROOT" "$ROOT"
    echo "regenerated: ${PROTOS[*]} -> proto/*_pb2*.py*"
    ;;
  --check)
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    mkdir -p "$TMP/src/proto" "$TMP/out"
    cp "${PROTOS[@]/#/$ROOT/}" "$TMP/src/proto/"
    generate "$TMP/src" "$TMP/out"
    status=0
    for f in "$TMP"/out/proto/*; do
      name="proto/$(basename "$f")"
      if ! diff -u "$ROOT/$name" "$f" >"$TMP/diff" 2>&1; then
        echo "stale: $name (run scripts/gen_proto.sh)" >&2
        head -n 40 "$TMP/diff" >&2
        status=1
      fi
    done
    [[ $status -eq 0 ]] && echo "proto stubs are current"
    exit $status
    ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac
