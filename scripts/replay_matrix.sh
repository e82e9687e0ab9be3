#!/usr/bin/env bash
# Replay the built-in trace under each write policy and a few eviction policies,
# each from an empty file:// L3, and print the tables without timings (issue 13:
# results must be identical before and after a refactor). Usage: replay_matrix.sh OUTDIR
set -euo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"
# The default L3 is file:// in the per-user cache directory, shared with every
# other replay and serve: give these runs a private one, emptied before each.
XDG_CACHE_HOME=$(mktemp -d); export XDG_CACHE_HOME
trap 'rm -rf "$XDG_CACHE_HOME"' EXIT
run() {  # name, --set flags...
  local name=$1; shift
  rm -rf "$XDG_CACHE_HOME/hicache/l3" .hicache/l3
  .venv/bin/hicache replay --quiet "$@" > "$out/$name.txt" 2>&1
  sed -E 's/ +[0-9.]+s$//; s/ +(time|-+)$//; s/done in .*//; s/bytes moved.*//; s#file://[^ ]*/hicache/l3#file://(private)/hicache/l3#' "$out/$name.txt" > "$out/$name.table"
}
run default
run write_back --no-baselines --set policy.write_policy=write_back
run selective --no-baselines --set policy.write_policy=write_through_selective
run lfu_fifo --no-baselines --set policy.device_eviction=lfu --set policy.host_eviction=fifo
run memory_l3 --no-baselines --set storage.url=memory://
rm -rf .hicache/l3
