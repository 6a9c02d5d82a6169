#!/usr/bin/env bash
# One device call for issue 16's H200 items: the launch-config sweep of the weight-only kernels (QUANT_FORMATS,
# QUANT_SWEEP_S, QUANT_SWEEP_ARGS), merged into the committed table and put in kernels/configs/ for the rest of the
# call, then gpu_quant with the table (QUANT_ARGS): correctness checks, the kernel table against cuBLAS bf16 and
# batch-1 decode per format (no fixed runs).
# Device call: run(command="bash benchmarks/gpu_quant_tune.sh", carry=[".whl"]); everything lands in $OUT/quant.tgz.
# Commit: cp sweep/nvidia-h200.json kernels/configs/; the .md/.json files to benchmarks/results/h200/.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 TOKENMILL_CACHE=/tmp/tmcache
OUT=${OUT:-/tmp/out}; R="$OUT/quant"; mkdir -p "$R"
t0=$SECONDS
mkdir -p "$R/sweep"; cp kernels/configs/*.json "$R/sweep/" 2>/dev/null  # the sweep adds its cells to the committed table
timeout $(( ${QUANT_SWEEP_S:-200} + 60 )) python3 -m tokenmill.benchmarks.gpu_quant --sweep --sweep-budget-s ${QUANT_SWEEP_S:-200} \
  --formats ${QUANT_FORMATS:-int4-g128-sym int8-ch-sym int4-g128-zp} ${QUANT_SWEEP_ARGS:-} --out "$R/sweep" > "$R/sweep.log" 2>&1
echo "sweep exit $? after $(( SECONDS - t0 )) s"; tail -25 "$R/sweep.log" | cut -c1-200
tar czf "$OUT/quant.tgz" -C "$OUT" quant
slug=$(ls "$R/sweep"/*.json 2>/dev/null | grep -v gpu_quant_sweep | head -1)
[ -n "$slug" ] && cp "$slug" kernels/configs/ && echo "table $(basename "$slug") in kernels/configs/"
t0=$SECONDS
timeout ${QUANT_RUN_S:-280} python3 -m tokenmill.benchmarks.gpu_quant --skip-fixed ${QUANT_ARGS:-} --out "$R/run" > "$R/run.log" 2>&1
echo "gpu_quant exit $? after $(( SECONDS - t0 )) s"; tail -45 "$R/run.log" | cut -c1-200
tar czf "$OUT/quant.tgz" -C "$OUT" quant
