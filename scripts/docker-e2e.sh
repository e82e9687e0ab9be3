#!/usr/bin/env bash
# The Compose end-to-end test (tests/docker/test_compose_e2e.py) on a real Docker
# engine, failing (not skipping) when none answers. Builds the image from
# docker/wheelhouse with OFFLINE=1, filling the wheelhouse first when it holds no
# torch wheel. The build gets HC_CA_BUNDLE (default: the system bundle) as its
# CA secret, and the test checks no layer holds it.
#
#   bash scripts/docker-e2e.sh            # extra arguments go to pytest (e.g. -k redis)
#
# On this kind of machine a Docker engine comes from ../shared/tools/docker-up.sh.
# Creates .venv with scripts/setup.sh when there is none (the test runs there).
set -euo pipefail
cd "$(dirname "$0")/.."
docker info >/dev/null 2>&1 || { echo "docker-e2e: no Docker engine answers (docker info fails);" \
  "start one first, e.g. bash ../shared/tools/docker-up.sh on this kind of machine" >&2; exit 1; }
# The test itself runs here, in .venv (pytest, httpx, hicache): set it up when missing
# (scripts/setup.sh: 3-5 min the first time, a second once done).
[ -x .venv/bin/python ] || bash scripts/setup.sh
ls docker/wheelhouse/torch-*.whl >/dev/null 2>&1 || bash scripts/docker-wheelhouse.sh
# The build mounts this CA bundle as its `ca` secret; the test then looks for it in every layer.
[ -n "${HC_CA_BUNDLE:-}" ] || [ ! -f /etc/ssl/certs/ca-certificates.crt ] || export HC_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
start=$(date +%s)
HC_DOCKER_E2E=require PYTHONPATH=$PWD .venv/bin/python -m pytest tests/docker/test_compose_e2e.py \
  -p no:randomly -v -s "$@"
echo "docker-e2e: finished in $(( $(date +%s) - start ))s"
