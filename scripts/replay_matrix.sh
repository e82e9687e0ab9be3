#!/usr/bin/env bash
# Replay the built-in trace under each write policy and a few eviction policies,
# each from an empty file:// L3, and print the tables without timings (issue 13:
# results must be identical before and after a refactor). Usage: replay_matrix.sh OUTDIR
set -euo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"
run() {  # name, --set flags...
  local name=$1; shift
  rm -rf .hicache/l3
  .venv/bin/hicache replay --quiet "$@" > "$out/$name.txt" 2>&1
  sed -E 's/ +[0-9.]+s$//; s/done in .*//; s/bytes moved.*//' "$out/$name.txt" > "$out/$name.table"
}
run default
run write_back --no-baselines --set policy.write_policy=write_back
run selective --no-baselines --set policy.write_policy=write_through_selective
run lfu_fifo --no-baselines --set policy.device_eviction=lfu --set policy.host_eviction=fifo
run memory_l3 --no-baselines --set storage.url=memory://
rm -rf .hicache/l3
