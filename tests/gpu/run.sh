#!/usr/bin/env bash
# Run every GPU test (tests/gpu) with pytest, on a machine with a CUDA GPU.
# Writes gpu-tests.xml (junit) and gpu-tests.log to $OUT when OUT is set, else to tests/gpu/.
# Extra arguments go to pytest (e.g. -k decode, -x).
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${OUT:-$repo/tests/gpu}"
mkdir -p "$dest"
cd "$repo"
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
# -o addopts='': the default suite's addopts ignore tests/gpu. --confcutdir keeps conftest
# files above tests/gpu (which may import gateway-only packages) out of this run.
"$PY" -m pytest -o addopts='' -ra --confcutdir=tests/gpu -p no:cacheprovider \
  --junitxml="$dest/gpu-tests.xml" "$@" tests/gpu 2>&1 | tee "$dest/gpu-tests.log"
exit "${PIPESTATUS[0]}"
