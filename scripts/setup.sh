#!/usr/bin/env bash
# Create .venv and install hicache from this checkout with its test extras
# (`pip install -e ".[dev]"`; hicache is not on PyPI).
# On a machine without an NVIDIA GPU, torch comes from PyTorch's CPU index
# first, so pip never pulls a multi-GB CUDA build.
# First run: 3-9 min (3.5 on a quiet 2-core box, 9 at load average 15) and 2.3 GB in .venv (CPU torch ~0.8 GB, Triton ~1 GB).
# Idempotent: a finished set-up is recognised by a stamp and costs about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
SETUP_TAG=setup.sh
PY=${PYTHON:-python3}
VPY=.venv/bin/python
STAMP=.venv/.hicache-setup
start=$(date +%s)
want="setup=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) src=$(pwd)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && "$VPY" -c "import sys; from importlib.util import find_spec as f; sys.exit(not f('torch') or
                 not (f('hicache').origin or '').startswith('$(pwd)/'))" 2>/dev/null; then
  echo "hicache in .venv is up to date (pyproject.toml and this script unchanged since the last set-up)"
  exit 0
fi
if [ ! -x "$VPY" ]; then
  step "create .venv with $PY" "5 s"
  "$PY" -m venv .venv
  step_done
fi
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    build="CUDA build (a GPU is present)" took="2-5 min, ~5 GB download"
  else
    build="CPU build, from PyTorch's CPU index" took="1-4 min, ~200 MB download"
  fi
  step "install torch, $build" "$took"
  if [[ $build == CUDA* ]]; then
    pip_loud install "torch>=2.4"
  else
    pip_loud install --retries 1 --timeout 15 --index-url https://download.pytorch.org/whl/cpu "torch>=2.4" \
      || pip_loud install "torch>=2.4"
  fi
  step_done
fi
step "install hicache from this checkout with the dev extra (pip install -e \".[dev]\": Triton, pytest, FastAPI, redis, ...)" "1-5 min the first time, 15-30 s after"
pip_loud install -e ".[dev]"
step_done
echo "$want" > "$STAMP"
echo "hicache installed in .venv ($("$VPY" -c 'import torch, hicache; print("torch", torch.__version__, "hicache", hicache.__version__)')) in $(( $(date +%s) - start ))s"
