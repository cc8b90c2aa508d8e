#!/usr/bin/env bash
# Everything that needs the GPU, in one command on a GPU machine (see CONTRIBUTING.md):
#   bash bench/gpu_all.sh tests     # all GPU tests + the CPU-offload bench
#   bash bench/gpu_all.sh disagg    # prefill/decode disaggregation bench on two GPUs
# A bare CUDA image lacks the gateway's packages: they come as wheels in .whl/ (CONTRIBUTING.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
case "${1:-tests}" in
  tests)
    bash tests/gpu/run.sh -q
    python3 bench/offload.py --lens 1024,8192,32768 --budget-s 60 --json "$OUT/offload.json" 2>&1 | tail -25 ;;
  disagg)
    python3 bench/disagg.py --preset llama3-8b --devices cuda:0,cuda:1 --warmup 8 --duration 30 \
      --json "$OUT/disagg.json" 2>&1 | tail -30 ;;
  *) echo "usage: $0 tests|disagg" >&2; exit 2 ;;
esac
