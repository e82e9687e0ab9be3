#!/usr/bin/env bash
# .venv-vllm: vLLM 0.33.0 over the CPU torch build, only its import-time
# dependencies (scripts/engines/vllm-requirements.txt, exact pins, --no-deps),
# hicache itself, and vLLM's own tests from the 0.33.0 source distribution in
# .engines/vllm-0.33.0 (git-ignored; never committed). First run: 5-12 min
# (quiet 2-core box to load average 15) and 3.3 GB. Idempotent: a finished setup is recognised by a stamp and costs a
# second or two.
# Never `pip install torchvision` here: it replaces torch with a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0
VENV=.venv-vllm
TESTS=.engines/vllm-$VLLM_VERSION
REQS=scripts/engines/vllm-requirements.txt
STAMP="$VENV/.hicache-setup"
PY=${PYTHON:-python3}
VPY=$VENV/bin/python
source scripts/steps.sh
SETUP_TAG=vllm.sh
start=$(date +%s)
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1

want="vllm=$VLLM_VERSION torch=$TORCH_VERSION setup=$(sha256sum "$REQS" pyproject.toml scripts/engines/vllm.sh scripts/steps.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -d "$TESTS/tests/v1/kv_offload" ] \
   && [ -f .engines/hf/hub/models--facebook--opt-125m/refs/main ]; then
  echo "vLLM $VLLM_VERSION test environment is up to date ($VENV, $TESTS)"
  exit 0
fi

venv_with_cpu_torch "$TORCH_VERSION"
step "install vllm==$VLLM_VERSION (--no-deps) and its import-time dependencies ($REQS)" "2-6 min the first time"
pip_loud install --no-deps "vllm==$VLLM_VERSION"
pip_loud install --no-deps -r "$REQS"
step_done
step "install hicache from this checkout (pip install -e \".[dev]\")" "15-30 s"
pip_quiet install --no-deps -e ".[dev]"
step_done
"$VPY" -c "import vllm.v1.kv_offload.tiering.spec, hicache.integrations.vllm" \
  || { echo "vLLM $VLLM_VERSION does not import in $VENV; see the error above" >&2; exit 1; }

if [ ! -d "$TESTS/tests/v1/kv_offload" ]; then
  # vLLM's tests ship only in its sdist. pip prepares the sdist's metadata
  # while downloading: build it in this venv (no isolation, which would fetch
  # vLLM's CUDA build requirements), with no device and the exact version.
  step "fetch vLLM's tests from its $VLLM_VERSION source distribution into $TESTS" "1-2 min, a ~30 MB download"
  pip_quiet install setuptools-rust==1.13.0 setuptools-scm==10.3.4
  dl=$(mktemp -d)
  trap 'rm -rf "$dl"' EXIT
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_VERSION \
    "$VPY" -m pip --disable-pip-version-check download --no-binary :all: --no-deps --no-build-isolation "vllm==$VLLM_VERSION" -d "$dl"
  mkdir -p .engines
  rm -rf "$TESTS.tmp" && mkdir -p "$TESTS.tmp"
  tar xzf "$dl/vllm-$VLLM_VERSION.tar.gz" -C "$TESTS.tmp" --strip-components=1 \
    "vllm-$VLLM_VERSION/tests" "vllm-$VLLM_VERSION/pyproject.toml"
  rm -rf "$TESTS" && mv "$TESTS.tmp" "$TESTS"
  step_done
fi
# vLLM's connector test utilities build a ModelConfig for facebook/opt-125m; with
# HF_HUB_OFFLINE=1 and HF_HOME=.engines/hf it resolves to this local config.json.
snap=.engines/hf/hub/models--facebook--opt-125m
mkdir -p "$snap/snapshots/hicache-local" "$snap/refs"
printf hicache-local > "$snap/refs/main"
cat > "$snap/snapshots/hicache-local/config.json" <<'JSON'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "num_attention_heads": 12,
 "num_hidden_layers": 12, "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048,
 "word_embed_proj_dim": 768, "do_layer_norm_before": true, "activation_function": "relu",
 "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16"}
JSON
echo "$want" > "$STAMP"
echo "vLLM $VLLM_VERSION test environment ready: $VENV, vLLM's tests in $TESTS ($(( $(date +%s) - start ))s)"
