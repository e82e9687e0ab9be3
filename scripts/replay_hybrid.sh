#!/usr/bin/env bash
# The hybrid rows of the replay matrix: `hicache replay --hybrid` at both published
# hybrid shapes, with and without an L3 and end snapshots, each from an empty file:// L3;
# the reports (JSON, no timings) must be identical before and after a refactor.
# Usage: replay_hybrid.sh OUTDIR  (run from the repository root: its hicache is replayed)
set -euo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
l3=$(mktemp -d); trap 'rm -rf "$l3"' EXIT
run() {  # name, flags...
  local name=$1; shift
  rm -rf "$l3/l3"
  "$py" -m hicache.cli replay --quiet --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  sed -i "/^report: /d" "$out/$name.txt"
  sed -i -E 's#file://[^" ]*/l3#file://(private)/l3#g' "$out/$name.json" "$out/$name.txt"
}
T="--set storage.timeout_ms=60000"
run gpt-oss-small-mem --hybrid gpt-oss-120b --scale small --set storage.url=memory://
run gpt-oss-small-ends --hybrid gpt-oss-120b --scale small --end-snapshots --snapshot-every 4 --set storage.url=
run gpt-oss-tiny-l1-file --hybrid gpt-oss-120b --scale tiny --set pool.device_pages=24 $T --set "storage.url=file://$l3/l3"
run qwen3-tiny-mem --hybrid qwen3-next-80b-a3b --scale tiny --set storage.url=memory://
run qwen3-tiny-ends --hybrid qwen3-next-80b-a3b --scale tiny --end-snapshots --snapshot-every 2 --set storage.url=
run qwen3-tiny-l1-file --hybrid qwen3-next-80b-a3b --scale tiny --set pool.device_pages=24 $T --set "storage.url=file://$l3/l3"
