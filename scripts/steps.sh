# Sourced by the set-up scripts: announce each step with its expected duration
# before it starts, and say how long it took, so that no wait is silent.
#   step "what" "how long it usually takes"  ...commands...  step_done
# SETUP_TAG names the script in each line.
_step_t0=0
step() {
  _step_t0=$(date +%s)
  echo "==> ${SETUP_TAG:-setup}: $1 (usually $2)"
}
step_done() {
  echo "    done in $(( $(date +%s) - _step_t0 ))s"
}
# pip: quiet for the short steps; its per-package lines (and progress bars on a terminal)
# where the wait is long.
pip_quiet() { "$VPY" -m pip --disable-pip-version-check -q "$@"; }
pip_loud() { "$VPY" -m pip --disable-pip-version-check "$@"; }

# "$VENV" with "$PY" and the CPU build of torch==$1 in it: PyTorch's CPU index first, so pip
# never pulls a CUDA build; PyPI (or a local wheel of that version) if the index cannot be reached.
venv_with_cpu_torch() {
  if [ ! -x "$VPY" ]; then
    step "create $VENV" "5 s"
    "$PY" -m venv "$VENV"
    step_done
  fi
  if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$1')" 2>/dev/null; then
    step "install torch==$1, CPU build" "1-3 min, ~200 MB download"
    pip_loud install --retries 1 --timeout 15 --index-url https://download.pytorch.org/whl/cpu "torch==$1" \
      || pip_loud install "torch==$1"
    step_done
  fi
}
