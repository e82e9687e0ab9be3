# Sourced (POSIX sh) by the Dockerfile's pip steps, with the wheelhouse bind-mounted
# at /wheelhouse and the optional CA secret at /run/secrets/ca. Sets pip's sources
# through its environment variables and TORCH_WHEEL (the wheelhouse's torch, or "").
if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi
export PIP_FIND_LINKS=/wheelhouse
TORCH_WHEEL=$(ls /wheelhouse/torch-*.whl 2>/dev/null | sort -V | tail -n 1)
case "${OFFLINE:-0}" in
  1|true|yes)
    export PIP_NO_INDEX=1
    if [ -z "$TORCH_WHEEL" ]; then
      echo "OFFLINE=1 but docker/wheelhouse in the build context has no torch wheel:" \
           "fill it with scripts/docker-wheelhouse.sh, or build with OFFLINE=0" >&2
      exit 1
    fi ;;
  0|false|no) ;;
  *) echo "OFFLINE=$OFFLINE: expected 1 (wheelhouse only) or 0 (wheelhouse, then the indexes)" >&2; exit 1 ;;
esac
