#!/usr/bin/env bash
# Create the engines' test environments (.venv-vllm, .venv-sglang) next to .venv.
# Each engine is pinned and installed with --no-deps over the CPU torch build,
# plus only the import-time dependencies it needs. Idempotent.
# Usage: bash scripts/setup-engines.sh [vllm] [sglang]
set -euo pipefail
cd "$(dirname "$0")/.."
for engine in "${@:-vllm sglang}"; do
  for e in $engine; do bash "scripts/engines/$e.sh"; done
done
