#!/usr/bin/env bash
# .venv-sglang: SGLang's real HiCache storage code on the CPU torch build, for
# tests/integrations/sglang. Called by scripts/setup-engines.sh. First run: 4-10 min
# (quiet 2-core box to load average 15) and 2.8 GB. Idempotent: a finished setup is recognised by a stamp and
# costs a second or two.
#
# sglang is installed with --no-deps (its full requirements pull CUDA torch,
# flashinfer, ...); then only what `sglang.srt.mem_cache` host pools,
# hicache_storage, the storage backend factory and HiCacheController import,
# pinned exactly, under a constraint that keeps torch at the CPU build.
# torchvision is never installed: the PyPI wheels are CUDA builds that fail to
# load on CPU torch. SGLang's import chain reaches it only through multimodal
# configs; tests/integrations/sglang/conftest.py puts an import-only stand-in
# on sys.path (see tests/integrations/sglang/_shims/torchvision).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
VENV=.venv-sglang
TORCH="torch==2.13.0"
SGLANG="sglang==0.5.23"
# What the imports above need (found by importing them), pinned.
IMPORT_DEPS=(
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
  ipython==9.18.1 aiohttp==3.14.5 transformers==5.24.0 dill==0.4.1
  apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3 compressed-tensors==0.18.0
  loguru==0.7.3 gguf==0.19.0
)
source scripts/steps.sh
SETUP_TAG=sglang.sh
VPY=$VENV/bin/python
STAMP="$VENV/.hicache-setup"
start=$(date +%s)
want="sglang=$SGLANG $TORCH setup=$(sha256sum pyproject.toml scripts/engines/sglang.sh scripts/steps.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && "$VPY" -c "import sys; from importlib.util import find_spec as f; sys.exit(not (f('sglang') and f('torch')
                 and f('hicache')))" 2>/dev/null; then
  echo "SGLang 0.5.23 test environment is up to date ($VENV)"
  exit 0
fi
if [ ! -x "$VPY" ]; then
  step "create $VENV" "5 s"
  "$PY" -m venv $VENV
  step_done
fi
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "$TORCH" > "$CONSTRAINTS"

if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  step "install $TORCH, CPU build" "1-3 min, ~200 MB download"
  wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    pip_loud install "$wheel"
  else
    pip_loud install --retries 1 --timeout 15 --index-url https://download.pytorch.org/whl/cpu "$TORCH" \
      || pip_loud install "$TORCH"
  fi
  step_done
fi
if ! "$VPY" -c "import sglang, sys; sys.exit(sglang.__version__ != '0.5.23')" 2>/dev/null; then
  step "install $SGLANG (--no-deps)" "20 s-2 min"
  pip_loud install --no-deps "$SGLANG"
  step_done
fi
# pip reports that sglang's full requirements are unmet (expected: --no-deps).
step "install SGLang's import-time dependencies (${#IMPORT_DEPS[@]} pinned packages: transformers, aiohttp, ...)" "1-3 min the first time"
pip_loud install -c "$CONSTRAINTS" "${IMPORT_DEPS[@]}"
step_done
step "install hicache from this checkout (pip install -e \".[dev]\")" "30 s-2 min"
pip_loud install -c "$CONSTRAINTS" -e ".[dev]"
step_done

# Fail loudly if anything replaced the CPU torch build.
$VENV/bin/python - <<'PY'
import torch, sglang
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__} replaced the CPU build 2.13.0"
assert not torch.version.cuda, f"torch {torch.__version__} is a CUDA build; rm -rf .venv-sglang and rerun"
print(f"sglang {sglang.__version__} over torch {torch.__version__} in .venv-sglang")
PY
echo "$want" > "$STAMP"
echo "scripts/engines/sglang.sh finished in $(( $(date +%s) - start ))s"
