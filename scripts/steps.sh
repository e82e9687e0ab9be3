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
