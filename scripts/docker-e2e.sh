#!/usr/bin/env bash
# The Compose end-to-end test (tests/docker/test_compose_e2e.py) on a real Docker
# engine, failing (not skipping) when none answers. Builds the image from
# docker/wheelhouse with OFFLINE=1, filling the wheelhouse first when it holds no
# torch wheel; set HC_CA_BUNDLE to pass a proxy's CA bundle to the build.
#
#   bash scripts/docker-e2e.sh            # extra arguments go to pytest (e.g. -k redis)
#
# On this kind of machine a Docker engine comes from ../shared/tools/docker-up.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
docker info >/dev/null 2>&1 || { echo "docker-e2e: no Docker engine answers (docker info fails);" \
  "start one first, e.g. bash ../shared/tools/docker-up.sh on this kind of machine" >&2; exit 1; }
ls docker/wheelhouse/torch-*.whl >/dev/null 2>&1 || bash scripts/docker-wheelhouse.sh
start=$(date +%s)
HC_DOCKER_E2E=require PYTHONPATH=$PWD .venv/bin/python -m pytest tests/docker/test_compose_e2e.py \
  -p no:randomly -v -s "$@"
echo "docker-e2e: finished in $(( $(date +%s) - start ))s"
