#!/usr/bin/env bash
# One device call on the lent H200: GPU tests, then the kernel benchmark, then the engine e2e benchmark.
# Device call: run(command="bash benchmarks/gpu_check.sh [tests|kernels|e2e ...]", carry=[".whl"])
# Results land in $OUT (logs, JSON, Markdown).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e .
export PYTHONUNBUFFERED=1 TOKENMILL_CACHE=/tmp/tmcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
sections=${*:-tests kernels e2e}
for s in $sections; do
  case $s in
    tests)   timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    kernels) timeout 300 python3 benchmarks/gpu_kernels.py --out "$OUT/kernels" 2>&1 | tee "$OUT/kernels.log" | tail -60 ;;
    e2e)     timeout 420 python3 -m tokenmill.benchmarks.gpu_e2e --model llama3-8b --out "$OUT/e2e" 2>&1 | tee "$OUT/e2e.log" | tail -40 ;;
  esac
done
