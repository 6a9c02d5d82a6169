#!/usr/bin/env bash
# Everything of one session's last H200 visit in one device call (under 10 minutes): GPU tests of the
# engine (async scheduling, Triton backend, CUDA graphs), the engine e2e decode benchmark with a profile
# of batch-1 decode steps, then the benchmark suite in the time left.
# Device call: run(command="bash benchmarks/gpu_final.sh", carry=[".whl", ".cache"], timeout_s=600)
set -uo pipefail
start=$SECONDS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/e2e"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_async_scheduling.py tests/test_gpu_engine.py \
  -s 2>&1 | grep -E "passed|failed|Error|diverged|^E " | tee "$OUT/e2e/gpu_tests.log"
timeout 110 python3 -m tokenmill.benchmarks.gpu_e2e --model llama3-8b --fill-requests 0 --profile \
  --out "$OUT/e2e" > "$OUT/e2e/e2e.log" 2>&1; echo "e2e exit $?"
rm -f "$OUT"/e2e/*trace*.json
tail -12 "$OUT/e2e/e2e.log"
SUITE_BUDGET_S=$(( 570 - (SECONDS - start) )) bash benchmarks/gpu_suite.sh 2>&1 | tail -40
# At most 8 files come back from a call: pack everything into one.
tar czf "$OUT/gpu_final.tgz" -C "$OUT" e2e h200 && rm -rf "$OUT/e2e" "$OUT/h200"
