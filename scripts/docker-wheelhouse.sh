#!/usr/bin/env bash
# Fill a wheelhouse for the Docker image build from this machine's pip (its
# indexes, find-links, proxy and CA settings), so the build itself needs no
# network (build with OFFLINE=1) or only a plain PyPI (the torch wheel here).
#
#   bash scripts/docker-wheelhouse.sh                  # everything, into docker/wheelhouse
#   bash scripts/docker-wheelhouse.sh --torch-only     # only the torch wheel (no deps): the rest from PyPI
#   bash scripts/docker-wheelhouse.sh --variant gpu DIR
#
# torch: the cpu variant takes the newest torch release whose version carries
# the +cpu local label among those this machine's pip can see (PyTorch's CPU
# index, a find-links folder, a mirror), because a plain `torch` from PyPI is
# the CUDA build (GBs of nvidia-* wheels). Set TORCH_REQ (e.g. "torch==2.13.0+cpu")
# to choose it yourself. The other requirements are hicache's runtime
# dependencies from pyproject.toml plus its build backend, for the image's
# Python (3.11, x86_64): this pip's minor version must match, and when the base
# image is here the set is checked (and topped up) with the image's own pip.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=cpu TORCH_ONLY=0 DIR=docker/wheelhouse
while [ $# -gt 0 ]; do
  case $1 in
    --variant) VARIANT=$2; shift 2 ;;
    --torch-only) TORCH_ONLY=1; shift ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    -*) echo "docker-wheelhouse: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) DIR=$1; shift ;;
  esac
done
PY=${PYTHON:-python3}
IMAGE_PY=${IMAGE_PYTHON_VERSION:-3.11}
BASE_IMAGE=${BASE_IMAGE:-python:$IMAGE_PY-slim}
have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$have" = "$IMAGE_PY" ] || { echo "docker-wheelhouse: $PY is Python $have but the image's is $IMAGE_PY;" \
  "run with PYTHON=python$IMAGE_PY (the wheels must match the image's interpreter)" >&2; exit 1; }
PIP="$PY -m pip --disable-pip-version-check"

if [ -z "${TORCH_REQ:-}" ]; then
  if [ "$VARIANT" = cpu ]; then
    # `pip index versions` lists what every configured source offers, local labels included.
    v=$($PIP index versions torch --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 15 2>/dev/null \
        | sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' | grep -m1 '+cpu$' || true)
    [ -n "$v" ] || { echo "docker-wheelhouse: this machine's pip offers no torch release labelled +cpu;" \
      "set TORCH_REQ='torch==X.Y.Z+cpu' and a source for it (PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL)" >&2; exit 1; }
    TORCH_REQ="torch==$v"
  else
    TORCH_REQ="torch>=2.4"
  fi
fi
mkdir -p "$DIR"
reqs=("$TORCH_REQ") nodeps=(--no-deps)
if [ "$TORCH_ONLY" = 0 ]; then
  nodeps=()
  # hicache's runtime dependencies and build backend, read from pyproject.toml (one source of truth).
  mapfile -t deps < <("$PY" - <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
for r in p["build-system"]["requires"] + p["project"]["dependencies"]:
    if not r.replace(" ", "").startswith("torch"):
        print(r)
PYEOF
)
  reqs+=("${deps[@]}")
fi
download() {  # download REQ... with this machine's pip, wheels only
  $PIP download --quiet --only-binary=:all: --dest "$DIR" --extra-index-url https://download.pytorch.org/whl/cpu \
    --retries 1 --timeout 15 "$@" 2> >(grep -v "^WARNING: \(Location\|Retrying\)" >&2)
}
echo "docker-wheelhouse: downloading ${reqs[*]} into $DIR" >&2
download "${nodeps[@]}" "${reqs[@]}"

# This pip evaluated environment markers for its own interpreter; the image's may
# need more (e.g. redis wants async-timeout below Python 3.11.3). Ask the image's
# pip, offline, to install the set from the wheelhouse alone, and top up what it
# names as missing, until it resolves.
if [ "$TORCH_ONLY" = 0 ]; then
  if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "docker-wheelhouse: not checked against the image's Python ($BASE_IMAGE is not here);" \
         "a build with OFFLINE=1 may miss a marker-dependent wheel" >&2
  else
    for round in 1 2 3 4 5 6; do
      out=$(docker run --rm --network none -v "$(cd "$DIR" && pwd):/wheelhouse:ro" "$BASE_IMAGE" sh -c \
            'python -m venv /tmp/v && /tmp/v/bin/pip install -q --disable-pip-version-check --dry-run --no-index \
             --find-links /wheelhouse "$@"' sh "${reqs[@]}" 2>&1) && break
      missing=$(printf '%s\n' "$out" | sed -n 's/^ERROR: No matching distribution found for \([^;]*\).*/\1/p' | head -1)
      [ -n "$missing" ] && [ "$round" -lt 6 ] || { printf '%s\n' "$out" >&2
        echo "docker-wheelhouse: the wheelhouse does not install in $BASE_IMAGE (see above)" >&2; exit 1; }
      echo "docker-wheelhouse: $BASE_IMAGE's Python also needs $missing" >&2
      download "$missing"
    done
    echo "docker-wheelhouse: checked: $BASE_IMAGE installs the set from $DIR offline" >&2
  fi
fi
echo "docker-wheelhouse: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR" >&2
