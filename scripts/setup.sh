#!/usr/bin/env bash
# Create .venv and install hicache with its test extras.
# On a machine without an NVIDIA GPU, torch comes from PyTorch's CPU index
# first, so pip never pulls a multi-GB CUDA build. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install "torch>=2.4"
  else
    $PIP install --retries 1 --timeout 15 --index-url https://download.pytorch.org/whl/cpu "torch>=2.4" \
      || $PIP install "torch>=2.4"
  fi
fi
$PIP install -e ".[dev]"
echo "hicache installed in .venv ($(.venv/bin/python -c 'import torch, hicache; print("torch", torch.__version__, "hicache", hicache.__version__)'))"
